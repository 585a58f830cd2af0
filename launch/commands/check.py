"""``vit-launch check``: the pre-flight checks alone (``launch/preflight.py``) for a config and a
number of ranks, without claiming a GPU; with ``--gpu``, also the performance model's prediction
for that layout."""
from __future__ import annotations

import argparse

from launch.commands.options import config_arguments, launch_spec, preflight, resource_arguments
from launch.hostfile import LaunchError
from launch.runner import check_spec, spec_world_size
from pretrain.config import load_config

SUMMARY = "run the pre-flight checks alone: batch, shards, manifest, run dir, memory (no GPU claimed)"
DESCRIPTION = ("Run the pre-flight checks for a config and a number of ranks, without claiming a GPU: batch "
               "arithmetic, shards and manifest (sizes, headers, sample counts), run directory, memory estimate. "
               "Exit 0 when none fails, 2 with one line per failure.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    config_arguments(ap, memory_default="the memory --gpu reports, else 80")
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
    cfg = load_config(args.config, args.overrides)
    if args.world_size is not None:
        world, where = args.world_size, "--world-size"
    else:
        world, nodes = spec_world_size(launch_spec(args))
        where = f"{nodes} node(s)"
    memory_gb = args.gpu_memory_gb
    if memory_gb is None:  # the plan's memory for the GPU type, so check and plan fit the same device
        from pretrain.perf.hardware import GPUS

        memory_gb = GPUS[args.gpu].memory_gb if args.gpu else 80.0
    ok = preflight(cfg, world, memory_gb, f"pre-flight: {args.config}, {world} rank(s) ({where})")
    if args.gpu:
        from pretrain.perf import perfmodel

        per_node = args.gpus_per_node or min(world, 8)
        nodes = max(1, world // per_node)
        pred = perfmodel.predict(perfmodel.layout_from_config(cfg, nodes=nodes, gpus_per_node=world // nodes,
                                                              gpu=args.gpu, memory_gb=memory_gb))
        print(perfmodel.summary_line(pred), flush=True)
    return 0 if ok else 2
