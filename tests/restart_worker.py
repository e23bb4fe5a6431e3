"""A two-rank job for torchrun --max-restarts 1: rank 1 SIGKILLs itself right after joining on the first attempt,
so the second attempt starts at once, while the killed attempt's keys are still in torchrun's store."""
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opendit.distributed import init_distributed  # noqa: E402

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
info = init_distributed(1.0)
dist.barrier()
if attempt == "0" and info.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
print(f"attempt {attempt} rank {info.rank} joined", flush=True)
dist.destroy_process_group()
