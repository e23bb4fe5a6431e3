"""Memory plan of one Wan2.1 T2V full fine-tune step at 480x832 x 81 frames, batch 1: GPU and host bytes per part
(weights, gradients, optimizer states, master-weight side data, activations, text encoder, VAE) in two settings,
(a) 8 x 80 GB GPUs under zero3 + sequence parallelism and (b) one 80 GB GPU with opendit's lean options.

    python benchmarks/wan_memory.py                                   # both models (no memory used, seconds)
    python benchmarks/wan_memory.py --model Wan2.1-T2V-14B --num_frames 49 --out wan_memory.md
    python benchmarks/wan_memory.py --model Wan2.2-I2V-A14B           # one A14B expert (I2V: 36 input channels)
    python benchmarks/wan_memory.py --model Wan2.2-TI2V-5B --num_frames 121 --height 704 --width 1280

Wan2.2: an A14B expert is Wan2.1-14B's network (the I2V one reads 36 channels); only the expert in training is
built, so a row is one run of --expert high or low. TI2V-5B's VAE divides space by 16, not 8.

Geometry: Wan's VAE divides time by 4 (1 + (T - 1) / 4 latent frames) and space by 8, and the (1, 2, 2) patches
halve the latent's height and width: 81 x 480 x 832 -> latents 16 x 21 x 60 x 104 -> 21 * 30 * 52 = 32,760 video
tokens per clip; the text is 512 UMT5 tokens x 4096.

Computed (exact, from real shapes on the meta device; no storage, so the 14B fits a laptop):
- parameter counts: WanModel built from WAN_CONFIGS (the official configs); UMT5-XXL's encoder and the Wan VAE
  as the memory planner counts them (the Wan family's memory_probe: transformers' UMT5EncoderModel of umt5-xxl's
  config, what Wan2.1 ships, and diffusers' AutoencoderKLWan with its default config, Wan2.1's VAE). UMT5
  counts in bf16 (2 B), the VAE in fp32 (4 B: opendit's load_wan_vae default).
- optimizer states and master side data: opendit's own optimizer allocating them for these shapes on the meta
  device (opendit.plan.account.optimizer_bytes): fp32 AdamW 8 B per parameter; u16 2 x 2.03 B plus the
  bf16_exact int16 residual (2 B).
- activations saved for backward: one bf16 forward of the meta model at the run's token count (this rank's
  n = ceil(L / P) tokens under sequence parallelism), recording every tensor autograd saves, by block, each
  storage once, weights excluded (the blocks after the first are alike: a 3-block model of the same widths runs
  and its third block stands for the rest). Attention is counted as FlashAttention / SDPA's flash kernel keeps
  it (q, k, v, the output and an fp32 log-sum-exp per row; no L x L matrix). It comes to, per block,
      per video token: 66 D + 4 F + 8 H + 36 bytes        (D = dim, F = ffn_dim, H = heads)
      = 11 fp32 D-wide tensors (the fp32 LayerNorm / RMSNorm inputs and outputs of norm1, q/k norms, norm3,
        the cross-attention's q norm, norm2) + 11 bf16 D-wide ones (Linear inputs, self-attention q, k, v and
        output, cross-attention q and output, the two gated-residual branches) + the FFN hidden twice in bf16
        (GELU's input and output) + two fp32 log-sum-exps per head + nine fp32 row statistics;
      plus about 12 D bytes per text token (the cross-attention's text-side k, v and k norm), not split by SP;
  the script checks the measured per-token bytes against this formula. RoPE (complex128) saves only its
  table, shared by all blocks.
  With checkpointing every block (--grad_checkpoint 1) the GPU holds every block's input (the fp32 residual
  stream, 4 D bytes per token; the first block's is bf16) + one block's saved tensors while it is recomputed
  (the largest block, its own input not counted twice) + the root's (patch embedding, text and time embedding,
  head).
Estimated (formulas, no measurement):
- backward temporaries of the block being differentiated: the residual stream's gradient in and out (2 x 4 D)
  and two bf16 FFN-hidden gradients (2 x 2 F) per token: 8 D + 4 F bytes per token.
- Ulysses: + 2 D bytes per token and block (the output of the all-to-all after attention, which the o
  projection saves beside FlashAttention's own output); the first block's input is a chunk (a view) of the full
  sequence's bf16 patch embedding, which stays alive: + 2 D L bytes.
- zero3 (FSDP2, opendit's apply_fully_shard): fp32 parameters, gradients and AdamW states sharded over the
  ranks; in flight the root's parameters gathered in bf16 for the whole step (reshard_after_forward=False) and
  two blocks (the running one and the prefetched next, bf16); gradients: one block's bf16 gradient and its fp32
  copy for the reduce-scatter, and the root's bf16 gradients until the end of backward.
- lean (one GPU): bf16 weights, bf16_exact master (int16 residual) and u16 AdamW states in host memory,
  fused backward (one block's bf16 gradients at a time), and the optimizer's per-parameter working set on the
  GPU, sized for a block's largest tensor (one updated while the activations peak): per element its host parts
  twice (its own and the prefetched next tensor's) + fp32 m, v, master and gradient (16 B) + 8 B of encode /
  decode temporaries. --blocks_to_swap N: the last N blocks' bf16 weights live on the host and two blocks are on
  the GPU in flight (the running one and the next).
  The lean rows train on a preprocess.py cache (Wan-VAE posteriors and UMT5 embeddings), so neither UMT5 nor the
  VAE is loaded while training; opendit cannot keep UMT5 on the CPU while the model trains on the GPU.
Not counted: the CUDA context, kernel workspaces (matmul, attention), the allocator's fragmentation, the loss
(three fp32 copies of the latents, ~25 MB), the VAE's encoding working set when encoding on the fly (large at
81 x 480 x 832; the preprocess cache avoids it). The budget (--budget_gb, default 80e9 bytes) leaves an
80 GB card's other 5.5e9 bytes (85.5e9 in all) for them. benchmarks/wan_lean_step.py measures a real peak.
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit.config import TrainConfig  # noqa: E402
from opendit.families import family_of  # noqa: E402
from opendit.families.wan import model as wan_module  # noqa: E402
from opendit.families.wan.family import WAN_CONSTANTS  # noqa: E402
from opendit.families.wan.model import WAN22_CONFIGS, WAN_CONFIGS, WanModel  # noqa: E402
from opendit.plan.account import offload_working_set, optimizer_bytes  # noqa: E402
from opendit.plan.measure import _flash_like  # noqa: E402

GB = 1e9
MODELS = ("Wan2.1-T2V-14B", "Wan2.1-T2V-1.3B")  # the default tables; --model also takes Wan2.2's
CHOICES = (*MODELS, "Wan2.2-T2V-A14B", "Wan2.2-I2V-A14B", "Wan2.2-TI2V-5B")  # an A14B row is one expert
VAE_TIME = 4
ARCHS = {**WAN_CONFIGS, **WAN22_CONFIGS}


def vae_space(name: str) -> int:
    """The VAE's downsampling in space of model `name`: 8 for Wan2.1's VAE, 16 for Wan2.2's (48 channels)."""
    return 16 if WAN_CONSTANTS[name]["vae_channels"] == 48 else 8
PARTS = ("weights", "in_flight", "grads", "states", "master", "activations", "text_encoder", "vae")
HEADS = ("weights", "weights in flight", "grads", "optimizer states", "master side data", "activations",
         "text encoder", "VAE")
HOST_NAMES = dict(weights="swapped bf16 weights", states="u16 AdamW states", master="bf16_exact int16 residual")
LEGEND = ("\n\nComputed on the meta device: parameter counts, optimizer-state and master bytes, the activations "
          "autograd saves (checked against 66 D + 4 F + 8 H + 36 bytes per token per block). Estimated: backward "
          "temporaries (8 D + 4 F per token), Ulysses' extra buffers, zero3's gathered weights and unsharded "
          "gradients, the lean optimizer's per-tensor GPU working set (formulas in the script's docstring). Not "
          "counted: CUDA context, kernel workspaces, fragmentation.")


def video_tokens(num_frames: int, height: int, width: int, patch,
                 space: int = 8) -> tuple[tuple[int, int, int], int]:
    """((f, h, w) patch grid, tokens) of one clip of num_frames x height x width pixels (a VAE `space`x smaller)."""
    if (num_frames - 1) % VAE_TIME or height % (space * patch[1]) or width % (space * patch[2]):
        raise ValueError(f"{num_frames} x {height} x {width} does not fit Wan's VAE and patches: frames must be "
                         f"1 + 4k, height and width multiples of {space * patch[1]}")
    grid = ((1 + (num_frames - 1) // VAE_TIME) // patch[0], height // space // patch[1], width // space // patch[2])
    return grid, math.prod(grid)


def activation_bytes(arch: dict, tokens: int, batch: int = 1) -> dict:
    """Bytes autograd saves in one bf16 forward of `tokens` video tokens (meta device): root (outside blocks), the
    blocks' inputs (each storage once), per block the saved bytes without its own inputs, and the first block's
    input. Blocks after the first are alike, so a 3-block model of the same widths is run and its third block
    stands for the others (checked equal to the second)."""
    with torch.device("meta"):
        model = WanModel(**{**arch, "num_layers": 3}).to(torch.bfloat16)
    owner, inputs, per_block, x_in = ["root"], {}, {}, {}
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    seen = set()

    def enter(i):
        def hook(_module, args):
            owner.append(i)
            x_in[i] = args[0].untyped_storage().nbytes()
            for a in args:
                if torch.is_tensor(a) and (a.is_floating_point() or a.is_complex()):
                    inputs.setdefault(a.untyped_storage()._cdata, a.untyped_storage().nbytes())
        return hook

    def leave(_module, _args, _out):
        owner.pop()

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in seen and key not in weights:
            seen.add(key)
            if key not in inputs:  # a block's inputs count under "inputs"
                per_block[owner[-1]] = per_block.get(owner[-1], 0) + t.untyped_storage().nbytes()
        return t

    handles = [h for i, b in enumerate(model.blocks) for h in (b.register_forward_pre_hook(enter(i)),
                                                               b.register_forward_hook(leave))]
    saved_attention = wan_module.attention
    wan_module.attention = _flash_like
    try:
        with torch.device("meta"):
            # a (1, 1, tokens) patch grid: the bytes depend on the token count only
            x, y = (torch.randn(batch, c, model.patch_size[0], model.patch_size[1], tokens * model.patch_size[2],
                                dtype=torch.bfloat16) for c in (model.out_dim, model.in_dim - model.out_dim))
            context = torch.randn(batch, model.text_len, model.text_dim)
            t = torch.rand(batch) * 1000
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(x, t, context, y=y if model.model_type == "i2v" else None)
    finally:
        wan_module.attention = saved_attention
        for h in handles:
            h.remove()
    if per_block[1] != per_block[2] or x_in[1] != x_in[2]:
        raise RuntimeError(f"blocks 1 and 2 save different bytes ({per_block[1]}, {per_block[2]}); the "
                           f"extrapolation to {arch['num_layers']} blocks does not hold")
    depth = arch["num_layers"]
    return dict(root=per_block.get("root", 0), inputs=sum(inputs.values()) + (depth - 3) * x_in[2],
                blocks=[per_block[0]] + [per_block[1]] * (depth - 1), first_input=x_in[0])


def formula_bytes_per_token(arch: dict) -> int:
    """The per-video-token bytes a block saves (the module docstring's formula)."""
    D, F, H = arch["dim"], arch["ffn_dim"], arch["num_heads"]
    return 66 * D + 4 * F + 8 * H + 36


def sequence_parallel_size(num_heads: int, gpus: int, wanted: int) -> int:
    """The largest SP degree <= wanted that divides both the head count (Ulysses splits heads) and the GPUs."""
    return max(p for p in range(1, wanted + 1) if num_heads % p == 0 and gpus % p == 0)


def encoder_params(name: str = MODELS[0]) -> dict:
    """Parameter counts of UMT5-XXL's encoder and model `name`'s Wan VAE (Wan2.2-TI2V-5B: the 48-channel one): the
    memory planner's (the Wan family's memory_probe on a GPU, which holds UMT5 in bf16 and the VAE in fp32)."""
    cfg = TrainConfig(model=name, vae="usual", num_frames=81, image_size=480)
    probe = family_of(cfg.model).memory_probe(cfg, torch.device("cuda"))
    return dict(umt5=probe.encoders["UMT5-XXL encoder"] / 2, vae=probe.encoders["Wan VAE"] / 4)


class WanPlan:
    """One model's parameter and optimizer-state bytes (meta device) and its per-setting parts."""

    def __init__(self, name: str):
        self.name, self.arch, self.space = name, ARCHS[name], vae_space(name)
        with torch.device("meta"):
            model = WanModel(**self.arch).to(torch.bfloat16)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.depth = len(model.blocks)
        self.block = sum(p.numel() for p in model.blocks[0].parameters())
        self.root = self.n_params - self.block * self.depth
        # the largest tensor a block updates while the activations peak (the backward of the last block); the time
        # projection's larger weight gets its gradient only at the end of backward, when the block inputs are gone
        self.largest = max(p.numel() for p in model.blocks[-1].parameters())
        shapes = [p.shape for p in model.parameters()]
        self.fp32_states, _ = optimizer_bytes(shapes, "adamw", "fp32", "fp32")
        self.lean_states, self.lean_master = optimizer_bytes(shapes, "adamw", "u16", "bf16_exact")
        self._acts = {}

    def tokens(self, num_frames: int, height: int, width: int) -> tuple[tuple[int, int, int], int]:
        return video_tokens(num_frames, height, width, self.arch["patch_size"], self.space)

    def acts(self, tokens: int) -> dict:
        if tokens not in self._acts:
            self._acts[tokens] = activation_bytes(self.arch, tokens)
        return self._acts[tokens]

    def checkpointed(self, tokens: int, ulysses_of: int | None = None) -> float:
        """GPU activation bytes with every block checkpointed, `tokens` per rank; ulysses_of: the full sequence's
        token count under Ulysses SP (see the module docstring's estimates)."""
        D, F = self.arch["dim"], self.arch["ffn_dim"]
        m = self.acts(tokens)
        extra = 0 if ulysses_of is None else 2 * D * tokens + 2 * D * ulysses_of - m["first_input"]
        backward = (8 * D + 4 * F) * tokens
        return m["root"] + m["inputs"] + max(m["blocks"]) + backward + extra

    def lean(self, swap: int, tokens: int) -> dict:
        """GPU and host parts of the lean one-GPU setting with `swap` blocks swapped."""
        parts_per_elem = (self.lean_states + self.lean_master) / self.n_params
        return dict(gpu=dict(weights=2 * (self.n_params - swap * self.block),
                             in_flight=2 * 2 * self.block if swap else 0, grads=2 * self.block,
                             states=offload_working_set(self.largest, parts_per_elem),
                             activations=self.checkpointed(tokens)),
                    host=dict(weights=2 * swap * self.block, states=self.lean_states, master=self.lean_master))


def plan(name: str, a, enc: dict) -> tuple[list[dict], dict]:
    """Rows of GPU / host bytes by part for each setting, and facts for the notes."""
    w = WanPlan(name)
    arch, n_params, block, root, depth = w.arch, w.n_params, w.block, w.root, w.depth
    grid, L = w.tokens(a.num_frames, a.height, a.width)
    P = sequence_parallel_size(arch["num_heads"], a.gpus, a.sp)
    n_local = -(-L // P)
    umt5_bytes, vae_bytes = 2 * enc["umt5"], 4 * enc["vae"]
    lean, checkpointed = w.lean, w.checkpointed

    def fits(row, margin=0.0):
        return sum(row["gpu"].values()) <= (a.budget_gb - margin) * GB

    rows = [
        dict(name="unsharded reference: one GPU holding it all (fp32 weights, grads and AdamW states, bf16 "
                  "compute, checkpointing every block, UMT5 bf16, VAE fp32)",
             gpu=dict(weights=4 * n_params, grads=4 * n_params, states=w.fp32_states, activations=checkpointed(L),
                      text_encoder=umt5_bytes, vae=vae_bytes)),
        dict(name=f"(a) {a.gpus} GPUs: zero3 over {a.gpus} (fp32 params / grads / AdamW states sharded, bf16 "
                  f"compute), Ulysses SP over {P}, checkpointing every block, UMT5 sharded over {a.gpus}, VAE "
                  f"replicated",
             gpu=dict(weights=4 * n_params / a.gpus, in_flight=2 * root + 2 * 2 * block,
                      grads=4 * n_params / a.gpus + (2 + 4) * block + 2 * root, states=w.fp32_states / a.gpus,
                      activations=checkpointed(n_local, L if P > 1 else None), text_encoder=umt5_bytes / a.gpus,
                      vae=vae_bytes)),
        dict(name="(b) 1 GPU, lean: bf16 weights + bf16_exact master, u16 AdamW states on the host, fused "
                  "backward, checkpointing every block, preprocess cache (no UMT5 / VAE loaded)", **lean(0, L)),
    ]
    facts = dict(n_params=n_params, block=block, root=root, largest=w.largest, L=L, grid=grid, P=P,
                 n_local=n_local, acts=w.acts(L), acts_local=w.acts(n_local), depth=depth, swap=None, frames_fit=None)
    if not fits(rows[-1], a.margin_gb):
        swap = next((s for s in range(1, depth + 1) if fits(lean(s, L), a.margin_gb)), None)
        facts["swap"] = swap
        if swap is not None:
            rows.append(dict(name=f"(b) lean + --blocks_to_swap {swap} (the fewest that leave {a.margin_gb:g} GB "
                                  f"of {a.budget_gb:g} GB free)", **lean(swap, L)))
        else:  # even with every block on the host the activations do not fit: the longest clip that does
            rows.append(dict(name=f"(b) lean + --blocks_to_swap {depth} (every block), {a.num_frames} frames: "
                                  f"over {a.budget_gb:g} GB - {a.margin_gb:g} GB", **lean(depth, L)))
            for frames in range(a.num_frames - VAE_TIME, 0, -VAE_TIME):
                _, tokens = w.tokens(frames, a.height, a.width)
                if fits(lean(depth, tokens), a.margin_gb):
                    facts["frames_fit"] = frames
                    rows.append(dict(name=f"(b) lean + --blocks_to_swap {depth}, {frames} frames ({tokens} "
                                          f"tokens): the longest clip that leaves {a.margin_gb:g} GB free",
                                     **lean(depth, tokens)))
                    break
    return rows, facts


def table(rows: list[dict], label: str) -> str:
    head = "| setting | " + " | ".join(f"GPU {h}" for h in HEADS) + " | GPU total | host total |"
    out = [f"### {label}", "", head, "|---|" + "---:|" * (len(PARTS) + 2)]
    for r in rows:
        gpu, host = r["gpu"], r.get("host", {})
        cells = [f"{gpu.get(p, 0) / GB:.2f}" for p in PARTS]
        out.append(f"| {r['name']} | " + " | ".join(cells) + f" | **{sum(gpu.values()) / GB:.2f}** | "
                   f"{sum(host.values()) / GB:.2f} |")
    return "\n".join(out)


def notes(name: str, rows: list[dict], f: dict, a, enc: dict) -> str:
    arch = ARCHS[name]
    m, ml = f["acts"], f["acts_local"]
    per_token = (max(m["blocks"]) - max(ml["blocks"])) / (f["L"] - f["n_local"]) if f["L"] != f["n_local"] else None
    formula = formula_bytes_per_token(arch)
    lines = [f"- parameters (meta-built): {f['n_params'] / 1e9:.3f}B = {len(m['blocks'])} blocks x "
             f"{f['block'] / 1e6:.1f}M + {f['root'] / 1e6:.1f}M outside the blocks; largest tensor in a block "
             f"{f['largest'] / 1e6:.1f}M elements (it sizes the lean optimizer's GPU working set). UMT5-XXL encoder "
             f"{enc['umt5'] / 1e9:.3f}B (bf16 {2 * enc['umt5'] / GB:.2f} GB), Wan VAE {enc['vae'] / 1e6:.1f}M (fp32 "
             f"{4 * enc['vae'] / GB:.2f} GB).",
             f"- tokens: {a.num_frames} x {a.height} x {a.width} -> patch grid {f['grid']} = {f['L']} video tokens "
             f"+ {arch['text_len']} text tokens; (a) splits them over SP {f['P']} -> {f['n_local']} per rank"
             + (f" ({arch['num_heads']} heads: SP {a.sp} does not divide them; {a.gpus // f['P']} SP groups of "
                f"{f['P']} ranks each hold one clip, so the {a.gpus} GPUs train {a.gpus // f['P']} clips per step)"
                if f["P"] != a.sp else f" (the {a.gpus} GPUs share one clip per step)") + ".",
             f"- activations, measured (bf16 forward on the meta device, full sequence): root {m['root'] / GB:.2f} GB, "
             f"block inputs {m['inputs'] / GB:.2f} GB ({len(m['blocks'])} blocks), largest block's saved tensors "
             f"{max(m['blocks']) / GB:.2f} GB; without checkpointing "
             f"{(m['root'] + m['inputs'] + sum(m['blocks'])) / GB:.1f} GB in all."]
    if per_token is not None:
        lines.append(f"- saved bytes per video token per block: measured {per_token:.0f}, formula 66 D + 4 F + 8 H + "
                     f"36 = {formula} (D {arch['dim']}, F {arch['ffn_dim']}, H {arch['num_heads']}).")
    lines.append(f"- (b) trains on a preprocess.py cache; encoding on the fly would add UMT5 "
                 f"({2 * enc['umt5'] / GB:.2f} GB bf16), the VAE ({4 * enc['vae'] / GB:.2f} GB fp32) and the VAE's "
                 f"encoding working set to the GPU.")
    budget = a.budget_gb * GB
    for r in rows:
        total = sum(r["gpu"].values())
        setting = r["name"].split(":")[0].split(" (")[0]
        host = ", ".join(f"{HOST_NAMES[k]} {v / GB:.2f}" for k, v in r.get("host", {}).items() if v)
        lines.append(f"- {setting}: {total / GB:.1f} GB of GPU memory; "
                     + (f"fits {a.budget_gb:g} GB with {(budget - total) / GB:.1f} GB to spare"
                        if total <= budget else f"does NOT fit {a.budget_gb:g} GB")
                     + (f"; host: {host} GB." if host else "."))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=list(MODELS), choices=CHOICES)
    p.add_argument("--num_frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--gpus", type=int, default=8, help="GPUs of setting (a) (zero3 shards over all of them)")
    p.add_argument("--sp", type=int, default=8, help="sequence-parallel degree of setting (a) (lowered to one the "
                                                     "head count and the GPUs allow)")
    p.add_argument("--budget_gb", type=float, default=80.0, help="GPU memory a setting must fit, in 1e9 bytes")
    p.add_argument("--margin_gb", type=float, default=8.0,
                   help="of the budget, left free for what the plan does not count when choosing --blocks_to_swap")
    p.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    a = p.parse_args()
    texts = []
    for name in a.model:
        enc = encoder_params(name)
        rows, facts = plan(name, a, enc)
        label = (f"{name}: {facts['n_params'] / 1e9:.2f}B parameters, {a.num_frames} x {a.height} x {a.width} "
                 f"({facts['L']} video + {ARCHS[name]['text_len']} text tokens), batch 1, GB = 1e9 bytes")
        texts.append(table(rows, label) + "\n\n" + notes(name, rows, facts, a, enc))
    text = "\n\n".join(texts) + LEGEND
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
