"""Process-group helpers: how a rank joins its job, picks its device, and agrees with its peers.

The backend is DeepSpeed's accelerator's: NCCL on GPUs, gloo on its CPU accelerator, so the same
code path runs in CI on CPU and on GPU clusters. Pre-training, fine-tuning and in-training
evaluation share these: one ``any_rank``, one lockstep for uneven batch counts.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Optional


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it), for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> bool:
    """True under a runner (the deepspeed launcher sets RANK); False for a plain process."""
    return "RANK" in os.environ


def set_device(local_rank: int) -> Optional[int]:
    """Bind this process to GPU ``local_rank`` of its node (the runner shows every rank all of the
    node's GPUs; without this every rank would allocate on cuda:0 first). Returns the index, or
    None without CUDA. Called before the process group starts, so NCCL's communicator and every
    ``torch.cuda`` default (streams, generator, allocator) are the rank's own device."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.set_device(local_rank)
    return local_rank


def init_distributed(timeout_s: Optional[float] = None) -> tuple[int, int, int]:
    """(rank, local_rank, world_size). Starts the process group when launched by a runner; a
    plain ``python -m pretrain.train`` becomes a world of one (DeepSpeed still wants a group).
    ``timeout_s``: how long a collective may wait for its peers before it fails (None: torch's
    default, 30 min); on NCCL the watchdog then aborts the communicator and ends the process.
    Training starts with the start-up bound here and narrows it with ``set_collective_timeout``
    once the first step is done."""
    import deepspeed
    import torch.distributed as dist

    from pretrain.distributed import ds_compat

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    set_device(local_rank)
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    deepspeed.init_distributed(verbose=False, **kwargs)
    ds_compat.release_shm_buffers()
    return dist.get_rank(), local_rank, dist.get_world_size()


END_BOUND_S = 10.0  # how long a command's end waits for its process group to close


def program(main: Callable[[], object]):
    """Run ``main`` as the whole process (a command's ``__main__`` and console script; tests call
    ``main`` itself) and end it with the code ``main`` ended with (``end_process``)."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # as the interpreter does: the message on stderr, code 1
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 (reported as the interpreter would: its except hook)
        sys.excepthook(type(e), e, e.__traceback__)  # torch.distributed's prefixes each line with the rank
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    end_process(code)


def end_process(code: int):
    """End this process as the interpreter would, short of its finalization: wait for its
    non-daemon threads (``threading``'s own shutdown: a thread pool's exit hooks, then the joins),
    run the exit handlers (W&B's, multiprocessing's workers, logging), flush stdout and stderr and
    leave with ``code``. What is skipped is the teardown of C and C++ state after that (module
    objects, static destructors, ``atexit`` handlers registered in C), where a library's worker
    thread still joinable at destruction ends the process with "terminate called without an
    active exception" (SIGABRT: exit 250 under the deepspeed runner) after a run that finished
    and said so; its code would be lost."""
    import atexit
    import gc
    import io

    for step in (getattr(threading, "_shutdown", None), atexit._run_exitfuncs):
        try:
            if step is not None:
                step()
        except BaseException:  # noqa: BLE001 (still leave, with the code the command chose)
            traceback.print_exc()
    # every file still open is flushed, as finalization would when it destroys it (type, not
    # isinstance: some of torch's deprecated aliases warn when their class is asked)
    for obj in [*gc.get_objects(), sys.stdout, sys.stderr]:
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):  # a closed pipe, a file on a full disk: nothing more to do
                pass
    os._exit(code)


@contextmanager
def process_group_ends(bound_s: float = END_BOUND_S):
    """A command's body (``vit-train``, ``vit-transfer``): the process group started inside is
    destroyed on the way out, whether it succeeded, failed or exits with a user error's code,
    while the interpreter is still whole. Otherwise a gloo worker thread may free a finished
    collective's tensors after the interpreter began finalizing, and the process aborts
    ("terminate called without an active exception", SIGABRT) with its exit code lost: 2 for a
    user's mistake becomes -6.

    Destroying waits for this rank's collectives in flight; after a failure one may wait on a peer
    that never comes. Past ``bound_s`` the process ends at once with the code it was leaving with
    (a failure's traceback printed first)."""
    try:
        yield
    except SystemExit as e:
        _end_process_group(bound_s, e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
        raise
    except BaseException as e:
        _end_process_group(bound_s, 1, e)
        raise
    else:
        _end_process_group(bound_s, 0)


def _end_process_group(bound_s: float, code: int, err: Optional[BaseException] = None) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    ender = threading.Thread(target=dist.destroy_process_group, name="vitscale-pg-end", daemon=True)
    ender.start()
    ender.join(bound_s)
    if ender.is_alive():  # a collective of ours waits on a peer: leave now, with our code
        if err is not None:
            traceback.print_exception(err)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def set_collective_timeout(timeout_s: float) -> None:
    """The timeout of every later collective, on every process group this rank belongs to: the
    default group and the ones DeepSpeed made for itself (ZeRO's data-parallel groups, which reduce
    the gradients and otherwise keep torch's 30-minute default whatever the default group says)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(dist, "set_timeout", None)
    if setter is None:  # torch before the public name
        from torch.distributed.distributed_c10d import _set_pg_timeout as setter
    timeout = timedelta(seconds=timeout_s)
    groups = [None] + [g for g in getattr(getattr(c10d, "_world", None), "pg_map", {})
                       if g is not c10d.GroupMember.WORLD and g is not c10d.GroupMember.NON_GROUP_MEMBER]
    for group in groups:
        try:
            setter(timeout, group)
        except ValueError:  # a group this rank is not part of
            pass


def any_rank(flag: bool, device) -> bool:
    """True on every rank if ``flag`` is true on any (one tiny all-reduce and a host read: a sync
    point; call it on the same steps on every rank)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def lockstep(batches: Iterable, device) -> Iterator:
    """Yield this rank's batches, then ``None`` until every rank has run out.

    Under ZeRO-3 each forward gathers the parameters collectively, so every rank must run the same
    number of forwards: a rank that gets ``None`` runs a dummy forward. One tiny all-reduce (and a
    host read) per batch."""
    it = iter(batches)
    while True:
        item = next(it, None)
        if not any_rank(item is not None, device):
            return
        yield item


# Errors of a collective whose peer went away or could not be reached (gloo and NCCL wording)
PEER_ERRORS = ("Timed out", "timed out", "Connection closed", "Connection reset", "Connection refused",
               "Broken pipe", "NCCL communicator was aborted", "remote process exited")


def is_peer_error(err: BaseException) -> bool:
    return any(k in str(err) for k in PEER_ERRORS)


def lost_peers(hosts: list[str], wait_s: float = 5.0, attempt: str = "0") -> Optional[tuple[str, list[int]]]:
    """After a collective failed: which peers still answer, asked through the rendezvous store
    (its own TCP connection to rank 0's host, not the collectives' links). Every rank that calls
    this marks itself alive and waits ``wait_s`` for the others' marks. Returns one line naming the
    ranks and hosts that did not answer, with those ranks; when the store itself cannot be reached
    the line names rank 0's host and the ranks are ``[0]``. None when every peer answered."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank, world = dist.get_rank(), dist.get_world_size()
    me = f"rank {rank} on {hosts[rank] if rank < len(hosts) else socket.gethostname()}"
    key = f"vitscale/alive/{attempt}/"
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(f"{key}{rank}", "1")
    except Exception:  # noqa: BLE001  the store itself is out of reach
        where = os.environ.get("MASTER_ADDR", "?")
        return (f"{me}: rank 0's host {hosts[0] if hosts else where} (rendezvous at {where}) is unreachable: "
                f"the network between the hosts is cut, or rank 0 is gone", [0])
    silent = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + wait_s
    while silent:  # polled with check(): a store.wait() that times out logs two lines of C++ warnings
        try:
            silent = [r for r in silent if not store.check([f"{key}{r}"])]
        except Exception:  # noqa: BLE001  the store went away meanwhile: those left did not answer
            break
        if not silent or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not silent:
        return None
    names = ", ".join(f"rank {r} on {hosts[r] if r < len(hosts) else '?'}" for r in silent[:8])
    more = f" and {len(silent) - 8} more" if len(silent) > 8 else ""
    return (f"{me}: no answer within {wait_s:g} s from {names}{more}: dead, or the network to "
            f"{'it' if len(silent) == 1 else 'them'} is cut", silent)


def set_cpu_threads(local_world: int, data_workers: int) -> None:
    """On CPU, ranks (and their data workers) share the cores, and torch's default of one thread
    per core in every rank oversubscribes them many times over: each rank gets its share of the
    cores, less one per node left to the data workers."""
    import torch

    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        per_rank = (os.cpu_count() or 1) // max(1, local_world) - (1 if data_workers > 0 else 0)
        torch.set_num_threads(max(1, per_rank))


def node_name() -> str:
    """This rank's node as the job's hostfile names it (what ``vit-launch run`` leaves out or keeps),
    else the machine's host name."""
    from pretrain.distributed.ds_compat import launcher_node

    return launcher_node() or socket.gethostname()


def all_hosts() -> list[str]:
    """Every rank's node name (``node_name``), in rank order (one all-gather at start-up)."""
    import torch.distributed as dist

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, node_name())
    return hosts
