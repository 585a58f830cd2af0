"""An sbatch script for a multi-node job: readable, and meant to be edited by a person. The
``vit-launch slurm`` command that writes it (options, checks) is ``launch/commands/slurm.py``.

The script (1) turns ``SLURM_JOB_NODELIST`` into a DeepSpeed hostfile with
``scontrol show hostnames``, (2) sets the NCCL defaults (README, "NCCL defaults"), (3) runs the
pre-flight checks on the first node, (4) starts the deepspeed runner:

* ``--launcher pdsh`` (default): the runner on the first node reaches the others over ssh with
  pdsh (passwordless ssh between the job's nodes). pdsh forwards only variables named
  ``NCCL*``, ``PYTHON*``, ``UCX*``, ``MV2*`` (runner.py ``EXPORT_ENVS`` + the CUDA accelerator's),
  so the rest (``TORCH_NCCL_*``, ``OMP_NUM_THREADS``) go through the runner's ``DS_ENV_FILE``.
* ``--launcher srun``: ``srun`` starts one runner per node with ``--no_ssh --node_rank
  $SLURM_NODEID``; no ssh or pdsh needed, srun passes the whole environment. srun's exit code is
  the runner's (1 for a signalled job), so the script takes the run's from ``status.json``.

DeepSpeed's own ``--launcher slurm`` is not used: in 0.19 it starts ``python -u <script>``
without ``-m`` and without the ``RANK`` / ``LOCAL_RANK`` its per-node launcher sets.

On one node no hostfile is written for the runner: the job starts locally (no ssh), so every
process of it lives inside SLURM's job step and is signalled by SLURM directly.

``--gpus-per-node 0`` writes a CPU-only job (CPU partitions, tests): no GPU request, no
``--exclusive``; ``--ranks-per-node R`` (default 1) ranks per node, ``--cpus-per-node`` CPUs.

``--requeue`` adds ``#SBATCH --requeue``, ``--open-mode=append`` (a requeued job appends to its
log) and ``#SBATCH --signal=B:USR1@<--signal-grace>``: the batch shell (only) gets SIGUSR1 that
many seconds before the time limit and forwards SIGTERM to the training job's process group, so the
ranks checkpoint at the next step and exit 75; the script then requeues the job itself (SLURM's
``--requeue`` covers node failure, pre-emption and ``scontrol requeue``, not a job's own exit), and
it resumes from that checkpoint, in the same W&B run. A plain ``scancel`` (SIGTERM) also ends in
75 and is not requeued. A job that ends with exit 69 (the shard store stayed unreachable past
``data.remote_retry_s``) is requeued by the script too. The launcher
runs in the background of the script (``wait``, re-``wait`` after the trap) because bash runs a
trap only between commands; a small bash around it writes its exit code to
``<log-dir>/exit.<job id>``, which the script takes over ``wait``'s (bash can lose a job's status
when the job ends just as the trap runs).

The log folder (``--log-dir``) is created when the script is written: SLURM opens the
``--output`` file before the script runs, and a missing folder ends the job at once
(JobLaunchFailure).

``DRY_RUN=1 bash job.sbatch`` (inside an allocation, or with ``SLURM_JOB_NODELIST`` set) writes
the hostfile and prints the commands instead of running them.

``--shards --parts N --output shards.sbatch -- VIT-SHARDS OPTIONS`` writes shard writing instead:
a job array whose task I runs ``vit-shards ... --part I/N`` and ``shards.merge.sbatch``, the
``vit-shards merge`` to submit with ``--dependency=afterok`` on the array
(``launch.slurm_shards``).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launch.hostfile import LaunchError
from launch.runner import STORE_ENV, TRAIN_MODULE, check_master_port, deepspeed_executable
from launch.sbatch import (
    NOT_ONE_WORD,
    SLURM_TIME,
    bash_array,
    check_header_names,
    header_path,
    shell_word,
    time_seconds,
)


@dataclass
class SlurmJob:
    config: str
    nodes: int
    gpus_per_node: int  # 0: CPU-only job, ranks_per_node ranks per node
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
    ranks_per_node: Optional[int] = None  # default: gpus_per_node, or 1 on a CPU-only job
    requeue: bool = False
    signal_grace: int = 120  # seconds before the time limit that the batch shell gets SIGUSR1

    @property
    def ranks(self) -> int:
        """Ranks (deepspeed "slots") per node."""
        return self.ranks_per_node or self.gpus_per_node or 1


def validate(job: SlurmJob) -> None:
    if job.nodes <= 0:
        raise LaunchError(f"--nodes must be a positive number, got {job.nodes}")
    if job.gpus_per_node < 0:
        raise LaunchError(f"--gpus-per-node must be 0 (CPU-only) or more, got {job.gpus_per_node}")
    if job.ranks_per_node is not None and job.ranks_per_node <= 0:
        raise LaunchError(f"--ranks-per-node must be a positive number, got {job.ranks_per_node}")
    if job.gpus_per_node and job.ranks_per_node and job.ranks_per_node != job.gpus_per_node:
        raise LaunchError(f"--ranks-per-node {job.ranks_per_node} with --gpus-per-node {job.gpus_per_node}: "
                          "one rank per GPU; leave --ranks-per-node out, or use --gpus-per-node 0 for CPU ranks")
    if job.time is not None and not SLURM_TIME.match(job.time):
        raise LaunchError(f"--time {job.time!r}: use a SLURM time such as 90, 4:00:00 or 2-00:00:00")
    if job.launcher not in ("pdsh", "srun"):
        raise LaunchError(f"--launcher {job.launcher!r}: choose pdsh or srun")
    if job.cpus_per_node is not None and job.cpus_per_node < job.ranks:
        raise LaunchError(f"--cpus-per-node {job.cpus_per_node} is fewer than the {job.ranks} rank(s) per node")
    if job.signal_grace <= 0:
        raise LaunchError(f"--signal-grace must be a positive number of seconds, got {job.signal_grace}")
    if job.requeue and job.time is not None and time_seconds(job.time) <= job.signal_grace:
        # SLURM would signal at the start: the job checkpoints, exits 75 and is requeued, over and over
        raise LaunchError(f"--time {job.time} is no longer than --signal-grace {job.signal_grace} s: with --requeue "
                          "the job would be told to stop as it starts; give a longer --time or a shorter grace")
    check_master_port(job.master_port)
    check_header_names(job_name=job.job_name, partition=job.partition, account=job.account)


def _header(job: SlurmJob, name: str, log_dir: Path) -> list[str]:
    h = [f"#SBATCH --job-name={name}", f"#SBATCH --nodes={job.nodes}",
         "#SBATCH --ntasks-per-node=1"]  # one runner per node; it starts the node's ranks
    if job.gpus_per_node:
        h += [f"# older SLURM without --gpus-per-node: use #SBATCH --gres=gpu:{job.gpus_per_node} instead",
              f"#SBATCH --gpus-per-node={job.gpus_per_node}", "#SBATCH --exclusive"]
    h.append(f"#SBATCH --output={header_path(f'{log_dir}/%x-%j.out')}")
    if job.cpus_per_node:
        h.append(f"#SBATCH --cpus-per-task={job.cpus_per_node}")
    for flag, v in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if v:
            h.append(f"#SBATCH --{flag}={v}")
    if job.requeue:
        h += ["# pre-emption / requeue: start again later, resuming from the last checkpoint (same W&B run)",
              "#SBATCH --requeue", "#SBATCH --open-mode=append",
              f"# USR1 to this script (only) {job.signal_grace} s before the time limit: it forwards SIGTERM to the",
              "# job and requeues it once the job has checkpointed and stopped (75); SLURM's --requeue does not",
              "# cover a job's own exit, and a plain scancel (SIGTERM) is not requeued",
              f"#SBATCH --signal=B:USR1@{job.signal_grace}"]
    return h


# The launcher runs in the background so that the TERM trap runs at once (bash runs traps only
# between commands); the job gets its own process group (setsid), which the trap signals as a
# whole: the runner/supervisor, the node's launcher and ranks (they checkpoint at the next step).
# That group's leader is a small bash (JOB) that runs the launcher and writes its exit code to a
# file: `wait` in the script can lose the job's status when the job ends just as a trap runs (bash
# keeps none, or the trap's 128 + signal stands), and a stop at the time limit would not be requeued.
# JOB catches TERM/INT/USR1 with a no-op, so the group's SIGTERM stops the launcher, not JOB; a
# caught signal is reset to its default in the commands JOB starts (an ignored one would be inherited;
# INT and QUIT are ignored in any background job of a script, as they were before JOB).
_JOB = """'trap : TERM INT USR1; "$@"; code=$?; echo "$code" > "$0"; exit "$code"'"""
_START = """\
# SIGTERM/SIGINT to this script (scancel, pre-emption, requeue) and USR1 (--signal=B:USR1@grace,
# the time limit is near) are forwarded as SIGTERM to the job's process group: ranks checkpoint at
# the next step and exit.
# Exit status of the run (`vit-launch run`'s; under srun, the code rank 0 wrote in status.json):
# 0 done, 2 user error, 75 interrupted (requeue is right), 69 the shard store stayed unreachable;
# with --requeue both 69 and a stop at the time limit (75 after USR1) are requeued below.
if [[ -n "${{DRY_RUN:-}}" ]]; then
  {dry}
else
  JOB_PID=""
  SIGNALLED=""
  forward() {{
    SIGNALLED=1
    echo "$(date -Is) batch script: signal; SIGTERM to the job's process group" >&2
    if [[ -n "$JOB_PID" ]]; then kill -TERM -- -"$JOB_PID" 2>/dev/null || true; fi
  }}
  TIME_LIMIT=""
  time_limit() {{ TIME_LIMIT=1; forward; }}
  trap forward TERM INT
  trap time_limit USR1
  STARTED_AT=$(date +%s.%N)  # to the fraction: a requeue may start in the second its attempt ended
  # the launcher's exit code, written by JOB as it ends; kept beside the log (as the hostfile):
  # it says how the last attempt ended, and a requeue (same job id) removes it before it starts
  EXIT_FILE={exit_file}
  rm -f "$EXIT_FILE"
  JOB={job}
  setsid bash -c "$JOB" "$EXIT_FILE" {launch} &
  JOB_PID=$!
  STATUS=0; wait "$JOB_PID" || STATUS=$?
  # a trap ends `wait` early with 128 + its signal, whether the job is still running or has just
  # ended (scancel signals the job too): wait again until the job has ended (127 or 255: bash kept
  # no status, read already or lost as the job ended just before the trap)
  while [[ -n "$SIGNALLED" ]]; do
    SIGNALLED=""; AGAIN=0; wait "$JOB_PID" 2>/dev/null || AGAIN=$?
    (( AGAIN == 127 || AGAIN == 255 )) || STATUS=$AGAIN
  done
  # the code JOB wrote stands over `wait`'s (no file: JOB itself was killed, `wait` says how)
  RECORDED=$(cat "$EXIT_FILE" 2>/dev/null || true)
  if [[ $RECORDED =~ ^[0-9]+$ ]]; then STATUS=$RECORDED; fi
  # ranks may still be saving after the runner ended; SLURM kills what is left when this script
  # ends, so give them up to {grace} s to finish
  for ((i = 0; i < {grace}; i++)); do kill -0 -- -"$JOB_PID" 2>/dev/null || break; sleep 1; done{run_status}
  echo "$(date -Is) job exited with status $STATUS" >&2{requeue}
  exit "$STATUS"
fi"""


# A requeued job continues its run: with a checkpoint.resume=false override each requeue would
# otherwise set the checkpoints aside and start over (a later override wins over an earlier one).
RESUME_LINES = """
# requeued (SLURM_RESTART_COUNT > 0): continue from the last complete checkpoint
if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
  LAUNCH+=(checkpoint.resume=true)
fi"""


REQUEUE = """
  # the shard store stayed away (69), or the job checkpointed at the time limit (75 after USR1):
  # start again later, from the checkpoint
  if [[ $STATUS == 69 || ( $STATUS == 75 && -n "$TIME_LIMIT" ) ]]; then
    scontrol requeue "$SLURM_JOB_ID"
  fi"""


# srun ends with the deepspeed runner's code, not the run's: a stop after a checkpoint is 1 there
# (its launcher's code for a signalled job) or SLURM's signal, never 75; `vit-launch run` reads
# status.json for the same reason
RUN_STATUS = """
  # the run's exit code, as rank 0 wrote it in status.json in this attempt (srun gives the runner's);
  # srun's stands where there is none (or where the reader itself fails)
  RUN_CODE=$({python} -m launch.supervise exit-code {status} "$STARTED_AT" "$STATUS" || true)
  if [[ $RUN_CODE =~ ^[0-9]+$ ]]; then STATUS=$RUN_CODE; fi"""


def start_block(launch: str, dry: str, grace: int, requeue: bool, logs: str,
                status_file: Optional[str] = None) -> str:
    """The end of the script: start the job (``launch``, words of bash, or print ``dry`` under
    DRY_RUN), forward signals to it, wait for it and, with ``requeue``, requeue what should go on.
    ``logs``: the log folder (a shell word), where the job's exit code is written as
    ``exit.$SLURM_JOB_ID``. ``status_file``: the run's status.json, whose exit code replaces the
    launcher's (``launch`` not `vit-launch run`)."""
    run_status = "" if status_file is None else RUN_STATUS.format(
        python=shell_word(sys.executable), status=shlex.quote(status_file))
    return _START.format(dry=dry, launch=launch, grace=grace, requeue=REQUEUE if requeue else "",
                         run_status=run_status, job=_JOB, exit_file=f'{logs}/"exit.$SLURM_JOB_ID"')


def render(job: SlurmJob, cwd: Optional[Path] = None, output: str = "job.sbatch") -> str:
    validate(job)
    cwd = (cwd or Path.cwd()).absolute()
    config = str(Path(job.config).absolute())
    stem = NOT_ONE_WORD.sub("_", Path(job.config).stem)  # one word of an #SBATCH line
    name = job.job_name or f"vitscale-{stem}"
    log_dir = (cwd / job.log_dir).absolute()
    logs = shlex.quote(str(log_dir))  # absolute: the runner resolves DS_ENV_FILE from ~
    check = [sys.executable, "-m", "launch", "check", "--config", config, "--hostfile", '"$HOSTFILE"',
             "--gpus-per-node", str(job.ranks), "--gpu-memory-gb", f"{job.gpu_memory_gb:g}", *job.overrides]
    overrides = " ".join(shlex.quote(o) for o in job.overrides) or "(none)"
    port = str(job.master_port) if job.master_port is not None else "$((20000 + SLURM_JOB_ID % 20000))"
    what = f"{job.gpus_per_node} GPU(s)" if job.gpus_per_node else f"{job.ranks} CPU rank(s), no GPU"
    if job.launcher == "srun":
        # `vit-launch run` has no --no_ssh / --node_rank: srun starts the deepspeed runner itself
        cmd = ds_command(config, job.overrides, job.nodes, job.ranks, no_ssh=True)
        launch_array = bash_array("LAUNCH", cmd) + RESUME_LINES
        run_line = ("srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n"
                    "    bash -c 'exec \"$0\" --node_rank \"$SLURM_NODEID\" \"$@\"' \"${LAUNCH[@]}\"")
        dry = "run srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n" \
              "    bash -c 'exec \"$0\" --node_rank \"$SLURM_NODEID\" \"$@\"' \"${LAUNCH[@]}\""
        where = "# one runner per node; each gets its node rank from srun (no ssh between nodes)"
        env_file = ""
        status_file = str(cwd / run_dir(job).status)
    else:
        cmd = launch_command(config, job.overrides, job.nodes, job.ranks)
        launch_array = bash_array("LAUNCH", cmd) + RESUME_LINES + "\n" + (
            "# one node: no hostfile, the runner starts the ranks here (no ssh); more: pdsh over ssh\n"
            "if (( ${#HOSTS[@]} > 1 )); then\n"
            "  LAUNCH+=(--hostfile \"$HOSTFILE\" --num-nodes \"${#HOSTS[@]}\")\n"
            "fi")
        status_file = None  # `vit-launch run` exits with the run's code
        run_line = "\"${LAUNCH[@]}\""
        dry = "run \"${LAUNCH[@]}\""
        where = "# the runner on this (first) node starts every node's ranks (over ssh with pdsh if several)"
        env_file = (
            "\n# pdsh forwards only NCCL*/PYTHON*/UCX*/MV2* variables; the runner adds the lines of DS_ENV_FILE.\n"
            f"export DS_ENV_FILE={logs}/\"deepspeed_env.$SLURM_JOB_ID\"\n"
            "# (where the store is, never its secrets: those stay in ~/.aws/credentials, read on every node)\n"
            f"(umask 077; env | grep -E '^(TORCH_NCCL_[A-Z_]*|OMP_NUM_THREADS|{STORE_ENV.pattern})=' "
            "> \"$DS_ENV_FILE\") || true\n")
    start = start_block(run_line, dry, job.signal_grace, job.requeue, logs, status_file)
    return f"""#!/bin/bash
# vitscale pre-training on {job.nodes} node(s) x {what}, written by `vit-launch slurm`.
#   config:    {config}
#   overrides: {overrides}
#   launcher:  deepspeed runner via {job.launcher}{", requeued on pre-emption" if job.requeue else ""}
# Submit with `sbatch {output}`; `DRY_RUN=1 bash {output}` prints the commands instead.
# The log folder below must exist at submit time (`vit-launch slurm` created it).
# Edit freely: the header, the NCCL block and the LAUNCH array are plain bash.
{chr(10).join(_header(job, name, log_dir))}

set -euo pipefail
cd {shlex.quote(str(cwd))}
mkdir -p {logs}

run() {{  # DRY_RUN=1: print the command (shell-quoted) instead of running it
  if [[ -n "${{DRY_RUN:-}}" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}}

# --- nodes -> DeepSpeed hostfile ("host slots=N", one line per node); rank 0 on the first node
RANKS_PER_NODE={job.ranks}
HOSTS=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
(( ${{#HOSTS[@]}} > 0 )) || {{ echo "no hosts in SLURM_JOB_NODELIST; submit with sbatch" >&2; exit 1; }}
HOSTFILE={logs}/"hostfile.$SLURM_JOB_ID"
for h in "${{HOSTS[@]}}"; do echo "$h slots=$RANKS_PER_NODE"; done > "$HOSTFILE"
MASTER_ADDR="${{HOSTS[0]}}"
MASTER_PORT="${{MASTER_PORT:-{port}}}"
echo "$(date -Is) job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on ${{HOSTS[*]}}" >&2

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
_threads=$(( ${{SLURM_CPUS_ON_NODE:-$RANKS_PER_NODE}} / RANKS_PER_NODE ))
export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( _threads > 0 ? _threads : 1 ))}}"
{env_file}
# --- pre-flight: shards, manifest, run dir, batch arithmetic, memory estimate (no GPU claimed)
run {" ".join(shell_word(w) for w in check)}

# --- the training job
{launch_array}
{where}
{start}
"""


def run_dir(job: SlurmJob):
    """The run directory of the job's config and overrides (``RunDir``; relative to the script's folder)."""
    from pretrain.checkpointing.rundir import RunDir
    from pretrain.config import load_config

    cfg = load_config(job.config, job.overrides)
    return RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir)


def launch_command(config: str, overrides: list[str], nodes: int, ranks_per_node: int) -> list[str]:
    """``vit-launch run`` (our supervisor of the deepspeed runner) for the script; the script adds
    ``--hostfile`` on a multi-node allocation. The pre-flight already ran, hence --skip-checks."""
    return [sys.executable, "-m", "launch", "run", "--gpus-per-node", str(ranks_per_node),
            "--master-addr", '"$MASTER_ADDR"', "--master-port", '"$MASTER_PORT"', "--skip-checks",
            "--config", config, *overrides]


def ds_command(config: str, overrides: list[str], nodes: int, gpus_per_node: int, no_ssh: bool) -> list[str]:
    """The runner command of the script; hostfile, master address and port are shell variables
    set by the script, so the layout is given by the node and GPU counts, not read from a file."""
    cmd = [deepspeed_executable(), "--hostfile", '"$HOSTFILE"', "--num_nodes", str(nodes),
           "--num_gpus", str(gpus_per_node), "--master_addr", '"$MASTER_ADDR"', "--master_port", '"$MASTER_PORT"']
    if no_ssh:
        cmd.append("--no_ssh")  # each node's runner gets --node_rank from srun
    return cmd + ["--module", TRAIN_MODULE, "--config", config, *overrides]


def write(job: SlurmJob, output: str | Path) -> Path:
    """Write the script, and create its log folder: SLURM opens the ``--output`` file before the
    script runs, so the folder must exist when ``sbatch`` is called."""
    text = render(job, output=str(output))
    out = Path(output)
    if out.parent and not out.parent.is_dir():
        raise LaunchError(f"--output {out}: folder {out.parent} does not exist")
    Path(job.log_dir).absolute().mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.chmod(0o755)
    return out
