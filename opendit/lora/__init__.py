"""LoRA: low-rank adapters on a model's Linear layers (layer.py), their files in the diffusers/PEFT and
kohya/ComfyUI layouts (formats.py), and what a run needs of them (run.py). `python -m opendit.lora merge`
writes merged full weights."""
from opendit.lora.formats import LAYOUTS, load_adapters, module_map, save_adapters
from opendit.lora.layer import (Adapter, LoRALinear, add_lora, attach_adapters, cast_frozen_linears,
                                linear_names, load_trained_adapters, lora_modules, match_targets, merge_adapters,
                                trained_adapters)

__all__ = ["Adapter", "LAYOUTS", "LoRALinear", "add_lora", "attach_adapters", "cast_frozen_linears",
           "linear_names", "load_adapters", "load_trained_adapters", "lora_modules", "match_targets",
           "merge_adapters", "module_map", "save_adapters", "trained_adapters"]
