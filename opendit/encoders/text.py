"""Frozen CLIP text encoder (transformers CLIPTextModel + its tokenizer) from a local folder: captions -> the
pooled embedding [B, D] that video DiT adds to its timestep embedding (as OpenDiT's VDiT did).

Nothing is downloaded: pass a folder written by `save_pretrained` (e.g. a download of
openai/clip-vit-large-patch14, or its text_encoder/ + tokenizer/ subfolders of a pipeline folder).
"""
import json
import os

import torch


def _is_none(path) -> bool:
    return path is None or str(path).strip().lower() == "none"


def _folders(path: str) -> tuple[str, str]:
    """(model folder, tokenizer folder): the folder itself, or a pipeline's text_encoder/ and tokenizer/."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--clip {path!r} does not exist; pass a local CLIP text encoder folder "
                                f"(config.json, weights, tokenizer files)")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, path
    model, tok = os.path.join(path, "text_encoder"), os.path.join(path, "tokenizer")
    if os.path.isfile(os.path.join(model, "config.json")) and os.path.isdir(tok):
        return model, tok
    raise FileNotFoundError(
        f"--clip {path!r} is not a CLIP text encoder folder: it needs config.json, the weights and the tokenizer "
        f"files (as CLIPTextModel.save_pretrained + tokenizer.save_pretrained write them), or a pipeline folder "
        f"with text_encoder/ and tokenizer/; download e.g. openai/clip-vit-large-patch14 where there is network "
        f"and pass that local folder")


class CLIPTextEncoder:
    """captions (list of str) -> pooled CLIP embeddings float32 [B, dim], frozen, no gradients."""

    def __init__(self, path: str, device="cpu", max_length: int = 77):
        from transformers import AutoTokenizer, CLIPTextModel  # lazy: transformers is slow to import

        model_dir, tok_dir = _folders(path)
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        self.model = CLIPTextModel.from_pretrained(model_dir).to(device).eval().requires_grad_(False)
        self.max_length = min(max_length, self.model.config.max_position_embeddings)
        self.device = torch.device(device)

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(captions), padding="max_length", max_length=self.max_length, truncation=True,
                                return_tensors="pt")
        out = self.model(input_ids=tokens["input_ids"].to(self.device),
                         attention_mask=tokens["attention_mask"].to(self.device))
        return out.pooler_output.float()


def text_encoder_dim(path) -> int | None:
    """The pooled embedding width of the CLIP text encoder at `path` (from its config.json; no weights read),
    None for None / "none"."""
    if _is_none(path):
        return None
    with open(os.path.join(_folders(str(path))[0], "config.json")) as f:
        return json.load(f)["hidden_size"]


def load_text_encoder(path, device="cpu"):
    """A CLIPTextEncoder, or None for None / "none" (class labels condition instead)."""
    return None if _is_none(path) else CLIPTextEncoder(str(path), device)
