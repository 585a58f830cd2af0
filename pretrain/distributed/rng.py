"""Random-number state of a training process: snapshot, restore, and a block that leaves it as it was.

One owner for what a checkpoint saves and what an evaluation must not disturb: Python's, NumPy's and
torch's CPU generators, and the CUDA generator of *this process's own device* only. The deepspeed
launcher shows each rank every GPU of its node; ``torch.cuda.get_rng_state_all()`` would save states
for all of them, and a resume on a node with fewer GPUs (an elastic restart) would ask to restore
generators of devices that do not exist there.

The state is JSON-safe (base64 for the byte tensors), so a checkpoint's ``rank_<R>.json`` holds it
without pickling.
"""
from __future__ import annotations

import base64
import contextlib
import random
from typing import Iterator, Optional

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def own_cuda_device() -> Optional[int]:
    """The index of this process's CUDA device (the one ``torch.cuda.set_device`` chose), or None
    on a machine without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def rng_state() -> dict:
    """Every generator this process draws from, JSON-safe; CUDA: this process's device only."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    dev = own_cuda_device()
    if dev is not None:
        state["cuda"] = _b64(torch.cuda.get_rng_state(dev))
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s output. A CUDA state goes to this process's own device; a state
    saved by another layout (a list of one state per visible GPU, as older checkpoints hold) gives
    this device the entry of its own index where there is one, else the first."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(_unb64(state["torch"]))
    dev, saved = own_cuda_device(), state.get("cuda")
    if dev is None or not saved:
        return
    if isinstance(saved, list):
        saved = saved[dev] if dev < len(saved) else saved[0]
    torch.cuda.set_rng_state(_unb64(saved), dev)


def rank_seed(seed: int, rank: int) -> int:
    """A fresh start's torch seed for ``rank``'s dropout / drop-path / patch-dropout stream."""
    return seed + 1000 * (rank + 1)


def resume_streams(states: list[dict], rank: int, seed: int, step: int) -> None:
    """Restore this rank's generators from a checkpoint's per-rank states (``states[r]["rng"]``, in
    the saving run's rank order). A rank the saving layout had continues its own stream exactly; a
    rank it did not have (a resume on more ranks) takes rank 0's Python and NumPy state and a torch
    stream of its own, seeded from (``seed``, rank, ``step``): a copy of rank 0's would draw the same
    dropout, drop-path and patch-dropout masks as rank 0 for the rest of the run."""
    if rank < len(states):
        set_rng_state(states[rank]["rng"])
        return
    set_rng_state(states[0]["rng"])
    fresh = np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0]
    torch.manual_seed(int(fresh) >> 1)  # every device's generator too; below 2**63


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Run a block (an evaluation) without moving torch's CPU generator or this device's CUDA
    generator: the training stream draws the same numbers as if the block had not run."""
    cpu = torch.get_rng_state()
    dev = own_cuda_device()
    cuda = torch.cuda.get_rng_state(dev) if dev is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, dev)
