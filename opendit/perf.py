"""Model FLOPs, matmul peak and MFU for DiT and video DiT (VDiT, Latte) training.

Counting convention (the DiT paper's and the issue's): only matmuls count — every nn.Linear, the patch
embedding convolution and the two attention products (q k^T and p v); norms, activations, softmax and
the optimizer are free. A training step costs 3 forward passes (forward, and a backward that needs two
matmuls per forward matmul), each multiply-accumulate (MAC) is 2 FLOP. DiT-XL/2 at 256 px (32x32
latents, 256 tokens) is 118.6 GMAC forward -> 3 x 2 x 118.6 = 712 GFLOP per training image.
Activation checkpointing recomputes a forward but does not change these *model* FLOPs (that is MFU,
not hardware FLOP utilisation).
"""
import time

import torch
import torch.nn as nn

from opendit.models.layers import Attention

# Linear layers applied once per sample (to the condition vector c [B, D] or a pooled text embedding) rather
# than to every token.
_PER_SAMPLE_PREFIXES = ("t_embedder", "adaLN_modulation", "text_embedder")


def _is_per_sample(name: str) -> bool:
    return any(part.startswith(_PER_SAMPLE_PREFIXES) for part in name.split("."))


def dit_forward_macs(model: nn.Module) -> int:
    """Multiply-accumulates of one forward pass for ONE sample of `model` (a DiT), from its layers.

    Tokens per sample N come from the model's position table (pos_embed [1, N, D]); a token-wise
    Linear(in, out) costs N * in * out, a per-sample one (timestep MLP, adaLN modulation) in * out,
    the patch conv N * (D * C_in * p * p), and each attention layer 2 * N^2 * D (q k^T and p v).
    """
    pos = getattr(model, "pos_embed", None)
    if pos is None or pos.dim() != 3:
        raise ValueError(f"{type(model).__name__} has no pos_embed [1, N, D]; dit_forward_macs counts DiT models "
                         f"(build one with opendit.models.build_model)")
    tokens = pos.shape[1]
    macs = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            rows = 1 if _is_per_sample(name) else tokens
            macs += rows * m.in_features * m.out_features
        elif isinstance(m, nn.Conv2d):
            macs += tokens * m.weight.numel()  # one output position per token
        elif isinstance(m, Attention):
            macs += 2 * tokens * tokens * m.num_heads * m.head_dim
    return macs


def dit_train_flops_per_image(model, image_size: int | None = None, vae_downsample: int = 8,
                              in_channels: int = 4, learn_sigma: bool = True) -> float:
    """Training FLOPs per image (3 passes x 2 FLOP x forward MACs).

    model: a DiT module (its own geometry is used; image_size must be None), or a registry name such as
    "DiT-XL/2" with image_size in pixels; the latent side is image_size // vae_downsample (1 = pixel space).
    The model is then built on the meta device: no memory, no weights.
    """
    if isinstance(model, str):
        if image_size is None:
            raise ValueError(f"dit_train_flops_per_image({model!r}) needs image_size (pixels), e.g. 256")
        if image_size % vae_downsample:
            raise ValueError(f"image_size {image_size} is not divisible by vae_downsample {vae_downsample}")
        from opendit.models import build_model
        with torch.device("meta"):
            model = build_model(model, input_size=image_size // vae_downsample, in_channels=in_channels,
                                learn_sigma=learn_sigma)
    elif image_size is not None:
        raise ValueError("pass image_size only with a model name; a built model already fixes its input size")
    return 3 * 2 * float(dit_forward_macs(model))


def video_forward_macs(model: nn.Module) -> int:
    """Multiply-accumulates of one forward pass for ONE clip of a video model (VDiT, Latte), from its layers.

    N = T'·S tokens per clip. A token-wise Linear(in, out) costs N * in * out, a per-sample one (timestep MLP,
    adaLN modulation, text projection) in * out, the patch conv N * weight.numel(), and each attention layer
    2 * L^2 * D per sequence of length L, as the model lays its sequences out (`attention_sequences()`):
    VDiT one sequence of T'·S tokens; Latte T' sequences of S (spatial blocks) and S sequences of T' (temporal).
    Latte evaluates the adaLN modulation once per frame / per position (its condition rows are repeated);
    model FLOPs count it once per clip, as the convention counts only what the model needs.
    """
    seqs = getattr(model, "attention_sequences", None)
    if seqs is None:
        raise ValueError(f"{type(model).__name__} has no attention_sequences(); video_forward_macs counts VDiT and "
                         f"Latte (opendit.models.vdit / latte); image DiT: dit_forward_macs")
    seqs = seqs()
    tokens = seqs[0][0] * seqs[0][1]
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    if len(attn) != len(seqs) or any(n * L != tokens for n, L in seqs):
        raise ValueError(f"{type(model).__name__}.attention_sequences() {seqs} does not cover its {len(attn)} "
                         f"attention layers with {tokens} tokens each")
    macs = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            macs += (1 if _is_per_sample(name) else tokens) * m.in_features * m.out_features
        elif isinstance(m, (nn.Conv2d, nn.Conv3d)):
            macs += tokens * m.weight.numel()  # one output position per token
    for m, (n, L) in zip(attn, seqs):
        macs += n * 2 * L * L * m.num_heads * m.head_dim
    return macs


def video_train_flops_per_sample(model: nn.Module) -> float:
    """Training FLOPs per clip (3 passes x 2 FLOP x forward MACs) of a built VDiT or Latte (meta device is fine)."""
    return 3 * 2 * float(video_forward_macs(model))


def mfu(flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation: achieved model FLOP/s over the peak (both per device)."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be positive, got {peak_flops_per_s}")
    return flops_per_s / peak_flops_per_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bf16_matmul_peak(device="cuda", n: int = 8192, iters: int = 20, dtype=torch.bfloat16) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device` (best of `iters` timed runs after a warm-up).

    The reference "peak" for MFU: what this device really reaches on the friendliest GEMM, measured in
    the same run as the model (on one H200 an 8192^3 bf16 matmul reaches ~790 TFLOP/s). On a CPU pass a
    small n (e.g. 512): the number only makes the smoke-test table complete.
    """
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


class MFUMeter:
    """Turns images trained per interval into TFLOP/s per device and MFU, for the training log.

    flops_per_image: dit_train_flops_per_image(model); world_size: devices sharing the global batch;
    peak_flops_per_s: per device (None: measure_bf16_matmul_peak on CUDA, no MFU on CPU).
    """

    def __init__(self, flops_per_image: float, world_size: int = 1, peak_flops_per_s: float | None = None,
                 device="cuda"):
        device = torch.device(device)
        if peak_flops_per_s is None and device.type == "cuda":
            peak_flops_per_s = measure_bf16_matmul_peak(device)
        self.flops_per_image, self.world_size, self.peak = flops_per_image, world_size, peak_flops_per_s
        self._t0 = time.perf_counter()

    def reset(self) -> None:
        """Start the interval now (call when the training loop starts, so set-up time is not counted)."""
        self._t0 = time.perf_counter()

    def update(self, images: int) -> dict:
        """images: global images trained since the last call (or construction) -> metrics for the log."""
        now = time.perf_counter()
        dt, self._t0 = max(now - self._t0, 1e-9), now
        return self.metrics(images / dt)

    def metrics(self, img_per_s: float) -> dict:
        """{"tflops": model TFLOP/s per device, "mfu": fraction of the peak (absent without a peak)}."""
        flops = img_per_s * self.flops_per_image / self.world_size
        out = {"tflops": flops / 1e12}
        if self.peak:
            out["mfu"] = mfu(flops, self.peak)
        return out


def flux_forward_macs(model: nn.Module, txt_tokens: int, img_tokens: int) -> int:
    """Multiply-accumulates of one FLUX forward pass for ONE sample of txt_tokens T5 tokens and img_tokens
    packed latent tokens, from its layers: a Linear of a text-stream module (txt_in, txt_attn, txt_mlp) costs
    txt_tokens * in * out, of an image-stream one (img_in, img_attn, img_mlp, final_layer.linear) img_tokens *
    in * out, of a single block (linear1, linear2: the joint sequence) (txt + img) * in * out, and a per-sample
    one (time / guidance / vector embedders, modulations) in * out; each of the depth + depth_single_blocks
    joint attentions 2 * L^2 * hidden with L = txt + img."""
    joint = txt_tokens + img_tokens
    macs = 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if "_mod." in name or "modulation" in name or name.split(".")[0] in ("time_in", "vector_in", "guidance_in"):
            tokens = 1
        elif name.startswith("single_blocks."):
            tokens = joint
        elif name.startswith("txt_in") or ".txt_" in name:
            tokens = txt_tokens
        else:  # img_in, the image stream, final_layer.linear
            tokens = img_tokens
        macs += tokens * m.in_features * m.out_features
    attentions = len(model.double_blocks) + len(model.single_blocks)
    return macs + attentions * 2 * joint * joint * model.hidden_size
