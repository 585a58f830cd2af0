"""``vit-launch slurm``: check the config and the layout, then write an sbatch script for a
pre-training job (``launch/slurm.py``) and create its log folder. With ``--shards`` (before any
``--``) it writes shard writing as a job array instead (``launch/slurm_shards.py``, its own options)."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from data_pipeline.errors import path_arg
from data_pipeline.files import check_output_file
from launch.commands.options import config_arguments
from launch.hostfile import LaunchError
from launch.slurm import SlurmJob, validate, write
from pretrain.config import load_config

SUMMARY = "check the layout, then write an sbatch script that starts the job on a SLURM allocation"
DESCRIPTION = ("Write an sbatch script for a pre-training job on NODES x GPUS ranks. The batch arithmetic and the "
               "memory estimate are checked first (a layout that fails is one line, exit 2, no script); the "
               "script checks data and disks on the first node before it starts the job.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    config_arguments(ap)
    ap.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    ap.add_argument("--gpus-per-node", type=int, required=True,
                    help="GPUs (ranks) per node; 0: a CPU-only job (no GPU request, see --ranks-per-node)")
    ap.add_argument("--ranks-per-node", type=int,
                    help="ranks per node of a CPU-only job (default 1); with GPUs it is --gpus-per-node")
    ap.add_argument("--partition", help="SLURM partition")
    ap.add_argument("--time", help="time limit, e.g. 4:00:00 or 2-00:00:00")
    ap.add_argument("--account", help="SLURM account")
    ap.add_argument("--job-name", help="default: vitscale-<config name>")
    ap.add_argument("--cpus-per-node", type=int, help="CPUs to request per node")
    ap.add_argument("--launcher", default="pdsh", choices=["pdsh", "srun"],
                    help="pdsh: runner on the first node over ssh (default); srun: one runner per node")
    ap.add_argument("--master-port", type=int, help="default: 20000 + job id %% 20000")
    ap.add_argument("--log-dir", default="logs", type=path_arg,
                    help="job output, hostfile (default logs/; created now)")
    ap.add_argument("--requeue", action="store_true",
                    help="requeue on pre-emption and at the time limit (checkpoint --signal-grace s before it)")
    ap.add_argument("--signal-grace", type=int, default=120,
                    help="with --requeue, seconds before the time limit that the job is told to checkpoint; "
                         "always, how long the script waits for ranks still saving after the job ends "
                         "(default 120)")
    ap.add_argument("--output", required=True, type=path_arg, help="sbatch script to write")
    g = ap.add_argument_group("shard writing instead of training: --shards [options] -- VIT-SHARDS OPTIONS")
    g.add_argument("--shards", action="store_true",
                   help="write vit-shards as a job array + a merge job to submit with --dependency=afterok on it "
                        "(no --config; `vit-launch slurm --shards --help`)")
    g.add_argument("--parts", type=int, help="with --shards: array tasks, one part of the vit-shards job each")
    g.add_argument("--max-running", type=int, help="with --shards: array tasks running at once")


def shards_asked(argv: list[str]) -> bool:
    """Whether ``argv`` (after ``slurm``) asks for the shard-writing job array: ``--shards`` among
    our options, before the ``--`` that starts vit-shards' own."""
    return "--shards" in argv[:argv.index("--") if "--" in argv else len(argv)]


def job_from_args(args) -> SlurmJob:
    return SlurmJob(config=args.config, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                    overrides=list(args.overrides), partition=args.partition, time=args.time,
                    account=args.account, job_name=args.job_name, cpus_per_node=args.cpus_per_node,
                    launcher=args.launcher, master_port=args.master_port, gpu_memory_gb=args.gpu_memory_gb,
                    log_dir=args.log_dir, ranks_per_node=args.ranks_per_node, requeue=args.requeue,
                    signal_grace=args.signal_grace)


def check_arguments(args) -> None:
    for flag, v in (("--parts", args.parts), ("--max-running", args.max_running)):
        if v is not None:
            raise LaunchError(f"{flag} belongs to a shard-writing job array: add --shards")
    validate(job_from_args(args))
    check_output_file(args.output, {"--config": args.config})  # the script written over its own config


def layout_ok(cfg, job: SlurmJob) -> bool:
    """The pre-flight checks that need no cluster (batch arithmetic, memory estimate) for the job's
    world size, before a script is written: a layout that cannot run fails now, not after the queue
    wait. Errors and warnings one line each on stderr; the data and disk checks run in the job."""
    import io

    from launch.preflight import layout_checks, report

    findings = layout_checks(cfg, job.nodes * job.ranks, gpu_memory_gb=job.gpu_memory_gb)
    return report(findings, "vit-launch slurm", io.StringIO(), sys.stderr)


def command(args) -> int:
    """Write the script and its log folder. A layout that fails a check is one line, exit 2, and
    no script."""
    cfg = load_config(args.config, args.overrides)  # a bad key fails here, not after the queue wait
    job = job_from_args(args)
    if not layout_ok(cfg, job):
        return 2
    out = write(job, args.output)
    what = f"{job.gpus_per_node} GPU(s)" if job.gpus_per_node else f"{job.ranks} CPU rank(s)"
    print(f"wrote {out}: {job.nodes} node(s) x {what}, launcher {job.launcher}"
          f"{', --requeue' if job.requeue else ''}; logs in {Path(job.log_dir).absolute()}; "
          f"submit with: sbatch {shlex.quote(str(out))}")
    return 0
