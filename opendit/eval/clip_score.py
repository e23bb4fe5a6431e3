"""CLIP score of text-conditioned samples: mean over images of 100 * max(cos(CLIP image embedding, CLIP text
embedding of its prompt), 0), as torchmetrics' CLIPScore, from a LOCAL CLIP folder (transformers' CLIPModel and
tokenizer in save_pretrained layout, e.g. a download of openai/clip-vit-large-patch14; nothing is downloaded).
Images are preprocessed by transformers' CLIP image processor (PIL backend: resize the short side, center crop,
normalize), with the folder's preprocessor_config.json where it has one. Video: every frame is scored against its
clip's prompt."""
import json
from pathlib import Path

import numpy as np
import torch

from opendit.eval.data import Images, UserError
from opendit.eval.metrics import clip_scores


def _image_processor(folder: Path, size: int):
    try:  # transformers >= 5: the PIL backend by name (CLIPImageProcessor's default backend needs torchvision)
        from transformers import CLIPImageProcessorPil as processor_class
    except ImportError:  # transformers 4: CLIPImageProcessor is the PIL / numpy one
        from transformers import CLIPImageProcessor as processor_class
    if (folder / "preprocessor_config.json").is_file():
        return processor_class.from_pretrained(folder, local_files_only=True)
    return processor_class(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def load_clip(folder, device="cpu"):
    """(model, tokenizer, image processor) from a local folder; one-line UserErrors for a missing / wrong one."""
    from transformers import AutoTokenizer, CLIPModel

    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(f"--clip {folder}: no CLIP model there (no config.json); save one with transformers' "
                        "CLIPModel.save_pretrained and the tokenizer's save_pretrained, e.g. a local copy of "
                        "openai/clip-vit-large-patch14")
    kind = json.loads(config.read_text()).get("model_type")
    if kind != "clip":
        raise UserError(f"--clip {folder}: config.json is a {kind!r} model; the CLIP score needs a full CLIPModel "
                        "(model_type 'clip': image and text towers), not a text encoder alone")
    model = CLIPModel.from_pretrained(folder, local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer, _image_processor(folder, model.config.vision_config.image_size)


def _embeds(out) -> torch.Tensor:
    """get_*_features returns the projected embeddings (transformers 4) or an output holding them as its
    pooler_output (transformers 5)."""
    return out if torch.is_tensor(out) else out.pooler_output


def read_prompts(prompts=None, prompts_file=None) -> list[str]:
    """--prompts plus the non-empty lines of --prompts_file, as sample.py reads them."""
    found = list(prompts or [])
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise UserError(f"--prompts_file {path}: no such file")
        found += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not found:
        raise UserError("clip_score needs the prompts the samples were made from: --prompts \"...\" or --prompts_file")
    return found


@torch.no_grad()
def clip_score(images: Images, prompts: list[str], clip, batch_size: int = 50, device="cpu") -> tuple[float, int]:
    """(mean CLIP score, number of images scored). Sample i was made from prompts[i % len(prompts)] (sample.py's
    rule); `clip` is load_clip's triple."""
    model, tokenizer, processor = clip
    max_length = min(int(getattr(tokenizer, "model_max_length", 77) or 77),
                     model.config.text_config.max_position_embeddings)
    per_sample, scores, index = images.frames or 1, [], 0
    for batch in images.batches(batch_size):
        texts = [prompts[((index + j) // per_sample) % len(prompts)] for j in range(len(batch))]
        index += len(batch)
        pixels = processor(images=list(batch), return_tensors="pt")["pixel_values"].to(device)
        tokens = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        tokens = {k: v.to(device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        image = _embeds(model.get_image_features(pixel_values=pixels))
        text = _embeds(model.get_text_features(**tokens))
        scores.append(clip_scores(image, text).cpu().numpy())
    values = np.concatenate(scores)
    return float(values.mean()), len(values)
