"""Tiny random text encoders for the debug models of the diffusers-transformer families (tests and the CPU demos,
where nothing can be downloaded): one table, WRITERS, keyed by the "tiny_text" constant of a debug model. Each writes
the folder that model's --text_encoder takes, with word-level tokenizers over the demo captions' words.

    python -m opendit.families.wrapped.tiny_text z-image-debug outputs/tiny_text   # then --text_encoder that folder
"""
import argparse
import os
from pathlib import Path


def _t5(folder, words):
    from opendit.families.flux.tiny_t5 import save_tiny_t5
    return save_tiny_t5(folder, words, max_length=16)


def _clip_and_t5(folder, words):
    """A FLUX.1 pipeline folder's text parts: CLIP (text_encoder/, tokenizer/) and T5 (text_encoder_2/,
    tokenizer_2/)."""
    from opendit.encoders.tiny_clip import save_tiny_clip
    root = Path(folder)
    t5, clip = _t5(root / "t5", words), save_tiny_clip(root / "clip", words=words)
    for name, target in (("text_encoder", clip), ("tokenizer", clip), ("text_encoder_2", t5), ("tokenizer_2", t5)):
        if not (root / name).exists():
            os.symlink(target, root / name)
    return str(root)


def _qwen3(folder, words):
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    return save_tiny_qwen3(folder, words)


def _mistral3(folder, words):
    from opendit.families.wrapped.flux2 import save_tiny_mistral3
    return save_tiny_mistral3(folder, words)


def _qwen25vl(folder, words):
    from opendit.families.wrapped.qwenimage import save_tiny_qwen25vl
    return save_tiny_qwen25vl(folder, words)


def _hunyuanvideo15(folder, words):
    from opendit.families.wrapped.hunyuanvideo15 import save_tiny_text_encoders
    return save_tiny_text_encoders(folder, words)


def _umt5(folder, words):
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    return save_tiny_umt5(folder, max_length=16)


WRITERS = {"t5": _t5, "clip+t5": _clip_and_t5, "qwen3": _qwen3, "mistral3": _mistral3, "qwen2.5-vl": _qwen25vl,
           "hunyuanvideo1.5": _hunyuanvideo15, "umt5": _umt5}


def write_text_encoder(model: str, folder, words: str = "digits") -> str:
    """The tiny text encoder of the registered debug `model` (its "tiny_text" constant) in `folder`."""
    from opendit.families import model_spec
    kind = model_spec(model).constants.get("tiny_text")
    if kind is None:
        with_one = sorted(n for n, s in _all_specs().items() if "tiny_text" in s.constants)
        raise ValueError(f"{model} has no tiny text encoder; the debug models that do: {', '.join(with_one)}")
    return WRITERS[kind](folder, words)


def _all_specs():
    from opendit.families import all_models
    return all_models()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a debug model of a diffusers-transformer family, e.g. z-image-debug")
    parser.add_argument("folder")
    parser.add_argument("--words", default="digits", help="the vocabulary: digits, moving_digits or all")
    args = parser.parse_args()
    print(write_text_encoder(args.model, args.folder, args.words))
