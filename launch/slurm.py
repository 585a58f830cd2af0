"""An sbatch script for a multi-node job: readable, and meant to be edited by a person.

The script (1) turns ``SLURM_JOB_NODELIST`` into a DeepSpeed hostfile with
``scontrol show hostnames``, (2) sets the NCCL defaults (README, "NCCL defaults"), (3) runs the
pre-flight checks on the first node, (4) starts the deepspeed runner:

* ``--launcher pdsh`` (default): the runner on the first node reaches the others over ssh with
  pdsh (passwordless ssh between the job's nodes). pdsh forwards only variables named
  ``NCCL*``, ``PYTHON*``, ``UCX*``, ``MV2*`` (runner.py ``EXPORT_ENVS`` + the CUDA accelerator's),
  so the rest (``TORCH_NCCL_*``, ``OMP_NUM_THREADS``) go through the runner's ``DS_ENV_FILE``.
* ``--launcher srun``: ``srun`` starts one runner per node with ``--no_ssh --node_rank
  $SLURM_NODEID``; no ssh or pdsh needed, srun passes the whole environment.

DeepSpeed's own ``--launcher slurm`` is not used: in 0.19 it starts ``python -u <script>``
without ``-m`` and without the ``RANK`` / ``LOCAL_RANK`` its per-node launcher sets.

``DRY_RUN=1 bash job.sbatch`` (inside an allocation, or with ``SLURM_JOB_NODELIST`` set) writes
the hostfile and prints the commands instead of running them.
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launch.hostfile import LaunchError
from launch.runner import TRAIN_MODULE, deepspeed_executable

# SLURM's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2})$")


@dataclass
class SlurmJob:
    config: str
    nodes: int
    gpus_per_node: int
    overrides: list[str] = field(default_factory=list)
    partition: Optional[str] = None
    time: Optional[str] = None
    account: Optional[str] = None
    job_name: Optional[str] = None
    cpus_per_node: Optional[int] = None
    launcher: str = "pdsh"
    master_port: Optional[int] = None  # None: derived from the job id (no clash on shared nodes)
    gpu_memory_gb: float = 80.0
    log_dir: str = "logs"


def validate(job: SlurmJob) -> None:
    if job.nodes <= 0:
        raise LaunchError(f"--nodes must be a positive number, got {job.nodes}")
    if job.gpus_per_node <= 0:
        raise LaunchError(f"--gpus-per-node must be a positive number, got {job.gpus_per_node}")
    if job.time is not None and not _TIME.match(job.time):
        raise LaunchError(f"--time {job.time!r}: use a SLURM time such as 90, 4:00:00 or 2-00:00:00")
    if job.launcher not in ("pdsh", "srun"):
        raise LaunchError(f"--launcher {job.launcher!r}: choose pdsh or srun")
    if job.cpus_per_node is not None and job.cpus_per_node < job.gpus_per_node:
        raise LaunchError(f"--cpus-per-node {job.cpus_per_node} is fewer than --gpus-per-node {job.gpus_per_node}")


def _q(word: str) -> str:
    """Shell-quote, but leave our "$VAR" words to the shell."""
    return word if word.startswith('"$') else shlex.quote(word)


def _array(name: str, words: list[str], indent: str = "  ") -> str:
    """A bash array, one option (with its value) per line so a person can edit it."""
    lines, i = [], 0
    while i < len(words):
        w = words[i]
        if w.startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            lines.append(f"{_q(w)} {_q(words[i + 1])}")
            i += 2
        else:
            lines.append(_q(w))
            i += 1
    return f"{name}=(\n" + "".join(f"{indent}{line}\n" for line in lines) + ")"


def render(job: SlurmJob, cwd: Optional[Path] = None, output: str = "job.sbatch") -> str:
    validate(job)
    cwd = (cwd or Path.cwd()).absolute()
    config = str(Path(job.config).absolute())
    name = job.job_name or f"vitscale-{Path(job.config).stem}"
    logs = shlex.quote(str(cwd / job.log_dir))  # absolute: the runner resolves DS_ENV_FILE from ~
    cmd = ds_command(config, job.overrides, job.nodes, job.gpus_per_node, no_ssh=job.launcher == "srun")
    check = [sys.executable, "-m", "launch", "check", "--config", config, "--hostfile", '"$HOSTFILE"',
             "--gpus-per-node", str(job.gpus_per_node), "--gpu-memory-gb", f"{job.gpu_memory_gb:g}",
             *job.overrides]
    header = [f"#SBATCH --job-name={name}", f"#SBATCH --nodes={job.nodes}", "#SBATCH --ntasks-per-node=1",
              f"# older SLURM without --gpus-per-node: use #SBATCH --gres=gpu:{job.gpus_per_node} instead",
              f"#SBATCH --gpus-per-node={job.gpus_per_node}",
              f"#SBATCH --output={cwd / job.log_dir}/%x-%j.out", "#SBATCH --exclusive"]
    if job.cpus_per_node:
        header.append(f"#SBATCH --cpus-per-task={job.cpus_per_node}")
    for flag, v in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if v:
            header.append(f"#SBATCH --{flag}={v}")
    port = str(job.master_port) if job.master_port else "$((20000 + SLURM_JOB_ID % 20000))"
    overrides = " ".join(shlex.quote(o) for o in job.overrides) or "(none)"
    if job.launcher == "srun":
        start = ("# one runner per node; each gets its node rank from srun (no ssh between nodes)\n"
                 "run srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n"
                 "  bash -c 'exec \"$0\" --node_rank \"$SLURM_NODEID\" \"$@\"' \"${LAUNCH[@]}\"")
        env_file = ""
    else:
        start = ("# the runner on this (first) node starts every node's ranks over ssh with pdsh\n"
                 "run \"${LAUNCH[@]}\"")
        env_file = (
            "\n# pdsh forwards only NCCL*/PYTHON*/UCX*/MV2* variables; the runner adds the lines of DS_ENV_FILE.\n"
            f"export DS_ENV_FILE={logs}/\"deepspeed_env.$SLURM_JOB_ID\"\n"
            "env | grep -E '^(TORCH_NCCL_[A-Z_]*|OMP_NUM_THREADS)=' > \"$DS_ENV_FILE\" || true\n")
    return f"""#!/bin/bash
# vitscale pre-training on {job.nodes} node(s) x {job.gpus_per_node} GPU(s), written by `vit-launch slurm`.
#   config:    {config}
#   overrides: {overrides}
#   launcher:  deepspeed runner via {job.launcher}
# Submit with `sbatch {output}`; `DRY_RUN=1 bash {output}` prints the commands instead.
# Edit freely: the header, the NCCL block and the LAUNCH array are plain bash.
{chr(10).join(header)}

set -euo pipefail
cd {shlex.quote(str(cwd))}
mkdir -p {logs}

run() {{  # DRY_RUN=1: print the command (shell-quoted) instead of running it
  if [[ -n "${{DRY_RUN:-}}" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}}

# --- nodes -> DeepSpeed hostfile ("host slots=N", one line per node); rank 0 on the first node
GPUS_PER_NODE={job.gpus_per_node}
HOSTS=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
(( ${{#HOSTS[@]}} > 0 )) || {{ echo "no hosts in SLURM_JOB_NODELIST; submit with sbatch" >&2; exit 1; }}
HOSTFILE={logs}/"hostfile.$SLURM_JOB_ID"
for h in "${{HOSTS[@]}}"; do echo "$h slots=$GPUS_PER_NODE"; done > "$HOSTFILE"
MASTER_ADDR="${{HOSTS[0]}}"
MASTER_PORT="${{MASTER_PORT:-{port}}}"

# --- NCCL / PyTorch distributed defaults; a value already in the environment wins
export NCCL_DEBUG="${{NCCL_DEBUG:-WARN}}"   # INFO to debug a hang or a slow ring; not for production runs
# On an NCCL error or timeout, abort the communicators and end the process, so the job fails
# (and frees its nodes) instead of hanging. NCCL_ASYNC_ERROR_HANDLING is the deprecated name.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${{TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}}"
# Site settings, left to NCCL's auto-detection unless your cluster documents otherwise:
# export NCCL_SOCKET_IFNAME=ib0      # interface for bootstrap + socket traffic (default skips lo, docker*)
# export NCCL_IB_HCA=mlx5            # InfiniBand / RoCE adapters to use (default: all found)
# export NCCL_IB_DISABLE=1           # only on clusters without InfiniBand / RoCE
# CPU threads per rank: the node's CPUs split over its ranks (data-loader workers are processes)
_threads=$(( ${{SLURM_CPUS_ON_NODE:-$GPUS_PER_NODE}} / GPUS_PER_NODE ))
export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( _threads > 0 ? _threads : 1 ))}}"
{env_file}
# --- pre-flight: shards, manifest, run dir, batch arithmetic, memory estimate (no GPU claimed)
run {" ".join(_q(w) for w in check)}

# --- the training job
{_array("LAUNCH", cmd)}
{start}
"""


def ds_command(config: str, overrides: list[str], nodes: int, gpus_per_node: int, no_ssh: bool) -> list[str]:
    """The runner command of the script; hostfile, master address and port are shell variables
    set by the script, so the layout is given by the node and GPU counts, not read from a file."""
    cmd = [deepspeed_executable(), "--hostfile", '"$HOSTFILE"', "--num_nodes", str(nodes),
           "--num_gpus", str(gpus_per_node), "--master_addr", '"$MASTER_ADDR"', "--master_port", '"$MASTER_PORT"']
    if no_ssh:
        cmd.append("--no_ssh")  # each node's runner gets --node_rank from srun
    return cmd + ["--module", TRAIN_MODULE, "--config", config, *overrides]


def write(job: SlurmJob, output: str | Path) -> Path:
    text = render(job, output=str(output))
    out = Path(output)
    if out.parent and not out.parent.is_dir():
        raise LaunchError(f"--output {out}: folder {out.parent} does not exist")
    out.write_text(text)
    out.chmod(0o755)
    return out
