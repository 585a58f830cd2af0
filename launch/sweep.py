"""Scaling sweeps: the same short job at several world sizes, one W&B group, one folder each.

    vit-launch sweep --config FILE --world-sizes 1,2,4,8 [--steps 50] [--scaling weak|strong]

Weak scaling (default): the micro batch per rank stays as configured and the global batch is
``micro x world size`` (no gradient accumulation), so every rank does the same work at every size
and images/s should grow linearly; the shortfall is communication (gradient reduce-scatter /
all-gather) and stragglers. With a ``train.resolution_schedule`` whose phases set their own micro
batch, ``micro`` is the smallest share every phase's micro batch divides (``phases.batch_unit``), so
each phase accumulates as many micro-steps at every size. Strong scaling keeps
``train.global_batch_size`` and splits it over more ranks (fewer accumulation steps); it must divide
by ``micro x world size`` at every size.

Each run gets ``train.output_dir=<root>/ws<N>``, ``logging.wandb.group=<group>``, tags
``scaling``, ``scaling=<weak|strong>`` and ``world_size=<N>``, ``checkpoint.resume=false`` (a
measurement must not resume an earlier run) and a log window of ``steps // 5`` steps, shorter where
a resolution schedule's phases would leave fewer than WINDOWS_KEPT windows after the cold ones
(a start's and each phase's first), which ``python -m launch.plot_scaling`` drops. World
sizes above one node's GPUs use whole nodes of a hostfile (``--num_nodes N/G --num_gpus G``); with a
hostfile, a size within one node runs on its first host (``runner.deepspeed_command``).
On a machine without GPUs every rank of every size gets the same ``OMP_NUM_THREADS``
(``cpu_thread_env``), so the sizes differ only in the number of ranks.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from data_pipeline.files import write_json
from launch.hostfile import LaunchError, local_gpu_count, parse_hostfile
from launch.runner import LaunchSpec, deepspeed_command, shell_join
from pretrain.config import image_size
from pretrain.config.phases import batch_unit, log_windows, resolution_phases

WINDOWS_KEPT = 4  # logged windows per run left after the cold ones, where the steps allow


@dataclass
class SweepRun:
    world_size: int
    nodes: int
    gpus_per_node: int
    global_batch_size: int
    output_dir: str
    overrides: list[str]  # the config overrides of this run (the user's, then the sweep's)
    command: list[str]
    exit_code: Optional[int] = None  # once it ran
    not_measured: Optional[str] = None  # why it is missing from the table, once the table is made


@dataclass
class SweepPlan:
    group: str
    root: str
    scaling: str
    steps: int
    batch_per_rank: int  # weak scaling's global batch per rank (the micro batch every phase divides)
    log_every_steps: int
    runs: list[SweepRun]
    stopped: Optional[str] = None  # the signal that stopped the sweep (no later size started)


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


def warm_windows(cfg, steps: int, log_every: int) -> int:
    """How many of a run's logging windows are not cold (``phases.log_windows``) with ``steps``
    steps of ``cfg``'s schedule, one window every ``log_every`` steps."""
    train = replace(cfg.train, steps=steps)
    return sum(not cold for _, _, cold in log_windows(resolution_phases(train, image_size(cfg.model)), log_every))


def log_interval(cfg, steps: int) -> int:
    """``steps // 5``, or less where the schedule's phases leave fewer than WINDOWS_KEPT warm windows;
    a LaunchError when even a window per step leaves none."""
    k = max(1, steps // (WINDOWS_KEPT + 1))
    while k > 1 and warm_windows(cfg, steps, k) < WINDOWS_KEPT:
        k -= 1
    if warm_windows(cfg, steps, k) == 0:
        enough = next(s for s in range(steps + 1, 100 * (steps + 10)) if warm_windows(cfg, s, 1) >= WINDOWS_KEPT)
        raise LaunchError(f"--steps {steps} leaves no logged window to measure: the first window of the run"
                          + (" and of each train.resolution_schedule phase" if cfg.train.resolution_schedule else "")
                          + f" is warm-up, dropped by plot_scaling; use --steps {enough} or more")
    return k


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
    if "train.log_every_steps" in user_keys:
        if not warm_windows(cfg, steps, t.log_every_steps):
            raise LaunchError(f"train.log_every_steps={t.log_every_steps} leaves no logged window of --steps {steps} "
                              "after the warm-up ones (a start's and each resolution phase's first, dropped by "
                              "plot_scaling); lower it or leave it to the sweep")
        log_every = t.log_every_steps
    else:
        log_every = log_interval(cfg, steps)
    micro = batch_unit(t)  # train.micro_batch_size, or what every schedule phase's micro batch divides
    what = ("train.micro_batch_size" if micro == t.micro_batch_size
            else "the micro batch every train.resolution_schedule phase divides")
    runs = []
    for n in world_sizes:
        nodes, per_node = _layout(n, hostfile, gpus_per_node)
        if scaling == "weak":
            gbs = micro * n
        else:
            gbs = t.global_batch_size
            if gbs % (micro * n):
                raise LaunchError(f"strong scaling: train.global_batch_size={gbs} is not divisible by "
                                  f"{what} x world size = {micro} x {n}; choose a global batch divisible by "
                                  f"{math.lcm(*(micro * k for k in world_sizes))} (every size of the sweep)")
        out = str(Path(root) / f"ws{n}")
        tags = list(cfg.logging.wandb.tags) + ["scaling", f"scaling={scaling}", f"world_size={n}"]
        extra = [f"train.steps={steps}", f"train.global_batch_size={gbs}", f"train.output_dir={out}",
                 "checkpoint.resume=false", f"checkpoint.every_steps={steps}",
                 f"logging.wandb.group={group}", f"logging.wandb.name={group}-ws{n}",
                 f"logging.wandb.tags={json.dumps(tags)}"]
        if "train.log_every_steps" not in user_keys:
            extra.append(f"train.log_every_steps={log_every}")
        spec = LaunchSpec(config=config, overrides=list(overrides) + extra, hostfile=hostfile,
                          num_nodes=nodes if hostfile else None, gpus_per_node=per_node, master_port=master_port)
        runs.append(SweepRun(n, nodes, per_node, gbs, out, spec.overrides, deepspeed_command(spec)))
    return SweepPlan(group=group, root=root, scaling=scaling, steps=steps, batch_per_rank=micro,
                     log_every_steps=log_every, runs=runs)


def describe(p: SweepPlan) -> str:
    # strong scaling: a rank's images per step are global / world size, so they shrink with the size
    rule = (f"{p.batch_per_rank} images per rank and step, global batch = {p.batch_per_rank} x world size"
            if p.scaling == "weak" else f"global batch {p.runs[0].global_batch_size} at every size, split over "
            f"the ranks in micro batches of {p.batch_per_rank}")
    lines = [f"sweep {p.group}: {p.scaling} scaling ({rule}), "
             f"{p.steps} steps per run logged every {p.log_every_steps}, W&B group {p.group}, runs under {p.root}"]
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


def record(p: SweepPlan, table: Optional[list[dict]] = None) -> Path:
    """``<root>/sweep.json``: the plan, each run's exit code once it ran, and the scaling table once
    made. Written before the first job and again after each, so it always says this sweep's state
    (a sweep run again into the same root replaces it)."""
    doc = asdict(p)
    if table is not None:
        doc["table"] = table
    return write_json(Path(p.root) / "sweep.json", doc, indent=1)


def execute(p: SweepPlan, env: Optional[dict] = None) -> Optional[int]:
    """Run the sweep's jobs one after the other, each under the supervisor of ``vit-launch run``
    (``launch/supervise.py``: a signal asks the job to checkpoint and stop; its exit code says how it
    ended, from ``status.json``). A failed size is reported and recorded (``record``), the rest
    still run; a stop asked for by a signal (Ctrl-C, SIGTERM) ends the sweep: no later size starts.
    Each run's ``exit_code`` is set once it ran; returns the last one (None: none ran)."""
    from launch.supervise import Supervisor
    from pretrain.checkpointing.rundir import RunDir

    Path(p.root).mkdir(parents=True, exist_ok=True)
    record(p)
    code = None
    for r in p.runs:
        print(f"\n==> world size {r.world_size}: {shell_join(r.command)}", flush=True)
        layout = RunDir.of(r.output_dir)
        # each size starts over (checkpoint.resume=false): no line may say a command resumes it
        sup = Supervisor(r.command, layout.status, stop_file=layout.stop_request, env=env, again=None)
        r.exit_code = code = sup.run()
        if sup.signals:
            p.stopped = sup.stop_signal
        record(p)
        if p.stopped:
            print(f"vit-launch: {sup.stop_signal}: the sweep stops at world size {r.world_size}; no later size "
                  "starts (run again, a sweep measures every size from the start)", file=sys.stderr, flush=True)
            break
        if r.exit_code != 0:
            print(f"vit-launch: warning: world size {r.world_size} failed with exit code {r.exit_code} "
                  f"(see above); continuing", file=sys.stderr, flush=True)
    return code
