"""Memory of one flux-dev 1024x1024 full fine-tune step, by part and by option set: GPU and host bytes of the
weights, gradients, master weights, optimizer states, activations, EMA and frozen encoders.

    python benchmarks/flux_memory.py                       # flux-dev, 1024 px, batch 1 (no memory used)
    python benchmarks/flux_memory.py --image_size 512 --out flux_memory.md

Every number comes from real tensor shapes on the meta device (no storage, so a 12B model fits a laptop):
- weights, gradients, master and optimizer bytes: FLUX.1-dev built from its official config; states are
  sized by the optimizer's own formats (fp32 8 B, u16 2 x 2.03 B per parameter for AdamW's two moments).
- activations: one forward pass of the real flux-dev at the run's token counts (512 T5 + 4096 image tokens at
  1024 px), bf16, recording every tensor autograd saves for backward and in which block (not the weights
  themselves, not attention's L x L score matrices, which FlashAttention never stores; the reference RMSNorm
  and RoPE keep fp32 intermediates, which the fused kernels would not). Without
  checkpointing all of them live at the peak; with --grad_checkpoint 1 only each block's inputs plus the
  largest block's saved tensors (it is recomputed during its backward) and what the root keeps.
- block swap N: the last N blocks' weights live on the host and stream in one block ahead, so the GPU holds
  the others plus two in flight; with the fused backward a gradient lives only until its block's update.
- EMA: fp32 beside the weights, in host memory (--ema_on_host), or none (--ema_decay 0).
- encoders: T5-XXL (4.76B) and CLIP-L text (0.12B) in bf16, and FLUX's autoencoder (84M) in bf16, when
  encoding on the fly; training on a preprocess.py cache loads none of them.
- LoRA (rank 16 by default, --lora_rank): the frozen base in bf16 (or its block Linear weights in fp8, torchao's
  float8 weight-only storage, 1 byte each), fp32 adapters with their gradients, AdamW states and EMA; activations
  measured again with the adapters on and the base frozen (a frozen Linear keeps no input for a weight gradient,
  the adapters keep their rank-r intermediates).
The workspace of kernels (attention, matmul) and the allocator's fragmentation are not counted: the GPU run
in benchmarks/gpu_check.sh measures the real peak under torch.cuda.set_per_process_memory_fraction.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit.models.flux import FLUX_CONFIGS, Flux, image_ids, pack_latents, text_ids  # noqa: E402

GB = 1e9
U16_BYTES = 2.03  # opendit.optim.formats.U16Format: 2 bytes + block-wise scales
ENCODER_PARAMS = {"T5-XXL encoder": 4.762e9, "CLIP-L text": 0.123e9, "autoencoder": 0.084e9}
EMA_BYTES = 4  # fp32


def activation_bytes(model: Flux, txt_tokens: int, img_tokens: int, batch: int = 1) -> tuple[int, int, list[int]]:
    """(bytes saved by the root, outside blocks; bytes of each block's inputs summed; saved bytes per block) of
    one bf16 forward on the meta device."""
    owner = ["root"]
    per_block: dict[str, int] = {}
    inputs = [0]
    blocks = [(f"double_blocks.{i}", b) for i, b in enumerate(model.double_blocks)] + \
             [(f"single_blocks.{i}", b) for i, b in enumerate(model.single_blocks)]

    def enter(name):
        def hook(_module, args):
            owner.append(name)
            inputs[0] += sum(a.numel() * a.element_size() for a in args
                             if torch.is_tensor(a) and a.dim() == 3 and a.is_floating_point() and a.shape[1] > 1)
        return hook

    def leave(_module, _args, _out):
        owner.pop()

    handles = [h for name, b in blocks for h in (b.register_forward_pre_hook(enter(name)),
                                                 b.register_forward_hook(leave))]
    weights = {p.untyped_storage()._cdata for p in model.parameters()}  # saved weights are not activations
    seq = txt_tokens + img_tokens
    seen = set()

    def pack(t):
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape))
        # the L x L score matrices are the CPU math path's; FlashAttention / SDPA's efficient kernels keep only
        # q, k, v, the output (saved anyway) and a log-sum-exp per row
        scores = t.dim() >= 2 and t.shape[-1] == t.shape[-2] == seq
        if key not in seen and t.is_floating_point() and key[0] not in weights and not scores:
            seen.add(key)
            per_block[owner[-1]] = per_block.get(owner[-1], 0) + t.numel() * t.element_size()
        return t

    side = int(img_tokens ** 0.5) * 2
    with torch.device("meta"):
        z = torch.randn(batch, model.in_channels // 4, side, side, dtype=torch.bfloat16)
        img = pack_latents(z).requires_grad_(False)
        txt = torch.randn(batch, txt_tokens, model.txt_in.in_features, dtype=torch.bfloat16)
        y = torch.randn(batch, model.vector_in.in_layer.in_features, dtype=torch.bfloat16)
        kw = dict(img=img, img_ids=image_ids(batch, side, side, "meta"), txt=txt,
                  txt_ids=text_ids(batch, txt_tokens, "meta"), timesteps=torch.rand(batch, dtype=torch.bfloat16), y=y,
                  guidance=torch.full((batch,), 1.0, dtype=torch.bfloat16) if model.guidance_embed else None)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**kw)
    for h in handles:
        h.remove()
    root = per_block.pop("root", 0)
    return root, inputs[0], [per_block.get(name, 0) for name, _ in blocks]


def option_sets(n_params: int, block_params: list[int], act: tuple[int, int, list[int]], budget: float) -> list[dict]:
    """Rows of GPU / host bytes by part for each option set (see the module docstring); the last row swaps the
    fewest blocks that fit `budget` bytes of GPU memory."""
    root_act, block_inputs, per_block = act
    full_act, ckpt_act = root_act + sum(per_block), root_act + block_inputs + max(per_block)
    one_block_grad = 2 * max(block_params)  # bf16 gradient of the block being updated (fused backward)
    ema = EMA_BYTES * n_params
    lean_host = dict(master=2 * n_params, states=2 * U16_BYTES * n_params)

    def swapped(n):  # --blocks_to_swap n: the last n blocks in forward order (single blocks first)
        return sum(block_params[len(block_params) - n:]) if n else 0

    def lean_gpu(n):
        in_flight = 2 * 2 * max(block_params) if n else 0  # the running swapped block and the prefetched next
        return dict(weights=2 * (n_params - swapped(n)) + in_flight, grads=one_block_grad, activations=ckpt_act)

    fits = next((n for n in range(len(block_params) + 1) if sum(lean_gpu(n).values()) <= budget), None)
    rows = [
        dict(name="plain mixed precision (fp32 weights + grads, AdamW fp32 states, autocast bf16, fp32 EMA)",
             gpu=dict(weights=4 * n_params, grads=4 * n_params, states=8 * n_params, activations=full_act, ema=ema)),
        dict(name="bf16 weights + fp32 master copy, fp32 states, fp32 EMA, grad checkpointing (a usual full "
                  "fine-tune)",
             gpu=dict(weights=2 * n_params, grads=2 * n_params, master=4 * n_params, states=8 * n_params,
                      activations=ckpt_act, ema=ema)),
        dict(name="lean: bf16_exact master + u16 states on the host, fused backward, grad checkpointing, "
                  "--ema_on_host", gpu=lean_gpu(0), host={**lean_host, "ema": ema}),
        dict(name="lean, --ema_decay 0 (no EMA, as sd-scripts)", gpu=lean_gpu(0), host=dict(lean_host)),
    ]
    if fits:
        rows.append(dict(name=f"lean, no EMA, --blocks_to_swap {fits} (the fewest that fit {budget / 2**30:.0f} GiB)",
                         gpu=lean_gpu(fits), host={**lean_host, "weights": 2 * swapped(fits)}))
    return rows


def lora_rows(n_params: int, n_adapter: int, fp8_params: int, act: tuple[int, int, list[int]],
              rank: int) -> list[dict]:
    """Rows of a LoRA run: the frozen base in bf16 or with `fp8_params` of it in fp8; fp32 adapters (weights in
    the weights column), their gradients, AdamW states and EMA; activations of the adapted model (act)."""
    root_act, block_inputs, per_block = act
    full_act, ckpt_act = root_act + sum(per_block), root_act + block_inputs + max(per_block)
    adapter = dict(grads=4 * n_adapter, states=8 * n_adapter, ema=EMA_BYTES * n_adapter)
    bf16, fp8 = 2 * n_params + 4 * n_adapter, 2 * n_params - fp8_params + 4 * n_adapter
    return [dict(name=f"LoRA rank {rank}: bf16 base, fp32 adapters + AdamW + EMA, no checkpointing",
                 gpu=dict(weights=bf16, activations=full_act, **adapter)),
            dict(name=f"LoRA rank {rank}: bf16 base, grad checkpointing", gpu=dict(weights=bf16, activations=ckpt_act,
                                                                                  **adapter)),
            dict(name=f"LoRA rank {rank}: fp8 block Linear weights (torchao float8 weight-only: planned, not in "
                      "opendit yet), grad checkpointing",
                 gpu=dict(weights=fp8, activations=ckpt_act, **adapter))]


def table(rows, label: str, encoders: float) -> str:
    parts = ("weights", "grads", "master", "states", "activations", "ema")
    head = "| option set | " + " | ".join(f"GPU {p}" for p in parts) + " | GPU total | host total |"
    out = [f"### {label}", "", head, "|---|" + "---:|" * (len(parts) + 2)]
    for r in rows:
        gpu, host = sum(r["gpu"].values()), sum(r.get("host", {}).values())
        cells = [f"{r['gpu'].get(p, 0) / GB:.1f}" for p in parts]
        out.append(f"| {r['name']} | " + " | ".join(cells) + f" | **{gpu / GB:.1f}** | {host / GB:.1f} |")
    out += ["", f"Encoding on the fly adds the frozen encoders in bf16 on the GPU: {encoders / GB:.1f} GB "
                f"({', '.join(f'{k} {2 * v / GB:.2f}' for k, v in ENCODER_PARAMS.items())}); training on a "
                f"preprocess.py cache loads none of them."]
    return "\n".join(out)


def lora_table(model: Flux, a, img_tokens: int) -> str:
    """The LoRA rows: `model` gets the flux family's default adapters (frozen base, meta device) and its
    activations are measured again."""
    from opendit.families import FAMILIES
    from opendit.lora import add_lora, lora_modules

    n_params = sum(q.numel() for q in model.parameters())
    add_lora(model, a.lora_rank, None, FAMILIES["flux"].lora_targets)
    model.to(torch.bfloat16)
    adapted = lora_modules(model)
    n_adapter = sum(q.numel() for q in model.parameters() if q.requires_grad)
    fp8 = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
              and m.weight.numel() >= 2 ** 20)  # the block projections torchao's weight-only float8 would take
    act = activation_bytes(model, a.t5_tokens, img_tokens)
    label = (f"{a.model} LoRA rank {a.lora_rank} on {len(adapted)} layers ({n_adapter / 1e6:.1f}M adapter "
             f"parameters), {a.image_size}x{a.image_size}, batch 1, GB = 1e9 bytes")
    return table(lora_rows(n_params, n_adapter, fp8, act, a.lora_rank), label,
                 sum(2 * v for v in ENCODER_PARAMS.values()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev", choices=[m for m in FLUX_CONFIGS if m != "flux-debug"])
    p.add_argument("--image_size", type=int, default=1024)
    p.add_argument("--t5_tokens", type=int, default=512)
    p.add_argument("--budget_gib", type=float, default=16.0, help="GPU memory the last row must fit")
    p.add_argument("--lora_rank", type=int, default=16, help="the LoRA rows' rank (the family's default targets)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    a = p.parse_args()
    with torch.device("meta"):
        model = Flux(**FLUX_CONFIGS[a.model]).to(torch.bfloat16)
    n_params = sum(q.numel() for q in model.parameters())
    block_params = [sum(q.numel() for q in b.parameters()) for b in [*model.double_blocks, *model.single_blocks]]
    img_tokens = (a.image_size // 16) ** 2  # 8x autoencoder, then 2x2 patches
    act = activation_bytes(model, a.t5_tokens, img_tokens)
    rows = option_sets(n_params, block_params, act, a.budget_gib * 2 ** 30)
    label = (f"{a.model}: {n_params / 1e9:.2f}B parameters, {a.image_size}x{a.image_size} ({img_tokens} image + "
             f"{a.t5_tokens} text tokens), batch 1, GB = 1e9 bytes")
    text = table(rows, label, sum(2 * v for v in ENCODER_PARAMS.values()))
    text += (f"\n\nActivations (bf16, from a meta-device forward): all saved tensors {(act[0] + sum(act[2])) / GB:.1f}"
             f" GB; with checkpointing every block: block inputs {act[1] / GB:.2f} GB + the largest block "
             f"{max(act[2]) / GB:.2f} GB + root {act[0] / GB:.2f} GB.")
    text += "\n\n" + lora_table(model, a, img_tokens)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
