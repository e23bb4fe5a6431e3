"""A tiny random UMT5 encoder with a word-level tokenizer, saved to a local folder: what tests and the CPU Wan2.1
demo use in place of umt5-xxl (nothing can be downloaded there). Like tiny_t5, its embeddings carry no pretrained
meaning, but each caption gets a fixed, distinct token sequence, which is all conditioning needs.

    python -m opendit.families.wan.tiny_umt5 outputs/tiny_umt5              # then: --umt5 outputs/tiny_umt5
    python -m opendit.families.wan.tiny_umt5 outputs/tiny_wan --pipeline    # text_encoder/ + tokenizer/, as Wan's

The tokenizer follows T5's conventions as umt5-xxl's does: <pad> = 0, </s> = 1 (appended, no BOS), <unk> = 2.
"""
import argparse
import os

import torch

from opendit.encoders.tiny_clip import WORD_SETS
from opendit.encoders.word_tokenizer import t5_word_tokenizer


def save_tiny_umt5(folder, words="moving_digits", d_model: int = 32, layers: int = 2, max_length: int = 512,
                   seed: int = 0, pipeline: bool = False) -> str:
    """Write a UMT5EncoderModel (d_model wide, `layers` deep, 2 heads, gated-GELU, a relative position bias per
    layer as UMT5 has, random weights from `seed`) and a word-level tokenizer over `words` (see
    word_tokenizer.t5_word_tokenizer; default "moving_digits", the moving digits demo's) to `folder`; pipeline=True lays
    them out as a diffusers Wan pipeline does (folder/text_encoder/ + folder/tokenizer/). Returns the folder."""
    from transformers import UMT5Config, UMT5EncoderModel

    if d_model % 2:
        raise ValueError(f"d_model must be even (2 heads), got {d_model}")
    tokenizer = t5_word_tokenizer(words, max_length)
    config = UMT5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model,
                        num_layers=layers, num_heads=2, relative_attention_num_buckets=8,
                        relative_attention_max_distance=32, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    model_dir, tok_dir = (os.path.join(folder, "text_encoder"), os.path.join(folder, "tokenizer")) if pipeline \
        else (folder, folder)
    UMT5EncoderModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(tok_dir)
    return str(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--words", choices=WORD_SETS, default="moving_digits",
                        help="the vocabulary: the moving digits' captions, the captioned digits' or both")
    parser.add_argument("--pipeline", action="store_true",
                        help="write text_encoder/ + tokenizer/ subfolders, as a diffusers Wan pipeline folder has")
    args = parser.parse_args()
    print(save_tiny_umt5(args.folder, words=args.words, d_model=args.d_model, pipeline=args.pipeline))
