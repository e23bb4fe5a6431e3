"""Families whose model is diffusers' own transformer class (the diffusers-transformer kind, kind.py), one glue
per model (glue.py's ModelGlue): FLUX.1 (flux1.py, beside the native FLUX family), FLUX.2 [klein] and [dev] (flux2.py),
Z-Image (zimage.py), Qwen-Image (qwenimage.py) and, through the video kind (video.py), HunyuanVideo-1.5
(hunyuanvideo15.py) and Wan2.1 (wan21.py, beside the native Wan family)."""
from opendit.families.wrapped.flux1 import Flux1Glue
from opendit.families.wrapped.flux2 import Flux2Glue
from opendit.families.wrapped.hunyuanvideo15 import HunyuanVideo15Glue
from opendit.families.wrapped.kind import DiffusersFamily
from opendit.families.wrapped.qwenimage import QwenImageGlue
from opendit.families.wrapped.video import DiffusersVideoFamily
from opendit.families.wrapped.wan21 import Wan21Glue
from opendit.families.wrapped.zimage import ZImageGlue

FLUX1 = DiffusersFamily("flux1", Flux1Glue())
FLUX2 = DiffusersFamily("flux2", Flux2Glue())
ZIMAGE = DiffusersFamily("zimage", ZImageGlue())
QWENIMAGE = DiffusersFamily("qwenimage", QwenImageGlue())
HUNYUANVIDEO15 = DiffusersVideoFamily("hunyuanvideo15", HunyuanVideo15Glue())
WAN21 = DiffusersVideoFamily("wan21", Wan21Glue())

__all__ = ["FLUX1", "FLUX2", "HUNYUANVIDEO15", "QWENIMAGE", "WAN21", "ZIMAGE", "DiffusersFamily",
           "DiffusersVideoFamily"]
