"""A tiny random CLIP text encoder with a word-level tokenizer, saved to a local folder: what tests and the
CPU demo use in place of a real CLIP (nothing can be downloaded there). Its embeddings carry no pretrained
meaning, but they are a fixed, distinct vector per caption, which is all conditioning needs to learn.

    python -m opendit.encoders.tiny_clip outputs/tiny_clip      # then: train.py --clip outputs/tiny_clip
    python -m opendit.encoders.tiny_clip outputs/tiny_clip --words digits     # the captioned digits' words
"""
import argparse

import torch

from opendit.data.captions import DIGIT_CAPTION_WORDS
from opendit.data.edit_pairs import EDITS

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]
# the words of the moving-digits captions ("the digit 3 moving up and left"), so the demo's tokens are all known
DEMO_WORDS = ["the", "digit", "moving", "up", "down", "left", "right", "and", *map(str, range(10))]
WORD_SETS = ("moving_digits", "digits", "edit_digits", "all")  # the demos' vocabularies by name (see demo_words)


def demo_words(words) -> list[str]:
    """A vocabulary: a list of words as it is, or a demo's by name: "moving_digits" (DEMO_WORDS), "digits" (the
    captioned digits', opendit.data.captions.DIGIT_CAPTION_WORDS), "edit_digits" (the editing demo's instructions)
    or "all" (the first two)."""
    if not isinstance(words, str):
        return list(words)
    named = {"moving_digits": DEMO_WORDS, "digits": list(DIGIT_CAPTION_WORDS),
             "edit_digits": sorted({w for edit in EDITS for w in edit.split()}),
             "all": [*DEMO_WORDS, *DIGIT_CAPTION_WORDS]}
    if words not in named:
        raise ValueError(f"unknown word set {words!r}; valid names: {', '.join(WORD_SETS)} (or pass a list of words)")
    return named[words]


def save_tiny_clip(folder, words=DEMO_WORDS, hidden_size: int = 32, layers: int = 2, max_length: int = 16,
                   seed: int = 0) -> str:
    """Write a CLIPTextModel (hidden_size wide, `layers` deep, random weights from `seed`) and a word-level
    tokenizer over `words` (a list, or a demo's by name, see demo_words; lower-cased; unknown words map to <unk>)
    to `folder`; returns the folder."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + sorted(set(demo_words(words)) - set(SPECIAL)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation ("up-left" -> up, -, left)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                       special_tokens=[("<bos>", 2), ("<eos>", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>", model_max_length=max_length)
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_hidden_layers=layers, num_attention_heads=2, max_position_embeddings=max_length,
                            pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(seed)
    CLIPTextModel(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--hidden_size", type=int, default=32)
    parser.add_argument("--words", choices=WORD_SETS, default="moving_digits",
                        help="the vocabulary: the moving digits' captions, the captioned digits' or both")
    args = parser.parse_args()
    print(save_tiny_clip(args.folder, words=args.words, hidden_size=args.hidden_size))
