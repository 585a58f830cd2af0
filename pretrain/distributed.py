"""Process-group start-up: one place for how a rank joins its job.

The backend is DeepSpeed's accelerator's: NCCL on GPUs, gloo on its CPU accelerator, so the same
code path runs in CI on CPU and on GPU clusters.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path


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
    release_shm_buffers()
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()


def shm_buffer_path(rank: int) -> Path:
    """The /dev/shm file DeepSpeed's CPU accelerator creates for ``rank`` of this job (its shm
    all-reduce, ``deepspeed/ops/csrc/cpu/comm/shm.cpp``: named by uid, MASTER_ADDR, MASTER_PORT)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffers() -> bool:
    """Unlink this rank's DeepSpeed shm buffer once every rank has mapped every peer's.

    On CPU, when all ranks are on one machine (the launcher's LOCAL_SIZE == WORLD_SIZE), each rank
    creates a 66 MB /dev/shm file and maps its peers' files during ``init_distributed``; DeepSpeed
    never unlinks them, so every job (each with its own MASTER_PORT) left 66 MB per rank in RAM-backed
    /dev/shm: a test suite or a restart loop filled the machine's memory until the OOM killer came.
    After a barrier every mapping exists, so the names can go: the memory stays mapped while the
    ranks live and the kernel frees it when the last one exits, by kill -9 too. Returns whether
    a file was removed. A no-op on GPUs and across several machines (no such files)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):  # a world of one under the runner makes one too
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    dist.barrier()  # every rank has returned from DeepSpeed's shm set-up (it opens all peers' files)
    try:
        shm_buffer_path(dist.get_rank()).unlink()
        return True
    except FileNotFoundError:  # the shm op was not built (an older DeepSpeed, no compiler)
        return False
