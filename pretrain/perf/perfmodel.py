"""Step-time model of a ViT training job on any cluster: compute, DeepSpeed's collectives, memory.

Pure functions over numbers (``pretrain.models.arch`` gives the architecture; no torch import), so
``vit-launch plan`` prices a layout in milliseconds before any GPU is claimed.

Per optimizer step, per GPU (``k`` accumulation micro-steps of ``b`` images):

compute
    ``pretrain.perf.compute``: every GEMM of the micro-step at the rate its shape reaches (one
    calibrated efficiency per GPU type), the fused attention kernels, the element-wise kernels at HBM
    bandwidth, the host issuing every kernel, ZeRO-3's hooks and work, and the optimizer step (its
    fp32 states read and written once per step).

communication
    ``pretrain.perf.collectives``: every collective DeepSpeed 0.19 issues per optimizer step for
    the layout's ZeRO stage, its bytes, its time on the slowest link its ring crosses, and what it
    may overlap with (the backward, the forward's prefetch) or not.

memory
    ``pretrain.perf.memory``: model states by stage (DeepSpeed's estimators' 2 + 18 bytes/param for bf16
    + AdamW, not the paper's 16), fixed communication buffers, activations (Korthikanti et al.
    with SDPA's fused attention), 1 GB of runtime, and at ZeRO-3 the weights kept gathered for the
    backward and hpZ's secondary partition: the one estimate ``vit-launch check`` and ``auto``
    checkpointing fit, read as it is.

input
    ``pretrain.perf.inputs``: the images per second a node's loaders decode on the run's path
    (CPU workers, or workers reading + the GPU's JPEG decoder), from measured rates; a layout whose
    GPUs would consume more is input-bound and runs at the loaders' rate.

fewer tokens
    ``model.patch_drop_rate``: the blocks (their GEMMs, attention and element-wise work) run on the
    kept tokens, the patch embedding on every patch. ``train.resolution_schedule``:
    :func:`price_tokens` predicts each phase at its resolution and micro batch and sums its steps,
    against every step at the model's resolution with every token (what ``vit-launch plan`` shows).

ZeRO++ (Wang et al. 2023): ``quantized_weights`` (qwZ) sends the forward all-gather in int8 (half
of bf16); ``hpz_partition_size`` (hpZ) keeps a secondary copy of the weights partitioned inside
groups of that many GPUs (``P / hpz`` weights in the module's dtype) so the backward all-gather
stays inside a node;
``quantized_gradients`` (qgZ) replaces the gradient reduce-scatter with an int4 all-to-all
(a quarter of the bf16 bytes, over the same ring volume).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Union

from pretrain.config import compile_mode
from pretrain.distributed.config import STAGE3_MAX_REUSE_DISTANCE
from pretrain.models import arch
from pretrain.perf import inputs, kernels, memory
from pretrain.perf.collectives import collective_seconds, collectives
from pretrain.perf.compute import compute_seconds, optimizer_seconds
from pretrain.perf.hardware import GPUS, NETWORKS, default_network, gpu_key, gpu_of


@dataclass(frozen=True)
class Layout:
    """Everything the model needs about a job. A config's layout is ``layout_from_config`` (its
    ``auto`` levers decided as training decides them); the defaults here are a plain job's: ZeRO-1,
    micro batch 32, no checkpointing, eager, DeepSpeed's own buckets (5e8 reduce, 5e7 prefetch;
    ``vit-launch plan --model`` sets the ``auto`` ones)."""
    model: str
    gpu: str
    nodes: int = 1
    gpus_per_node: int = 8
    micro_batch: int = 32
    global_batch: Optional[int] = None  # None: micro_batch x world (no accumulation)
    img_size: Optional[int] = None
    num_classes: int = 1000
    # the model's options beyond its name (pretrain.models.arch.config_options: the model section's
    # reg_tokens, class_token, global_pool, qk_norm, init_values as LayerScale on or off,
    # representation_size, pos_embed)
    reg_tokens: int = 0
    class_token: bool = True
    global_pool: str = "token"
    qk_norm: bool = False
    layer_scale: bool = False
    representation_size: Optional[int] = None
    pos_embed: str = "learned"
    zero: int = 1
    precision: str = "bf16"
    reduce_dtype: str = "fp32"
    # True: every block recomputed; an int: that many (the first ones); "selective": op by op
    checkpointing: Union[bool, int, str] = False
    compile: Union[bool, str] = False  # "blocks" (True), "model" or off (train.compile)
    patch_drop_rate: float = 0.0  # model.patch_drop_rate: the blocks run on the kept tokens
    drop_rate: float = 0.0  # model.drop_rate: dropout's element-wise work (and, eager, kernels)
    drop_path_rate: float = 0.0  # model.drop_path_rate: stochastic depth's, eager
    fused_attention: bool = True  # F.scaled_dot_product_attention (flash / memory-efficient)
    optimizer: str = "adamw"
    ema: bool = False  # train.ema_decay > 0: the weights' average updated after each step
    overlap_comm: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    persistence_threshold: int = 100_000
    leaf_blocks: bool = True  # zero.leaf_blocks: each block one ZeRO-3 leaf module
    max_reuse_distance: int = STAGE3_MAX_REUSE_DISTANCE  # as training sets it
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    network: str = "dgx-h100"
    intra_node_gbps: Optional[float] = None  # overrides the preset
    inter_node_gbps: Optional[float] = None
    efficiency: Optional[float] = None  # overrides the GPU table (calibration, measured CPUs)
    peak_tflops: Optional[float] = None
    hbm_gbs: Optional[float] = None
    memory_gb: Optional[float] = None
    # the input pipeline (pretrain.perf.inputs): decode path, img/s per loader worker (None: the
    # measured defaults), CPU cores per node (None: the network preset's), stored shorter side
    decode: str = "cpu"
    decode_rate: Optional[float] = None
    cpu_cores: Optional[int] = None
    stored_side: int = 256
    loader_workers: Optional[int] = None  # data.workers per rank (None: one per core the ranks leave free)

    def __post_init__(self):
        bad = [f"{k}={getattr(self, k)} (must be >= 1)" for k in ("nodes", "gpus_per_node", "micro_batch")
               if getattr(self, k) < 1]
        bad += [f"{k}={getattr(self, k)} (must be {'finite' if getattr(self, k) == math.inf else '> 0'})"
                for k in ("intra_node_gbps", "inter_node_gbps", "efficiency", "peak_tflops", "hbm_gbs", "memory_gb")
                if getattr(self, k) is not None and not 0 < getattr(self, k) < math.inf]
        bad += [f"{k}={getattr(self, k)} (must be >= 1)" for k in ("cpu_cores", "stored_side")
                if getattr(self, k) is not None and getattr(self, k) < 1]
        if self.loader_workers is not None and self.loader_workers < 0:
            bad.append(f"loader_workers={self.loader_workers} (must be >= 0)")
        if self.decode_rate is not None and not 0 < self.decode_rate < math.inf:
            need = "finite" if self.decode_rate == math.inf else "> 0"
            bad.append(f"decode_rate={self.decode_rate} (must be {need})")
        if self.global_batch is not None and self.global_batch < 1:
            bad.append(f"global_batch={self.global_batch} (must be >= 1)")
        if self.hpz_partition_size < 1:
            bad.append(f"hpz_partition_size={self.hpz_partition_size} (must be >= 1)")
        elif self.hpz_partition_size > 1 and self.gpus_per_node % self.hpz_partition_size:
            bad.append(f"hpz_partition_size={self.hpz_partition_size} (must divide gpus_per_node={self.gpus_per_node}:"
                       " hpZ keeps its secondary partition inside a node)")
        if self.zero != 3 and (self.hpz_partition_size > 1 or self.quantized_weights or self.quantized_gradients):
            bad.append(f"ZeRO++ (hpZ / qwZ / qgZ) with zero={self.zero} (DeepSpeed runs it only with ZeRO-3)")
        if bad:
            raise ValueError("; ".join(bad))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def arch(self) -> dict:
        """The architecture options ``pretrain.models.arch`` and ``memory.analytic_shape`` take
        (``arch.config_options`` of a config's model section)."""
        return dict(global_pool=self.global_pool, representation_size=self.representation_size,
                    qk_norm=self.qk_norm, layer_scale=self.layer_scale, reg_tokens=self.reg_tokens,
                    class_token=self.class_token, pos_embed=self.pos_embed)

    def shape(self, img_size: Optional[int] = None) -> memory.ModelShape:
        """The analytic shape of the model this layout trains, at ``img_size`` px (None: the layout's)."""
        return memory.analytic_shape(self.model, img_size=img_size or self.img_size, num_classes=self.num_classes,
                                     **self.arch)

    @property
    def accumulation(self) -> int:
        gb = self.global_batch or self.micro_batch * self.world
        k, rest = divmod(gb, self.micro_batch * self.world)
        if rest or k < 1:
            raise ValueError(f"global batch {gb} is not a multiple of micro batch {self.micro_batch} "
                             f"x world {self.world}")
        return k


# ------------------------------------------------------------------------------------- result
@dataclass
class Prediction:
    layout: dict
    params: int
    images_per_second: float
    images_per_second_per_gpu: float
    mfu: float
    hfu: float
    step_seconds: float
    compute_seconds: float
    elementwise_seconds: float
    launch_seconds: float  # per step, the GPU waiting for the host to issue kernels
    zero3_hook_seconds: float  # per step, ZeRO-3's module hooks on the host
    zero3_work_seconds: float  # per step, ZeRO-3's measured work beyond its hooks
    optimizer_seconds: float
    comm_seconds: float
    exposed_comm_seconds: float
    comm_bytes_per_gpu: dict  # kind -> bytes each GPU sends per step (bus volume)
    collective_calls: dict  # kind -> calls per step
    memory_gb_per_gpu: dict  # part -> GB of 2**30 bytes
    fits: bool
    bottleneck: str
    train_flops_per_image: float
    input_images_per_second: float = 0.0  # what the loaders of all nodes make (pretrain.perf.inputs)
    input_limit: str = ""
    input_bound: bool = False
    kernels_per_step: int = 0  # kernels one GPU issues per step (forward + backward of every micro-step)
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def predict(layout: Layout) -> Prediction:
    g = gpu_of(layout)
    img = layout.img_size or arch.model_defaults(layout.model)["img_size"]
    shape = layout.shape(img)
    k, b = layout.accumulation, layout.micro_batch
    micro = compute_seconds(layout, b)
    comp = micro["total"] * k
    opt = optimizer_seconds(layout, shape.params)
    colls = collectives(layout, shape.params)
    comm_total = exposed = 0.0
    # compute each kind of collective can hide under, per step
    depth = shape.depth
    backward_share = 2 / 3 + kernels.recomputed_blocks(depth, layout.checkpointing) / depth / 4
    hide = {"backward": micro["total"] * backward_share * (k if layout.zero in (2, 3) else 1),
            "forward": micro["total"] * (1 - backward_share) * k}
    if compile_mode(layout.compile, layout.zero) == "model":
        # one compiled backward graph returns every gradient at its end: no bucket is ready before
        hide["backward"] = 0.0
    for c in colls:
        t = collective_seconds(layout, c)
        comm_total += t
        if not c.overlappable_with or not layout.overlap_comm:
            exposed += t
            continue
        per_call = t / c.calls
        # what cannot hide: the last gradient bucket, or ZeRO-3's first gathers (the first block's
        # weights, before any compute exists to hide them); never more than the collective itself
        tail = min(t, per_call if layout.zero in (1, 2) else per_call * 4)
        room = hide[c.overlappable_with]
        exposed += tail + max(0.0, t - tail - room)
        hide[c.overlappable_with] = max(0.0, room - (t - tail))
    step = comp + opt + exposed
    ips = b * k * layout.world / step
    feed = inputs.node_rate(layout.decode, layout.cpu_cores or NETWORKS[layout.network].cpu_cores,
                            layout.gpus_per_node, layout.stored_side, layout.decode_rate, layout.loader_workers)
    input_bound = feed.images_per_second * layout.nodes < ips
    if input_bound:  # the GPUs wait for batches: the step takes as long as the loaders need
        ips = feed.images_per_second * layout.nodes
        step = b * k * layout.world / ips
    flops_img = micro["model_flops"] / b
    mfu = flops_img * ips / layout.world / (g.peak_tflops * 1e12)
    hfu = micro["hardware_flops"] / b * ips / layout.world / (g.peak_tflops * 1e12)

    est = _memory(layout, shape, img)
    # memory in GB of 2**30 bytes, as `vit-launch check` and torch.cuda count it; the GPU table holds
    # what each device reports in that unit (an H100 "80GB": 79.6)
    # (the bytes on links, GB of 1e9, are the collectives' unit)
    gib = memory.GB
    mem = {"weights": est.states["weights"] / gib, "gradients": est.states["gradients"] / gib,
           "optimizer": est.states["optimizer"] / gib, "buffers": est.buffers / gib,
           "activations": est.activations / gib, "runtime": est.runtime / gib}
    if layout.zero == 3:
        mem["gathered_weights"] = est.gathered_weights / gib
    if est.hpz_secondary:
        mem["hpz_secondary"] = est.hpz_secondary / gib
    mem["total"] = est.total / gib
    fits = mem["total"] <= g.memory_gb * memory.MEMORY_HEADROOM if g.memory_gb else True

    by_kind: dict[str, float] = {}
    calls: dict[str, int] = {}
    for c in colls:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.wire_bytes()
        calls[c.kind] = calls.get(c.kind, 0) + c.calls
    parts = {"matmul compute": micro["matmul"] * k, "element-wise (memory-bound) kernels": micro["elementwise"] * k,
             "kernel launches (the GPU waits for the host)": micro["launch_wait"] * k,
             "ZeRO-3 module hooks on the host": micro["zero3_hooks"] * k,
             "ZeRO-3 work beyond its hooks (measured, not itemised)": micro["zero3_work"] * k,
             "exposed communication": exposed, "optimizer step": opt}
    worst = max(parts, key=parts.get)
    bottleneck = f"{worst}: {parts[worst] / step:.0%} of the step"
    if exposed > 0.1 * step:
        slow = "inter-node" if layout.nodes > 1 else "intra-node"
        bottleneck += f"; {exposed / step:.0%} waits on the {slow} network"
    if input_bound:
        bottleneck = (f"input pipeline: {feed.images_per_second:,.0f} img/s per node ({feed.limit}) of the "
                      f"{b * k * layout.gpus_per_node / (comp + opt + exposed):,.0f} the GPUs could take; fix with "
                      f"{inputs.advice(layout.decode, layout.stored_side, feed.idle_cores, layout.gpus_per_node)}")
    if not fits:
        bottleneck = f"does not fit: {mem['total']:.1f} GB needed of {g.memory_gb:.1f} GB; " + bottleneck
    return Prediction(layout=asdict(layout), params=shape.params, images_per_second=ips,
                      images_per_second_per_gpu=ips / layout.world, mfu=mfu, hfu=hfu, step_seconds=step,
                      compute_seconds=comp, elementwise_seconds=micro["elementwise"] * k,
                      launch_seconds=micro["launch_wait"] * k, zero3_hook_seconds=micro["zero3_hooks"] * k,
                      zero3_work_seconds=micro["zero3_work"] * k,
                      optimizer_seconds=opt,
                      comm_seconds=comm_total, exposed_comm_seconds=exposed, comm_bytes_per_gpu=by_kind,
                      collective_calls=calls, memory_gb_per_gpu=mem, fits=fits, bottleneck=bottleneck,
                      train_flops_per_image=flops_img, input_images_per_second=feed.images_per_second * layout.nodes,
                      input_limit=feed.limit, input_bound=input_bound, kernels_per_step=micro["kernels"] * k)


def _memory(layout: Layout, shape: memory.ModelShape, img: int) -> memory.MemoryEstimate:
    from types import SimpleNamespace as NS

    zero = NS(stage=layout.zero, contiguous_gradients=True, overlap_comm=layout.overlap_comm,
              reduce_bucket_size=layout.reduce_bucket_size, stage3_prefetch_bucket_size=layout.prefetch_bucket_size,
              offload_optimizer=False, offload_params=False, leaf_blocks=layout.leaf_blocks,
              stage3_param_persistence_threshold=layout.persistence_threshold,
              hpz_partition_size=layout.hpz_partition_size)
    cfg = NS(zero=zero, model=NS(drop_rate=layout.drop_rate, patch_drop_rate=layout.patch_drop_rate),
             optim=NS(name=layout.optimizer),
             train=NS(precision=layout.precision, micro_batch_size=layout.micro_batch,
                      activation_checkpointing=layout.checkpointing, compile=layout.compile,
                      ema_decay=0.9999 if layout.ema else 0.0))
    return memory.estimate(cfg, layout.world, shape, max_reuse_distance=layout.max_reuse_distance)


# ------------------------------------------------------------------------------ from configs
def layout_from_config(cfg, *, nodes: int, gpus_per_node: int, gpu: str, network: Optional[str] = None,
                       **overrides) -> Layout:
    """The layout a ``pretrain.config.Config`` trains with on ``nodes x gpus_per_node`` GPUs: the model
    its ``model:`` section builds (every option ``arch.config_options`` names, as ``vit-launch check``
    and training size it), its ``auto`` levers decided for them as training decides them
    (``pretrain.perf.levers``; the GPU type's memory from its table entry)."""
    from pretrain.config import image_size
    from pretrain.perf import levers

    network = network or default_network(gpu)
    memory_gb = overrides.get("memory_gb") or GPUS[gpu].memory_gb if gpu in GPUS else overrides.get("memory_gb")
    cfg, _ = levers.resolve(cfg, nodes * gpus_per_node, gpus_per_node=gpus_per_node, gpu=gpu, network=network,
                            memory_bytes=memory_gb * memory.GB if memory_gb else None)
    t, z, m = cfg.train, cfg.zero, cfg.model
    kw = dict(model=m.name, gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node, micro_batch=t.micro_batch_size,
              global_batch=t.global_batch_size, img_size=image_size(m), num_classes=m.num_classes,
              **arch.config_options(m), zero=z.stage,
              precision=t.precision, reduce_dtype=t.reduce_dtype, checkpointing=t.activation_checkpointing,
              compile=t.compile, patch_drop_rate=m.patch_drop_rate, drop_rate=m.drop_rate,
              drop_path_rate=m.drop_path_rate, optimizer=cfg.optim.name, ema=t.ema_decay > 0,
              overlap_comm=z.overlap_comm,
              reduce_bucket_size=z.reduce_bucket_size, allgather_bucket_size=z.allgather_bucket_size,
              prefetch_bucket_size=z.stage3_prefetch_bucket_size,
              persistence_threshold=z.stage3_param_persistence_threshold, leaf_blocks=z.leaf_blocks,
              hpz_partition_size=z.hpz_partition_size, quantized_weights=z.quantized_weights,
              quantized_gradients=z.quantized_gradients, network=network, loader_workers=cfg.data.workers,
              decode="synthetic" if cfg.data.synthetic else inputs.CONFIG_PATHS[cfg.data.decode_device])
    kw.update(overrides)
    return Layout(**kw)


# ------------------------------------------------------------------------- fewer tokens
@dataclass
class PhasePrice:
    """One ``train.resolution_schedule`` phase priced: its steps at its predicted step time."""
    first: int
    last: int
    img_size: int
    micro_batch: int
    prediction: Prediction
    seconds: float  # wall seconds of the phase's steps
    flops: float  # model FLOPs of the phase's images (all GPUs)


@dataclass
class TokenPrice:
    """A run that trains on fewer tokens (a resolution schedule, patch dropout) against the same run
    with every step at the model's resolution and every token (``fixed``)."""
    phases: list
    fixed: Prediction
    steps: int
    seconds: float
    flops: float
    fixed_seconds: float
    fixed_flops: float
    fits: bool  # every phase fits the GPU's memory (the largest phase decides)

    def as_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("phases", "fixed")},
                "phases": [{k: v for k, v in asdict(p).items() if k != "prediction"}
                           | {"images_per_second": p.prediction.images_per_second, "mfu": p.prediction.mfu,
                              "memory_gb_per_gpu": p.prediction.memory_gb_per_gpu["total"]} for p in self.phases],
                "fixed_images_per_second": self.fixed.images_per_second}


def price_tokens(layout: Layout, phases: list) -> TokenPrice:
    """``layout`` (at the model's resolution and base micro batch) trained in ``phases``
    (``pretrain.config.phases.Phase``: steps, px, micro batch; the global batch kept), each phase
    predicted at its own resolution, micro batch and kept tokens, against every step at the
    model's resolution with every token: time and model FLOPs of the whole run."""
    global_batch = layout.global_batch or layout.micro_batch * layout.world
    rows = []
    for p in phases:
        pred = predict(replace(layout, img_size=p.img_size, micro_batch=p.micro_batch))
        images = p.steps * global_batch
        rows.append(PhasePrice(p.first, p.last, p.img_size, p.micro_batch, pred, p.steps * pred.step_seconds,
                               images * pred.train_flops_per_image))
    fixed = predict(replace(layout, patch_drop_rate=0.0))
    steps = sum(p.steps for p in phases)
    return TokenPrice(rows, fixed, steps, sum(r.seconds for r in rows), sum(r.flops for r in rows),
                      steps * fixed.step_seconds, steps * global_batch * fixed.train_flops_per_image,
                      all(r.prediction.fits for r in rows))


def summary_line(p: Prediction) -> str:
    lay = p.layout
    return (f"predicted on {lay['nodes']} x {lay['gpus_per_node']} {lay['gpu']}: {p.images_per_second:,.0f} img/s "
            f"({p.images_per_second_per_gpu:,.1f} per GPU), MFU {p.mfu:.1%}, step {p.step_seconds * 1e3:,.1f} ms, "
            f"{p.memory_gb_per_gpu['total']:.1f} GB per GPU{'' if p.fits else ' (does NOT fit)'}, input "
            f"{p.input_images_per_second:,.0f} img/s ({lay['decode']} decode); {p.bottleneck}")


def run_record(cfg, world: int, gpus_per_node: int, device_name: Optional[str]) -> Optional[dict]:
    """What training records of the model's prediction for its own layout (run config, W&B
    config), so predicted and measured MFU sit side by side; None when the GPU type is unknown
    (CPU runs, GPUs not in ``pretrain.perf.hardware.GPUS``)."""
    key = gpu_key(device_name or "")
    if key is None:
        return None
    per_node = max(1, min(gpus_per_node, world))
    p = predict(layout_from_config(cfg, nodes=max(1, world // per_node), gpus_per_node=per_node, gpu=key))
    return {"gpu": key, "images_per_second": p.images_per_second, "mfu": p.mfu, "step_seconds": p.step_seconds,
            "memory_gb_per_gpu": p.memory_gb_per_gpu["total"], "bottleneck": p.bottleneck}
