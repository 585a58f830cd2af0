"""The life of DataLoader worker processes inside a training rank.

Preemption sends SIGTERM to every process of the job, and Ctrl-C sends SIGINT to the whole
process group: workers ignore both, so the rank can still finish its step (which may need more
batches) and checkpoint. They must never outlive or block their rank, though:

* each worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so a rank
  killed with ``kill -9`` takes its workers with it;
* on exit (normal, by exception, or ``SystemExit``) the rank SIGKILLs its workers first
  (``stop_workers``, also registered with ``atexit``): Python's multiprocessing would otherwise send
  them SIGTERM, which they ignore, and join them forever;
* a SIGKILLed worker cannot remove its own files, so the rank makes multiprocessing's temporary
  folder before it starts them (``share_temp_dir``): forked workers then put their sockets (torch
  passes tensors' file descriptors through one) in the rank's folder, which the rank removes at exit.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def worker_init(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: ignore SIGTERM / SIGINT, die with the rank."""
    parent = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent:  # the rank died before the request took effect
        os._exit(1)


def share_temp_dir() -> None:
    """Make this process's multiprocessing temporary folder now, before its workers are forked (they
    inherit it instead of each making one that its SIGKILL would leave in the system's temp folder)."""
    from multiprocessing import util

    util.get_temp_dir()


def stop_workers(timeout_s: float = 5.0) -> int:
    """SIGKILL this process's worker processes and reap them; returns how many were running."""
    children = multiprocessing.active_children()
    if children and threading.current_thread() is threading.main_thread():
        # torch's DataLoader raises "worker ... killed by signal" from its SIGCHLD handler when a
        # worker dies under a live iterator; here their death is the point
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in children:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
    for p in children:
        p.join(timeout_s)
    return len(children)


atexit.register(stop_workers)  # runs before multiprocessing's own exit handler (registered earlier)
