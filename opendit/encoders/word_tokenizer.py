"""Word-level tokenizers for the tiny random text encoders of demos and tests (no tokenizer can be downloaded
there): every caption gets a fixed, distinct token sequence."""
from opendit.encoders.tiny_clip import demo_words

SPECIAL = ["<pad>", "</s>", "<unk>"]  # T5's ids 0, 1, 2


def t5_word_tokenizer(words, max_length: int = 512):
    """A word-level fast tokenizer with T5's conventions (<pad> = 0, </s> = 1 appended to every caption, <unk> = 2)
    over `words` (a list, or a demo's by name as tiny_clip.demo_words takes it; lower-cased; words and punctuation
    split; unknown words map to <unk>), model_max_length max_length. Its vocabulary size is len(tokenizer)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + sorted({str(w).lower() for w in demo_words(words)} - set(SPECIAL)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_max_length=max_length)


def bos_word_tokenizer(words, special: list[str], bos: str, max_length: int = 16, **tokens):
    """A word-level fast tokenizer over `words` (as t5_word_tokenizer reads them) whose ids start with `special` in
    its order, `bos` put before every caption and nothing appended (Gemma's and Mistral's conventions); `tokens`: the
    special tokens' roles (pad_token=..., eos_token=..., unk_token=...) and other PreTrainedTokenizerFast options.
    Unknown words map to "<unk>"."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(special + sorted({str(w).lower() for w in demo_words(words)} - set(special)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, model_max_length=max_length, **tokens)


CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]  # pad (Qwen's), turn markers, unknown
# a message's content: a string, or a list of {"type": "text", "text": ...} parts (FLUX.2 [dev]'s Mistral format)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for part in m['content'] %}{{ part['text'] }} {% endfor %}{% endif %}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


WORDS = r"\w+|[^\w\s]+|\n"  # words, punctuation and each line break


def chat_word_tokenizer(words, max_length: int = 512, pieces: str = WORDS):
    """A word-level fast tokenizer with a Qwen-style chat template (<|im_start|>role text<|im_end|>, padding with
    <|endoftext|>, nothing appended), for the tiny Qwen text encoders of FLUX.2 [klein], Z-Image and Qwen-Image, whose
    pipelines format prompts with tokenizer.apply_chat_template or a template of their own. Words as
    t5_word_tokenizer takes them; `pieces`: the regex of the pieces a text splits into."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_words = sorted({str(w).lower() for w in [*demo_words(words), "user", "assistant", "system", "\n"]})
    vocab = {w: i for i, w in enumerate(CHAT_SPECIAL + vocab_words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # by default a Qwen tokenizer's count of a template's tokens (Qwen-Image's pipeline drops its system prompt's
    # first 34)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pieces), behavior="removed", invert=True)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"],
                                  model_max_length=max_length)
    out.chat_template = CHAT_TEMPLATE
    return out
