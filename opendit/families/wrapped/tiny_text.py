"""Tiny random text encoders for the debug models of the diffusers-transformer families (tests and the CPU demos,
where nothing can be downloaded): one table, WRITERS, keyed by the "tiny_text" constant of a debug model. Each writes
the folder that model's --text_encoder takes, with word-level tokenizers over the demo captions' words.

    python -m opendit.families.wrapped.tiny_text z-image-debug outputs/tiny_text   # then --text_encoder that folder
"""
import argparse
import os
from pathlib import Path


GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's ids 0-3


def _link(root: Path, name: str, target) -> None:
    """root/name -> target (a folder under root), relative: the folder still reads when moved or named relatively."""
    if not (root / name).exists():
        os.symlink(os.path.relpath(target, root), root / name)


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
        _link(root, name, target)
    return str(root)


def _clip_with_projection(folder, words, width: int, seed: int) -> str:
    """A CLIPTextModelWithProjection `width` wide (its projection too) that reads 77 positions, and its word-level
    tokenizer (model_max_length 77: SD3's pipeline pads CLIP prompts to that)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from opendit.encoders.tiny_clip import save_tiny_clip
    save_tiny_clip(folder, words=words, hidden_size=width, max_length=77, seed=seed)  # its tokenizer and config
    config = CLIPTextConfig.from_pretrained(folder)
    config.projection_dim = width
    torch.manual_seed(seed)
    CLIPTextModelWithProjection(config).save_pretrained(folder)  # in place of the plain CLIPTextModel
    return str(folder)


def _clip_clip_and_t5(folder, words):
    """A Stable Diffusion 3.5 pipeline folder's text parts: CLIP-L (text_encoder/, tokenizer/, 16 wide), CLIP-G
    (text_encoder_2/, tokenizer_2/, 32 wide) and T5 (text_encoder_3/, tokenizer_3/, 64 wide: the two CLIPs' 48
    channels are zero-padded to it, as SD3 pads 768 + 1280 to 4,096)."""
    from opendit.families.flux.tiny_t5 import save_tiny_t5
    root = Path(folder)
    parts = (_clip_with_projection(root / "clip_l", words, 16, seed=0),
             _clip_with_projection(root / "clip_g", words, 32, seed=1), save_tiny_t5(root / "t5", words, d_model=64))
    names = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3"))
    for target, pair in zip(parts, names):
        for name in pair:
            _link(root, name, target)
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


def _qwen25vl_processor(folder, words):
    from opendit.families.wrapped.qwenimage import save_tiny_qwen25vl
    return save_tiny_qwen25vl(folder, words, processor=True)


def _hunyuanvideo15(folder, words):
    from opendit.families.wrapped.hunyuanvideo15 import save_tiny_text_encoders
    return save_tiny_text_encoders(folder, words)


def _umt5(folder, words):
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    return save_tiny_umt5(folder, max_length=16)


def _qwen3vl_config(tokenizer, layers: int, **vision_options):
    """A Qwen3-VL 16 wide and `layers` deep over `tokenizer`'s words, with a one-block vision tower (and its
    `vision_options`)."""
    from transformers import Qwen3VLConfig
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True},
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                  deepstack_visual_indexes=[], **vision_options)
    return Qwen3VLConfig(text_config=text, vision_config=vision)


def _qwen3vl(folder, words):
    """krea2-debug's and ideogram4-debug's text encoder: a tiny random Qwen3VLModel 36 layers deep, as Qwen3-VL-4B
    and -8B are (Krea 2's pipeline taps the hidden states of layers 2, 5, ..., 35; Ideogram 4's 0, 3, ..., 33, 35),
    16 wide, with a one-block vision tower no prompt reaches, and a word-level chat tokenizer over `words`
    (Qwen-Image's system template in 34 tokens, as Qwen's tokenizer splits it)."""
    import torch
    from transformers import Qwen3VLModel

    from opendit.encoders.word_tokenizer import chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, 64)
    torch.manual_seed(0)
    Qwen3VLModel(_qwen3vl_config(tokenizer, layers=36)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _gemma2(folder, words):
    """sana-debug's text encoder: a tiny random Gemma2Model (16 wide, 2 layers) and a word-level tokenizer over
    `words` with Gemma's conventions (<pad> 0, <eos> 1, <bos> 2 put before every prompt, <unk> 3; nothing appended),
    which SanaPipeline pads on the right."""
    import torch
    from transformers import Gemma2Config, Gemma2Model

    from opendit.encoders.word_tokenizer import bos_word_tokenizer
    tokenizer = bos_word_tokenizer(words, GEMMA_SPECIAL, "<bos>", pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                          max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    Gemma2Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _ministral3(folder, words):
    """ernie-image-debug's text encoder: a tiny random Mistral3Model, the release's class (its Ministral 3 text model
    16 wide and 3 layers deep; a one-layer Pixtral vision tower no prompt reaches), and a word-level tokenizer over
    `words` that starts every prompt with <s> (ERNIE-Image's pipeline tokenizes a prompt alone, with special tokens
    and no template), truncating at 16 tokens."""
    import torch
    from transformers import Ministral3Config, Mistral3Config, Mistral3Model, PixtralVisionConfig

    from opendit.encoders.word_tokenizer import bos_word_tokenizer
    tokenizer = bos_word_tokenizer(words, ["<unk>", "<s>", "</s>", "<pad>"], "<s>", unk_token="<unk>",
                                   eos_token="</s>", pad_token="<pad>")
    text = Ministral3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, bos_token_id=1, eos_token_id=2,
                            pad_token_id=3)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=32, patch_size=16)
    torch.manual_seed(0)
    Mistral3Model(Mistral3Config(text_config=text, vision_config=vision, image_token_index=0)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _qwen3vl_processor(folder, words):
    """flux3-debug's text encoder: a tiny random Qwen3VLForConditionalGeneration, the class FLUX.3's pipeline loads,
    16 wide and 3 layers deep (flux3-debug stacks layers 1-3: 3 x 16 = 48 wide), with a one-block vision tower no
    prompt reaches, and a processor, which FLUX.3's text-encoder step takes in place of a tokenizer (its chat template
    and its .tokenizer): a LlavaProcessor over a word-level chat tokenizer of `words` stands in for Qwen3-VL's, whose
    video processor needs torchvision."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaProcessor, Qwen3VLForConditionalGeneration

    from opendit.encoders.word_tokenizer import CHAT_TEMPLATE, chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, 64)
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(_qwen3vl_config(tokenizer, layers=3)).save_pretrained(folder)
    LlavaProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer,
                   chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return str(folder)


def _qwen25vl_and_clip(folder, words):
    """A Kandinsky 5 pipeline folder's text parts: a tiny random Qwen2.5-VL (text_encoder/, tokenizer/, 16 wide, 2
    layers; its word-level tokenizer splits the image template into the pipeline's 40 dropped tokens as Qwen's does,
    the video template into 131 where Qwen's makes 128, so a debug video prompt keeps 3 template tokens) and CLIP
    (text_encoder_2/, tokenizer_2/, 32 wide, reading the 77 positions the pipeline pads to)."""
    from opendit.encoders.tiny_clip import save_tiny_clip
    from opendit.families.wrapped.qwenimage import save_tiny_qwen25vl
    root = Path(folder)
    qwen, clip = save_tiny_qwen25vl(root / "qwen", words), save_tiny_clip(root / "clip", words=words, max_length=77)
    for name, target in (("text_encoder", qwen), ("tokenizer", qwen), ("text_encoder_2", clip),
                         ("tokenizer_2", clip)):
        _link(root, name, target)
    return str(root)


def _qwen_image21(folder, words):
    """qwen-image-2.1-debug's text encoder: a tiny random Qwen3VLForConditionalGeneration, the release's class (2
    layers, 16 wide; a one-block vision tower no prompt reaches), and beside it the processor the pipeline formats
    and tokenizes prompts with: a chat template that lays out turns as Qwen's does (<|im_start|>role, a line break,
    the text, <|im_end|>, a line break), so the pipeline's hand-written template splits its system turn into as
    many tokens as the processor's, which the pipeline drops; a word-level chat tokenizer of `words` with
    <|image_pad|> as one token (the pipeline marks image slots by it). A LlavaProcessor (that tokenizer and a Qwen2-VL
    image processor) stands in for Qwen3-VL's, whose video processor needs torchvision: for text the pipeline asks
    the same of both (the chat template, the tokenizer, tokenizing with left padding)."""
    import torch
    from transformers import LlavaProcessor, Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    from opendit.encoders.word_tokenizer import chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, 64)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|vision_start|>", "<|vision_end|>",
                                                                "<|image_pad|>"]})
    turns = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
             "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(_qwen3vl_config(tokenizer, layers=2, patch_size=16, spatial_merge_size=2,
                                                    temporal_patch_size=2, num_position_embeddings=64)
                                    ).save_pretrained(folder)
    LlavaProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2),
                   tokenizer=tokenizer, chat_template=turns, image_token="<|image_pad|>").save_pretrained(folder)
    return str(folder)


def _gemma3_and_connectors(folder, words):
    """An LTX-2 pipeline folder's text parts: a tiny random Gemma3ForConditionalGeneration, the release's class
    (text_encoder/: 32 wide, 2 layers, so 3 hidden states stacked; a one-layer SigLIP tower no prompt reaches), a
    word-level tokenizer over `words` with Gemma's conventions (tokenizer/: <pad> 0, <eos> 1, <bos> 2 before every
    prompt, <unk> 3; the pipeline pads on the left), and LTX-2's text connectors (connectors/: one block each for the
    video and the audio stream, 4 heads of 8, 8 learnable registers, "split" RoPE as the release's)."""
    import torch
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from opendit.encoders.word_tokenizer import bos_word_tokenizer
    root = Path(folder)
    tokenizer = bos_word_tokenizer(words, GEMMA_SPECIAL, "<bos>", pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                sliding_window=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                image_token_index=3)).save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")
    stream = dict(num_attention_heads=4, attention_head_dim=8, num_layers=1, num_learnable_registers=8)
    torch.manual_seed(1)
    LTX2TextConnectors(caption_channels=32, text_proj_in_factor=3, rope_type="split",
                       **{f"{s}_connector_{k}": v for s in ("video", "audio") for k, v in stream.items()}
                       ).save_pretrained(root / "connectors")
    return str(root)


WRITERS = {"t5": _t5, "clip+t5": _clip_and_t5, "clip+clip+t5": _clip_clip_and_t5, "qwen3": _qwen3,
           "mistral3": _mistral3, "qwen2.5-vl": _qwen25vl, "qwen2.5-vl+processor": _qwen25vl_processor,
           "hunyuanvideo1.5": _hunyuanvideo15, "umt5": _umt5,
           "qwen3-vl": _qwen3vl, "gemma2": _gemma2, "ministral3": _ministral3,
           "qwen3-vl+processor": _qwen3vl_processor, "kandinsky5": _qwen25vl_and_clip,
           "qwen-image-2.1": _qwen_image21, "gemma3+connectors": _gemma3_and_connectors}


def write_text_encoder(model: str, folder, words: str = "digits") -> str:
    """The tiny text encoder of the registered debug `model` (its "tiny_text" constant) in `folder`."""
    from opendit.families import all_models, model_spec
    kind = model_spec(model).constants.get("tiny_text")
    if kind is None:
        with_one = sorted(n for n, s in all_models().items() if "tiny_text" in s.constants)
        raise ValueError(f"{model} has no tiny text encoder; the debug models that do: {', '.join(with_one)}")
    return WRITERS[kind](folder, words)


if __name__ == "__main__":
    from opendit.encoders.tiny_clip import WORD_SETS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a debug model of a diffusers-transformer family, e.g. z-image-debug")
    parser.add_argument("folder")
    parser.add_argument("--words", default="digits", choices=WORD_SETS, help="the vocabulary: a demo's captions")
    args = parser.parse_args()
    print(write_text_encoder(args.model, args.folder, args.words))
