"""Compressed storage formats for optimizer states (encode fp32 -> parts, decode parts -> fp32).

Each format stores one fp32 tensor of shape S as a few "parts" whose leading dimension is S[0], so an
FSDP2 shard (Shard(0) of a parameter) can be wrapped as a DTensor part-by-part and Distributed
Checkpoint can reshard the parts without decoding them. Part names become state_dict key suffixes:

| format | parts (dtype, shape)                                 | bytes/elem | round-trip error bound            |
|--------|------------------------------------------------------|------------|-----------------------------------|
| fp32   | "" (fp32, S)                                         | 4          | exact                             |
| bf16   | "bf16" (bf16, S)                                     | 2          | rel 2^-8 (nearest), abs 2^-134    |
| f24    | "f24hi" (int16, S), "f24lo" (uint8, S)               | 3          | rel 2^-16 (nearest), abs 2^-142   |
| u16    | "u16" (int16, S), "u16range" (fp32, (S[0], nblk, 2)) | 2 + 8/block| half a step of y = sign(x)|x|^(1/p)|

u16 companding: y = sign(x)|x|^(1/p) is quantized to 65536 levels between the min and max of y in
each block of `block` consecutive elements of one dim-0 row (blocks never cross rows, so dim-0 shards
keep them whole). A step dy in y is a relative step p*dy/|y| in x, so small entries keep more relative
accuracy than with linear scaling. 1-D tensors cannot be split into rows and fall back to f24.
"""
import math

import torch

SMALL_NUMEL = 4096  # tensors with at most this many elements (globally) stay fp32
BF16_MAX = float.fromhex("0x1.fe00000000000p+127")  # largest finite bf16, exactly representable in fp32
F24_MAX = float.fromhex("0x1.fffe000000000p+127")  # largest fp32 whose low 8 bits are zero
HALF_MAX = torch.finfo(torch.float32).max / 2


def _empty(shape, dtype, device, pin):
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


class Fp32Format:
    name = "fp32"
    parts = ("",)

    def empty(self, shape, device, pin=False):
        return {"": _empty(shape, torch.float32, device, pin).zero_()}

    def encode(self, x, out):
        if x is not out[""]:
            out[""].copy_(x)

    def decode(self, parts):
        return parts[""]

    def nbytes(self, shape):
        return 4 * math.prod(shape)


class Bf16Format:
    name = "bf16"
    parts = ("bf16",)

    def empty(self, shape, device, pin=False):
        return {"bf16": _empty(shape, torch.bfloat16, device, pin).zero_()}

    def encode(self, x, out):
        # Clamp first: fp32 values above the bf16 range would round to inf; clamped they round to max.
        out["bf16"].copy_(x.clamp(-BF16_MAX, BF16_MAX))

    def decode(self, parts):
        return parts["bf16"].float()

    def nbytes(self, shape):
        return 2 * math.prod(shape)


class F24Format:
    """The top 24 bits of fp32 (sign, exponent, 15 mantissa bits), rounded to nearest (ties away)."""
    name = "f24"
    parts = ("f24hi", "f24lo")

    def empty(self, shape, device, pin=False):
        return {"f24hi": _empty(shape, torch.int16, device, pin).zero_(),
                "f24lo": _empty(shape, torch.uint8, device, pin).zero_()}

    def encode(self, x, out):
        # Adding 0x80 to the bit pattern rounds the magnitude (sign-magnitude layout) to nearest; the
        # clamp keeps the largest values from carrying into the inf exponent.
        bits = x.clamp(-F24_MAX, F24_MAX).view(torch.int32) + 0x80
        out["f24hi"].copy_(bits >> 16)
        out["f24lo"].copy_((bits >> 8) & 0xFF)

    def decode(self, parts):
        bits = (parts["f24hi"].to(torch.int32) << 16) | (parts["f24lo"].to(torch.int32) << 8)
        return bits.view(torch.float32)

    def nbytes(self, shape):
        return 3 * math.prod(shape)


class U16Format:
    """Block-wise min/max quantization of the companded values y = sign(x)|x|^(1/power)."""
    name = "u16"
    parts = ("u16", "u16range")

    def __init__(self, block: int = 256, power: float = 3.0):
        if block < 1 or power <= 0:
            raise ValueError(f"u16 format needs block >= 1 and power > 0, got block={block}, power={power}")
        self.block, self.power = block, float(power)

    def _layout(self, shape):
        rows = shape[0]
        cols = math.prod(shape) // max(rows, 1)
        return rows, cols, -(-cols // self.block)

    def empty(self, shape, device, pin=False):
        rows, _, nblk = self._layout(shape)
        return {"u16": _empty(shape, torch.int16, device, pin).zero_(),
                "u16range": _empty((rows, nblk, 2), torch.float32, device, pin).zero_()}

    def _blocks(self, t, rows, cols, nblk, fill):
        """(rows, cols) -> (rows, nblk, block), padding each row's tail with `fill` (a (rows, 1) tensor)."""
        pad = nblk * self.block - cols
        if pad:
            t = torch.cat([t, fill.expand(rows, pad)], dim=1)
        return t.view(rows, nblk, self.block)

    def encode(self, x, out):
        rows, cols, nblk = self._layout(x.shape)
        # Half the fp32 range keeps max - min finite (only matters for power 1 and |x| > 1.7e38).
        y = x.reshape(rows, cols).float()
        y = y.abs().pow(1.0 / self.power).clamp_(max=HALF_MAX).copysign(y)
        yb = self._blocks(y, rows, cols, nblk, y[:, -1:])  # padding with a real value keeps min/max
        lo, hi = yb.amin(dim=2, keepdim=True), yb.amax(dim=2, keepdim=True)
        span = hi - lo
        inv = torch.where(span > 0, 65535.0 / span, torch.zeros_like(span))
        q = ((yb - lo) * inv).round_().clamp_(0, 65535) - 32768
        out["u16"].copy_(q.view(rows, -1)[:, :cols].reshape(x.shape))
        out["u16range"].copy_(torch.cat([lo, hi], dim=2))

    def decode(self, parts):
        q = parts["u16"]
        rows, cols, nblk = self._layout(q.shape)
        qf = q.reshape(rows, cols).float() + 32768.0
        qb = self._blocks(qf, rows, cols, nblk, qf[:, -1:])
        lo, hi = parts["u16range"][..., :1], parts["u16range"][..., 1:]
        y = lo + qb * ((hi - lo) / 65535.0)
        x = y.abs().pow(self.power).clamp_(max=torch.finfo(torch.float32).max).copysign(y)
        return x.view(rows, -1)[:, :cols].reshape(q.shape)

    def nbytes(self, shape):
        rows, _, nblk = self._layout(shape)
        return 2 * math.prod(shape) + 8 * rows * nblk


FORMATS = ("fp32", "bf16", "u16", "f24")


def make_format(name: str, *, global_numel: int, ndim: int, u16_block: int = 256, u16_power: float = 3.0,
                small_numel: int = SMALL_NUMEL):
    """The format a state of a parameter with `global_numel` elements and `ndim` dims is stored in.

    Small tensors stay fp32 (their states cost little and biases/norms are sensitive); u16 needs rows,
    so 1-D tensors use f24 instead. Deciding on the global size keeps the choice stable across ranks.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown state format {name!r}; choose one of {FORMATS}")
    if name == "fp32" or global_numel <= small_numel:
        return Fp32Format()
    if name == "u16" and ndim < 2:
        return F24Format()
    return {"bf16": Bf16Format, "f24": F24Format}.get(name, lambda: U16Format(u16_block, u16_power))()


def detect_format(keys, u16_block: int = 256, u16_power: float = 3.0):
    """The format whose part suffixes are `keys` (a set of suffixes from a saved state_dict)."""
    for fmt in (Fp32Format(), Bf16Format(), F24Format(), U16Format(u16_block, u16_power)):
        if set(fmt.parts) == set(keys):
            return fmt
    raise ValueError(f"saved optimizer state has parts {sorted(keys)} that match no known format {FORMATS}")


def part_key(state_name: str, part: str) -> str:
    return f"{state_name}.{part}" if part else state_name
