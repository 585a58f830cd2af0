"""``vit-launch run`` (the default command): validate the config, run the pre-flight checks
(``launch/preflight.py``, no GPU claimed), then start the deepspeed runner and stay above it
(``launch/supervise.py``: signals, restarts, exit code). ``--dry-run`` prints the exact command,
shell-quoted, and exits 0 (config and hostfile are validated; data and disk checks are left to
``check``, which may run on another machine)."""
from __future__ import annotations

import argparse
import math
import os

from launch.commands.options import (
    CPU_MEMORY,
    PROG,
    config_arguments,
    device_memory_gb,
    launch_spec,
    preflight,
    resource_arguments,
)
from launch.hostfile import LaunchError
from launch.runner import (
    check_spec,
    deepspeed_command,
    export_node_env,
    master_port_problem,
    shell_join,
    spec_world_size,
)
from pretrain.config import load_config

SUMMARY = "(the default) run the pre-flight checks, then start the deepspeed runner and supervise the job"
DESCRIPTION = ("Start pre-training through the deepspeed runner, on one node or many: validate the config, run the "
               "pre-flight checks, start the runner and stay above it (signals, restarts, exit code).")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    config_arguments(ap, memory_default=CPU_MEMORY)
    resource_arguments(ap)
    ap.add_argument("--dry-run", action="store_true", help="print the command and exit 0")
    ap.add_argument("--skip-checks", action="store_true", help="start without the pre-flight checks")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="start the job again after a failure, up to N times; it resumes from the last "
                         "complete checkpoint (default 0)")
    ap.add_argument("--restart-backoff", type=float, default=10.0,
                    help="seconds before the first restart, doubling each time, at most 300 (default 10)")
    ap.add_argument("--stop-grace", type=float, default=90.0,
                    help="seconds the job gets to checkpoint after SIGTERM/SIGINT before it is killed (default 90)")
    ap.add_argument("--exclude-slow-hosts", action="store_true",
                    help="before each start, leave out the hosts the run named as stragglers "
                         "(<output_dir>/stragglers.json); with --max-restarts, a straggler named while the job "
                         "runs stops it (after a checkpoint) and restarts it without that host")
    ap.add_argument("--min-nodes", type=int, default=None,
                    help="with --hostfile and --max-restarts: do not restart on fewer nodes than this when "
                         "nodes are left out (default: any number on which the global batch still splits)")


def check_arguments(args) -> None:
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    for flag, v, zero_ok in (("--restart-backoff", args.restart_backoff, True),
                             ("--stop-grace", args.stop_grace, False)):
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):  # nan compares false to every bound
            raise LaunchError(f"{flag} must be a number of seconds {'>= 0' if zero_ok else '> 0'}, got {v:g}")
    if args.exclude_slow_hosts and not args.hostfile:
        raise LaunchError("--exclude-slow-hosts needs --hostfile (the hosts to choose from)")
    if args.min_nodes is not None and (args.min_nodes <= 0 or not args.hostfile):
        raise LaunchError(f"--min-nodes needs --hostfile and a positive number, got {args.min_nodes}")
    check_spec(launch_spec(args))


def command(args) -> int:
    from pretrain.checkpointing.rundir import RunDir

    spec = launch_spec(args)
    cfg = load_config(args.config, args.overrides)
    layout = RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir)
    cmd = deepspeed_command(spec)
    world, nodes = spec_world_size(spec)
    pool = None
    if spec.hostfile and (args.max_restarts > 0 or args.exclude_slow_hosts):
        from launch.nodes import NodePool

        pool = NodePool(spec, layout, cfg.train, min_nodes=args.min_nodes, exclude_slow=args.exclude_slow_hosts,
                        log=lambda line: print(f"{PROG}: {line}", flush=True))
        cmd = pool.command()  # the first attempt's: checked here (a LaunchError is one line, exit 2)
        world, nodes = len(pool.attempt.ranks), len(pool.attempt.hosts)
    if args.dry_run:
        print(shell_join(cmd))
        return 0
    header = f"pre-flight: {args.config}, {world} rank(s) on {nodes} node(s)"
    memory_gb = device_memory_gb(args.gpu_memory_gb, spec.hostfile)
    if not args.skip_checks and not preflight(cfg, world, memory_gb, header):
        return 2
    if not os.path.exists(cmd[0]):
        raise LaunchError(f"deepspeed runner not found ({cmd[0]}); pip install deepspeed")
    busy = master_port_problem(spec)
    if busy is not None:
        raise LaunchError(busy)
    if spec.hostfile:  # other nodes' ranks see only what pdsh forwards and DS_ENV_FILE holds
        line = export_node_env(layout.root / "deepspeed_env")
        if line:
            print(f"{PROG}: {line}", flush=True)
    print(f"$ {shell_join(cmd)}", flush=True)
    return supervise(args, cmd, pool, layout, cfg.checkpoint.resume)


RESUME = "checkpoint.resume=true"  # every attempt after the first: a later override wins over an earlier one


def supervise(args, cmd: list[str], pool, layout, resumes: bool = True) -> int:
    """Start ``cmd`` under the Supervisor; with a node ``pool``, each restart runs the pool's next
    command (the nodes left). Every restart resumes (``checkpoint.resume=true`` appended): started
    with ``checkpoint.resume=false``, a restart would otherwise set aside the checkpoint it is meant
    to continue from and start over; for the same reason its closing line names
    ``checkpoint.resume=true`` as what resumes it (``resumes`` false)."""
    from launch.supervise import Supervisor
    from pretrain.resilience.lifecycle import resume_command

    first = [cmd]

    def command() -> list[str]:  # the first attempt's is made above; each restart's after the failure
        if first:
            return first.pop()
        again = (pool.command() if pool is not None else list(cmd)) + [RESUME]
        print(f"$ {shell_join(again)}", flush=True)
        return again
    watch = pool.slow_named if pool is not None and args.exclude_slow_hosts else None
    return Supervisor(command, layout.status, stop_grace_s=args.stop_grace, watch=watch,
                      stop_file=layout.stop_request, again=resume_command(resumes)).run(args.max_restarts,
                                                                                        args.restart_backoff)
