"""Wan2.1's text encoder, described for opendit.encoders.text: umt5-xxl's encoder as Wan and diffusers' WanPipeline
run it (whitespace collapsed, padded to 512 tokens, the attention mask seen, every position after a caption's tokens
zero). A Wan2.1 pipeline folder (Wan-AI/Wan2.1-T2V-1.3B-Diffusers) holds it in text_encoder/ + tokenizer/."""
import torch

from opendit.encoders.text import TextEncoderSource, load_token_encoder, token_encoder_dim

UMT5_SOURCE = TextEncoderSource(
    "--umt5", "UMT5 encoder", (("text_encoder", "tokenizer"),), ("umt5",),
    "the text_encoder/ + tokenizer/ of Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    params=5_680_910_336,  # transformers' UMT5EncoderModel built from the google/umt5-xxl config on the meta device
    model_class="UMT5EncoderModel", masked=True, collapse_whitespace=True, lengths="Wan2.1: 512")


def umt5_encoder_dim(path) -> int | None:
    return token_encoder_dim(path, UMT5_SOURCE)


def load_umt5_encoder(path, device="cpu", max_length: int = 512, dtype: torch.dtype = torch.float32):
    """UMT5 as Wan runs it (a TokenTextEncoder of UMT5_SOURCE), or None for None / "none"."""
    return load_token_encoder(path, UMT5_SOURCE, device, max_length, dtype)
