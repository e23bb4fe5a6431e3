import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter; set before any triton import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# README's command runs two pytest-xdist workers on the 2-core machines: one intra-op thread each, or their threads
# fight over the cores (tiny ops then run 100x slower)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread: two cores shared by several test processes make oversubscribed
    threads slow tiny ops down 100x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def family_runs(tmp_path_factory):
    """One training step of each family's tiny model (pixel space, 8 px; video 4 frames, Wan 5) -> the outputs root
    holding <family>/<run>; the sampling tests (non-square sizes, step caches) read these checkpoints."""
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from tests.test_flux_family import tiny_text_encoders
    from tests.test_train import run_trainer, tiny_cfg

    root = tmp_path_factory.mktemp("family_runs")
    t5, clip = tiny_text_encoders(root / "encoders")
    umt5 = save_tiny_umt5(root / "umt5", max_length=16)
    settings = {"dit": dict(model="DiT-debug"),
                "vdit": dict(model="VDiT-debug", dataset="moving_digits", num_frames=4),
                "latte": dict(model="Latte-debug", dataset="moving_digits", num_frames=4),
                "flux": dict(model="flux-debug", dataset="captioned_digits", t5=t5, clip=clip),
                "wan": dict(model="Wan-debug", dataset="moving_digits", num_frames=5, umt5=umt5)}
    for name, kw in settings.items():
        run_trainer(tiny_cfg(root / name, max_steps=1, batch_size=4, **kw))
    return root
