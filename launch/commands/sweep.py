"""``vit-launch sweep``: the same short job at several world sizes, one after the other, in one W&B
group (``launch/sweep.py`` plans and runs them); then the scaling table and plot
(``launch/plot_scaling.py``). Every size passes the pre-flight checks before the first job starts."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline.errors import path_arg
from launch import plot_scaling, sweep
from launch.commands.options import CPU_MEMORY, PROG, config_arguments, device_memory_gb, preflight
from launch.hostfile import LaunchError
from launch.runner import LaunchSpec, check_spec, export_node_env, master_port_problem
from pretrain.config import load_config

SUMMARY = "run the same short job at several world sizes and plot the scaling curve"
DESCRIPTION = ("Scaling sweep: the same short job at each world size, one after the other, in one W&B group; "
               "prints images/s and efficiency per size and draws the plot.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    config_arguments(ap, memory_default=CPU_MEMORY)
    ap.add_argument("--world-sizes", required=True, help="comma-separated, e.g. 1,2,4,8")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps per run (default 50)")
    ap.add_argument("--scaling", default="weak", choices=["weak", "strong"],
                    help="weak: global batch = micro x world (default); strong: global batch fixed")
    ap.add_argument("--group", help="W&B group (default: scaling-<config>-<time>)")
    ap.add_argument("--output-root", type=path_arg, help="folder of the runs (default: beside train.output_dir)")
    ap.add_argument("--hostfile", type=path_arg, help="for world sizes above one node")
    ap.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the hostfile's slots)")
    ap.add_argument("--master-port", type=int, help="rendezvous port (default 29500)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
    ap.add_argument("--plot", type=path_arg, default=None,
                    help="scaling plot to write (default <root>/scaling.png)")


def check_arguments(args) -> None:
    sweep.parse_world_sizes(args.world_sizes)
    if args.steps <= 0:
        raise LaunchError(f"--steps must be positive, got {args.steps}")
    # as `run` says them: a 0 ranks per node would otherwise be read as "the default"
    check_spec(LaunchSpec(config=args.config, gpus_per_node=args.gpus_per_node, master_port=args.master_port))
    if args.plot is not None:  # before the first job, not after the last
        plot_scaling.check_plot_output(args.plot, flag="--plot")


def command(args) -> int:
    cfg = load_config(args.config, args.overrides)
    p = sweep.plan(cfg, args.config, list(args.overrides), sweep.parse_world_sizes(args.world_sizes),
                   steps=args.steps, scaling=args.scaling, group=args.group, root=args.output_root,
                   hostfile=args.hostfile, gpus_per_node=args.gpus_per_node, master_port=args.master_port)
    print(sweep.describe(p), flush=True)
    if args.dry_run:
        return 0
    ok, memory_gb = True, device_memory_gb(args.gpu_memory_gb, args.hostfile)
    for r in p.runs:  # every size passes pre-flight before the first job starts
        run_cfg = load_config(args.config, r.overrides)
        ok &= preflight(run_cfg, r.world_size, memory_gb, f"pre-flight: world size {r.world_size}")
    if not ok:
        return 2
    env = sweep.cpu_thread_env(p, args.hostfile)
    if env:
        print(f"CPU ranks: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} for every rank of every size", flush=True)
    busy = master_port_problem(LaunchSpec(config=args.config, hostfile=args.hostfile, master_port=args.master_port))
    if busy is not None:  # as `run` says it: the ranks of every size would stall at the rendezvous
        raise LaunchError(busy)
    if args.hostfile:  # every size starts over pdsh: the ranks see only what it forwards and DS_ENV_FILE holds
        line = export_node_env(Path(p.root) / "deepspeed_env")
        if line:
            print(f"{PROG}: {line}", flush=True)
    last = sweep.execute(p, env)
    stats = []
    for r in p.runs:
        if r.exit_code is None:
            r.not_measured = f"not run: the sweep was stopped ({p.stopped})"
        elif r.exit_code != 0:
            r.not_measured = f"{'stopped' if p.stopped else 'failed'} with exit code {r.exit_code}"
        else:
            try:
                stats.append(plot_scaling.load_run(r.output_dir))
            except plot_scaling.PlotError as e:  # it ran, but left nothing to measure
                r.not_measured = str(e)
    missing = [r for r in p.runs if r.not_measured]
    # a stop asked for by a signal ends with the stopped job's code (75: after a checkpoint), as `run`
    code = last if p.stopped and last != 0 else (1 if missing else 0)
    if not stats:  # stopped (said above), or the jobs failed (exit 1): their output says why
        sweep.record(p)
        if not p.stopped:
            print(f"{PROG}: error: no run of the sweep was measured; see the output above", file=sys.stderr)
        return code or 1
    rows = plot_scaling.scaling_table(stats)
    sweep.record(p, rows)
    print("\n" + plot_scaling.format_table(rows))
    for r in missing:
        print(f"world size {r.world_size}: not measured: {r.not_measured}")
    png = plot_scaling.plot(rows, args.plot or f"{p.root}/scaling.png", title=p.group)
    done = [s.run_dir for s in stats]
    print(f"plot: {png}\nrecord: {p.root}/sweep.json\nredraw with: python -m launch.plot_scaling "
          f"{' '.join(done)} --output {png}")
    return code
