"""The deepspeed runner command for a training job: one pure function from launch options to argv.

    deepspeed [--hostfile H] [--num_nodes N] [--num_gpus G] [--master_addr A] [--master_port P]
              [--include S | --exclude S] --module pretrain.train --config FILE [a.b=c ...]

Runner options follow DeepSpeed 0.19's ``deepspeed/launcher/runner.py``. Why some are not offered:
``--launcher slurm|openmpi|mvapich|...`` start ``python <script>`` (the Slurm backend drops
``--module``) with the MPI/Slurm rank variables, while each rank here needs the ``RANK`` /
``LOCAL_RANK`` that the runner's per-node ``deepspeed.launcher.launch`` sets; so multi-node jobs use
the pdsh backend (the default) or one runner per node with ``--no_ssh --node_rank`` (``slurm.py``).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launch.hostfile import Host, LaunchError, active_ranks, local_gpu_count, parse_hostfile, world_size

TRAIN_MODULE = "pretrain.train"

# Where an S3 store is, never its secrets (those stay in ~/.aws/credentials, read on every node): the
# runner forwards only PYTHON* / NCCL* / UCX* / MV2* variables to other nodes over pdsh, so these go
# through its DS_ENV_FILE (node_env_file here; the script of launch/slurm.py greps the same names).
STORE_ENV = re.compile(r"AWS_(ENDPOINT_URL[A-Z_0-9]*|DEFAULT_REGION|REGION|PROFILE|"
                       r"CONFIG_FILE|SHARED_CREDENTIALS_FILE)")


def node_env_file(path: Path, environ: Optional[dict] = None) -> Optional[tuple[Path, list[str]]]:
    """The DS_ENV_FILE of a multi-node pdsh launch: the lines the deepspeed runner would have read
    (the file ``$DS_ENV_FILE`` names, else ``~/.deepspeed_env`` and ``./.deepspeed_env``), then this
    environment's STORE_ENV variables that those lines do not set. Written to ``path`` (mode 600: the
    user's files may hold anything) and returned with the names added; None when there is none to
    add, and the runner reads its usual files."""
    environ = os.environ if environ is None else environ
    store = {k: v for k, v in environ.items() if STORE_ENV.fullmatch(k) and "\n" not in v}
    if not store:
        return None
    name, seen, lines = environ.get("DS_ENV_FILE", ".deepspeed_env"), set(), []
    for folder in (os.path.expanduser("~"), "."):  # as the runner looks (an absolute name: one file)
        f = Path(folder, name).resolve()
        if f not in seen and f.is_file():
            seen.add(f)
            lines += [ln for ln in f.read_text().splitlines() if "=" in ln]
    have = {ln.split("=", 1)[0].strip() for ln in lines}
    added = sorted(k for k in store if k not in have)
    if not added:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("".join(f"{ln}\n" for ln in lines + [f"{k}={store[k]}" for k in added]))
    return path, added


def export_node_env(path: Path) -> Optional[str]:
    """For a job the runner starts over pdsh: write ``node_env_file`` at ``path`` and name it in this
    process's ``DS_ENV_FILE``, which the runner (a child) reads. The line saying what goes to every
    node, or None when there is nothing to add."""
    made = node_env_file(path)
    if not made:
        return None
    os.environ["DS_ENV_FILE"] = str(made[0])
    return f"{', '.join(made[1])} to every node through DS_ENV_FILE={made[0]}"


@dataclass
class LaunchSpec:
    config: str
    overrides: list[str] = field(default_factory=list)
    hostfile: Optional[str] = None
    num_nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    include: str = ""
    exclude: str = ""


def deepspeed_executable() -> str:
    """The runner beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "deepspeed"
    if beside.exists():
        return str(beside)
    return shutil.which("deepspeed") or "deepspeed"


def check_spec(spec: LaunchSpec) -> None:
    for flag, v in (("--num-nodes", spec.num_nodes), ("--gpus-per-node", spec.gpus_per_node)):
        if v is not None and v <= 0:
            raise LaunchError(f"{flag} must be a positive number, got {v}")
    check_master_port(spec.master_port)


def check_master_port(port: Optional[int]) -> None:
    if port is not None and not 1 <= port <= 65535:
        raise LaunchError(f"--master-port must be in 1-65535, got {port}")


def plan_ranks(spec: LaunchSpec) -> tuple[Optional[list[Host]], dict[str, list[int]]]:
    """(hostfile hosts or None, host -> slot ids). Without a hostfile and without
    ``--gpus-per-node`` the job uses this machine's GPUs (1 rank on a machine without any)."""
    check_spec(spec)
    hosts = parse_hostfile(spec.hostfile) if spec.hostfile else None
    gpus = spec.gpus_per_node
    if hosts is None and gpus is None and not (spec.include or spec.exclude):  # those need a hostfile: say so
        gpus = max(1, local_gpu_count())
    return hosts, active_ranks(hosts, num_nodes=spec.num_nodes, gpus_per_node=gpus, include=spec.include,
                               exclude=spec.exclude, hostfile=spec.hostfile or "hostfile")


def deepspeed_command(spec: LaunchSpec, *, executable: Optional[str] = None,
                      runner_args: tuple[str, ...] = ()) -> list[str]:
    """argv for the deepspeed runner. Rank counts are passed explicitly (``--num_gpus``) so the
    world size the pre-flight checks is the one that runs; the one exception is a local job under
    ``CUDA_VISIBLE_DEVICES`` with no count given, where the runner's own device mapping is kept."""
    hosts, ranks = plan_ranks(spec)
    cmd = [executable or deepspeed_executable()]
    if spec.hostfile:
        cmd += ["--hostfile", spec.hostfile]
    if spec.include:
        cmd += ["--include", spec.include]
    elif spec.exclude:
        cmd += ["--exclude", spec.exclude]
    else:
        if spec.num_nodes:
            cmd += ["--num_nodes", str(spec.num_nodes)]
        if spec.gpus_per_node or not (hosts or "CUDA_VISIBLE_DEVICES" in os.environ):
            cmd += ["--num_gpus", str(len(next(iter(ranks.values()))))]
    if spec.master_addr:
        cmd += ["--master_addr", spec.master_addr]
    if spec.master_port:
        cmd += ["--master_port", str(spec.master_port)]
    if hosts and len(ranks) == 1 and not is_this_machine(next(iter(ranks))):
        # one active host of a hostfile: the runner takes its local path (multi-node only with more
        # hosts), which would start the ranks on the machine running this command; --force_multi
        # ("launch on a single remote node") starts them on that host over pdsh
        cmd.append("--force_multi")
    cmd += list(runner_args)
    cmd += ["--module", TRAIN_MODULE, "--config", spec.config, *spec.overrides]
    return cmd


def is_this_machine(host: str) -> bool:
    """``host`` (a hostfile name or address) names the machine running this: localhost, a loopback
    address, this machine's own name or one of the addresses that name resolves to."""
    import socket

    if host in ("localhost", socket.gethostname(), socket.getfqdn()) or host.startswith("127.") or host == "::1":
        return True
    try:
        return host in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def spec_world_size(spec: LaunchSpec) -> tuple[int, int]:
    """(world size, nodes) this spec starts."""
    _, ranks = plan_ranks(spec)
    return world_size(ranks), len(ranks)


DEFAULT_MASTER_PORT = 29500  # the deepspeed runner's


def busy_master_port(spec: LaunchSpec) -> Optional[int]:
    """The rendezvous port when rank 0 runs on this machine and something already holds that port
    here (another job's rendezvous): the runner would start, and the ranks would stall or fail to
    meet. None when the port is free or rank 0 is elsewhere."""
    import socket

    port = spec.master_port or DEFAULT_MASTER_PORT
    if spec.hostfile:
        first = parse_hostfile(spec.hostfile)[0].name
        if spec.master_addr is not None and not is_this_machine(spec.master_addr):
            return None
        if spec.master_addr is None and not is_this_machine(first):
            return None
    elif spec.master_addr not in (None, "localhost") and not spec.master_addr.startswith("127."):
        return None
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed job's TIME_WAIT is no owner
        try:
            s.bind(("", port))
        except OSError:
            return port
    return None


def master_port_problem(spec: LaunchSpec) -> Optional[str]:
    """The one line that says :func:`busy_master_port`'s port is held; None when it is not."""
    busy = busy_master_port(spec)
    if busy is None:
        return None
    return (f"--master-port {busy} is in use on this machine (another job's rendezvous?); "
            "choose a free one with --master-port")


def shell_join(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)

