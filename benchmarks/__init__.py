"""Benchmark scripts, importable as `benchmarks.<script>` so tests never put this folder on `sys.path`.

Each script runs as `python benchmarks/<name>.py` from a checkout. Python then puts this folder first on
`sys.path`, so no script may share its name with an installed package (tests/test_module_names.py checks it).
"""
