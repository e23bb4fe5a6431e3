from setuptools import find_packages, setup

setup(
    name="opendit",
    version="0.1.0",
    description="Fast, memory-lean training and sampling of Diffusion Transformers (DiT, video DiT, FLUX)",
    packages=find_packages(include=["opendit", "opendit.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "einops",
        "diffusers",
        "transformers",
        "safetensors>=0.8",  # its pread backend: files read tensor by tensor (host memory at the weights' size)
        "numpy",
        "pillow",
        "pandas",
        "pyyaml",
        "tensorboard",
        "tqdm",
        "scikit-learn",
        "matplotlib",
        # sharded streams (--dataset webdataset | parquet | hf): tar shards through wids / webdataset, Parquet through
        # pyarrow, Arrow tables through datasets
        "webdataset",
        "wids",
        "pyarrow",
        "datasets",
    ],
    extras_require={
        # peft: diffusers loads LoRA files through it; pytest-xdist: README's test command runs two workers
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "ruff==0.17.5", "peft"],
        "kernels": ["triton"],
        "video": ["av"],
    },
)
