"""The speed levers a config may leave to vitscale (``auto``), decided from the performance model.

- ``train.activation_checkpointing: auto``: the fewest checkpointed blocks with which the memory
  model (``pretrain.perf.memory``) fits the job into the device's memory; none where no device
  memory is known (a CPU). Recompute is the one lever that costs compute, so it is spent only
  where memory needs it.
- ``zero.reduce_bucket_size: auto``: gradient buckets small enough that the reduction runs under
  the backward (only the last bucket waits at its end) and large enough that each collective's
  fixed latency is a small share of its transfer (``pretrain.perf.buckets``).
- ``zero.stage3_prefetch_bucket_size: auto``: two Transformer blocks' weights, so that the next
  block's all-gather runs under the current block's compute.

Pure arithmetic on the config and the architecture table (no torch): ``vit-launch plan`` and
``check`` print what training will choose, and training applies the same function at start-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from pretrain.config import checkpoint_count, image_size, selective_checkpointing
from pretrain.models import arch
from pretrain.perf import buckets, memory


@dataclass(frozen=True)
class Choices:
    """What ``resolve`` decided for a job, in words and numbers (start-up lines, plan, check)."""
    checkpoint_blocks: int
    depth: int
    reduce_bucket_size: int
    prefetch_bucket_size: int
    lines: tuple[str, ...] = ()


def with_checkpointing(cfg, value):
    """``cfg`` with ``train.activation_checkpointing`` set to ``value``."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=value))


def recompute_share(model_cfg, blocks: int) -> float:
    """What checkpointing ``blocks`` Transformer blocks adds to a step's compute, as a share of the
    step's model FLOPs: each of them runs its forward again in the backward (a forward is a third of
    a forward and backward), so HFU / MFU - 1. At the model's own resolution."""
    macs = arch.config_macs(model_cfg, image_size(model_cfg), breakdown=True)
    return blocks / arch.model_defaults(model_cfg.name)["depth"] * macs["blocks"] / (3 * macs["total"])


def fewest_checkpointed(cfg, world: int, shape: memory.ModelShape, memory_bytes: float) -> int:
    """The fewest checkpointed blocks (first blocks first) whose estimate fits ``memory_bytes``;
    all of them when even that does not fit (the check then says it does not)."""
    for n in range(shape.depth + 1):
        if memory.estimate(with_checkpointing(cfg, n), world, shape).total <= memory_bytes * memory.MEMORY_HEADROOM:
            return n
    return shape.depth


def resolve_zero(zero, train, params: int, block_params: int, world: int, *, gpus_per_node: int = 8,
                 gpu: Optional[str] = None, network: Optional[str] = None):
    """The ``zero:`` section with its ``auto`` bucket sizes decided for a model of ``params``
    parameters (``block_params`` per Transformer block), and lines saying what was chosen."""
    lines = []
    reduce = zero.reduce_bucket_size
    if reduce == "auto":
        reduce = buckets.auto_bucket(params, buckets.grad_bytes(train), world, gpus_per_node=gpus_per_node, gpu=gpu,
                                     network=network)
        if zero.stage >= 1:
            n = -(-params // reduce)
            lines.append(f"zero.reduce_bucket_size=auto: {reduce / 1e6:g}M elements ({n} bucket{'s' * (n != 1)} "
                         f"over the model's {params / 1e6:.3g}M parameters)")
    prefetch = zero.stage3_prefetch_bucket_size
    if prefetch == "auto":
        prefetch = buckets.auto_prefetch(block_params)
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
    if selective_checkpointing(cfg.train.activation_checkpointing):  # nothing to decide: kept as the word
        return cfg, Choices(0, shape.depth, zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, tuple(lines))
    n = checkpoint_count(cfg.train.activation_checkpointing, shape.depth)
    if n is None:
        n = fewest_checkpointed(cfg, world, shape, memory_bytes) if memory_bytes else 0
        where = f"{memory_bytes / memory.GB:.0f} GB" if memory_bytes else "no device memory limit (CPU)"
        cost = (f": their forward runs again in the backward, +{recompute_share(cfg.model, n):.1%} of the step's "
                f"FLOPs" if n else "")
        lines.append(f"train.activation_checkpointing=auto: {n} of {shape.depth} blocks checkpointed ({where}){cost}")
    return with_checkpointing(cfg, n), Choices(n, shape.depth, zero.reduce_bucket_size,
                                               zero.stage3_prefetch_bucket_size, tuple(lines))
