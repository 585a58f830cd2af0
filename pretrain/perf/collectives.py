"""The collectives of a training step, as DeepSpeed 0.19 issues them (``runtime/zero/stage_1_and_2.py``
and ``stage3.py``).

``G`` = gradient bytes per element in ``train.reduce_dtype`` (fp32: 4), ``W`` = weight bytes
in the module's dtype (bf16 and fp16: 2; fp32 and bf16-autocast: 4, but 2 for ZeRO-3's gathers
of bf16-autocast with ``train.reduce_dtype=bf16``, which sends the matmul weights in bf16),
``P`` = parameters:
- stage 0: one all-reduce of ``P x G`` at the accumulation boundary, after the backward;
- stage 1: the same all-reduce, issued in ``zero.reduce_bucket_size`` buckets during the last
  micro-step's backward (``reduce_ready_partitions_and_remove_grads`` runs only at the
  boundary), then an all-gather of the updated ``P x W`` weights after the step;
- stage 2: the bucketed all-reduce in every micro-step's backward (gradients are partitioned
  as they are produced), the same all-gather after the step. Both use all-reduce, not
  reduce-scatter: ``use_multi_rank_bucket_allreduce`` defaults to true;
- stage 3: each micro-step all-gathers the partitioned weights for the forward (tensors of at
  most ``stage3_param_persistence_threshold`` elements stay whole on every rank; the trace's
  prefetch coalesces up to ``stage3_prefetch_bucket_size`` elements per call), gathers again in
  the backward only what was released after the forward (``memory.zero3_released``: nothing for
  models under ~1e9 elements with DeepSpeed's defaults), reduce-scatters every gradient in
  ``reduce_bucket_size`` buckets; after the step one all-gather refreshes the persistent
  tensors on every rank.
bf16 with ZeRO-1 and fp32 accumulation is DeepSpeed's ``BF16_Optimizer``: one all-reduce of
the whole fp32 gradient buffer at the boundary, whatever the bucket size.
Time per collective (nccl-tests' bus bandwidth): all-reduce ``S 2(n-1)/n / busbw``,
all-gather and reduce-scatter ``S (n-1)/n / busbw`` (``S`` the whole tensor), plus a fixed
latency. ``busbw`` is the slowest link the ring crosses: NVLink/PCIe inside a node, the
node's NICs between nodes (NCCL runs one ring per NIC, so a node's rate is the sum of its
NICs), each at :data:`LINK_EFFICIENCY` of its line rate. Overlap: the reduction stream runs
gradient buckets under the backward of the micro-step that issues them, all but the last
bucket; ZeRO-3 prefetches the next layers' weights under the current layer's compute, all but
the first layer's; the ZeRO-1/2 post-step all-gather and stage 0's all-reduce are exposed.

``layout`` is a ``pretrain.perf.perfmodel.Layout``; pure arithmetic, no torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.perf import memory
from pretrain.perf.hardware import LATENCY_S, LINK_EFFICIENCY, NETWORKS, gpu_of

GB = 1e9


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    bytes: float  # the whole tensor S (nccl-tests' "size"), per call
    calls: int  # per optimizer step
    ranks: int
    crosses_nodes: bool
    overlappable_with: str = ""  # "backward" / "forward+backward" / "" (exposed)
    what: str = ""

    def bus_factor(self) -> float:
        n = self.ranks
        return 2 * (n - 1) / n if self.kind == "all_reduce" else (n - 1) / n

    def wire_bytes(self) -> float:
        """Bytes each rank sends for all calls (nccl-tests' bus volume)."""
        return self.bytes * self.calls * self.bus_factor()


def busbw(layout, crosses_nodes: bool) -> float:
    """Bus bandwidth (bytes/s) of the slowest link a ring over these ranks crosses."""
    net = NETWORKS[layout.network]
    g = gpu_of(layout)
    intra = layout.intra_node_gbps or net.intra_gbps or g.link_gbps
    intra = min(intra, g.link_gbps) if layout.intra_node_gbps is None else intra
    bw = intra / 8 * GB * LINK_EFFICIENCY["intra"]
    if crosses_nodes:
        inter = (layout.inter_node_gbps or net.inter_gbps) / 8 * GB * LINK_EFFICIENCY["inter"]
        bw = min(bw, inter)
    return bw


def collective_seconds(layout, c: Collective) -> float:
    if c.ranks <= 1 or c.calls == 0:
        return 0.0
    lat = LATENCY_S["inter" if c.crosses_nodes else "intra"]
    return c.calls * (c.bytes * c.bus_factor() / busbw(layout, c.crosses_nodes) + lat)


def partitioned(layout) -> list[int]:
    """Element counts of the tensors ZeRO-3 partitions (and gathers one module at a time):
    ``memory.zero3_partitioned`` of the layout's model."""
    return memory.zero3_partitioned(layout.shape().tensors, layout.persistence_threshold)


# modules of pretrain.models.layers' Block (itself, norms, attention and MLP with their linears, dropouts,
# identities, drop paths) and of the rest of a patch-embedding ViT (the model, patch embedding with
# its conv, position dropout, the blocks' Sequential, final norm, pre-logits and pooling identities,
# head; patch dropout when on), and of the MAP head (the pool, its query, key + value
# and output linears, norm, MLP with its linears, GELU and dropouts); tests/integration/test_perfmodel.py
# counts them on the built models
BLOCK_MODULES, OTHER_MODULES, MAP_MODULES = 19, 9, 11


def zero3_hooked(layout) -> int:
    """Modules DeepSpeed hooks under ZeRO-3: every module, or with ``leaf_blocks`` each block as one
    module and nothing inside it. A hybrid's ResNet stem is counted as one module (its layers are not)."""
    depth = memory.analytic_shape(layout.model, img_size=layout.img_size, num_classes=layout.num_classes).depth
    patch_drop = 1 if layout.patch_drop_rate else 0  # PatchDropout: a module only when on
    pool = MAP_MODULES if layout.global_pool == "map" else 0
    return OTHER_MODULES + patch_drop + pool + depth * (1 if layout.leaf_blocks else BLOCK_MODULES)


def backward_gathers(layout) -> tuple[int, int]:
    """ZeRO-3's weights in elements: (gathered again in each micro-step's backward, gathered in its
    forward): ``memory.zero3_released`` of the :func:`partitioned` tensors, and their sum."""
    tensors = partitioned(layout)
    return memory.zero3_released(tensors, layout.max_reuse_distance), sum(tensors)


def collectives(layout, params: int) -> list[Collective]:
    """Every collective DeepSpeed issues per optimizer step (module docstring)."""
    n, k = layout.world, layout.accumulation
    multi = layout.nodes > 1
    w = memory.weight_bytes(layout.precision)  # all-gathers move the module's dtype
    g = 2 if (layout.precision in ("bf16", "bf16-autocast") and layout.reduce_dtype == "bf16") else 4
    # bf16-autocast with reduce_dtype bf16: DeepSpeed sends the Linear / Conv weights (nearly all) in bf16
    w3 = 2 if (layout.precision == "bf16-autocast" and layout.reduce_dtype == "bf16") else w
    out: list[Collective] = []

    def buckets(total_elems: int, bucket: int) -> tuple[int, float]:
        calls = max(1, math.ceil(total_elems / bucket))
        return calls, total_elems / calls

    if layout.zero in (0, 1, 2):
        calls, per = buckets(params, layout.reduce_bucket_size)
        times = k if layout.zero == 2 else 1
        over = "backward" if layout.zero == 2 or (layout.zero == 1 and layout.overlap_comm) else ""
        if layout.zero == 1 and layout.precision == "bf16":  # BF16_Optimizer: one exposed all-reduce
            calls, per, over = 1, params, ""
        out.append(Collective("all_reduce", per * g, calls * times, n, multi, over, "gradients"))
    if layout.zero in (1, 2):
        calls, per = buckets(params, layout.allgather_bucket_size)
        out.append(Collective("all_gather", per * w, calls, n, multi, "", "updated weights after the step"))
    if layout.zero == 3:
        released, part = backward_gathers(layout)
        fwd_w = 1 if layout.quantized_weights else w3  # qwZ: int8 blocks
        calls = k * max(1, math.ceil(part / layout.prefetch_bucket_size))
        out.append(Collective("all_gather", part * fwd_w * k / calls, calls, n, multi, "forward", "weights, forward"))
        if released:
            hpz = layout.hpz_partition_size if layout.hpz_partition_size > 1 else n
            calls = k * max(1, math.ceil(released / layout.prefetch_bucket_size))
            out.append(Collective("all_gather", released * w3 * k / calls, calls, min(hpz, n),
                                  multi and hpz > layout.gpus_per_node, "backward",
                                  "weights released after the forward, backward"
                                  + (" (hpZ secondary)" if hpz < n else "")))
        calls, per = buckets(params, layout.reduce_bucket_size)
        if layout.quantized_gradients:
            out.append(Collective("all_to_all", per * 0.5, k * calls, n, multi, "backward", "gradients, int4 (qgZ)"))
        else:
            out.append(Collective("reduce_scatter", per * g, k * calls, n, multi, "backward", "gradients"))
        if params > part:
            out.append(Collective("all_gather", (params - part) * w, 1, n, multi, "",
                                  "persistent weights after the step"))
    return out
