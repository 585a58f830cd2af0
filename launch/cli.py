"""``vit-launch``: start pre-training through the deepspeed runner, on one node or many.

    vit-launch [run] --config FILE [--hostfile H] [--num-nodes N] [--gpus-per-node G]
               [--master-addr A] [--master-port P] [--include S | --exclude S]
               [--gpu-memory-gb 80] [--skip-checks] [--dry-run] [a.b=c ...]
    vit-launch check --config FILE [same resource options] [--world-size W] [a.b=c ...]
    vit-launch plan --model NAME --gpu GPU --nodes N --gpus-per-node G --micro-batch B [--search] [--json]
    vit-launch plan --config FILE --world-size W --gpu GPU [a.b=c ...]
    vit-launch slurm --config FILE --nodes N --gpus-per-node G [--partition P] [--time T]
               [--launcher pdsh|srun] --output job.sbatch [a.b=c ...]
    vit-launch slurm --shards --parts N --output shards.sbatch [...] -- VIT-SHARDS OPTIONS
    vit-launch sweep --config FILE --world-sizes 1,2,4,8 [--steps 50] [--scaling weak|strong]
               [--dry-run] [a.b=c ...]

``run`` validates the config, runs the pre-flight checks (``launch/preflight.py``, no GPU
claimed) and then becomes the deepspeed runner (``exec``), so signals reach it directly.
``--dry-run`` prints the exact command, shell-quoted, and exits 0 (config and hostfile are
validated; data and disk checks are left to ``check``, which may run on another machine).
Every user mistake is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from data_pipeline.errors import Parser, cli_errors
from pretrain.config import load_config

PROG = "vit-launch"
COMMANDS = ("run", "check", "plan", "slurm", "sweep")
SUMMARY = {  # one line each: `vit-launch --help` lists them, each command's --help starts with its own
    "run": "(the default) run the pre-flight checks, then start the deepspeed runner and supervise the job",
    "check": "run the pre-flight checks alone: batch, shards, manifest, run dir, memory (no GPU claimed)",
    "plan": "predict images/s, MFU, memory and the bottleneck of a layout from the performance model (--search ranks layouts)",
    "slurm": "check the layout, then write an sbatch script that starts the job on a SLURM allocation",
    "sweep": "run the same short job at several world sizes and plot the scaling curve",
}
DESCRIPTION = {
    "run": "Start pre-training through the deepspeed runner, on one node or many: validate the config, run the "
           "pre-flight checks, start the runner and stay above it (signals, restarts, exit code).",
    "check": "Run the pre-flight checks for a config and a number of ranks, without claiming a GPU: batch "
             "arithmetic, shards and manifest (sizes, headers, sample counts), run directory, memory estimate. "
             "Exit 0 when none fails, 2 with one line per failure.",
    "plan": "Predict a layout's images/s, MFU, step time, exposed communication, memory per GPU and bottleneck "
            "from the performance model (pretrain/perf/perfmodel.py), without a GPU; --search ranks the layouts that fit.",
    "slurm": "Write an sbatch script for a pre-training job on NODES x GPUS ranks. The batch arithmetic and the "
             "memory estimate are checked first (a layout that fails is one line, exit 2, no script); the "
             "script checks data and disks on the first node before it starts the job.",
    "sweep": "Scaling sweep: the same short job at each world size, one after the other, in one W&B group; "
             "prints images/s and efficiency per size and draws the plot.",
}


def _common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. optim.lr=3e-4")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0,
                    help="device memory the estimate is checked against (default 80)")


def _resources(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("where the ranks run (deepspeed runner options)")
    g.add_argument("--hostfile", help="DeepSpeed hostfile: one 'HOST slots=N' line per node")
    g.add_argument("--num-nodes", type=int, help="use the first N hosts of the hostfile")
    g.add_argument("--gpus-per-node", type=int,
                   help="ranks per node (default: all slots; without a hostfile this machine's GPUs, or 1)")
    g.add_argument("--include", default="", help="runner --include, e.g. 'worker-0@worker-1:0,2'")
    g.add_argument("--exclude", default="", help="runner --exclude, same format")
    g.add_argument("--master-addr", help="address of rank 0's node (default: the runner's choice)")
    g.add_argument("--master-port", type=int, help="rendezvous port (default 29500)")


def _parser(cmd: str) -> argparse.ArgumentParser:
    epilog = None
    if cmd == "run":  # `vit-launch --help`: the commands, one line each
        width = max(map(len, COMMANDS))
        epilog = "commands:\n" + "\n".join(f"  {c:<{width}}  {SUMMARY[c]}" for c in COMMANDS) + \
                 f"\n\n`{PROG} COMMAND --help` shows a command's options; without a command, run."
    if epilog:
        import textwrap

        ap = Parser(prog=PROG, usage=f"{PROG} [{'|'.join(COMMANDS)}] --config FILE [options] [a.b=c ...]",
                    description=textwrap.fill(DESCRIPTION[cmd], 88), epilog=epilog,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    elif cmd == "plan":
        from launch.plan_cli import add_arguments

        ap = Parser(prog=f"{PROG} plan", description=DESCRIPTION[cmd])
        add_arguments(ap)
        return ap
    else:
        ap = Parser(prog=f"{PROG} {cmd}", description=DESCRIPTION[cmd])
    _common(ap)
    if cmd in ("run", "check"):
        _resources(ap)
    if cmd == "run":
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
    elif cmd == "check":
        ap.add_argument("--world-size", type=int, help="check for this many ranks instead of the resource options")
        ap.add_argument("--gpu", help="GPU type: also print the performance model's prediction for this layout "
                                      "(see `vit-launch plan --help` for the types)")
    elif cmd == "slurm":
        from launch.slurm import add_arguments

        add_arguments(ap)
    elif cmd == "sweep":
        ap.add_argument("--world-sizes", required=True, help="comma-separated, e.g. 1,2,4,8")
        ap.add_argument("--steps", type=int, default=50, help="optimizer steps per run (default 50)")
        ap.add_argument("--scaling", default="weak", choices=["weak", "strong"],
                        help="weak: global batch = micro x world (default); strong: global batch fixed")
        ap.add_argument("--group", help="W&B group (default: scaling-<config>-<time>)")
        ap.add_argument("--output-root", help="folder of the runs (default: beside train.output_dir)")
        ap.add_argument("--hostfile", help="for world sizes above one node")
        ap.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the hostfile's slots)")
        ap.add_argument("--master-port", type=int, help="rendezvous port (default 29500)")
        ap.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
        ap.add_argument("--plot", default=None, help="scaling plot to write (default <root>/scaling.png)")
    return ap


def _spec(args):
    from launch.runner import LaunchSpec

    return LaunchSpec(config=args.config, overrides=list(args.overrides), hostfile=args.hostfile,
                      num_nodes=args.num_nodes, gpus_per_node=args.gpus_per_node, master_addr=args.master_addr,
                      master_port=args.master_port, include=args.include, exclude=args.exclude)


def _preflight(cfg, world: int, gpu_memory_gb: float, header: str) -> bool:
    from launch.preflight import report, run_checks

    print(header, flush=True)
    ok = report(run_checks(cfg, world, gpu_memory_gb=gpu_memory_gb), PROG, sys.stdout, sys.stderr)
    sys.stdout.flush()
    return ok


def cmd_run(args) -> int:
    from launch.runner import deepspeed_command, shell_join, spec_world_size

    spec = _spec(args)
    cfg = load_config(args.config, args.overrides)
    cmd = deepspeed_command(spec)
    world, nodes = spec_world_size(spec)
    if args.exclude_slow_hosts and not spec.hostfile:
        print(f"{PROG}: error: --exclude-slow-hosts needs --hostfile (the hosts to choose from)", file=sys.stderr)
        return 2
    if args.min_nodes is not None and (args.min_nodes <= 0 or not spec.hostfile):
        print(f"{PROG}: error: --min-nodes needs --hostfile and a positive number, got {args.min_nodes}", file=sys.stderr)
        return 2
    pool = None
    if spec.hostfile and (args.max_restarts > 0 or args.exclude_slow_hosts):
        from launch.nodes import NodePool
        from pretrain.checkpointing.rundir import RunDir

        pool = NodePool(spec, RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir), cfg.train,
                        min_nodes=args.min_nodes, exclude_slow=args.exclude_slow_hosts,
                        log=lambda line: print(f"{PROG}: {line}", flush=True))
        cmd = pool.command()  # the first attempt's: checked here (a LaunchError is one line, exit 2)
        world, nodes = len(pool.attempt.ranks), len(pool.attempt.hosts)
    if args.dry_run:
        print(shell_join(cmd))
        return 0
    if not args.skip_checks:
        if not _preflight(cfg, world, args.gpu_memory_gb, f"pre-flight: {args.config}, {world} rank(s) on {nodes} node(s)"):
            return 2
    if args.max_restarts < 0 or args.restart_backoff < 0 or args.stop_grace <= 0:
        print(f"{PROG}: error: --max-restarts and --restart-backoff must be >= 0, --stop-grace > 0", file=sys.stderr)
        return 2
    if not os.path.exists(cmd[0]):
        print(f"{PROG}: error: deepspeed runner not found ({cmd[0]}); pip install deepspeed", file=sys.stderr)
        return 2
    from launch.runner import busy_master_port

    busy = busy_master_port(spec)
    if busy is not None:
        print(f"{PROG}: error: --master-port {busy} is in use on this machine (another job's rendezvous?); "
              "choose a free one with --master-port", file=sys.stderr)
        return 2
    from launch.supervise import Supervisor
    from pretrain.checkpointing.rundir import RunDir

    layout = RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir)
    if spec.hostfile:  # other nodes' ranks see only what pdsh forwards and DS_ENV_FILE holds
        from launch.runner import node_env_file

        made = node_env_file(layout.root / "deepspeed_env")
        if made:
            os.environ["DS_ENV_FILE"] = str(made[0])
            print(f"{PROG}: {', '.join(made[1])} to every node through DS_ENV_FILE={made[0]}", flush=True)
    print(f"$ {shell_join(cmd)}", flush=True)
    if pool is None:
        return Supervisor(cmd, layout.status, stop_grace_s=args.stop_grace).run(args.max_restarts, args.restart_backoff)
    first = [cmd]

    def command() -> list[str]:  # the first attempt's is made above; each restart's after the failure
        if first:
            return first.pop()
        again = pool.command()
        print(f"$ {shell_join(again)}", flush=True)
        return again
    return Supervisor(command, layout.status, stop_grace_s=args.stop_grace,
                      watch=pool.slow_named if args.exclude_slow_hosts else None,
                      stop_file=layout.stop_request).run(args.max_restarts, args.restart_backoff)


def cmd_check(args) -> int:
    from launch.runner import spec_world_size

    cfg = load_config(args.config, args.overrides)
    if args.world_size is not None:
        if args.world_size <= 0:
            print(f"{PROG}: error: --world-size must be positive, got {args.world_size}", file=sys.stderr)
            return 2
        world, where = args.world_size, "--world-size"
    else:
        world, nodes = spec_world_size(_spec(args))
        where = f"{nodes} node(s)"
    ok = _preflight(cfg, world, args.gpu_memory_gb, f"pre-flight: {args.config}, {world} rank(s) ({where})")
    if args.gpu:
        from pretrain.perf import perfmodel
        from pretrain.perf.hardware import GPUS

        if args.gpu not in GPUS:
            print(f"{PROG}: error: --gpu {args.gpu!r} is not one of {', '.join(GPUS)}", file=sys.stderr)
            return 2
        per_node = args.gpus_per_node or min(world, 8)
        nodes = max(1, world // per_node)
        pred = perfmodel.predict(perfmodel.layout_from_config(cfg, nodes=nodes, gpus_per_node=world // nodes,
                                                              gpu=args.gpu))
        print(perfmodel.summary_line(pred), flush=True)
    return 0 if ok else 2


def cmd_plan(args) -> int:
    from launch.plan_cli import command

    return command(args)


def cmd_slurm(args) -> int:
    from launch.slurm import command

    return command(args)


def cmd_sweep(args) -> int:
    from launch import plot_scaling, sweep

    cfg = load_config(args.config, args.overrides)
    sizes = sweep.parse_world_sizes(args.world_sizes)
    p = sweep.plan(cfg, args.config, list(args.overrides), sizes, steps=args.steps, scaling=args.scaling,
                   group=args.group, root=args.output_root, hostfile=args.hostfile,
                   gpus_per_node=args.gpus_per_node, master_port=args.master_port)
    print(sweep.describe(p, cfg.train.micro_batch_size), flush=True)
    if args.dry_run:
        return 0
    ok = True
    for r in p.runs:  # every size passes pre-flight before the first job starts
        run_cfg = load_config(args.config, r.overrides)
        ok &= _preflight(run_cfg, r.world_size, args.gpu_memory_gb, f"pre-flight: world size {r.world_size}")
    if not ok:
        return 2
    env = sweep.cpu_thread_env(p, args.hostfile)
    if env:
        print(f"CPU ranks: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} for every rank of every size", flush=True)
    results = sweep.execute(p, env)
    done = [r.output_dir for r, code in results if code == 0]
    if len(done) < 1:
        print(f"{PROG}: error: no run of the sweep finished; see the output above", file=sys.stderr)
        return 1
    rows = plot_scaling.scaling_table([plot_scaling.load_run(d) for d in done])
    print("\n" + plot_scaling.format_table(rows))
    png = plot_scaling.plot(rows, args.plot or f"{p.root}/scaling.png", title=p.group)
    print(f"plot: {png}\nredraw with: python -m launch.plot_scaling {' '.join(done)} --output {png}")
    return 0 if len(done) == len(results) else 1


def main(argv=None) -> None:
    from data_pipeline.errors import DataError
    from launch.plot_scaling import PlotError

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    if cmd == "slurm" and "--shards" in argv[:argv.index("--") if "--" in argv else len(argv)]:
        from launch.slurm_shards import shards_main  # a vit-shards job array: no training config

        shards_main(argv)
    args = _parser(cmd).parse_intermixed_args(argv)
    with cli_errors(PROG, DataError, PlotError, OSError):  # OSError: an unwritable --output, say
        code = {"run": cmd_run, "check": cmd_check, "plan": cmd_plan, "slurm": cmd_slurm,
                "sweep": cmd_sweep}[cmd](args)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
