"""A tiny random T5 encoder with a word-level tokenizer, saved to a local folder: what tests and the CPU FLUX
demo use in place of T5-XXL (nothing can be downloaded there). Like tiny_clip, its embeddings carry no
pretrained meaning, but each caption gets a fixed, distinct token sequence, which is all conditioning needs.

    python -m opendit.families.flux.tiny_t5 outputs/tiny_t5 --clip outputs/tiny_clip
    # then: train.py --model flux-debug --dataset captioned_digits --t5 outputs/tiny_t5 --clip outputs/tiny_clip

The tokenizer follows T5's conventions: <pad> = 0, </s> = 1 (appended to every caption, no BOS), <unk> = 2.
"""
import argparse

import torch

from opendit.encoders.tiny_clip import WORD_SETS, save_tiny_clip
from opendit.encoders.word_tokenizer import t5_word_tokenizer

def save_tiny_t5(folder, words="digits", d_model: int = 32, layers: int = 2, max_length: int = 512,
                 seed: int = 0) -> str:
    """Write a T5EncoderModel (d_model wide, `layers` deep, 2 heads, gated-GELU as T5 v1.1, random weights from
    `seed`) and a word-level tokenizer over `words` (see t5_word_tokenizer; default "digits", the captioned digits
    demo's) to `folder`; returns the folder."""
    from transformers import T5Config, T5EncoderModel

    if d_model % 2:
        raise ValueError(f"d_model must be even (2 heads), got {d_model}")
    tokenizer = t5_word_tokenizer(words, max_length)
    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model,
                      num_layers=layers, num_heads=2, relative_attention_num_buckets=8,
                      relative_attention_max_distance=32, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                      dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    T5EncoderModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--words", choices=WORD_SETS, default="digits",
                        help="the vocabulary: the captioned digits' captions, the moving digits' or both")
    parser.add_argument("--clip", default=None, metavar="FOLDER",
                        help="also write a tiny CLIP text encoder over the same words to FOLDER")
    parser.add_argument("--clip_hidden_size", type=int, default=32)
    args = parser.parse_args()
    print(save_tiny_t5(args.folder, words=args.words, d_model=args.d_model))
    if args.clip:
        print(save_tiny_clip(args.clip, words=args.words, hidden_size=args.clip_hidden_size))
