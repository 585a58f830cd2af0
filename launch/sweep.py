"""Scaling sweeps: the same short job at several world sizes, one W&B group, one folder each.

    vit-launch sweep --config FILE --world-sizes 1,2,4,8 [--steps 50] [--scaling weak|strong]

Weak scaling (default): the micro batch per rank stays as configured and the global batch is
``micro x world size`` (no gradient accumulation), so every rank does the same work at every size
and images/s should grow linearly; the shortfall is communication (gradient reduce-scatter /
all-gather) and stragglers. Strong scaling keeps ``train.global_batch_size`` and splits it over
more ranks (fewer accumulation steps); it must divide by ``micro x world size``.

Each run gets ``train.output_dir=<root>/ws<N>``, ``logging.wandb.group=<group>``, tags
``scaling``, ``scaling=<weak|strong>`` and ``world_size=<N>``, ``checkpoint.resume=false`` (a
measurement must not resume an earlier run) and a log window of ``steps // 5`` steps, so that
``python -m launch.plot_scaling`` has windows left after dropping the first (warm-up). World
sizes above one node's GPUs use whole nodes of a hostfile (``--num_nodes N/G --num_gpus G``).
On a machine without GPUs every rank of every size gets the same ``OMP_NUM_THREADS``
(``cpu_thread_env``), so the sizes differ only in the number of ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.files import write_json
from launch.hostfile import LaunchError, local_gpu_count, parse_hostfile
from launch.runner import LaunchSpec, deepspeed_command, shell_join


@dataclass
class SweepRun:
    world_size: int
    nodes: int
    gpus_per_node: int
    global_batch_size: int
    output_dir: str
    overrides: list[str]  # the config overrides of this run (the user's, then the sweep's)
    command: list[str]


@dataclass
class SweepPlan:
    group: str
    root: str
    scaling: str
    steps: int
    runs: list[SweepRun]


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LaunchError(f"--world-sizes {text!r}: expected numbers separated by commas, e.g. 1,2,4,8") from None
    if not sizes or min(sizes) <= 0:
        raise LaunchError(f"--world-sizes {text!r}: expected positive numbers, e.g. 1,2,4,8")
    return sorted(set(sizes))


def _layout(world: int, hostfile: Optional[str], gpus_per_node: Optional[int]) -> tuple[int, int]:
    """(nodes, ranks per node) for one world size."""
    if hostfile:
        hosts = parse_hostfile(hostfile)
        per_node = gpus_per_node or min(h.slots for h in hosts)
        if world <= per_node:
            return 1, world
        if world % per_node:
            raise LaunchError(f"world size {world} is not a whole number of nodes of {per_node} GPUs "
                              f"({hostfile}); use multiples of {per_node} or set --gpus-per-node")
        if world // per_node > len(hosts):
            raise LaunchError(f"world size {world} needs {world // per_node} nodes of {per_node} GPUs; "
                              f"{hostfile} lists {len(hosts)}")
        return world // per_node, per_node
    local = gpus_per_node or local_gpu_count()
    if local and world > local:
        raise LaunchError(f"world size {world} exceeds this machine's {local} GPU(s); "
                          "give --hostfile for multi-node sizes")
    return 1, world  # CPU-only machine: any number of local CPU ranks


def plan(cfg, config: str, overrides: list[str], world_sizes: list[int], *, steps: int = 50,
         scaling: str = "weak", group: Optional[str] = None, root: Optional[str] = None,
         hostfile: Optional[str] = None, gpus_per_node: Optional[int] = None,
         master_port: Optional[int] = None) -> SweepPlan:
    """The runs of a sweep; ``cfg`` is the config loaded with ``overrides`` (batch and W&B keys)."""
    if steps <= 0:
        raise LaunchError(f"--steps must be positive, got {steps}")
    if scaling not in ("weak", "strong"):
        raise LaunchError(f"--scaling {scaling!r}: choose weak or strong")
    t = cfg.train
    group = group or f"scaling-{Path(config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = root or str(Path(t.output_dir).parent / group)
    user_keys = {o.split("=", 1)[0] for o in overrides}
    runs = []
    for n in world_sizes:
        nodes, per_node = _layout(n, hostfile, gpus_per_node)
        if scaling == "weak":
            gbs = t.micro_batch_size * n
        else:
            gbs = t.global_batch_size
            if gbs % (t.micro_batch_size * n):
                raise LaunchError(f"strong scaling: train.global_batch_size={gbs} is not divisible by "
                                  f"train.micro_batch_size x world size = {t.micro_batch_size} x {n}; choose a "
                                  f"global batch divisible by {t.micro_batch_size * max(world_sizes)}")
        out = str(Path(root) / f"ws{n}")
        tags = list(cfg.logging.wandb.tags) + ["scaling", f"scaling={scaling}", f"world_size={n}"]
        extra = [f"train.steps={steps}", f"train.global_batch_size={gbs}", f"train.output_dir={out}",
                 "checkpoint.resume=false", f"checkpoint.every_steps={steps}",
                 f"logging.wandb.group={group}", f"logging.wandb.name={group}-ws{n}",
                 f"logging.wandb.tags={json.dumps(tags)}"]
        if "train.log_every_steps" not in user_keys:
            extra.append(f"train.log_every_steps={max(1, steps // 5)}")
        spec = LaunchSpec(config=config, overrides=list(overrides) + extra, hostfile=hostfile,
                          num_nodes=nodes if hostfile else None, gpus_per_node=per_node, master_port=master_port)
        runs.append(SweepRun(n, nodes, per_node, gbs, out, spec.overrides, deepspeed_command(spec)))
    return SweepPlan(group=group, root=root, scaling=scaling, steps=steps, runs=runs)


def describe(p: SweepPlan, micro: int) -> str:
    rule = (f"global batch = {micro} x world size" if p.scaling == "weak"
            else f"global batch {p.runs[0].global_batch_size} at every size")
    lines = [f"sweep {p.group}: {p.scaling} scaling (micro batch {micro} per rank, {rule}), {p.steps} steps "
             f"per run, W&B group {p.group}, runs under {p.root}"]
    for r in p.runs:
        lines.append(f"  world size {r.world_size} ({r.nodes} node(s) x {r.gpus_per_node}), global batch "
                     f"{r.global_batch_size} -> {r.output_dir}")
        lines.append(f"    $ {shell_join(r.command)}")
    return "\n".join(lines)


def cpu_thread_env(p: SweepPlan, hostfile: Optional[str]) -> Optional[dict]:
    """On a machine without GPUs, ranks share the CPU cores: give every rank of every size the
    same thread count (cores / largest world size), or weak scaling compares 1 rank with all
    cores against N ranks with 1/N each; a rank whose threads compete with its data worker for
    the cores slows down several-fold (benchmarks/results/sweep-threads-cpu.md). A value the user
    set for OMP_NUM_THREADS is kept; GPU jobs are left alone."""
    if hostfile or local_gpu_count() or "OMP_NUM_THREADS" in os.environ:
        return None
    threads = max(1, (os.cpu_count() or 1) // max(r.world_size for r in p.runs))
    return dict(os.environ, OMP_NUM_THREADS=str(threads))


def execute(p: SweepPlan, env: Optional[dict] = None) -> list[tuple[SweepRun, int]]:
    """Run the sweep's jobs one after the other; a failed size is reported, the rest still run."""
    Path(p.root).mkdir(parents=True, exist_ok=True)
    write_json(Path(p.root) / "sweep.json", asdict(p), indent=1)
    results = []
    for r in p.runs:
        print(f"\n==> world size {r.world_size}: {shell_join(r.command)}", flush=True)
        code = subprocess.run(r.command, env=env).returncode
        results.append((r, code))
        if code != 0:
            print(f"vit-launch: warning: world size {r.world_size} failed with exit code {code} "
                  f"(see above); continuing", file=sys.stderr, flush=True)
    return results
