"""The ``zero:`` section of an experiment config: its schema and its checks.

``pretrain.distributed.engine`` turns it into DeepSpeed's ``zero_optimization`` (``deepspeed_config(cfg.optim,
cfg.train, cfg.zero, ...)``), so it lives beside the engine; ``pretrain.config`` composes the experiment
schema from the sections and names the file in its errors. Torch-free: the config loads without DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Union

__all__ = ["STAGE3_MAX_LIVE_PARAMETERS", "STAGE3_MAX_REUSE_DISTANCE", "ZeroConfig", "check_zero"]

# ZeRO-3's limits on gathered weights (elements), set by training (``pretrain.distributed.engine``)
# and read by the memory model (``pretrain.perf.memory``): at most this many gathered at once, and
# a used weight kept gathered when its next use comes within this many elements of other weights
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
STAGE3_MAX_REUSE_DISTANCE = 1_000_000_000


@dataclass
class ZeroConfig:
    stage: int = 1
    """DeepSpeed ZeRO stage, 0-3."""
    offload_optimizer: bool = False
    """Keep the optimizer states in host memory (DeepSpeed's `offload_optimizer` to CPU)."""
    offload_params: bool = False
    """ZeRO-3 only: keep each rank's parameter partitions in pinned host memory between uses
    (DeepSpeed's `offload_param` to CPU); the weights are copied to the GPU when gathered, so the
    GPU holds about one gathered unit's weights (a whole block with `zero.leaf_blocks`, else one
    layer) instead of 1/N of the model."""
    overlap_comm: bool = True
    """Overlap the gradient reduction with the backward (DeepSpeed's `overlap_comm`)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (DeepSpeed's
    `contiguous_gradients`)."""
    reduce_bucket_size: Union[int, Literal["auto"]] = "auto"
    """Elements per gradient-reduction bucket (DeepSpeed's `reduce_bucket_size`). A bucket is
    reduced once full, under the rest of the backward; only the last one waits at its end, so a
    bucket as large as the model (DeepSpeed's 5e8 is larger than ViT-L) overlaps nothing. `auto`:
    the smallest bucket whose collective's fixed latency costs at most 5 % of its transfer on the
    job's slowest link, and at most a quarter of the parameters (`pretrain/perf/levers.py`)."""
    allgather_bucket_size: int = 500_000_000
    """Elements per all-gather bucket, stages 1-2 (DeepSpeed's `allgather_bucket_size`)."""
    stage3_prefetch_bucket_size: Union[int, Literal["auto"]] = "auto"
    """Stage 3: elements of weights fetched ahead of use (DeepSpeed's
    `stage3_prefetch_bucket_size`); `auto`: two Transformer blocks' weights, so the next block's
    gather runs under the current block's compute."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: tensors smaller than this many elements stay whole on every rank (DeepSpeed's
    `stage3_param_persistence_threshold`)."""
    leaf_blocks: bool = True
    """Stage 3: each Transformer block is one ZeRO-3 leaf module (DeepSpeed's `leaf_module`), its
    weights gathered and released by one hook pair around the whole block instead of one per
    Linear and LayerNorm; the host's per-module bookkeeping is what a ZeRO-3 step spends beyond
    ZeRO-1's (pretrain/perf/PERFORMANCE.md, "ZeRO-3 on the host"). false: DeepSpeed's hooks on every
    module. `train.compile` makes the blocks leaves either way. Other stages have no module hooks."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ (stage 3 only): a secondary weight partition inside groups of this many GPUs (a
    node), so the backward all-gather stays on NVLink, for `params / hpz` weights per GPU in the
    module's dtype (2 bytes each in bf16; in host memory with `zero.offload_params`)."""
    quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): int8 weight all-gather; needs DeepSpeed's CUDA quantizer, so a CPU
    run refuses it in one line."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): int4 gradient all-to-all; needs DeepSpeed's CUDA quantizer, so a CPU
    run refuses it in one line."""


def check_zero(zero: ZeroConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    if zero.stage not in (0, 1, 2, 3):
        fail("zero.stage", f"must be 0, 1, 2 or 3, got {zero.stage}")
    if zero.allgather_bucket_size < 1:
        fail("zero.allgather_bucket_size", f"must be a positive number of elements, got {zero.allgather_bucket_size}")
    if zero.stage3_param_persistence_threshold < 0:
        fail("zero.stage3_param_persistence_threshold", f"must be >= 0 elements, got "
             f"{zero.stage3_param_persistence_threshold}")
    # DeepSpeed refuses these as the engine starts, after the model is built; ``vit-launch check`` passed them
    if zero.reduce_bucket_size != "auto" and zero.reduce_bucket_size < 1:
        fail("zero.reduce_bucket_size", f"must be a positive number of elements or auto, got {zero.reduce_bucket_size}")
    if zero.stage3_prefetch_bucket_size != "auto" and zero.stage3_prefetch_bucket_size < 0:
        fail("zero.stage3_prefetch_bucket_size",
             f"must be >= 0 elements or auto, got {zero.stage3_prefetch_bucket_size}")
    if zero.offload_optimizer and zero.stage == 0:
        fail("zero.offload_optimizer", "needs zero.stage >= 1 (DeepSpeed offloads a partitioned optimizer)")
    if zero.offload_params and zero.stage != 3:
        fail("zero.offload_params", f"needs zero.stage=3 (parameters are partitioned only there), got "
             f"zero.stage={zero.stage}")
    if zero.hpz_partition_size < 1:
        fail("zero.hpz_partition_size", f"must be >= 1, got {zero.hpz_partition_size}")
    # each key against its own off value: true == 1, so one tuple of both would let `true` pass
    for key, off in (("hpz_partition_size", 1), ("quantized_weights", False), ("quantized_gradients", False)):
        if getattr(zero, key) != off and zero.stage != 3:
            fail(f"zero.{key}", f"is ZeRO++, which DeepSpeed runs only with zero.stage=3 (got stage {zero.stage})")
