"""Shared model code: layers (layers.py: patch embeddings, timestep / label embedders, attention, MLP), the
adaLN-Zero blocks and the DiT size table (blocks.py), sin-cos position tables (pos_embed.py) and sampling's step
caches (step_cache.py). Each architecture lives in its family's folder (opendit/families/<name>/model.py).

Layers are plain math: they import no family, registry or booster. Each layer with a fused path declares its
`kernel_switches` (opendit.kernels.set_kernels); a model declares its `parallel_plan` (opendit.parallel).
"""
