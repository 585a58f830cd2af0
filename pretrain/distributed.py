"""Process-group start-up: one place for how a rank joins its job.

The backend is DeepSpeed's accelerator's: NCCL on GPUs, gloo on its CPU accelerator, so the same
code path runs in CI on CPU and on GPU clusters.
"""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it), for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> bool:
    """True under a runner (the deepspeed launcher sets RANK); False for a plain process."""
    return "RANK" in os.environ


def init_distributed(timeout_s: float | None = None) -> tuple[int, int, int]:
    """(rank, local_rank, world_size). Starts the process group when launched by a runner; a
    plain ``python -m pretrain.train`` becomes a world of one (DeepSpeed still wants a group).
    ``timeout_s``: how long a collective may wait for its peers before it fails (None: torch's
    default, 30 min); on NCCL the watchdog then aborts the communicator and ends the process."""
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    deepspeed.init_distributed(verbose=False, **kwargs)
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
