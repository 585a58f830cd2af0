"""``vit-launch check``: the pre-flight checks alone (``launch/preflight.py``) for a config and a
number of ranks, without claiming a GPU; with ``--gpu``, also the performance model's prediction
for that layout."""
from __future__ import annotations

import argparse
import sys

from launch.commands.options import (
    CPU_MEMORY,
    PROG,
    config_arguments,
    device_memory_gb,
    launch_spec,
    preflight,
    resource_arguments,
)
from launch.hostfile import LaunchError, world_size
from launch.runner import check_spec, master_port_problem, plan_ranks
from pretrain.config import ConfigError, check_world_size, load_config

SUMMARY = "run the pre-flight checks alone: batch, shards, manifest, run dir, memory (no GPU claimed)"
DESCRIPTION = ("Run the pre-flight checks for a config and a number of ranks, without claiming a GPU: batch "
               "arithmetic, shards and manifest (sizes, headers, sample counts), run directory, memory estimate, "
               "and that the rendezvous port is free where rank 0 runs on this machine. "
               "Exit 0 when none fails, 2 with one line per failure.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    config_arguments(ap, memory_default="the memory --gpu reports, else " + CPU_MEMORY)
    resource_arguments(ap)
    ap.add_argument("--world-size", type=int, help="check for this many ranks instead of the resource options")
    ap.add_argument("--gpu", help="GPU type: also print the performance model's prediction for this layout "
                                  "(see `vit-launch plan --help` for the types)")


def check_arguments(args) -> None:
    from pretrain.perf.hardware import GPUS

    if args.world_size is not None and args.world_size <= 0:
        raise LaunchError(f"--world-size must be positive, got {args.world_size}")
    if args.gpu and args.gpu not in GPUS:
        raise LaunchError(f"--gpu {args.gpu!r} is not one of {', '.join(GPUS)}")
    check_spec(launch_spec(args))  # the values `run` refuses, whether or not they give the world size


def command(args) -> int:
    from launch.preflight import FAIL, Finding

    cfg = load_config(args.config, args.overrides)
    spec = launch_spec(args)
    if args.world_size is not None:
        world, where, ranks = args.world_size, "--world-size", None
    else:
        _, ranks = plan_ranks(spec)
        world = world_size(ranks)
        where = f"{len(ranks)} node(s)"
    memory_gb = device_memory_gb(args.gpu_memory_gb, args.hostfile, args.gpu)
    more = []
    if args.world_size is None or args.master_port is not None:  # the launch `run` would start: its port too
        busy = master_port_problem(spec)
        if busy:
            more.append(Finding(FAIL, "port", busy))
    ok = preflight(cfg, world, memory_gb, f"pre-flight: {args.config}, {world} rank(s) ({where})", more)
    if args.gpu:
        predict(cfg, args, world, ranks, memory_gb)
    return 0 if ok else 2


def predict(cfg, args, world: int, ranks, memory_gb: float) -> None:
    """The performance model's line for the layout checked: the nodes the resource options start
    (``ranks``: host -> slots), or ``--world-size`` as nodes of ``--gpus-per-node`` (8 unless given,
    as ``vit-launch plan`` takes it). A layout the model cannot price (a batch that does not split,
    nodes of unequal rank counts, a world that is not whole nodes) is a warning, not a guess."""
    from pretrain.perf import perfmodel

    try:
        check_world_size(cfg.train, world)
    except ConfigError:
        return  # the batch check has said it; no step to price
    if ranks is not None:
        counts = {len(s) for s in ranks.values()}
        if len(counts) > 1:
            print(f"{PROG}: warning: prediction: not made for nodes of unequal rank counts "
                  f"({', '.join(f'{h}: {len(s)}' for h, s in ranks.items())})", file=sys.stderr, flush=True)
            return
        nodes, per_node = len(ranks), counts.pop()
    else:
        per_node = args.gpus_per_node or 8
        nodes, rest = divmod(world, per_node) if world > per_node else (1, 0)
        per_node = min(world, per_node)
        if rest:
            print(f"{PROG}: warning: prediction: --world-size {world} is not whole nodes of {per_node} GPUs; "
                  "give --gpus-per-node", file=sys.stderr, flush=True)
            return
    pred = perfmodel.predict(perfmodel.layout_from_config(cfg, nodes=nodes, gpus_per_node=per_node,
                                                          gpu=args.gpu, memory_gb=memory_gb))
    print(perfmodel.summary_line(pred), flush=True)
