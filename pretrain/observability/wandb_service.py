"""A W&B service that survives the signals that stop a training job.

wandb starts its service (``wandb-core``) as a child of the training process. When a job is
stopped, everything below the rank is signalled: DeepSpeed's launcher answers SIGTERM / SIGINT (and
a crashed peer) by SIGTERMing every descendant of every rank (``terminate_process_tree``), and
``wandb-core`` answers SIGTERM with a forced shutdown that drops the history it has not written
yet, while the rank itself is still checkpointing and has not called ``finish()``. The offline
``.wandb`` file then holds its 7-byte header only.

So rank 0 starts the service out of its own process tree and session: a guardian process is
double-forked (its first child exits, so the guardian is re-parented away from the rank), starts
``wandb-core`` detached, hands its connection token back through a pipe, and waits. wandb
connects to a running service named by ``WANDB_SERVICE``. Once the rank is gone (after its
``finish()``, or killed), the guardian waits a grace period in which the service writes out what it
received, then ends it: ``finish()`` returns when the service has taken the run's last record,
not when its writer has flushed it, and the service answers SIGTERM by dropping what it has not
written. The guardian ignores SIGTERM / SIGINT: neither a process-group signal nor the launcher's
tree kill reaches it or the service.

Costs: one extra Python process (importing wandb, about a second) per run start.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

_GUARDIAN = r"""
import os, signal, sys, time
rank, grace = int(sys.argv[1]), float(sys.argv[2])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
r, w = os.pipe()
if os.fork() > 0:  # the first child hands the token back and exits: the guardian leaves the rank's tree
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.write(1, data)
    os._exit(0 if data else 1)
os.close(r)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):  # the rank reads our first child's stdout to its end: hold no copy of it
    os.dup2(null, fd)
import wandb
from wandb.sdk.lib.service import service_process
service = service_process.start_detached(wandb.Settings(), idle_timeout="0")
os.write(w, f"{service._process.pid} {service.token.env_value}".encode())
os.close(w)
while service._process.poll() is None:
    time.sleep(1.0)
    try:
        os.kill(rank, 0)
    except ProcessLookupError:  # the rank is gone without ending the service: let it write, then end it
        time.sleep(grace)
        service._process.terminate()
        try:
            service._process.wait(30)
        except Exception:
            service._process.kill()
        break
"""


@dataclass
class Service:
    pid: int
    token: str  # the value of WANDB_SERVICE

    def end(self) -> None:
        """End the service now, dropping what it has not written: only for a service whose run
        never started (an online attempt that failed)."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def start(grace_s: float = 10.0, timeout_s: float = 60.0) -> Optional[Service]:
    """Start a guarded W&B service for this process; None when it cannot be started (then wandb
    starts its own, as a child, and a stop signal may cut its history short)."""
    try:
        r = subprocess.run([sys.executable, "-c", _GUARDIAN, str(os.getpid()), str(grace_s)], capture_output=True,
                           text=True, timeout=timeout_s, start_new_session=True)
        pid, token = r.stdout.split(" ", 1)
        return Service(int(pid), token.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
