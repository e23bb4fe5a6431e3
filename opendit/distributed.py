"""Process-group set-up shared by the entry scripts.

Under torchrun (WORLD_SIZE set) this joins the job's group: NCCL for CUDA tensors plus gloo for CPU ones when
a GPU exists, gloo otherwise. A plain `python train.py` gets a one-process gloo group, so the same code paths
(DeviceMesh, DTensor, DCP) run everywhere.
"""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed() -> DistInfo:
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", device_id=device if cuda else None)
        else:
            dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, device_id=device if cuda else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def broadcast_object(obj, src: int = 0):
    """Rank src's obj on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_mean(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def cleanup() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
