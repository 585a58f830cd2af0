"""What several ``vit-launch`` commands share: the config options, the options of where the ranks
run (the deepspeed runner's), the launch spec they make, and the pre-flight report."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from data_pipeline.errors import path_arg
from launch.runner import LaunchSpec

PROG = "vit-launch"
# --gpu-memory-gb's default in words, for the commands that start ranks here (device_memory_gb)
CPU_MEMORY = ("80; on a machine without a GPU and without --hostfile, none: the ranks run on DeepSpeed's CPU "
              "accelerator and the estimate is per rank")


def _device_gb(text: str) -> float:
    """``--gpu-memory-gb``: a memory, more than none (an estimate checked against 0 GB warns of nothing real)."""
    try:
        gb = float(text)
    except ValueError:
        gb = float("nan")
    if not 0 < gb < float("inf"):  # nan too
        raise argparse.ArgumentTypeError(f"must be a number of GB above 0, got {text!r}")
    return gb


def config_arguments(ap: argparse.ArgumentParser, memory_default: str = "80") -> None:
    """``--config``, overrides and ``--gpu-memory-gb`` (GiB, as the estimate; ``memory_default`` says
    in words what a command takes without it: ``check`` takes the memory of its ``--gpu``)."""
    ap.add_argument("--config", required=True, type=path_arg, help="YAML experiment file")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. optim.lr=3e-4")
    ap.add_argument("--gpu-memory-gb", type=_device_gb, default=80.0 if memory_default == "80" else None,
                    help=f"device memory the estimate is checked against, GB of 2^30 bytes (default {memory_default})")


def device_memory_gb(gpu_memory_gb: Optional[float], hostfile: Optional[str], gpu: Optional[str] = None
                     ) -> Optional[float]:
    """The device memory the estimate is checked against: ``--gpu-memory-gb``, else ``--gpu``'s (the
    plan's, so check and plan fit the same device), else 80 GB; None for a job on DeepSpeed's CPU
    accelerator: no device named, no hostfile (the ranks run here) and no GPU on this machine."""
    from launch.hostfile import local_gpu_count
    from pretrain.perf.hardware import GPUS

    if gpu_memory_gb is not None:
        return gpu_memory_gb
    if gpu:
        return GPUS[gpu].memory_gb
    return None if not hostfile and local_gpu_count() == 0 else 80.0


def resource_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("where the ranks run (deepspeed runner options)")
    g.add_argument("--hostfile", type=path_arg, help="DeepSpeed hostfile: one 'HOST slots=N' line per node")
    g.add_argument("--num-nodes", type=int, help="use the first N hosts of the hostfile")
    g.add_argument("--gpus-per-node", type=int,
                   help="ranks per node (default: all slots; without a hostfile this machine's GPUs, or 1)")
    g.add_argument("--include", default="", help="runner --include, e.g. 'worker-0@worker-1:0,2'")
    g.add_argument("--exclude", default="", help="runner --exclude, same format")
    g.add_argument("--master-addr", help="address of rank 0's node (default: the runner's choice)")
    g.add_argument("--master-port", type=int, help="rendezvous port (default 29500)")


def launch_spec(args) -> LaunchSpec:
    """The ``LaunchSpec`` of ``config_arguments`` + ``resource_arguments``."""
    return LaunchSpec(config=args.config, overrides=list(args.overrides), hostfile=args.hostfile,
                      num_nodes=args.num_nodes, gpus_per_node=args.gpus_per_node, master_addr=args.master_addr,
                      master_port=args.master_port, include=args.include, exclude=args.exclude)


def preflight(cfg, world: int, gpu_memory_gb: Optional[float], header: str, more: Sequence = ()) -> bool:
    """Run the pre-flight checks for ``world`` ranks (``gpu_memory_gb`` None: on DeepSpeed's CPU
    accelerator) and add the findings ``more``: ``header``, then findings on stdout, failures one
    line each on stderr. True when none failed."""
    from launch.preflight import report, run_checks

    print(header, flush=True)
    ok = report(run_checks(cfg, world, gpu_memory_gb=gpu_memory_gb) + list(more), PROG, sys.stdout, sys.stderr)
    sys.stdout.flush()
    return ok
