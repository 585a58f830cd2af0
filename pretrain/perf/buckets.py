"""The sizes ``zero.reduce_bucket_size: auto`` and ``zero.stage3_prefetch_bucket_size: auto`` pick
(``pretrain.perf.levers`` decides the levers).

DeepSpeed reduces a gradient bucket once it is full, under the rest of the backward; only the last
bucket waits for its end. So a bucket should be small, but each collective pays a fixed latency: the
``auto`` bucket is the smallest one whose latency costs at most :data:`LATENCY_SHARE` of its
transfer on the job's slowest link, never more than a quarter of the parameters (at least four
buckets overlap) and never less than :data:`BUCKET_FLOOR`. Numbers only, no torch.
"""
from __future__ import annotations

from typing import Optional

from pretrain.perf.hardware import ring_link

# what a collective's fixed latency may cost against its transfer: 5 % (20x the latency in bytes)
LATENCY_SHARE = 0.05
BUCKET_FLOOR = 1_000_000  # elements: below this the NCCL ring runs far from its bus bandwidth
BUCKET_ROUND = 1_000_000


def bucket_elements(params: int, grad_bytes: int, busbw_bytes_s: float, latency_s: float) -> int:
    """The ``auto`` gradient bucket (module docstring) for ``params`` parameters whose gradients
    travel in ``grad_bytes`` per element over a link of this bus bandwidth and latency."""
    by_latency = latency_s / LATENCY_SHARE * busbw_bytes_s / grad_bytes
    elems = min(by_latency, params / 4)
    return max(BUCKET_FLOOR, int(round(elems / BUCKET_ROUND)) * BUCKET_ROUND)


def auto_bucket(params: int, grad_bytes: int, world: int, *, gpus_per_node: int = 8, gpu: Optional[str] = None,
                network: Optional[str] = None) -> int:
    """:func:`bucket_elements` on the slowest link a ring of ``world`` ranks crosses."""
    return bucket_elements(params, grad_bytes, *ring_link(world, gpus_per_node, gpu, network))


def auto_prefetch(block_params: int) -> int:
    """``zero.stage3_prefetch_bucket_size: auto``: two Transformer blocks' weights, so that the next
    block's all-gather runs under the current block's compute."""
    return 2 * block_params


def grad_bytes(train) -> int:
    """Bytes per gradient element on the wire (``train.reduce_dtype`` under the bf16 modes)."""
    return 2 if (train.precision in ("bf16", "bf16-autocast") and train.reduce_dtype == "bf16") else 4
