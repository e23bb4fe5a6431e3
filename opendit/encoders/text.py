"""Frozen text encoders (transformers) from local folders, each described by a TextEncoderSource (where it lives,
which model types it accepts, how its token embeddings are computed), so a family adds an encoder by describing it.

- CLIPTextEncoder: captions -> the pooled CLIP embedding [B, D] that video DiT adds to its timestep embedding
  (as OpenDiT's VDiT did) and that FLUX feeds its `vec` input (CLIP-L, 77 tokens, pooler_output).
- TokenTextEncoder: captions -> encoder token embeddings [B, L, D], padded to L. T5_SOURCE is T5 as FLUX's
  HFEmbedder runs it (T5-XXL v1.1, L = 512 for FLUX.1-dev, 256 for FLUX.1-schnell: padded, truncated, no attention
  mask); a masked source (Wan's UMT5, opendit.families.wan.text) lets the encoder see the mask and zeroes every
  position after a caption's tokens.

Nothing is downloaded: pass a folder written by `save_pretrained` (the model and its tokenizer together),
or a pipeline folder laid out as black-forest-labs/FLUX.1-dev is: text_encoder/ + tokenizer/ (CLIP),
text_encoder_2/ + tokenizer_2/ (T5). The same FLUX folder works for --clip and --t5.
"""
import glob
import json
import os
from dataclasses import dataclass

import torch

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json")


@dataclass(frozen=True)
class TextEncoderSource:
    """A text encoder, described: its flag and name; the (model, tokenizer) subfolders of a pipeline folder, tried
    in order; the config model types accepted; where to get one; the released model's parameter count (the memory
    planner sizes a run from it without reading the folder). A token encoder (TokenTextEncoder) also names its
    transformers class, whether the encoder sees the attention mask with the positions after each caption's tokens
    zeroed (masked), whether whitespace is collapsed first, and the usual lengths (for errors)."""
    flag: str
    kind: str
    subfolders: tuple[tuple[str, str], ...]
    model_types: tuple[str, ...]
    where: str
    params: float = 0
    model_class: str = ""
    masked: bool = False
    collapse_whitespace: bool = False
    lengths: str = ""


CLIP_SOURCE = TextEncoderSource(
    "--clip", "CLIP text encoder", (("text_encoder", "tokenizer"),), ("clip_text_model", "clip"),
    "openai/clip-vit-large-patch14, or the text_encoder/ + tokenizer/ of black-forest-labs/FLUX.1-dev",
    params=123_060_480)  # CLIP-L's text model (FLUX's text_encoder)
# FLUX: text_encoder_2/ (text_encoder/ is CLIP); SD3: text_encoder_3/; PixArt: text_encoder/
T5_SOURCE = TextEncoderSource(
    "--t5", "T5 encoder", (("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3"),
                           ("text_encoder", "tokenizer")), ("t5",),
    "google/t5-v1_1-xxl, or the text_encoder_2/ + tokenizer_2/ of black-forest-labs/FLUX.1-dev",
    params=4.762e9,  # T5-XXL's encoder (FLUX's text_encoder_2; as benchmarks/flux_memory.py has used)
    model_class="T5EncoderModel", lengths="FLUX.1-dev: 512, FLUX.1-schnell: 256")


def _is_none(path) -> bool:
    return path is None or str(path).strip().lower() == "none"


def _needs(source: TextEncoderSource) -> str:
    model_dir, tok_dir = source.subfolders[0]
    return (f"it needs config.json, the weights (*.safetensors or pytorch_model*.bin) and the tokenizer files "
            f"(tokenizer.json or spiece.model / vocab.json, with tokenizer_config.json), as "
            f"save_pretrained writes them for the model and its tokenizer, or a pipeline folder with {model_dir}/ "
            f"and {tok_dir}/; download {source.where} where there is network and pass that local folder")


def _model_type(folder: str) -> str | None:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f).get("model_type")


def _has_model(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json")) and \
        any(glob.glob(os.path.join(folder, pattern)) for pattern in WEIGHT_PATTERNS)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def _folders(path: str, source: TextEncoderSource = CLIP_SOURCE, check_files: bool = True) -> tuple[str, str]:
    """(model folder, tokenizer folder) of `source` (e.g. CLIP_SOURCE, T5_SOURCE): the folder itself, or
    the first pipeline subfolder pair holding that kind of model. FileNotFoundError (ValueError for a config of
    another model) naming the flag, the path and the files otherwise; check_files=False needs only the config."""
    flag, kind = source.flag, source.kind
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag} {path!r} does not exist; pass a local {kind} folder: {_needs(source)}")
    if os.path.isfile(os.path.join(path, "config.json")):
        model_dir, tok_dir = path, path
    else:
        pairs = [tuple(os.path.join(path, sub) for sub in pair) for pair in source.subfolders]
        pairs = [pair for pair in pairs if os.path.isfile(os.path.join(pair[0], "config.json"))]
        if not pairs:
            raise FileNotFoundError(f"{flag} {path!r} is not a {kind} folder (no config.json, nor "
                                    f"{source.subfolders[0][0]}/config.json): {_needs(source)}")
        # a pipeline's first subfolder of the right kind (FLUX's text_encoder/ is CLIP, its text_encoder_2/ T5)
        model_dir, tok_dir = next((p for p in pairs if _model_type(p[0]) in source.model_types), pairs[0])
    model_type = _model_type(model_dir)
    if model_type not in source.model_types:
        raise ValueError(f"{flag} {path!r}: {os.path.join(model_dir, 'config.json')} describes a {model_type!r} "
                         f"model, not a {kind} (model_type {' or '.join(source.model_types)}); {_needs(source)}")
    if not check_files:
        return model_dir, tok_dir
    missing = [what for what, ok in (("weights", _has_model(model_dir)), ("tokenizer files", _has_tokenizer(tok_dir)))
               if not ok]
    if missing:
        raise FileNotFoundError(f"{flag} {path!r} has no {' and no '.join(missing)} (looked in {model_dir!r} and "
                                f"{tok_dir!r}): {_needs(source)}")
    return model_dir, tok_dir


def _config(path, source: TextEncoderSource) -> dict:
    """The model's config.json (neither weights nor tokenizer read, nor required)."""
    with open(os.path.join(_folders(str(path), source, check_files=False)[0], "config.json")) as f:
        return json.load(f)


class CLIPTextEncoder:
    """captions (list of str) -> pooled CLIP embeddings float32 [B, dim], frozen, no gradients.

    dtype: the weights' dtype (bf16 as FLUX runs CLIP-L; float32 by default); outputs are float32 either way."""

    def __init__(self, path: str, device="cpu", max_length: int = 77, dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer, CLIPTextModel  # lazy: transformers is slow to import

        model_dir, tok_dir = _folders(path, CLIP_SOURCE)
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        self.model = CLIPTextModel.from_pretrained(model_dir, dtype=dtype).to(device=device, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.max_length = min(max_length, self.model.config.max_position_embeddings)
        self.device = torch.device(device)

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(captions), padding="max_length", max_length=self.max_length, truncation=True,
                                return_tensors="pt")
        # CLIP's attention is causal and the pool reads the EOS token, so the mask does not change the result
        out = self.model(input_ids=tokens["input_ids"].to(self.device),
                         attention_mask=tokens["attention_mask"].to(self.device))
        return out.pooler_output.float()


def encoder_dtype(device) -> torch.dtype:
    """The weights' dtype of a large frozen text encoder: bf16 on GPUs (FLUX's and Wan's setting: T5-XXL is 9.5 GB
    in bf16), fp32 on CPUs, where bf16 matmuls are slow."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class TokenTextEncoder:
    """captions (list of str) -> encoder token embeddings float32 [B, max_length, dim] of the text encoder `source`
    describes, frozen, no gradients.

    Every caption is padded (or truncated) to max_length tokens, EOS included. Unmasked (T5 as FLUX's HFEmbedder):
    the encoder sees no attention mask (FLUX was trained on the embeddings of the padded sequence). Masked (UMT5 as
    Wan2.1 and diffusers' WanPipeline): the encoder sees the mask and every position after a caption's tokens
    (`lengths`) is exactly zero, so a caption's embedding depends neither on the rest of the batch nor on
    max_length (beyond truncation). dtype: the weights' dtype (bf16 as FLUX and Wan run their encoders; fp16
    overflows in T5); outputs are float32 either way. `model` is the transformers model (its blocks:
    model.encoder.block)."""

    def __init__(self, path: str, source: TextEncoderSource, device="cpu", max_length: int = 512,
                 dtype: torch.dtype = torch.bfloat16):
        import transformers  # lazy: transformers is slow to import

        if int(max_length) <= 0:
            lengths = f" ({source.lengths})" if source.lengths else ""
            raise ValueError(f"{source.kind} max_length must be a positive int, got {max_length!r}{lengths}")
        model_dir, tok_dir = _folders(path, source)
        model = getattr(transformers, source.model_class).from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
        self.source, self.max_length, self.device = source, int(max_length), torch.device(device)

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    def tokenize(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (input ids int64 [B, max_length], attention mask int64 [B, max_length]: 1 on each caption's tokens,
        EOS included, 0 on the padding after them)."""
        if self.source.collapse_whitespace:  # Wan's ftfy / HTML clean-up is not applied
            captions = [" ".join(str(c).split()) for c in captions]
        tokens = self.tokenizer(list(captions), padding="max_length", max_length=self.max_length, truncation=True,
                                return_attention_mask=True, return_tensors="pt")
        return tokens["input_ids"], tokens["attention_mask"]

    def lengths(self, captions: list[str]) -> torch.Tensor:
        """-> int64 [B]: each caption's real tokens, EOS included (masked: the positions that are not 0)."""
        return self.tokenize(captions)[1].sum(dim=1)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> torch.Tensor:
        ids, mask = (t.to(self.device) for t in self.tokenize(captions))
        if not self.source.masked:
            return self.model(input_ids=ids, attention_mask=None).last_hidden_state.float()
        out = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return out.masked_fill(mask[..., None] == 0, 0.0)


def token_encoder_dim(path, source: TextEncoderSource) -> int | None:
    """The token embedding width (d_model) of the encoder `source` describes at `path` (from its config.json; no
    weights read), None for None / "none"."""
    return None if _is_none(path) else _config(path, source)["d_model"]


def load_token_encoder(path, source: TextEncoderSource, device="cpu", max_length: int = 512,
                       dtype: torch.dtype = torch.bfloat16):
    """A TokenTextEncoder, or None for None / "none"."""
    return None if _is_none(path) else TokenTextEncoder(str(path), source, device, max_length, dtype)


def text_encoder_dim(path) -> int | None:
    """The pooled embedding width of the CLIP text encoder at `path` (from its config.json; no weights read),
    None for None / "none"."""
    if _is_none(path):
        return None
    config = _config(path, CLIP_SOURCE)
    return config.get("text_config", config)["hidden_size"]  # a whole CLIPModel's config nests the text part


def load_text_encoder(path, device="cpu", dtype: torch.dtype = torch.float32):
    """A CLIPTextEncoder, or None for None / "none" (class labels condition instead)."""
    return None if _is_none(path) else CLIPTextEncoder(str(path), device, dtype=dtype)


def t5_encoder_dim(path) -> int | None:
    return token_encoder_dim(path, T5_SOURCE)


def load_t5_encoder(path, device="cpu", max_length: int = 512, dtype: torch.dtype = torch.bfloat16):
    """T5 as FLUX runs it (a TokenTextEncoder of T5_SOURCE), or None for None / "none"."""
    return load_token_encoder(path, T5_SOURCE, device, max_length, dtype)


class FixedEmbeddings:
    """Stands in for a text encoder when only known captions will be asked for: a table caption -> embedding
    (CPU tensors) computed beforehand, e.g. a training preview's prompts, encoded once on every rank while a
    sharded T5 can still run collectively, then looked up on rank 0 alone. Called like the encoder it replaces:
    captions -> the stacked embeddings, float32 [B, ...]."""

    def __init__(self, table: dict[str, torch.Tensor]):
        self.table = table

    @classmethod
    def encode(cls, encoder, captions: list[str]) -> "FixedEmbeddings":
        """The embeddings of `captions` (each once) by `encoder` (a CLIPTextEncoder or TokenTextEncoder)."""
        captions = list(dict.fromkeys(captions))
        return cls(dict(zip(captions, encoder(captions).float().cpu())))

    def __call__(self, captions: list[str]) -> torch.Tensor:
        missing = [c for c in captions if c not in self.table]
        if missing:
            raise KeyError(f"captions {missing[:3]} were not encoded beforehand; known: {list(self.table)[:8]}")
        return torch.stack([self.table[c] for c in captions]).float()
