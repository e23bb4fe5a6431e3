"""Booster and plugins: DDP / ZeRO-2 / ZeRO-3 (FSDP) / HSDP / Gemini (CPU offload) on PyTorch FSDP2 + DeviceMesh."""
from opendit.booster.booster import Booster, global_grad_norm
from opendit.booster.mesh import MESH_DIMS, mesh_shape
from opendit.booster.plugins import (PLUGINS, DDPPlugin, GeminiPlugin, HSDPPlugin, Plugin, Zero2Plugin, Zero3Plugin,
                                     build_plugin, shard_frozen, validate_parallel_config)
from opendit.booster.precision import PRECISIONS, DynamicLossScaler

__all__ = ["Booster", "DDPPlugin", "DynamicLossScaler", "GeminiPlugin", "HSDPPlugin", "MESH_DIMS", "PLUGINS",
           "PRECISIONS", "Plugin", "Zero2Plugin", "Zero3Plugin", "build_plugin", "global_grad_norm", "mesh_shape",
           "shard_frozen", "validate_parallel_config"]
