"""A second model family defined outside opendit: a tiny UNconditional diffusion transformer on the digits.

It proves the seam: nothing in opendit knows it, yet the Trainer trains, checkpoints and resumes it and
sample.py samples it. Importing this module registers it (OPENDIT_FAMILIES=tests.toy_family does that for
the entry scripts). It is built only from opendit's shared layers, none of DiT's own code.
"""
import torch
import torch.nn as nn

from opendit.families import ModelSpec, register_family
from opendit.data import DIGITS, FOLDER, LATENTS, dataset_map
from opendit.families.gaussian import GaussianDiffusionFamily
from opendit.models.blocks import AdaLNZeroBlock, FinalLayer
from opendit.models.layers import Attention, PatchEmbed, TimestepEmbedder
from opendit.models.pos_embed import sincos_2d
from opendit.parallel import ParallelPlan


class ToyDiT(nn.Module):
    """x [B, C, S, S], t [B] -> [B, 2C or C, S, S]; no labels."""
    _block_lists = ("layers",)  # not DiT's "blocks": the booster must follow the declaration
    parallel_plan = ParallelPlan(attention=(Attention,), split=("image tokens",), replicated=("condition",))
    sequence_parallel = None

    def __init__(self, input_size, in_channels, depth, hidden_size, num_heads, patch_size, learn_sigma=True):
        super().__init__()
        self.patch_size, self.grid = patch_size, input_size // patch_size
        self.out_channels = in_channels * (2 if learn_sigma else 1)
        self.embed = PatchEmbed(patch_size, in_channels, hidden_size)
        self.time = TimestepEmbedder(hidden_size)
        self.register_buffer("pos", sincos_2d(hidden_size, self.grid).unsqueeze(0), persistent=False)
        self.layers = nn.ModuleList(AdaLNZeroBlock(hidden_size, num_heads) for _ in range(depth))
        self.head = FinalLayer(hidden_size, patch_size, self.out_channels)

    def forward(self, x, t):
        tokens, c = self.embed(x) + self.pos.to(x.dtype), self.time(t)
        sp = self.sequence_parallel
        if sp is not None:
            tokens = sp.split(tokens)
        for layer in self.layers:
            tokens = layer(tokens, c)
        out = self.head(tokens, c)
        if sp is not None:
            out = sp.gather(out)
        B, g, p = x.shape[0], self.grid, self.patch_size
        out = out.view(B, g, g, p, p, self.out_channels)
        return torch.einsum("bhwpqc->bchpwq", out).reshape(B, self.out_channels, g * p, g * p)

    def forward_with_cfg(self, x, t, cfg_scale):
        return self(x, t)  # nothing to guide


class ToyFamily(GaussianDiffusionFamily):
    name = "toy"
    models = {"Toy-S": ModelSpec("Toy-S", "toy", ToyDiT, dict(depth=2, hidden_size=32, num_heads=2, patch_size=2))}
    datasets = dataset_map(DIGITS, FOLDER, LATENTS)
    class_conditional = False

    def build_model(self, cfg, latent_shape):
        channels, size, _ = latent_shape
        return self.models[cfg.model].build(input_size=size, in_channels=channels, learn_sigma=cfg.learn_sigma)

    def train_flops_per_sample(self, model) -> float:
        tokens = model.grid ** 2  # 3 passes x 2 FLOP per multiply-accumulate of every token-wise Linear
        return 6.0 * tokens * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


register_family(ToyFamily())
