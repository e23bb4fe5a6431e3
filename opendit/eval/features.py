"""Inception features for FID / IS / precision-recall, from a LOCAL weights file: nothing is downloaded.

The network is torch-fidelity's FeatureExtractorInceptionV3, the PyTorch port of the TensorFlow Inception graph
(2015-12-05) that the reference FID / IS numbers (TTUR, ADM's evaluator) are computed with, including the
TF1-exact bilinear resize to 299x299. It is taken from torch-fidelity when that is installed, importing only its
Inception module: the package's __init__ also imports its CLIP / DINOv2 / VGG extractors, which import
torchvision, which this module does not need (and which on the project's machines cannot be imported). Without
torch-fidelity, the same module copied from torch-fidelity 0.4.0 (opendit/eval/_tf_inception.py) is used. It is
not a project dependency because every FID package on PyPI declares torchvision, and installing that pulls a
different torch build.

An extractor is any callable: uint8 [B, 3, H, W] tensor -> (pool features [B, D], logits [B, C]); tests inject a
small random one.
"""
import importlib
import importlib.metadata
import importlib.util
import logging
import pickle
import sys
import types
from pathlib import Path
from collections.abc import Callable

import numpy as np
import torch

from opendit.eval.data import Images, UserError

logger = logging.getLogger("opendit")

WEIGHTS_FILE = "pt_inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/" + WEIGHTS_FILE
# the same file (same sha256 prefix 6726825d) under torch-fidelity's name
WEIGHTS_URL_TORCH_FIDELITY = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                              "weights-inception-2015-12-05-6726825d.pth")
FEATURES = ["2048", "logits_unbiased"]  # pool3 (FID, precision/recall) and fc without bias (IS, as ADM)

Extractor = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _library_class():
    """torch-fidelity's FeatureExtractorInceptionV3 and a label, or None where it is not installed or fails to load.
    Loads torch_fidelity.feature_extractor_inceptionv3 (which imports only torch and two torch-fidelity helper
    modules) without running the package's __init__: a placeholder package stands in while it loads and is removed
    afterwards, so a later `import torch_fidelity` still runs the real __init__."""
    name = "torch_fidelity.feature_extractor_inceptionv3"
    try:
        spec = importlib.util.find_spec("torch_fidelity")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    placeholder = "torch_fidelity" not in sys.modules
    if placeholder:
        package = types.ModuleType("torch_fidelity")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torch_fidelity"] = package
    try:
        module = importlib.import_module(name)
        version = importlib.metadata.version("torch-fidelity")
    except Exception as e:  # noqa: BLE001 - a changed or broken install: the copy does the same
        logger.warning("torch-fidelity is installed but its Inception did not load (%s); using opendit's copy", e)
        return None
    finally:
        if placeholder:
            sys.modules.pop("torch_fidelity", None)
    return module.FeatureExtractorInceptionV3, f"torch-fidelity {version}"


def inception_class(backend: str = "auto"):
    """(class, label): backend "auto" (torch-fidelity if installed, else the copy), "torch-fidelity" or "copy"."""
    if backend not in ("auto", "torch-fidelity", "copy"):
        raise UserError(f"unknown Inception backend {backend!r} (auto, torch-fidelity, copy)")
    if backend != "copy":
        found = _library_class()
        if found is not None:
            return found
        if backend == "torch-fidelity":
            raise UserError("torch-fidelity is not installed (pip install --no-deps torch-fidelity)")
    from opendit.eval._tf_inception import FeatureExtractorInceptionV3

    return FeatureExtractorInceptionV3, "torch-fidelity 0.4.0 Inception (copy in opendit/eval/_tf_inception.py)"


def missing_weights_message(path) -> str:
    return (f"Inception weights not found: {path}. Download {WEIGHTS_FILE} (the FID Inception of pytorch-fid and "
            f"torch-fidelity, ~92 MB) from {WEIGHTS_URL} and pass its path as --inception_weights")


def read_weights(path) -> dict:
    """The state dict of the FID Inception from a local file, read with weights_only=True (a file that would run
    code when unpickled is refused). One-line UserErrors for a missing, unreadable or wrong file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(missing_weights_message(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--inception_weights {path}: not a readable PyTorch state dict ({first}); "
                        f"expected {WEIGHTS_FILE} from {WEIGHTS_URL}") from None
    fc = state.get("fc.weight") if isinstance(state, dict) else None
    if fc is None or tuple(fc.shape) != (1008, 2048):
        raise UserError(f"--inception_weights {path}: not the FID Inception (no fc.weight of shape [1008, 2048]; "
                        f"torchvision's ImageNet Inception is a different network); get {WEIGHTS_FILE} from "
                        f"{WEIGHTS_URL}")
    return state


def load_inception(weights, device="cpu", backend: str = "auto") -> tuple[Extractor, str]:
    """(extractor, label): the FID Inception with the local weights, on `device`, returning (pool3 [B, 2048],
    unbiased logits [B, 1008]) for uint8 [B, 3, H, W] input of any size (resized inside, as TF did)."""
    state = read_weights(weights)
    cls, label = inception_class(backend)
    if cls.__module__.startswith("opendit."):
        net = cls("inception-v3-compat", list(FEATURES))
        net.load_state_dict(state)
    else:  # the library's constructor reads the file itself (and downloads when given none): the checked file
        net = cls("inception-v3-compat", list(FEATURES), feature_extractor_weights_path=str(weights))
    return net.to(device).eval(), label


def random_inception_weights(path, seed: int = 0) -> str:
    """Save the FID Inception's architecture with random weights to `path` (tests: the real code path, no
    download); returns the path."""
    from opendit.eval._tf_inception import FeatureExtractorInceptionV3

    torch.manual_seed(seed)
    torch.save(FeatureExtractorInceptionV3("inception-v3-compat", list(FEATURES)).state_dict(), path)
    return str(path)


@torch.no_grad()
def extract(images: Images, extractor: Extractor, batch_size: int = 50, device="cpu",
            progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(pool [N, D], logits [N, C]) float32 of every image (video: every frame)."""
    pools, logits, done = [], [], 0
    for batch in images.batches(batch_size):
        x = torch.from_numpy(np.array(batch)).permute(0, 3, 1, 2).to(device)  # np.array: a writable copy
        pool, logit = extractor(x)
        pools.append(pool.float().cpu().numpy())
        logits.append(logit.float().cpu().numpy())
        done += len(batch)
        if progress:
            print(f"\r{images.path.name}: {done}/{images.count} images", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return np.concatenate(pools), np.concatenate(logits)
