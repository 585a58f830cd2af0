"""The input pipeline in the performance model: how many decoded, cropped images per second one
node's loader makes on the decode path a run uses, to set beside what its GPUs consume.

Rates are measurements, not data-sheet numbers (benchmarks/results/gpu-suite-h100.md: one H100
machine with 16 vCPUs, 8 loader workers, 224 px crops of JPEGs stored with shorter side 256):

- ``cpu`` (``data.decode_device: worker``): each loader worker decodes and crops; 354 img/s per
  worker: 283 measured there with the float32 hand-off, times 1.25, what the uint8 hand-off (workers
  send uint8 batches, the GPU normalises) gained in the same loader on a 16-vCPU H200 machine
  (benchmarks/results/loader-host-cpu-h200.md, 4 workers: 1,931-2,105 -> 2,462-2,604 img/s). A node's
  loader workers (``data.workers`` per rank, or by default one per core the ranks leave free)
  share the cores the ranks leave them, each rank keeping one busy (its own process launching
  kernels): more workers than cores add nothing.
- ``cuda`` (``data.decode_device: cuda``): workers only read tar members and draw crop boxes
  (610 img/s per worker there) and each GPU decodes with nvJPEG (4,883 img/s per GPU measured with
  8 workers feeding it, so a lower bound for the GPU side).
- ``dali`` (``data.decode_device: dali``): the same split as ``cuda``, DALI's decoder on the GPU.
  Its rate has not been measured on a GPU (the GPU suite has a row for it), so it is priced at
  nvJPEG's, and the plan says so.
- ``rank`` (``data.decode_device: cpu``): workers read, and each training process decodes on the
  CPU itself, at one worker's rate: one decoding process per GPU.

Decode work grows with the pixels stored: a rate measured at a stored shorter side of 256 px is
scaled by ``(256 / side)^2`` for other sizes (PIL's draft mode and nvJPEG decode every stored pixel
of a crop's DCT blocks; pre-resized shards are the cheapest lever). A run's own measurement
(``benchmarks/loader_throughput.py`` on the training machine) replaces the defaults through
``vit-launch plan --decode-rate``.
"""
from __future__ import annotations

from dataclasses import dataclass

MEASURED_SIDE = 256  # stored shorter side the rates below were measured at
CPU_DECODE_PER_WORKER = 283.0 * 1.25  # img/s, decode + crop + flip in one loader worker (docstring)
READ_PER_WORKER = 610.0  # img/s, a worker that only reads members and draws boxes (cuda decode)
GPU_DECODE_PER_GPU = 4883.0  # img/s, nvJPEG on one H100 (a lower bound)
DECODE_PATHS = ("cpu", "cuda", "dali", "rank", "synthetic")  # synthetic: data.synthetic, made on the GPU
# data.decode_device -> the path here
CONFIG_PATHS = {"worker": "cpu", "cuda": "cuda", "dali": "dali", "cpu": "rank"}
# cores a training rank keeps busy itself: on a GPU, the Python process launching kernels
RANK_CORES = 1.0


@dataclass(frozen=True)
class InputRate:
    images_per_second: float  # one node
    limit: str  # what sets it, in words
    workers: int  # loader processes on the node
    idle_cores: float = 0.0  # cores neither the ranks nor the workers use (more workers would)


def worker_cores(cpu_cores: float, ranks: int, workers: int, rank_cores: float = RANK_CORES) -> float:
    """Cores a node's ``workers`` loader processes get beside ``ranks`` training processes that want
    ``rank_cores`` each, shared as the kernel's scheduler shares them (max-min fair): every process
    gets what it wants if all fit, else an equal share, and a rank wanting less than that share
    leaves the rest to the workers. A worker wants a whole core (it decodes whenever the loader is
    the bottleneck, the only case that matters)."""
    if ranks * rank_cores + workers <= cpu_cores:
        return float(workers)
    level = (cpu_cores - ranks * rank_cores) / workers  # the workers' share once the ranks have theirs
    if level < rank_cores:  # the ranks get no more than anyone: one equal share each
        level = cpu_cores / (ranks + workers)
    return workers * min(1.0, level)


def node_rate(decode: str, cpu_cores: int, gpus_per_node: int, stored_side: int = MEASURED_SIDE,
              decode_rate: float | None = None, workers: int | None = None,
              rank_cores: float = RANK_CORES) -> InputRate:
    """Images per second one node's loaders make. ``decode_rate``: a measured img/s per worker on
    this path at ``stored_side`` (None: the defaults above, scaled to ``stored_side``). ``workers``:
    loader processes per rank (``data.workers``; None: one per core the ranks leave free).
    ``rank_cores``: cores each rank process keeps busy itself."""
    if decode not in DECODE_PATHS:
        raise ValueError(f"decode={decode!r} (one of {', '.join(DECODE_PATHS)})")
    if decode == "synthetic":  # data.synthetic: batches made on the device, nothing read or decoded
        return InputRate(float("inf"), "synthetic batches on the GPU (data.synthetic)", 0, float(cpu_cores))
    procs = max(1, int(cpu_cores - gpus_per_node * rank_cores)) if workers is None else gpus_per_node * max(1, workers)
    cores = worker_cores(cpu_cores, gpus_per_node, procs, rank_cores)
    idle = max(0.0, cpu_cores - gpus_per_node * rank_cores - cores)
    on = f"{procs} worker{'s' if procs != 1 else ''}" + (f" on {cores:.1f} cores" if cores < procs else "")
    scale = (MEASURED_SIDE / stored_side) ** 2 if decode_rate is None else 1.0
    if decode == "cpu":
        per = decode_rate if decode_rate is not None else CPU_DECODE_PER_WORKER * scale
        return InputRate(cores * per, f"CPU decode: {on} x {per:,.0f} img/s", procs, idle)
    per = decode_rate if decode_rate is not None else READ_PER_WORKER
    read = cores * per
    if decode == "rank":
        decode_each = CPU_DECODE_PER_WORKER * scale
        if read <= gpus_per_node * decode_each:
            return InputRate(read, f"reading members: {on} x {per:,.0f} img/s", procs, idle)
        return InputRate(gpus_per_node * decode_each, f"CPU decode in the training processes: {gpus_per_node} x "
                         f"{decode_each:,.0f} img/s", procs, idle)
    gpu = gpus_per_node * GPU_DECODE_PER_GPU * scale
    if read <= gpu:
        return InputRate(read, f"reading members: {on} x {per:,.0f} img/s", procs, idle)
    what = "DALI GPU decode, priced at nvJPEG's measured rate" if decode == "dali" else "GPU JPEG decode"
    return InputRate(gpu, f"{what}: {gpus_per_node} x {gpu / gpus_per_node:,.0f} img/s", procs, idle)


def advice(decode: str, stored_side: int, idle_cores: float = 0.0, gpus_per_node: int = 1) -> str:
    """What would feed the GPUs faster, in words."""
    fixes = []
    if idle_cores >= gpus_per_node:  # at least one more worker for every rank of the node
        fixes.append(f"more loader workers (data.workers: {int(idle_cores)} cores per node are idle, "
                     f"{int(idle_cores) // gpus_per_node} more per rank)")
    if decode in ("cpu", "rank"):
        fixes.append("GPU decode (data.decode_device: cuda)")
    if stored_side > MEASURED_SIDE:
        fixes.append(f"shards pre-resized to a shorter side of {MEASURED_SIDE} (vit-shards --resize-shorter "
                     f"{MEASURED_SIDE}: {(stored_side / MEASURED_SIDE) ** 2:.1f}x fewer pixels to decode)")
    fixes.append("more CPU cores per GPU")
    return ", or ".join(fixes)
