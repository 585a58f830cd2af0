"""The input pipeline in the performance model: how many decoded, cropped images per second one
node's loader makes on the decode path a run uses, to set beside what its GPUs consume.

Rates are measurements, not data-sheet numbers (benchmarks/RESULTS.md, GPU suite, one H100 machine
with 16 vCPUs, 8 loader workers, 224 px crops of JPEGs stored with shorter side 256):

- ``cpu`` (``data.decode_device: worker``): each loader worker decodes with PIL and crops;
  283 img/s per worker there. A node gives the loader its cores less one per GPU (each rank's own
  process), one worker per core.
- ``cuda`` (``data.decode_device: cuda``): workers only read tar members and draw crop boxes
  (610 img/s per worker there) and each GPU decodes with nvJPEG (4,883 img/s per GPU measured with
  8 workers feeding it, so a lower bound for the GPU side).

Decode work grows with the pixels stored: a rate measured at a stored shorter side of 256 px is
scaled by ``(256 / side)^2`` for other sizes (PIL's draft mode and nvJPEG decode every stored pixel
of a crop's DCT blocks; pre-resized shards are the cheapest lever). A run's own measurement
(``benchmarks/loader_throughput.py`` on the training machine) replaces the defaults through
``vit-launch plan --decode-rate``.
"""
from __future__ import annotations

from dataclasses import dataclass

MEASURED_SIDE = 256  # stored shorter side the rates below were measured at
CPU_DECODE_PER_WORKER = 283.0  # img/s, PIL decode + crop + flip in one loader worker
READ_PER_WORKER = 610.0  # img/s, a worker that only reads members and draws boxes (cuda decode)
GPU_DECODE_PER_GPU = 4883.0  # img/s, nvJPEG on one H100 (a lower bound)
DECODE_PATHS = ("cpu", "cuda")


@dataclass(frozen=True)
class InputRate:
    images_per_second: float  # one node
    limit: str  # what sets it, in words
    workers: int  # loader processes on the node


def node_rate(decode: str, cpu_cores: int, gpus_per_node: int, stored_side: int = MEASURED_SIDE,
              decode_rate: float | None = None) -> InputRate:
    """Images per second one node's loaders make. ``decode_rate``: a measured img/s per worker on
    this path at ``stored_side`` (None: the defaults above, scaled to ``stored_side``)."""
    if decode not in DECODE_PATHS:
        raise ValueError(f"decode={decode!r} (one of {', '.join(DECODE_PATHS)})")
    workers = max(1, cpu_cores - gpus_per_node)
    scale = (MEASURED_SIDE / stored_side) ** 2 if decode_rate is None else 1.0
    if decode == "cpu":
        per = decode_rate if decode_rate is not None else CPU_DECODE_PER_WORKER * scale
        return InputRate(workers * per, f"CPU decode: {workers} workers x {per:,.0f} img/s", workers)
    read = workers * (decode_rate if decode_rate is not None else READ_PER_WORKER)
    gpu = gpus_per_node * GPU_DECODE_PER_GPU * scale
    if read <= gpu:
        return InputRate(read, f"reading members: {workers} workers x {read / workers:,.0f} img/s", workers)
    return InputRate(gpu, f"GPU JPEG decode: {gpus_per_node} x {gpu / gpus_per_node:,.0f} img/s", workers)


def advice(decode: str, stored_side: int) -> str:
    """What would feed the GPUs faster, in words."""
    fixes = []
    if decode == "cpu":
        fixes.append("GPU decode (data.decode_device: cuda)")
    if stored_side > MEASURED_SIDE:
        fixes.append(f"shards pre-resized to a shorter side of {MEASURED_SIDE} (vit-shards --resize-shorter "
                     f"{MEASURED_SIDE}: {(stored_side / MEASURED_SIDE) ** 2:.1f}x fewer pixels to decode)")
    fixes.append("more CPU cores per GPU")
    return ", or ".join(fixes)
