"""Frozen text encoders (transformers) from local folders.

- CLIPTextEncoder: captions -> the pooled CLIP embedding [B, D] that video DiT adds to its timestep embedding
  (as OpenDiT's VDiT did) and that FLUX feeds its `vec` input (CLIP-L, 77 tokens, pooler_output).
- T5TextEncoder: captions -> T5 encoder token embeddings [B, L, D], FLUX's `txt` input (T5-XXL v1.1, L = 512
  for FLUX.1-dev, 256 for FLUX.1-schnell), computed as FLUX's HFEmbedder does: padded to max_length,
  truncated, no attention mask (FLUX was trained on the embeddings of the padded sequence).
- UMT5TextEncoder: captions -> umt5-xxl encoder token embeddings [B, L, D], Wan2.1's text input (L = 512), computed
  as Wan does: the encoder sees the attention mask and every position after a caption's tokens is zero.

Nothing is downloaded: pass a folder written by `save_pretrained` (the model and its tokenizer together),
or a pipeline folder laid out as black-forest-labs/FLUX.1-dev is: text_encoder/ + tokenizer/ (CLIP),
text_encoder_2/ + tokenizer_2/ (T5). The same FLUX folder works for --clip and --t5. A Wan2.1 pipeline folder
(Wan-AI/Wan2.1-T2V-1.3B-Diffusers) holds UMT5 in text_encoder/ + tokenizer/.
"""
import glob
import json
import os

import torch

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json")
# where each encoder lives: the flag, (model, tokenizer) subfolders of a pipeline folder tried in order, the
# config model types accepted, and where to get one
CLIP_SOURCE = dict(flag="--clip", kind="CLIP text encoder", subfolders=(("text_encoder", "tokenizer"),),
                   model_types=("clip_text_model", "clip"),
                   where="openai/clip-vit-large-patch14, or the text_encoder/ + tokenizer/ of "
                         "black-forest-labs/FLUX.1-dev")
# FLUX: text_encoder_2/ (text_encoder/ is CLIP); SD3: text_encoder_3/; PixArt: text_encoder/
T5_SOURCE = dict(flag="--t5", kind="T5 encoder", subfolders=(("text_encoder_2", "tokenizer_2"),
                                                             ("text_encoder_3", "tokenizer_3"),
                                                             ("text_encoder", "tokenizer")),
                 model_types=("t5",),
                 where="google/t5-v1_1-xxl, or the text_encoder_2/ + tokenizer_2/ of black-forest-labs/FLUX.1-dev")
UMT5_SOURCE = dict(flag="--umt5", kind="UMT5 encoder", subfolders=(("text_encoder", "tokenizer"),),
                   model_types=("umt5",), where="the text_encoder/ + tokenizer/ of Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


def _is_none(path) -> bool:
    return path is None or str(path).strip().lower() == "none"


def _needs(source: dict) -> str:
    model_dir, tok_dir = source["subfolders"][0]
    return (f"it needs config.json, the weights (*.safetensors or pytorch_model*.bin) and the tokenizer files "
            f"(tokenizer.json or spiece.model / vocab.json, with tokenizer_config.json), as "
            f"save_pretrained writes them for the model and its tokenizer, or a pipeline folder with {model_dir}/ "
            f"and {tok_dir}/; download {source['where']} where there is network and pass that local folder")


def _model_type(folder: str) -> str | None:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f).get("model_type")


def _has_model(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json")) and \
        any(glob.glob(os.path.join(folder, pattern)) for pattern in WEIGHT_PATTERNS)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def _folders(path: str, source: dict = CLIP_SOURCE, check_files: bool = True) -> tuple[str, str]:
    """(model folder, tokenizer folder) of `source` (CLIP_SOURCE / T5_SOURCE / UMT5_SOURCE): the folder itself, or
    the first pipeline subfolder pair holding that kind of model. FileNotFoundError (ValueError for a config of
    another model) naming the flag, the path and the files otherwise; check_files=False needs only the config."""
    flag, kind = source["flag"], source["kind"]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag} {path!r} does not exist; pass a local {kind} folder: {_needs(source)}")
    if os.path.isfile(os.path.join(path, "config.json")):
        model_dir, tok_dir = path, path
    else:
        pairs = [tuple(os.path.join(path, sub) for sub in pair) for pair in source["subfolders"]]
        pairs = [pair for pair in pairs if os.path.isfile(os.path.join(pair[0], "config.json"))]
        if not pairs:
            raise FileNotFoundError(f"{flag} {path!r} is not a {kind} folder (no config.json, nor "
                                    f"{source['subfolders'][0][0]}/config.json): {_needs(source)}")
        # a pipeline's first subfolder of the right kind (FLUX's text_encoder/ is CLIP, its text_encoder_2/ T5)
        model_dir, tok_dir = next((p for p in pairs if _model_type(p[0]) in source["model_types"]), pairs[0])
    model_type = _model_type(model_dir)
    if model_type not in source["model_types"]:
        raise ValueError(f"{flag} {path!r}: {os.path.join(model_dir, 'config.json')} describes a {model_type!r} "
                         f"model, not a {kind} (model_type {' or '.join(source['model_types'])}); {_needs(source)}")
    if not check_files:
        return model_dir, tok_dir
    missing = [what for what, ok in (("weights", _has_model(model_dir)), ("tokenizer files", _has_tokenizer(tok_dir)))
               if not ok]
    if missing:
        raise FileNotFoundError(f"{flag} {path!r} has no {' and no '.join(missing)} (looked in {model_dir!r} and "
                                f"{tok_dir!r}): {_needs(source)}")
    return model_dir, tok_dir


def _config(path, source: dict) -> dict:
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


# Parameter counts of the released text encoders, for the memory planner (opendit.plan), which sizes a run without
# reading their folders: T5-XXL's encoder (FLUX's text_encoder_2; as benchmarks/flux_memory.py has used), CLIP-L's
# text model (FLUX's text_encoder) and umt5-xxl's encoder (Wan2.1's; transformers' UMT5EncoderModel built from the
# google/umt5-xxl config on the meta device: 5,680,910,336).
TEXT_ENCODER_PARAMS = {"T5-XXL": 4.762e9, "CLIP-L": 123_060_480, "UMT5-XXL": 5_680_910_336}


def encoder_dtype(device) -> torch.dtype:
    """The weights' dtype of a large frozen text encoder: bf16 on GPUs (FLUX's and Wan's setting: T5-XXL is 9.5 GB
    in bf16), fp32 on CPUs, where bf16 matmuls are slow."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _frozen(path: str, source: dict, model_class, device, dtype):
    """(tokenizer, frozen eval-mode model_class on device in dtype) from the folders of `source` (see _folders)."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    model_dir, tok_dir = _folders(path, source)
    model = model_class.from_pretrained(model_dir, dtype=dtype).to(device=device, dtype=dtype)
    return AutoTokenizer.from_pretrained(tok_dir), model.eval().requires_grad_(False)


class T5TextEncoder:
    """captions (list of str) -> T5 encoder token embeddings float32 [B, max_length, dim], frozen, no gradients.

    As FLUX's HFEmbedder: every caption is padded (or truncated) to max_length tokens, EOS included, and the
    encoder sees no attention mask. dtype: the weights' dtype (bf16 as FLUX runs T5-XXL; fp16 overflows in T5);
    outputs are float32 either way. `model` is the transformers T5EncoderModel (its blocks: model.encoder.block).
    """

    def __init__(self, path: str, device="cpu", max_length: int = 512, dtype: torch.dtype = torch.bfloat16):
        from transformers import T5EncoderModel  # lazy: transformers is slow to import

        if int(max_length) <= 0:
            raise ValueError(f"T5 max_length must be a positive int, got {max_length!r} (FLUX.1-dev: 512, "
                             f"FLUX.1-schnell: 256)")
        self.tokenizer, self.model = _frozen(path, T5_SOURCE, T5EncoderModel, device, dtype)
        self.max_length = int(max_length)
        self.device = torch.device(device)

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        """-> input ids int64 [B, max_length] (pad id 0 after the EOS)."""
        return self.tokenizer(list(captions), padding="max_length", max_length=self.max_length, truncation=True,
                              return_tensors="pt")["input_ids"]

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> torch.Tensor:
        out = self.model(input_ids=self.tokenize(captions).to(self.device), attention_mask=None)
        return out.last_hidden_state.float()


class UMT5TextEncoder:
    """captions (list of str) -> UMT5 encoder token embeddings float32 [B, max_length, dim], frozen, no gradients.

    As Wan2.1 and diffusers' WanPipeline: whitespace collapsed (Wan's ftfy / HTML clean-up is not applied), padded
    (or truncated) to max_length tokens, EOS included; the encoder sees the attention mask; each caption keeps its
    real tokens (`lengths`) and every position after them is exactly zero, as Wan trims each embedding to its
    length and its transformer zero-pads it back to text_len. A caption's embedding therefore depends neither on the
    rest of the batch nor on max_length (beyond truncation). dtype: the weights' dtype (Wan runs umt5-xxl in bf16);
    outputs are float32 either way. `model` is the transformers UMT5EncoderModel (its blocks: model.encoder.block).
    """

    def __init__(self, path: str, device="cpu", max_length: int = 512, dtype: torch.dtype = torch.float32):
        from transformers import UMT5EncoderModel  # lazy: transformers is slow to import

        if int(max_length) <= 0:
            raise ValueError(f"UMT5 max_length must be a positive int, got {max_length!r} (Wan2.1: 512)")
        self.tokenizer, self.model = _frozen(path, UMT5_SOURCE, UMT5EncoderModel, device, dtype)
        self.max_length = int(max_length)
        self.device = torch.device(device)

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    def tokenize(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (input ids int64 [B, max_length], attention mask int64 [B, max_length]: 1 on each caption's tokens,
        EOS included, 0 on the padding after them)."""
        tokens = self.tokenizer([" ".join(str(c).split()) for c in captions], padding="max_length",
                                max_length=self.max_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        return tokens["input_ids"], tokens["attention_mask"]

    def lengths(self, captions: list[str]) -> torch.Tensor:
        """-> int64 [B]: each caption's real tokens, EOS included (the positions of its embedding that are not 0)."""
        return self.tokenize(captions)[1].sum(dim=1)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> torch.Tensor:
        ids, mask = (t.to(self.device) for t in self.tokenize(captions))
        out = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return out.masked_fill(mask[..., None] == 0, 0.0)


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
    """The token embedding width (d_model) of the T5 encoder at `path` (from its config.json; no weights read),
    None for None / "none"."""
    return None if _is_none(path) else _config(path, T5_SOURCE)["d_model"]


def load_t5_encoder(path, device="cpu", max_length: int = 512, dtype: torch.dtype = torch.bfloat16):
    """A T5TextEncoder, or None for None / "none"."""
    return None if _is_none(path) else T5TextEncoder(str(path), device, max_length, dtype)


def umt5_encoder_dim(path) -> int | None:
    """The token embedding width (d_model) of the UMT5 encoder at `path` (from its config.json; no weights read),
    None for None / "none"."""
    return None if _is_none(path) else _config(path, UMT5_SOURCE)["d_model"]


def load_umt5_encoder(path, device="cpu", max_length: int = 512, dtype: torch.dtype = torch.float32):
    """A UMT5TextEncoder, or None for None / "none"."""
    return None if _is_none(path) else UMT5TextEncoder(str(path), device, max_length, dtype)


class FixedEmbeddings:
    """Stands in for a text encoder when only known captions will be asked for: a table caption -> embedding
    (CPU tensors) computed beforehand, e.g. a training preview's prompts, encoded once on every rank while a
    sharded T5 can still run collectively, then looked up on rank 0 alone. Called like the encoder it replaces:
    captions -> the stacked embeddings, float32 [B, ...]."""

    def __init__(self, table: dict[str, torch.Tensor]):
        self.table = table

    @classmethod
    def encode(cls, encoder, captions: list[str]) -> "FixedEmbeddings":
        """The embeddings of `captions` (each once) by `encoder` (a CLIPTextEncoder, T5TextEncoder or
        UMT5TextEncoder)."""
        captions = list(dict.fromkeys(captions))
        return cls(dict(zip(captions, encoder(captions).float().cpu())))

    def __call__(self, captions: list[str]) -> torch.Tensor:
        missing = [c for c in captions if c not in self.table]
        if missing:
            raise KeyError(f"captions {missing[:3]} were not encoded beforehand; known: {list(self.table)[:8]}")
        return torch.stack([self.table[c] for c in captions]).float()
