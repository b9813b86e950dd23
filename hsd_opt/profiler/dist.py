"""Profiling under ``torchrun``: the rank and world size, and the two collectives the profiler needs.

Prompts are sharded round-robin across ranks; the additive sums are all-reduced (gloo on CPU, NCCL on CUDA)
and rank 0 measures costs and writes the profile. Outside torchrun every function is a no-op of world size 1.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` from torchrun's environment (``(0, 1)`` outside torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


#: Whether the default process group is the one :func:`ensure_process_group` made (and
#: :func:`close_process_group` may destroy): a caller's own group is left to the caller.
_made_here = False


def ensure_process_group(device) -> None:
    """Initialise the default process group once: NCCL for a CUDA device when available, else gloo."""
    import torch
    import torch.distributed as dist

    global _made_here
    if not dist.is_initialized():
        backend = "nccl" if (device.type == "cuda" and dist.is_nccl_available()) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        _made_here = True


def close_process_group() -> None:
    """Destroy the default process group where :func:`ensure_process_group` made it (no-op otherwise).

    A process that exits with the group alive leaves gloo's worker threads to the interpreter's teardown, which
    now and then aborts the process (SIGABRT, "terminate called without an active exception") after its work
    is done and written: torchrun then reports the rank as failed."""
    global _made_here
    if not _made_here:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _made_here = False


def all_reduce_sum(values: np.ndarray, device) -> np.ndarray:
    """The element-wise sum of ``values`` (float64) over all ranks."""
    import torch
    import torch.distributed as dist

    ensure_process_group(device)
    v = torch.from_numpy(np.asarray(values, dtype=np.float64))
    if dist.get_backend() == "nccl":
        v = v.to(device)
    dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return v.cpu().numpy()


def all_gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    import torch
    import torch.distributed as dist

    ensure_process_group(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    got: list = [None] * world
    dist.all_gather_object(got, obj)
    return got


def barrier() -> None:
    """Wait for every rank (no-op outside torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
