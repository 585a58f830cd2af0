"""The speed levers a config may leave to vitscale (``auto``), decided from the performance model.

- ``train.activation_checkpointing: auto``: the fewest checkpointed blocks with which the memory
  model (``pretrain.perf.memory``) fits the job into the device's memory; none where no device
  memory is known (a CPU). Recompute is the one lever that costs compute, so it is spent only
  where memory needs it.
- ``zero.reduce_bucket_size: auto``: gradient buckets small enough that the reduction runs under
  the backward (only the last bucket waits at its end) and large enough that each collective's
  fixed latency costs at most :data:`LATENCY_SHARE` of its transfer on the job's slowest link;
  never more than a quarter of the parameters, so at least four buckets overlap.
- ``zero.stage3_prefetch_bucket_size: auto``: two Transformer blocks' weights, so that the next
  block's all-gather runs under the current block's compute.

Pure arithmetic on the config and the architecture table (no torch): ``vit-launch plan`` and
``check`` print what training will choose, and training applies the same function at start-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from pretrain.config import checkpoint_count
from pretrain.perf import memory
from pretrain.perf.collectives import LATENCY_S, LINK_EFFICIENCY
from pretrain.perf.hardware import GPUS, NETWORKS, default_network

# what a collective's fixed latency may cost against its transfer: 5 % (20x the latency in bytes)
LATENCY_SHARE = 0.05
BUCKET_FLOOR = 1_000_000  # elements: below this the NCCL ring runs far from its bus bandwidth
BUCKET_ROUND = 1_000_000
# the memory model's estimate against the device: what is left for the allocator's fragmentation
MEMORY_HEADROOM = 0.95


@dataclass(frozen=True)
class Choices:
    """What ``resolve`` decided for a job, in words and numbers (start-up lines, plan, check)."""
    checkpoint_blocks: int
    depth: int
    reduce_bucket_size: int
    prefetch_bucket_size: int
    lines: tuple[str, ...] = ()


def bucket_elements(params: int, grad_bytes: int, busbw_bytes_s: float, latency_s: float) -> int:
    """The ``auto`` gradient bucket (module docstring): ``latency / LATENCY_SHARE`` seconds of
    transfer on the link, at most a quarter of ``params``, at least :data:`BUCKET_FLOOR`."""
    by_latency = latency_s / LATENCY_SHARE * busbw_bytes_s / grad_bytes
    elems = min(by_latency, params / 4)
    return max(BUCKET_FLOOR, int(round(elems / BUCKET_ROUND)) * BUCKET_ROUND)


def link(world: int, gpus_per_node: int, gpu: Optional[str], network: Optional[str] = None) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in s) of the slowest link a ring of ``world`` ranks
    crosses, from ``network`` or the GPU type's usual network preset (an H100 DGX where the GPU is
    unknown)."""
    key = gpu if gpu in GPUS else "h100-sxm"
    net = NETWORKS[network or default_network(key)]
    crosses = world > max(1, gpus_per_node)
    if crosses:
        return net.inter_gbps / 8 * 1e9 * LINK_EFFICIENCY["inter"], LATENCY_S["inter"]
    intra = min(net.intra_gbps or GPUS[key].link_gbps, GPUS[key].link_gbps)
    return intra / 8 * 1e9 * LINK_EFFICIENCY["intra"], LATENCY_S["intra"]


def fewest_checkpointed(cfg, world: int, shape: memory.ModelShape, memory_bytes: float) -> int:
    """The fewest checkpointed blocks (first blocks first) whose estimate fits ``memory_bytes``;
    all of them when even that does not fit (the check then says it does not)."""
    for n in range(shape.depth + 1):
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=n))
        if memory.estimate(trial, world, shape).total <= memory_bytes * MEMORY_HEADROOM:
            return n
    return shape.depth


def resolve_zero(zero, train, params: int, block_params: int, world: int, *, gpus_per_node: int = 8,
                 gpu: Optional[str] = None, network: Optional[str] = None):
    """The ``zero:`` section with its ``auto`` bucket sizes decided for a model of ``params``
    parameters (``block_params`` per Transformer block), and lines saying what was chosen."""
    e = 2 if (train.precision in ("bf16", "bf16-autocast") and train.reduce_dtype == "bf16") else 4
    bw, lat = link(world, gpus_per_node, gpu, network)
    lines = []
    reduce = zero.reduce_bucket_size
    if reduce == "auto":
        reduce = bucket_elements(params, e, bw, lat)
        if zero.stage >= 1:
            lines.append(f"zero.reduce_bucket_size=auto: {reduce / 1e6:g}M elements "
                         f"({-(-params // reduce)} buckets of {params / 1e6:.0f}M parameters)")
    prefetch = zero.stage3_prefetch_bucket_size
    if prefetch == "auto":
        prefetch = 2 * block_params
        if zero.stage == 3:
            lines.append(f"zero.stage3_prefetch_bucket_size=auto: {prefetch / 1e6:g}M elements (two blocks)")
    return dataclasses.replace(zero, reduce_bucket_size=reduce, stage3_prefetch_bucket_size=prefetch), lines


def resolve(cfg, world: int, *, gpus_per_node: int = 8, gpu: Optional[str] = None,
            memory_bytes: Optional[float] = None, network: Optional[str] = None):
    """``cfg`` with every ``auto`` lever decided (and ``true``/``false`` checkpointing as a block
    count), and the :class:`Choices` made. ``memory_bytes``: the device's memory (None: unknown, as
    on a CPU: ``auto`` checkpoints nothing). Idempotent: a resolved config comes back unchanged."""
    shape = memory.model_shape(cfg.model)
    zero, lines = resolve_zero(cfg.zero, cfg.train, shape.params, shape.block_params, world,
                               gpus_per_node=gpus_per_node, gpu=gpu, network=network)
    cfg = dataclasses.replace(cfg, zero=zero)
    n = checkpoint_count(cfg.train.activation_checkpointing, shape.depth)
    if n is None:
        n = fewest_checkpointed(cfg, world, shape, memory_bytes) if memory_bytes else 0
        where = f"{memory_bytes / 2 ** 30:.0f} GiB" if memory_bytes else "no device memory limit (CPU)"
        lines.append(f"train.activation_checkpointing=auto: {n} of {shape.depth} blocks checkpointed ({where})")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=n))
    return cfg, Choices(n, shape.depth, zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, tuple(lines))
