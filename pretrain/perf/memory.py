"""Per-GPU memory estimate for a ViT training job: model states by ZeRO stage + activations.

Model states (bytes per parameter, after DeepSpeed 0.19's own estimators
``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``, whose
"2 + 18" split is the ZeRO paper's 16 bytes (Rajbhandari et al. 2020, sec. 3.1) plus the fp32
gradient partition ZeRO casts to for the optimizer step)::

                                   bf16   fp32   sharded over the N ranks from
    module weights                   2      4    stage 3
    module gradients                 2      4    stage 2
    fp32 master weights              4      4    stage 1   (fp32 + stage 0: none, torch's own step)
    fp32 gradient partition          4      -    stage 1
    Adam / LAMB m, v (SGD: mom. 4)   8      8    stage 1   (moved to CPU by zero.offload_optimizer)
    EMA of the weights               4      4    stage 1   (train.ema_decay; beside the masters)
    (zero.offload_params moves the stage-3 module weight partitions to CPU)

So bf16 + AdamW costs 20 B/param on one rank, 2 + 18/N with ZeRO-2, 20/N with ZeRO-3. ZeRO-1 in
bf16 with fp32 gradient accumulation (our default) is DeepSpeed's ``BF16_Optimizer``: it keeps
the bf16 gradients and a whole fp32 accumulation buffer (``fp32_groups_gradients_flat``, with
``bf16.immediate_grad_update`` off as by default) and partitions only the master weights and
moments: 2 + 6 + 12/N. ``tests/integration/test_perfmodel.py`` reads these buffers off live optimizers. ZeRO-1/2
also hold one or two (``overlap_comm``) gradient buckets of ``zero.reduce_bucket_size`` elements
whatever the model size (``setup_buckets`` in stage_1_and_2.py): 2 GB for the 5e8 default in bf16,
which is why small GPUs lower that setting. ZeRO-3 holds the weights and gradients of one gathered
unit at a time beyond the partitions: a whole Transformer block with ``zero.leaf_blocks`` (the
default; ``train.compile`` too: each block is one DeepSpeed leaf module, fetched whole), else the
largest single module (DeepSpeed fetches each module's own parameters); the patch embedding and the
head are single modules either way, so the unit is the larger of a block and the largest module.
Two more terms at ZeRO-3 (``vit-launch plan`` and ``check`` name them as here):
``gathered_weights``, the weights DeepSpeed keeps gathered from their forward use to their backward
use (:func:`zero3_released`: every partitioned weight of a model under about a billion partitioned
elements, in the module's dtype) beyond the unit above and the ``zero.stage3_prefetch_bucket_size``
weights fetched ahead of it (:func:`zero_buffer_bytes` counts both; at the end of the forward,
where the activations peak too, they are among the kept weights), and with ZeRO++ hpZ
(``zero.hpz_partition_size`` between 1 and the world size) ``hpz_secondary``, the secondary copy of
the weights partitioned inside groups of that many GPUs (``P / hpz`` weights in the module's dtype,
as DeepSpeed 0.19's ``_partition_param_sec`` allocates it: ``2 P / hpz`` bytes in bf16; in host
memory with ``zero.offload_params``, as it goes to the offload device).

The "bf16" column is ``train.precision`` bf16 and fp16 (DeepSpeed keeps the module in 16 bits).
``bf16-autocast`` keeps the module fp32: its weights, gradients and masters are the fp32 column (no
separate fp32 gradient partition: the gradients already are fp32), and its activations are the
16-bit ones below plus what autocast adds: each block's two LayerNorm inputs, the residual stream,
in fp32 (``4 s b h`` more), and a bf16 copy of every weight that goes through a matmul, which
autograd keeps from the forward to the backward (2 B/param of the whole model, also at ZeRO-3; one
block's with activation checkpointing, whose forward keeps nothing).

Activations per micro-batch, per transformer block, from Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", sec. 4.1 (s sequence length, b micro
batch, h width, a heads, 16-bit activations)::

    attention: 11 s b h + 5 a s^2 b   (QKV input 2sbh, Q K 4sbh, softmax 2as^2b + dropout mask
                                       as^2b, dropped probs 2as^2b, V 2sbh, proj input 2sbh, mask sbh)
    MLP:       19 s b h               (fc1 input 2sbh, GELU input 8sbh, fc2 input 8sbh, mask sbh)
    norms:      4 s b h               -> 34 s b h + 5 a s^2 b per block

For ViT, s = patches + the prefix tokens ([class], registers: ``pretrain.models.arch.seq_len``)
and the MLP is 4h wide as in the paper (g/14 and G/14: about 4.4h and 4.9h, so the two MLP terms
scale by hidden / 4h). ``model.qk_norm`` keeps the normalised Q and K and part of the norms'
inputs (``6 s b h`` more, as autograd saves them on CPU; plus a mean and 1/std per row,
``8 a s b``); LayerScale (``model.init_values``) keeps each branch's output for the gradient of its
gamma (``4 s b h``). Two changes:
``F.scaled_dot_product_attention`` runs a fused kernel (flash / memory-efficient) that keeps no
s x s matrix, only Q, K, V, the output and a log-sum-exp (``4 a s b`` bytes, fp32), so the
``5 a s^2 b`` term becomes ``4 a s b``; and dropout masks exist only with ``model.drop_rate > 0``:
timm's block layout drops after the projection, after the GELU (4h wide) and after fc2, so
``6 s b h`` bytes of CUDA's 1-byte masks instead of the paper's ``2 s b h`` (on CPU, dropout keeps
a scaled mask in the activation dtype, twice that in bf16). fp32 training doubles every 16-bit
term. With activation
checkpointing (``model.set_grad_checkpointing``: each block recomputed in backward) only each
block's input stays (``2 s b h`` per block, the paper's "full recomputation") plus one block's
full set while it is recomputed; op by op (``selective``, ``selective_block_bytes``) each block
keeps its input and its linears' and attention's outputs, ``22 s b h + 4 a s b``, and the bf16
weight copies of ``bf16-autocast`` are recomputed with the rest. Outside the blocks: the image
batch, the final norm and the logits. The formula is checked against the bytes autograd actually
saves in ``tests/unit/test_launch_memory.py``. A step that trains on fewer tokens keeps fewer: ``s`` is the
kept patch tokens plus the prefix tokens under ``model.patch_drop_rate`` (the image batch is still whole), and under
``train.resolution_schedule`` each phase has its own ``s``, image size and micro batch; the phase
with the most activations is the one the estimate (and ``auto`` checkpointing) must fit.

Host memory while the model is built (``host_build``, per rank, CPU RAM): without ZeRO-3 every
rank builds and initialises the whole fp32 model on the CPU before DeepSpeed moves it (4 B/param;
8 ranks on a node of ViT-G/14: 8 x 7.4 GB). Under ZeRO-3 ``train.build_model`` builds inside
``deepspeed.zero.Init``: each layer is made whole, broadcast and partitioned onto the device as
soon as it exists, and initialised one module at a time under ``GatheredParameters`` (leaf blocks
play no part while building: they change only how training fetches), so the host and the device
each hold at most one whole layer (fp32) beyond the rank's 1/N share (which is already in
``weights``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pretrain.distributed.config import STAGE3_MAX_REUSE_DISTANCE

GB = 2 ** 30
# CUDA context, cuBLAS / NCCL workspaces and allocator fragmentation: not in any formula above;
# about 0.5-1.5 GB in practice, so the estimate carries 1 GB for it.
RUNTIME_OVERHEAD_BYTES = 1 * GB
# the share of a device's memory an estimate may fill (`auto` checkpointing, `vit-launch plan` and
# `vit-launch check` alike): the rest is the allocator's margin for what the estimate misses
MEMORY_HEADROOM = 0.95


@dataclass(frozen=True)
class ModelShape:
    params: int
    largest_layer: int  # parameters of the largest single module (ZeRO-3's unit without leaf blocks)
    block_params: int  # parameters of one Transformer block (ZeRO-3's unit for a leaf block)
    # element counts of the parameter tensors in the order of the forward (ZeRO-3 partitions them one by one)
    tensors: tuple[int, ...] = dataclasses.field(repr=False)
    seq_len: int
    width: int
    depth: int
    heads: int
    img_size: int
    num_classes: int
    mlp_hidden: int = 0  # 0: 4 x width
    qk_norm: bool = False
    layer_scale: bool = False
    prefix_tokens: int = 1  # [class] and register tokens: seq_len less the patches
    stride: int = 16  # input pixels per token, per side
    stem: bool = False  # a hybrid's ResNet stem ('SAME' padding keeps partial positions)

    def patches(self, img_size: int) -> int:
        """Patch tokens of an ``img_size`` input."""
        side = -(-img_size // self.stride) if self.stem else img_size // self.stride
        return side * side


def trained_shape(shape: ModelShape, img_size: int | None = None, patch_drop_rate: float = 0.0) -> ModelShape:
    """``shape`` (the model's) as a training step sees it at ``img_size`` px (None: the model's):
    that resolution's patch grid less what patch dropout drops (``arch.patch_keep``), plus every
    prefix token ([class], registers: patch dropout keeps them), in the blocks; the parameters stay
    the model's."""
    from pretrain.models.arch import patch_keep

    img = img_size or shape.img_size
    kept = patch_keep(shape.patches(img), patch_drop_rate)
    return dataclasses.replace(shape, img_size=img, seq_len=kept + shape.prefix_tokens)


def training_shapes(cfg, shape: ModelShape) -> list[tuple[ModelShape, int]]:
    """(shape as trained, micro batch) of each ``train.resolution_schedule`` phase (one without a
    schedule), with ``model.patch_drop_rate`` applied: what the activations of each phase are sized by."""
    from pretrain.config.phases import resolution_phases

    rate = getattr(cfg.model, "patch_drop_rate", 0.0)
    t = cfg.train
    if not getattr(t, "resolution_schedule", None):
        return [(trained_shape(shape, None, rate), t.micro_batch_size)]
    return [(trained_shape(shape, p.img_size, rate), p.micro_batch) for p in resolution_phases(t, shape.img_size)]


def analytic_shape(name: str, *, img_size=None, num_classes: int = 1000, representation_size=None,
                   global_pool: str = "token", qk_norm: bool = False, layer_scale: bool = False,
                   reg_tokens: int = 0, class_token: bool = True, pos_embed: str = "learned") -> ModelShape:
    """The shape of a registered model from its architecture alone (``pretrain.models.arch``; no torch).
    ``params`` counts the trainable tensors (a fixed sin-cos position embedding is none)."""
    from pretrain.models import arch

    d = arch.model_defaults(name)
    img = img_size or d["img_size"]
    options = dict(global_pool=global_pool, representation_size=representation_size, qk_norm=qk_norm,
                   layer_scale=layer_scale, reg_tokens=reg_tokens, class_token=class_token, pos_embed=pos_embed)
    params, largest = arch.param_count(name, img, num_classes, **options)
    return ModelShape(params=params, largest_layer=largest,
                      block_params=arch.block_param_count(name, qk_norm, layer_scale),
                      tensors=tuple(arch.param_tensors(name, img, num_classes, **options)),
                      seq_len=arch.seq_len(name, img, reg_tokens, class_token), width=d["embed_dim"],
                      depth=d["depth"], heads=d["num_heads"], img_size=img, num_classes=num_classes,
                      mlp_hidden=d["mlp_hidden"], qk_norm=qk_norm, layer_scale=layer_scale,
                      prefix_tokens=arch.prefix_tokens(reg_tokens, class_token), stride=d["stride"],
                      stem=bool(d["stem_layers"]))


def weight_bytes(precision: str) -> int:
    """Bytes per element of the module DeepSpeed trains (``train.precision``): 2 where it is
    16-bit (bf16, fp16), 4 where it stays fp32 (fp32, bf16-autocast)."""
    return 2 if precision in ("bf16", "fp16") else 4


def activation_dtype_bytes(precision: str) -> int:
    """Bytes per element of the activations the matmuls keep: 2 in every 16-bit mode."""
    return 4 if precision == "fp32" else 2


def model_shape(model_cfg) -> ModelShape:
    """:func:`analytic_shape` for a config's ``model:`` section (tests check it against the built model);
    its options are ``pretrain.models.arch.config_options``', which ``vit-launch plan``'s layouts carry too."""
    from pretrain.config import image_size
    from pretrain.models.arch import config_options

    return analytic_shape(model_cfg.name, img_size=image_size(model_cfg), num_classes=model_cfg.num_classes,
                          **config_options(model_cfg))


def optimizer_state_bytes(optimizer: str) -> int:
    """Bytes per parameter of the optimizer's own state: Adam's and LAMB's two moments, SGD's momentum."""
    return 4 if optimizer == "sgd" else 8


def model_state_bytes(params: int, *, stage: int, world: int, precision: str, optimizer: str = "adamw",
                      offload_optimizer: bool = False, offload_params: bool = False,
                      ema: bool = False) -> dict[str, float]:
    """Bytes per GPU for weights, gradients and optimizer states (table in the module docstring);
    ``cpu`` is what ZeRO-Offload keeps in host memory per rank instead (the optimizer states, and
    with ``offload_params`` at ZeRO-3 the weight partitions: the GPU then holds the gathered layers,
    which ``zero_buffer_bytes``' prefetch bucket bounds). ``ema``: the weights' moving average,
    counted with the optimizer states (it lives beside the masters)."""
    e = weight_bytes(precision)
    master = 0 if (e == 4 and stage == 0) else 4  # an fp32 module without ZeRO: torch steps it in place
    opt_per_param = master + (4 if e == 2 else 0) + optimizer_state_bytes(optimizer) + (4 if ema else 0)
    n = max(1, world)
    weights = e * params / (n if stage >= 3 else 1)
    grads = e * params / (n if stage >= 2 else 1)
    opt = opt_per_param * params / (n if stage >= 1 else 1)
    if stage == 1 and precision == "bf16":
        # BF16_Optimizer (ZeRO-1 + fp32 accumulation): the bf16 grads and a whole fp32
        # accumulation buffer, not a partition of one
        grads, opt = (e + 4) * params, (opt_per_param - 4) * params / n
    on_host = weights if offload_params and stage == 3 else 0.0
    out = {"weights": weights - on_host, "gradients": grads, "optimizer": 0.0 if offload_optimizer else opt,
           "cpu": (opt if offload_optimizer else 0.0) + on_host}
    return out


def zero3_gathered_params(shape: ModelShape, leaf_blocks: bool) -> int:
    """Parameters ZeRO-3 holds gathered at once at most (module docstring): a whole block when the
    blocks are leaf modules, never less than the largest single module (the patch embedding and the
    head are gathered alone either way)."""
    return max(shape.block_params, shape.largest_layer) if leaf_blocks else shape.largest_layer


def zero3_partitioned(tensors, persistence_threshold: int) -> list[int]:
    """Element counts of the tensors ZeRO-3 partitions (and gathers one module at a time), of the
    model's ``tensors`` in forward order: those above ``zero.stage3_param_persistence_threshold``;
    the rest stay whole on every rank."""
    return [n for n in tensors if n > persistence_threshold]


def zero3_released(partitioned, max_reuse_distance: int = STAGE3_MAX_REUSE_DISTANCE) -> int:
    """Elements of the ``partitioned`` tensors (forward order) ZeRO-3 frees after their forward use
    and gathers again in the backward. ``PartitionedParameterCoordinator.__params_to_release`` keeps
    a parameter gathered when it is used again within ``stage3_max_reuse_distance`` elements of other
    parameters: a tensor with ``x`` elements after it in the forward comes back after about ``2 x``
    (the rest of the forward, then the backward down to it). So models under about a billion
    partitioned elements gather each weight once per micro-step and keep it until the backward has
    used it: the rest of the partitioned elements stay gathered (``gathered_weights``)."""
    after, out = sum(partitioned), 0
    for t in partitioned:
        after -= t
        if 2 * after >= max_reuse_distance:
            out += t
    return out


def zero3_kept_bytes(shape: ModelShape, zero_cfg, precision: str, world: int,
                     max_reuse_distance: int = STAGE3_MAX_REUSE_DISTANCE, *,
                     leaf_blocks: bool = True) -> dict[str, float]:
    """ZeRO-3's bytes per GPU beyond the partitions and :func:`zero_buffer_bytes` (module docstring):
    ``gathered_weights``, the partitioned weights kept gathered from their forward to their backward
    use, and ``hpz_secondary``, hpZ's secondary partition; both 0 below stage 3. At the end of the
    forward the gathered weights are the kept ones, among which the unit being computed and those
    prefetched for the next: ``zero_buffer_bytes`` counts those (``zero_cfg``'s prefetch bucket
    sized, not ``auto``), so ``gathered_weights`` is only what is kept beyond them."""
    if zero_cfg.stage != 3:
        return {"gathered_weights": 0.0, "hpz_secondary": 0.0}
    e = weight_bytes(precision)
    part = zero3_partitioned(shape.tensors, zero_cfg.stage3_param_persistence_threshold)
    kept = sum(part) - zero3_released(part, max_reuse_distance)
    in_buffers = zero3_gathered_params(shape, leaf_blocks) + zero_cfg.stage3_prefetch_bucket_size
    hpz = zero_cfg.hpz_partition_size
    # every parameter, the persistent ones too (zero.Init partitions each: _zero_init_param calls
    # param.partition(), so _partition_param_sec gives it aligned numel / hpz elements), until the
    # step's invalidate_secondary_tensor; the first micro-step holds them all
    return {"gathered_weights": e * max(0, kept - in_buffers),
            "hpz_secondary": e * shape.params / hpz if 1 < hpz < world else 0.0}


def zero_buffer_bytes(zero_cfg, shape: ModelShape, precision: str, *, leaf_blocks: bool) -> float:
    """Communication buffers DeepSpeed allocates at a fixed size, and at ZeRO-3 the weights and
    gradients of the unit it gathers (see module docstring). ``leaf_blocks``: the blocks are
    ZeRO-3 leaf modules (``zero.leaf_blocks`` or ``train.compile``)."""
    e = weight_bytes(precision)
    if zero_cfg.stage in (1, 2):
        if not zero_cfg.contiguous_gradients:
            return 0.0
        return zero_cfg.reduce_bucket_size * e * (2 if zero_cfg.overlap_comm else 1)
    if zero_cfg.stage == 3:
        return ((zero_cfg.reduce_bucket_size + zero_cfg.stage3_prefetch_bucket_size) * e
                + 2 * e * zero3_gathered_params(shape, leaf_blocks))
    return 0.0


def block_activation_bytes(s: int, b: int, h: int, a: int, *, precision: str = "bf16",
                           dropout: bool = False, fused_attention: bool = True, mlp_hidden: int = 0,
                           qk_norm: bool = False, layer_scale: bool = False) -> float:
    """Korthikanti et al. 2022 eq. (1) per block, adapted as in the module docstring."""
    scale = activation_dtype_bytes(precision) // 2  # the paper counts 16-bit activations
    sbh = s * b * h
    r = (mlp_hidden or 4 * h) / (4 * h)  # MLP width against the paper's 4h
    # the paper's 34 s b h without its two 1-byte dropout masks; its MLP's 16 s b h (GELU input
    # and fc2 input, each 4h wide) scale with the MLP width
    acts = (16 + 16 * r) * sbh * scale
    if qk_norm:
        acts += (6 * sbh + 8 * a * s * b) * scale  # normalised Q, K, norms' inputs; mean, 1/std per row
    if layer_scale:
        acts += 4 * sbh * scale  # both branches' outputs, for the gradients of the gammas
    masks = (2 + 4 * r) * sbh if dropout else 0  # proj (h), after GELU (4h), fc2 (h): CUDA's bool masks
    attn = 4 * a * s * b if fused_attention else (4 * a * s * s * b * scale + (a * s * s * b if dropout else 0))
    if precision == "bf16-autocast":
        acts += 4 * sbh  # the two LayerNorm inputs (the residual stream) in fp32, not 16 bits
    return acts + masks + attn


def selective_block_bytes(s: int, b: int, h: int, a: int, *, precision: str = "bf16",
                          fused_attention: bool = True, mlp_hidden: int = 0) -> float:
    """What one block keeps under op-level checkpointing (``pretrain.models.recompute``): its input
    (the module's dtype), the outputs of its four linears (q k v 3h, the projection h, fc1 the MLP
    width, fc2 h) and, with a fused attention kernel, the attention output and its fp32
    log-sum-exp; the LayerNorms, GELU, dropout masks, LayerScale and QK-norm outputs are
    recomputed. bf16: ``22 s b h + 4 a s b`` against the whole block's ``32 s b h + 4 a s b``."""
    e = activation_dtype_bytes(precision)
    kept = weight_bytes(precision) * s * b * h + e * s * b * (5 * h + (mlp_hidden or 4 * h))
    return kept + (e * s * b * h + 4 * a * s * b if fused_attention else 0)


def activation_bytes(shape: ModelShape, micro_batch: int, *, precision: str = "bf16", checkpointing=False,
                     dropout: bool = False, fused_attention: bool = True) -> float:
    """Activation memory of one micro-batch's forward, held until its backward. ``checkpointing``:
    the blocks checkpointed (``true`` all, ``false`` none, or a count: the first ``N``), each of
    which keeps only its input, or ``"selective"`` (every block keeps ``selective_block_bytes``);
    one block's full set exists while it is recomputed."""
    from pretrain.config import checkpoint_count, selective_checkpointing

    s, b, h, L = shape.seq_len, micro_batch, shape.width, shape.depth
    n = checkpoint_count(checkpointing, L) or 0
    e = activation_dtype_bytes(precision)
    stream = weight_bytes(precision)  # the residual stream and the input are in the module's dtype
    block = block_activation_bytes(s, b, h, shape.heads, precision=precision, dropout=dropout,
                                   fused_attention=fused_attention, mlp_hidden=shape.mlp_hidden,
                                   qk_norm=shape.qk_norm, layer_scale=shape.layer_scale)
    if selective_checkpointing(checkpointing):
        kept = selective_block_bytes(s, b, h, shape.heads, precision=precision, fused_attention=fused_attention,
                                     mlp_hidden=shape.mlp_hidden)
        n, blocks = L, (L - 1) * kept + block  # (n: the weight copies below are recomputed too)
    else:
        blocks = n * stream * s * b * h + (L - n) * block + (block if n else 0)
    # image batch (patch-embedding input, the module's dtype) + final norm input + head input and fp32 logits
    outside = 3 * shape.img_size ** 2 * b * stream + stream * s * b * h + e * b * h + 4 * b * shape.num_classes
    if precision == "bf16-autocast":  # bf16 weight copies kept for the backward (module docstring)
        rest = shape.params - L * shape.block_params  # patch embedding, head: kept whatever is checkpointed
        outside += 2 * rest + 2 * shape.block_params * ((L - n) + (1 if n else 0))
    return blocks + outside


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    states: dict  # weights / gradients / optimizer / cpu (bytes per GPU)
    buffers: float
    activations: float  # as configured (with or without checkpointing)
    activations_other: float  # with no block checkpointed (with every block when some are), for advice
    checkpointing: int | str  # blocks checkpointed, or "selective"
    host_build: float = 0.0  # host (CPU) bytes per rank while the model is built (module docstring)
    largest: tuple[int, int] = (0, 0)  # (px, micro batch) of the phase with the most activations
    runtime: float = RUNTIME_OVERHEAD_BYTES  # CUDA's context and workspaces; none on a CPU
    gathered_weights: float = 0.0  # ZeRO-3: weights kept gathered from their forward to their backward use
    hpz_secondary: float = 0.0  # ZeRO++ hpZ: the secondary weight partition

    @property
    def total(self) -> float:
        s = self.states
        return (s["weights"] + s["gradients"] + s["optimizer"] + self.buffers + self.activations + self.runtime
                + self.gathered_weights + self.hpz_secondary)

    def total_if_checkpointing(self, on: bool) -> float:
        act = self.activations if on == bool(self.checkpointing) else self.activations_other
        return self.total - self.activations + act


def host_build_bytes(shape: ModelShape, stage: int) -> float:
    """Peak host bytes per rank for building the model (see the module docstring): the whole
    fp32 model, or under ZeRO-3 (``deepspeed.zero.Init``) one whole fp32 layer at a time."""
    return 4.0 * (shape.largest_layer if stage == 3 else shape.params)


def estimate(cfg, world: int, shape: ModelShape | None = None, *, cuda: bool = True,
             max_reuse_distance: int = STAGE3_MAX_REUSE_DISTANCE) -> MemoryEstimate:
    """Per-rank estimate for a full ``pretrain.config.Config`` at this world size: a GPU's memory,
    or with ``cuda`` false the host memory of a rank on DeepSpeed's CPU accelerator (no CUDA
    runtime to carry). ``max_reuse_distance``: DeepSpeed's ``stage3_max_reuse_distance``, which
    decides ZeRO-3's ``gathered_weights`` (training's unless a performance-model layout says otherwise)."""
    shape = shape or model_shape(cfg.model)
    t = cfg.train
    states = model_state_bytes(shape.params, stage=cfg.zero.stage, world=world, precision=t.precision,
                               optimizer=cfg.optim.name, offload_optimizer=cfg.zero.offload_optimizer,
                               offload_params=cfg.zero.offload_params, ema=getattr(t, "ema_decay", 0) > 0)
    from pretrain.config import checkpoint_count, selective_checkpointing

    kw = dict(precision=t.precision, dropout=cfg.model.drop_rate > 0)
    # `auto` without a device to fit (pretrain.perf.levers.resolve decides it against one): none
    ckpt = t.activation_checkpointing
    n = ckpt if selective_checkpointing(ckpt) else checkpoint_count(ckpt, shape.depth) or 0
    # the phase of train.resolution_schedule that holds the most activations decides (one without)
    act, trained, micro = max(((activation_bytes(s, b, checkpointing=n, **kw), s, b)
                               for s, b in training_shapes(cfg, shape)), key=lambda e: e[0])
    other = activation_bytes(trained, micro, checkpointing=0 if n else shape.depth, **kw)
    sized, leaf = _sized_buckets(cfg, world, shape), cfg.zero.leaf_blocks or bool(t.compile)
    buffers = zero_buffer_bytes(sized, shape, t.precision, leaf_blocks=leaf)
    kept = zero3_kept_bytes(shape, sized, t.precision, world, max_reuse_distance, leaf_blocks=leaf)
    if cfg.zero.offload_params:  # _partition_param_sec allocates it on the remote (offload) device
        states["cpu"] += kept["hpz_secondary"]
        kept["hpz_secondary"] = 0.0
    return MemoryEstimate(params=shape.params, states=states, buffers=buffers,
                          activations=act, activations_other=other, checkpointing=n,
                          host_build=host_build_bytes(shape, cfg.zero.stage), largest=(trained.img_size, micro),
                          runtime=RUNTIME_OVERHEAD_BYTES if cuda else 0.0,
                          **kept)


def _sized_buckets(cfg, world: int, shape: ModelShape):
    """``cfg.zero`` with ``auto`` bucket sizes as ``pretrain.perf.levers`` decides them (8 GPUs a node)."""
    import dataclasses

    from pretrain.perf import buckets

    z = cfg.zero
    if z.reduce_bucket_size == "auto":
        z = dataclasses.replace(z, reduce_bucket_size=buckets.auto_bucket(shape.params, buckets.grad_bytes(cfg.train),
                                                                          world))
    if z.stage3_prefetch_bucket_size == "auto":
        z = dataclasses.replace(z, stage3_prefetch_bucket_size=buckets.auto_prefetch(shape.block_params))
    return z


def largest_micro_batch(cfg, world: int, budget_bytes: float, shape: ModelShape, checkpointing: bool) -> int:
    """The largest micro batch whose estimate fits ``budget_bytes`` (0 if none does)."""
    base = estimate(cfg, world, shape)
    fixed = base.total - base.activations
    kw = dict(precision=cfg.train.precision, checkpointing=checkpointing, dropout=cfg.model.drop_rate > 0)
    per_sample = activation_bytes(shape, 2, **kw) - activation_bytes(shape, 1, **kw)
    const = activation_bytes(shape, 1, **kw) - per_sample
    room = budget_bytes - fixed - const
    return max(0, int(room // per_sample))


def checkpoint_bytes(params: int, precision: str, optimizer: str = "adamw", stage: int = 1,
                     ema: bool = False) -> float:
    """Size on disk of one checkpoint, all ranks together: the module's weights in their training
    dtype (2 or 4 B/param), ZeRO's fp32 master weights (4; none for an fp32 module without ZeRO,
    where the optimizer steps the module's own weights), the moments (Adam and LAMB 8, SGD 4) and
    the EMA of the weights (4, ``ema``): 14-16 B/param with AdamW. Measured on the tiny config
    (fp32, ZeRO-1, 2 ranks): 4.0 + 12.0 B/param. 5% on top for pickling, RNG and loader state."""
    weights = weight_bytes(precision)
    master = 0 if (weights == 4 and stage == 0) else 4
    return 1.05 * params * (weights + master + optimizer_state_bytes(optimizer) + (4 if ema else 0))
