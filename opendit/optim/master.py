"""Master weights: the fp32 value each update is computed on, and how bf16 parameters hold it.

| mode            | parameter | extra state                  | bytes/param beyond the parameter |
|-----------------|-----------|------------------------------|----------------------------------|
| fp32            | fp32      | none (the parameter is it)   | 0                                |
| fp32            | bf16      | "master" fp32 copy           | 4                                |
| fp32_copy       | bf16      | "master" fp32 copy           | 4                                |
| bf16_exact      | bf16      | "master_lo" int16 residual   | 2                                |
| bf16_stochastic | bf16      | none                         | 0                                |

bf16_exact: the fp32 master is split into the nearest bf16 (ties away from zero; the parameter) and the
signed difference of the bit patterns, which lies in [-2^15, 2^15) and so fits an int16 exactly. Joining
them gives back the fp32 master bit for bit, so training equals fp32-master training whose bf16 copy is
rounded the same way (our "fp32" mode with bf16 parameters uses the same rounding). Round-to-nearest-even
would need one value more than 16 bits hold at ties, hence ties away.
fp32_copy is "fp32 with bf16 parameters", asked for by name (it refuses fp32 parameters): the classic
mixed-precision recipe, 2 bytes more per parameter than bf16_exact but no join/split per update.
"""
import torch

from opendit.seeding import mix_seed

MASTER_MODES = ("fp32", "bf16_exact", "bf16_stochastic", "fp32_copy")
_HIGH = -65536  # int32 mask 0xFFFF0000


def _high_half_nearest(w32: torch.Tensor) -> torch.Tensor:
    # (bits + 2^15) >> 16: the top 16 bits rounded half away from zero, as int32 in [-2^15, 2^15)
    return (w32.contiguous().view(torch.int32) + 0x8000) >> 16


def round_bf16_nearest(w32: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest bf16, ties away from zero (the rounding every bf16-parameter mode here uses)."""
    return _high_half_nearest(w32).to(torch.int16).view(torch.bfloat16)


def split_bf16(w32: torch.Tensor):
    """fp32 (shape S) -> (bf16 nearest, int16 residual) with join_bf16(*split_bf16(w)) == w bitwise."""
    bits = w32.contiguous().view(torch.int32)
    high = (bits + 0x8000) & _HIGH  # 0x8000 in the low half carries into the magnitude: round half away
    return (high >> 16).to(torch.int16).view(torch.bfloat16), (bits - high).to(torch.int16)


def join_bf16(hi: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return ((hi.view(torch.int16).to(torch.int32) << 16) + residual.to(torch.int32)).view(torch.float32)


def stochastic_round_bf16(w32: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding the magnitude up with probability (low 16 bits) / 2^16: unbiased in expectation."""
    noise = torch.randint(0, 1 << 16, w32.shape, dtype=torch.int32, device=w32.device, generator=generator)
    high = (w32.contiguous().view(torch.int32) + noise) & _HIGH
    return (high >> 16).to(torch.int16).view(torch.bfloat16)


class MasterWeights:
    def __init__(self, mode: str = "fp32", seed: int = 0):
        if mode not in MASTER_MODES:
            raise ValueError(f"master_weights must be one of {MASTER_MODES}, got {mode!r}")
        self.mode, self.seed = mode, seed
        self._generators = {}
        self._param_seeds = {}

    def check(self, local: torch.Tensor) -> None:
        if self.mode != "fp32" and local.dtype != torch.bfloat16:
            raise ValueError(f"master_weights={self.mode!r} keeps bf16 parameters, but a parameter of shape "
                             f"{tuple(local.shape)} is {local.dtype}; cast the model to torch.bfloat16 or use "
                             "master_weights='fp32'")
        if self.mode == "fp32" and not local.is_floating_point():
            raise ValueError(f"cannot optimize a parameter of dtype {local.dtype}")

    def init_parts(self, local: torch.Tensor) -> dict:
        """Fresh master state for a parameter's local tensor (on the parameter's device)."""
        if self.mode == "bf16_exact":
            return {"master_lo": torch.zeros(local.shape, dtype=torch.int16, device=local.device)}
        if self.mode == "fp32_copy" or (self.mode == "fp32" and local.dtype != torch.float32):
            return {"master": local.float()}
        return {}

    def gather(self, local: torch.Tensor, parts: dict) -> torch.Tensor:
        """The fp32 master (the parameter itself for fp32 parameters: updated in place)."""
        if "master" in parts:
            return parts["master"]
        if "master_lo" in parts:
            return join_bf16(local, parts["master_lo"])
        return local if local.dtype == torch.float32 else local.float()

    def scatter(self, w32: torch.Tensor, local: torch.Tensor, parts: dict, key: tuple) -> None:
        """Store the updated master back into the parameter (and the residual). key seeds rounding noise."""
        if w32 is local:
            return
        if self.mode == "bf16_stochastic":
            local.copy_(stochastic_round_bf16(w32, self._generator(w32.device, key)))
        elif "master_lo" in parts:
            hi, residual = split_bf16(w32)
            local.copy_(hi)
            parts["master_lo"].copy_(residual)
        elif local.dtype == torch.bfloat16:
            local.view(torch.int16).copy_(_high_half_nearest(w32))  # = round_bf16_nearest, one pass less
        else:
            local.copy_(w32)

    def _generator(self, device, key):
        """Reseeded from (seed, parameter index, step) so a resumed run draws the same noise as an unbroken one.
        The (seed, index) part is mixed once per parameter (mix_seed costs ~10 us, this runs per parameter and
        step); adding the step to a well-mixed 63-bit seed still gives every (index, step) its own stream."""
        index, step = key
        if index not in self._param_seeds:
            self._param_seeds[index] = mix_seed(self.seed, index)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        g = self._generators[device]
        g.manual_seed((self._param_seeds[index] + step) % (1 << 63))
        return g
