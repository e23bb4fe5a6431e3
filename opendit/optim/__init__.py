"""Memory-lean optimizers: offloaded / compressed states, exact bf16 master weights, fused backward, block swap."""
from .adam import AdamW, NAdamW
from .adan import Adan
from .base import LeanOptimizer
from .block_swap import BlockSwap
from .build import OPTIMIZER_NAMES, OPTIMIZERS, OptimizerSettings, build_optimizer
from .formats import FORMATS, make_format
from .fused_backward import attach_fused_backward
from .master import MASTER_MODES, join_bf16, round_bf16_nearest, split_bf16, stochastic_round_bf16

__all__ = ["AdamW", "NAdamW", "Adan", "LeanOptimizer", "BlockSwap", "build_optimizer", "OptimizerSettings",
           "OPTIMIZERS", "OPTIMIZER_NAMES", "FORMATS", "make_format", "attach_fused_backward", "MASTER_MODES",
           "join_bf16", "round_bf16_nearest", "split_bf16", "stochastic_round_bf16"]
