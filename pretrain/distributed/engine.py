"""DeepSpeed wiring: typed config -> DeepSpeed config dict (a pure function), the optimizer (AdamW,
SGD or LAMB; weight-decay groups, or per-layer groups with ``optim.layer_decay``), and
``deepspeed.initialize`` with the LR schedule of ``pretrain.distributed.schedule``.

The backend is DeepSpeed's accelerator's: NCCL on GPUs, gloo on its CPU accelerator, so the same
code path runs in CI on CPU and on GPU clusters.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from pretrain.config import ConfigError, check_world_size, checkpoint_count, compile_mode, selective_checkpointing
from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed import ds_compat, ds_masters, schedule
from pretrain.distributed.config import STAGE3_MAX_LIVE_PARAMETERS, STAGE3_MAX_REUSE_DISTANCE, ZeroConfig
from pretrain.distributed.lamb import Lamb, ShardLayout
from pretrain.distributed.layer_decay import layer_decay_groups

# the Transformer block's class, as DeepSpeed's ``leaf_module.classes`` names it (module.qualname)
LEAF_BLOCK_CLASS = "pretrain.models.layers.Block"


def deepspeed_config(optim: OptimConfig, train: TrainConfig, zero: ZeroConfig, world_size: int,
                     extra: Optional[dict] = None) -> dict:
    """The DeepSpeed JSON config for these sections and world size, with the ``deepspeed:``
    pass-through ``extra`` merged in (:func:`merge_passthrough`). Pure: no torch, no I/O.

    Every key whose value the training algorithm depends on is written out, DeepSpeed's default or
    not (``tests/unit/test_engine.py`` reads them back through DeepSpeed's own parser), so a new
    DeepSpeed release that changes a default cannot change a run: clipping (absent, DeepSpeed clips
    at 1.0), gradient pre-scaling, the ZeRO buckets and their overlap, the stage-3 gather limits."""
    gas = check_world_size(train, world_size)
    unresolved = [k for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size") if getattr(zero, k) == "auto"]
    if unresolved:
        raise ConfigError(f"zero.{unresolved[0]}=auto is decided from the model (pretrain.perf.levers.resolve or "
                          "resolve_zero) before the DeepSpeed config is made")
    compiled = bool(compile_mode(train.compile))
    z: dict = {"stage": zero.stage}
    if zero.stage >= 1:
        z.update(reduce_bucket_size=zero.reduce_bucket_size, overlap_comm=zero.overlap_comm,
                 contiguous_gradients=zero.contiguous_gradients, round_robin_gradients=False,
                 load_from_fp32_weights=True)
    if zero.stage in (1, 2):
        z.update(allgather_bucket_size=zero.allgather_bucket_size, reduce_scatter=True,
                 allgather_partitions=True, use_multi_rank_bucket_allreduce=True)
    if zero.stage == 3:
        z.update(stage3_prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                 stage3_param_persistence_threshold=zero.stage3_param_persistence_threshold,
                 stage3_max_live_parameters=STAGE3_MAX_LIVE_PARAMETERS,
                 stage3_max_reuse_distance=STAGE3_MAX_REUSE_DISTANCE,
                 sub_group_size=1_000_000_000,
                 # export consolidates from the fp32 shards; no 16-bit gather at save time
                 stage3_gather_16bit_weights_on_model_save=False,
                 # leaf modules are chosen here (zero.leaf_blocks), not by DeepSpeed's granularity rule
                 stage3_module_granularity_threshold=0,
                 leaf_module={"classes": [LEAF_BLOCK_CLASS] if zero.leaf_blocks or compiled else [],
                              "names": [], "name_suffixes": []})
        if compiled or selective_checkpointing(train.activation_checkpointing):
            # zero.Init swaps F.linear for an autograd.Function whose backward reads each weight's
            # ZeRO status: traced by dynamo, that guards on every Linear and can exhaust its
            # recompile limit. Compiled blocks are ZeRO-3 leaf modules (leaf_module above), their
            # weights gathered around the whole block, so the plain F.linear serves. Op-level
            # checkpointing cannot have it either (plain_linear_for_selective).
            z["memory_efficient_linear"] = False
        # ZeRO++ (Wang et al. 2023), DeepSpeed's own key names; qwZ/qgZ quantize with CUDA kernels
        z.update(zero_hpz_partition_size=zero.hpz_partition_size, zero_quantized_weights=zero.quantized_weights,
                 zero_quantized_gradients=zero.quantized_gradients)
    if zero.offload_optimizer:
        if zero.stage == 0:
            raise ConfigError("zero.offload_optimizer needs zero.stage >= 1")
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if zero.offload_params:
        if zero.stage != 3:
            raise ConfigError(f"zero.offload_params needs zero.stage=3 (parameters are partitioned only there), "
                              f"got zero.stage={zero.stage}")
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "zero_optimization": z,
        "steps_per_print": 10 ** 9,  # our metrics module logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # torch AdamW / SGD and our LAMB as client optimizers
        "zero_force_ds_cpu_optimizer": False,
        # 0.0 disables clipping: DeepSpeed clips at 1.0 when the key is absent
        "gradient_clipping": float(optim.grad_clip),
        # gradients are averaged over ranks after the reduction, not divided before it
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
    }
    cfg.update(precision_sections(train, zero))
    return merge_passthrough(cfg, extra or {})


# keys of the DeepSpeed config that come from a section of ours: where to change them instead
OWNERS = {"train_batch_size": "train.global_batch_size", "train_micro_batch_size_per_gpu": "train.micro_batch_size",
          "gradient_accumulation_steps": "train.global_batch_size and train.micro_batch_size",
          "gradient_clipping": "optim.grad_clip", "bf16": "train.precision", "fp16": "train.precision",
          "torch_autocast": "train.precision and train.reduce_dtype", "data_types": "train.reduce_dtype",
          "communication_data_type": "train.reduce_dtype",
          "zero_optimization.stage": "zero.stage", "zero_optimization.offload_optimizer": "zero.offload_optimizer",
          "zero_optimization.offload_param": "zero.offload_params",
          "zero_optimization.zero_hpz_partition_size": "zero.hpz_partition_size"}
BUILT = ("optimizer", "scheduler")  # vitscale hands DeepSpeed its own optimizer and LR schedule (optim.*)


def merge_passthrough(ours: dict, extra: dict, prefix: str = "") -> dict:
    """``ours`` with the ``deepspeed:`` section's keys added. A key we set may repeat our value; a
    different one raises ConfigError naming the key of ours that sets it."""
    out = dict(ours)
    for k, v in extra.items():
        path = f"{prefix}{k}"
        if not prefix and k in BUILT:
            raise ConfigError(f"deepspeed.{k}: vitscale builds the {k} itself from optim.*; remove it")
        if k not in out:
            out[k] = v
        elif isinstance(out[k], dict) and isinstance(v, dict) and path not in OWNERS:
            out[k] = merge_passthrough(out[k], v, f"{path}.")
        elif out[k] != v:
            owner = next((o for key, o in OWNERS.items() if path == key or path.startswith(key + ".")), None)
            raise ConfigError(f"deepspeed.{path}={json.dumps(v)} contradicts {json.dumps(out[k])}, which vitscale "
                              + (f"sets from {owner}: change that instead" if owner else
                                 "sets itself (vit-config --deepspeed --world-size N shows its config)"))
    return out


def check_with_deepspeed(ds_cfg: dict) -> None:
    """DeepSpeed's own parser reads ``ds_cfg``; what it refuses is a one-line ConfigError. The parser
    checks the batch against the process group's world size (1 without one, as in ``vit-config``);
    the batch keys are ``check_world_size``'s, so they are restated for that world."""
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    here = dict(ds_cfg, train_batch_size=ds_cfg["train_micro_batch_size_per_gpu"]
                * ds_cfg["gradient_accumulation_steps"] * world)
    try:
        DeepSpeedConfig(here)
    except Exception as e:  # noqa: BLE001  pydantic's ValidationError, DeepSpeed's asserts and ValueErrors
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ConfigError(f"deepspeed: DeepSpeed refuses the merged config: {' '.join(lines[:3])[:400]}") from None


# torch.nn classes whose gradients (and ZeRO-3 weight gathers) go in bf16 under bf16-autocast with
# train.reduce_dtype=bf16: the matmul weights, nearly all the bytes; norms and embeddings stay fp32
AUTOCAST_BF16_COMM_MODULES = ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv2d"]
# fp16's dynamic loss scaling, each key DeepSpeed's default chosen on purpose: start at 2**16 (as
# torch's GradScaler; not Megatron's 2**32, whose first dozens of steps would be skipped halving it
# down), double after 1000 steps without an overflow, halve on the 2nd overflow in a row (hysteresis
# 2: a stray overflow skips its step without lowering the scale), the hysteresis refilled only by a
# raise (consecutive_hysteresis off), never below 1.
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "consecutive_hysteresis": False, "min_loss_scale": 1}


def precision_sections(train: TrainConfig, zero: ZeroConfig) -> dict:
    """DeepSpeed's keys for ``train.precision`` and ``train.reduce_dtype``, every one written out
    (``bf16``, ``fp16``, ``torch_autocast``, ``data_types``, ``communication_data_type``); the
    modes are ``pretrain.distributed.precision``'s. Micro-batch gradients are accumulated in fp32
    unless ``bf16`` is told otherwise.

    - ``bf16``: DeepSpeed's ``bf16``; gradients accumulated and reduced in fp32 with
      ``train.reduce_dtype=fp32`` (``data_types.grad_accum_dtype``, ``communication_data_type``).
      ``check_grad_overflow`` (default on) would make ZeRO-1/2 all-reduce an overflow flag and read
      it on the host every step; ``pretrain.train``'s non-finite guard already drops a non-finite
      micro-batch on the device on every rank, so it is off.
    - ``bf16-autocast``: ``torch_autocast``. The module stays fp32, so its gradients accumulate in
      fp32 on the parameters and ZeRO's fp32 partitions are copies of the fp32 weights
      (``model.init_from`` needs no master fix-up). ``lower_precision_safe_modules`` names the
      modules whose gradients ZeRO reduces, and whose weights ZeRO-3 gathers, in bf16: none with
      ``train.reduce_dtype=fp32`` (DeepSpeed's default when the key is absent is Linear and Conv*:
      written out, the empty list keeps fp32); Linear and Conv2d with bf16. At ZeRO-0 the engine
      reduces every gradient in ``communication_data_type``. Costs against ``bf16`` (DeepSpeed's
      source, benchmarks/results/bf16-policy-cpu.md): the fp32 module (4 B/param instead of 2 on every rank at
      ZeRO-0/1/2), weight all-gathers in fp32 (ZeRO-1/2 after the step, ZeRO-3 every micro-step),
      a bf16 copy of every weight held by autograd from the forward to the backward (also at
      ZeRO-3, whole), fp32 element-wise traffic in norms and residual adds.
    - ``fp16``: DeepSpeed's ``fp16`` with dynamic loss scaling (:data:`FP16_LOSS_SCALING`); a step
      whose gradients overflow is skipped by DeepSpeed and the scale lowered, which needs its
      overflow check: one host read per step. Reduced in fp32 only.

    Refused in one line: ``bf16`` or ``fp16`` at ZeRO-0 (DeepSpeed has no fp32 accumulation for a
    16-bit model there, its optimizer sanity check raises, and its 16-bit path reads every
    gradient on the host each step: ZeRO-1 holds no more per rank); ``train.reduce_dtype=bf16``
    outside the bf16 modes; ``bf16-autocast`` with ``zero.quantized_weights`` (DeepSpeed asserts
    against the pair)."""
    p, stage = train.precision, zero.stage
    if train.reduce_dtype == "bf16" and p not in ("bf16", "bf16-autocast"):
        raise ConfigError(f"train.reduce_dtype=bf16 with train.precision={p}: a bf16 reduction needs a bf16 "
                          "precision; set train.reduce_dtype=fp32")
    if p in ("bf16", "fp16") and stage == 0:
        raise ConfigError(f"zero.stage=0 with train.precision={p}: DeepSpeed accumulates and reduces gradients in "
                          f"{p} there and reads every gradient on the host each step; use zero.stage=1 (fp32 "
                          "master weights and gradients, optimizer states sharded: no more memory per rank), "
                          "train.precision=bf16-autocast or train.precision=fp32")
    if p == "bf16-autocast" and zero.quantized_weights:
        raise ConfigError("zero.quantized_weights=true with train.precision=bf16-autocast: DeepSpeed's torch_autocast "
                          "refuses quantized weights; use train.precision=bf16")
    reduce = "bf16" if train.reduce_dtype == "bf16" else "fp32"
    out = {"bf16": {"enabled": False}, "fp16": {"enabled": False}, "torch_autocast": {"enabled": False},
           "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": reduce}
    if p == "bf16":
        out["bf16"] = {"enabled": True, "check_grad_overflow": False, "immediate_grad_update": False,
                       "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
        out["data_types"] = {"grad_accum_dtype": reduce}
    elif p == "bf16-autocast":
        out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules":
                                 list(AUTOCAST_BF16_COMM_MODULES) if reduce == "bf16" else []}
    elif p == "fp16":
        out["fp16"] = {"enabled": True, "auto_cast": False, **FP16_LOSS_SCALING, "fp16_master_weights_and_grads": False}
    return out


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weight matrices; and biases, norm weights, position embedding and
    [class] token without decay (as big_vision / timm)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))  # ZeRO-3 partitioned (zero.Init): p is a 0-size stub
        if ndim <= 1 or name.endswith(".bias") or name in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def optimizer_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict]:
    """:func:`param_groups`, or with ``optim.layer_decay`` below 1 a group per layer and decay
    (``pretrain.distributed.layer_decay``, timm's ``param_groups_layer_decay``), each at its own
    base LR: ``optim.lr`` times its layer's ``lr_scale``, which the LR schedule (a ``LambdaLR``,
    recording it as the group's ``initial_lr``) then scales. None of them is empty: DeepSpeed drops
    an empty group, after which the schedule would hold one base LR too many."""
    if optim.layer_decay == 1.0:
        return param_groups(model, optim.weight_decay)
    groups = layer_decay_groups(model.named_parameters(), weight_decay=optim.weight_decay,
                                layer_decay=optim.layer_decay,
                                no_weight_decay=getattr(model, "no_weight_decay", lambda: set())())
    for g in groups:
        g["lr"] = optim.lr * g["lr_scale"]
    return groups


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, offload: bool) -> torch.optim.Optimizer:
    """``optim.name`` over :func:`optimizer_groups`."""
    groups = optimizer_groups(model, optim)
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)
    if optim.name == "lamb":  # on the CPU's partitions too under ZeRO-Offload
        return Lamb(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
    if offload:
        # ZeRO-Offload steps the optimizer on the CPU; DeepSpeed's vectorised CPU Adam is ~5x
        # faster than torch's there (built once by JIT, cached in ~/.cache/torch_extensions).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                weight_decay=optim.weight_decay, adamw_mode=True)
    from deepspeed.accelerator import get_accelerator

    fused = use_fused_adamw(get_accelerator().device_name(), torch.cuda.is_available())
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             weight_decay=optim.weight_decay, fused=fused or None)


def use_fused_adamw(accelerator: str, cuda_available: bool) -> bool:
    """Fused (one-kernel) AdamW where DeepSpeed will run the model on CUDA. Decided from the
    accelerator, not from the parameters: the optimizer is built before ``deepspeed.initialize``
    moves the model there, so the parameters are still on the CPU at this point."""
    return accelerator == "cuda" and cuda_available


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Regional compilation: ``torch.compile`` each Transformer block's ``forward`` in place (the
    modules and their parameter names stay, so checkpoints and exports are unchanged). All blocks
    share one shape, so one block's compile is reused by the others (seconds, not the minutes of a
    whole-model compile). Activation checkpointing wraps the blocks' calls unchanged.

    Only ``forward`` is compiled, not the module call: hooks on a block run eagerly around the
    compiled code. Under ZeRO-3 each block must also be a leaf module, so that its parameters are
    gathered by one hook pair around the whole block and no ZeRO hook is left inside it: the
    DeepSpeed config names the block class in ``zero_optimization.leaf_module`` whenever
    ``train.compile`` is on (``deepspeed_config``), and ``deepspeed.initialize`` flags the blocks
    before it installs its hooks. Without that, dynamo traces ZeRO-3's per-Linear hooks, guards on
    each module's id and hits its recompile limit, slower than eager; so does DeepSpeed's
    ``engine.compile()`` (a whole-model compile), and DeepCompile, DeepSpeed's answer to this, runs
    on CUDA only. ZeRO 1/2's hooks sit on the parameters, outside the compiled code. ``backend``:
    torch.compile's (training uses inductor). Returns the count."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ConfigError(f"train.compile: {type(model).__name__} has no Transformer blocks to compile")
    for blk in blocks:
        blk.forward = torch.compile(blk.forward, backend=backend)
    return len(blocks)


def check_zeropp_device(zero: ZeroConfig, cuda: bool) -> None:
    """qwZ and qgZ quantize in DeepSpeed's CUDA quantizer op: without a GPU, one line instead of a
    build error deep inside the first step. hpZ has no kernel of its own."""
    keys = [k for k in ("quantized_weights", "quantized_gradients") if getattr(zero, k)]
    if keys and not cuda:
        raise ConfigError(f"zero.{keys[0]}=true needs CUDA (DeepSpeed's quantizer kernels); this process has no GPU: "
                          f"set zero.{keys[0]}=false on CPU")


def plain_linear_for_selective(checkpointing) -> None:
    """Op-level checkpointing (``pretrain.models.recompute``) keeps each matmul's output for the
    backward; DeepSpeed's ZeRO-3 memory-efficient ``F.linear`` adds the bias into that output in
    place, through an ``_unsafe_view`` that the cache's mutation check does not see, so the
    recompute would add the bias a second time. The DeepSpeed config turns it off under
    ``selective`` (``deepspeed_config``); one that an earlier ZeRO-3 engine of this process
    installed (it "persists unless manually reset", DeepSpeed says) is put back to torch's own."""
    import torch.nn.functional as F

    if selective_checkpointing(checkpointing) and F.linear is not torch._C._nn.linear:
        F.linear = torch._C._nn.linear


def compile_model(model: torch.nn.Module, mode, zero_stage: int, backend: str = "inductor") -> str:
    """``train.compile`` applied to ``model`` in place, before ``deepspeed.initialize``; returns what
    was compiled. ``model``: ``nn.Module.compile`` of the whole module (parameter names, state dict
    and exports unchanged; the LayerNorms, GELU, residual adds and casts between and inside the
    blocks fuse into fewer kernels). DeepSpeed's ``engine.compile()`` calls the same
    ``Module.compile`` after the engine exists; compiling first keeps one path for every stage and
    leaves DeepSpeed's bf16 cast of the module to happen before the first (lazy) trace. At ZeRO-3
    the module hooks split the graph at every gathered module, so ``model`` compiles the blocks
    (each a ZeRO-3 leaf module: ``deepspeed_config``). The whole-model graph produces all
    gradients at the end of its backward, so ZeRO-2's reduction buckets can start only then
    (``pretrain.perf`` prices that)."""
    mode = compile_mode(mode, zero_stage)
    if mode == "model":
        model.compile(backend=backend)
        return "model"
    if mode == "blocks":
        return f"{compile_blocks(model, backend)} blocks"
    return ""


def initialize(model: torch.nn.Module, optim: OptimConfig, train: TrainConfig, zero: ZeroConfig,
               world_size: int, extra: Optional[dict] = None):
    """``deepspeed.initialize`` with our optimizer and schedule; returns (engine, ds_config).
    ``extra``: the config's ``deepspeed:`` pass-through. ``auto`` bucket sizes are decided here from
    the model's parameter count (``pretrain.perf.levers.resolve_zero``); an ``auto`` activation
    checkpointing must be decided before (``pretrain.perf.levers.resolve``, from the device's
    memory), except on a CPU, where it checkpoints nothing."""
    import deepspeed

    ds_compat.import_muon_uncompiled()
    zero = resolved_zero(model, train, zero, world_size)
    n = checkpoint_count(train.activation_checkpointing, len(getattr(model, "blocks", ())))
    if n is None:
        if torch.cuda.is_available():
            raise ConfigError("train.activation_checkpointing=auto is decided from the device's memory "
                              "(pretrain.perf.levers.resolve) before the engine is built")
        n = 0
    ds_cfg = deepspeed_config(optim, train, zero, world_size, extra)
    check_zeropp_device(zero, torch.cuda.is_available())
    if selective_checkpointing(train.activation_checkpointing):
        plain_linear_for_selective(train.activation_checkpointing)
        model.set_grad_checkpointing("selective")
    elif n:
        model.set_grad_checkpointing(n)
    compile_model(model, train.compile, zero.stage)
    optimizer = build_optimizer(model, optim, zero.offload_optimizer)
    factor = schedule.lr_multiplier(optim.schedule, optim.warmup_steps, train.steps, optim.min_lr / optim.lr)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_schedule,
                                           config=ds_cfg)
    shard_lamb(engine, optimizer)
    return engine, ds_cfg


def shard_lamb(engine, optimizer: torch.optim.Optimizer) -> None:
    """Under ZeRO, LAMB steps flat partitions: tell it which pieces of which parameters each holds,
    so that its trust ratios are per whole parameter (``pretrain/distributed/lamb.py``)."""
    if not isinstance(optimizer, Lamb) or engine.zero_optimization_stage() == 0:
        return
    device = ds_masters.collective_device(engine)
    optimizer.shard(lambda: {s.flat: ShardLayout.of(s, device) for s in ds_masters.master_shards(engine)})


def resolved_zero(model: torch.nn.Module, train: TrainConfig, zero: ZeroConfig, world_size: int) -> ZeroConfig:
    """``zero`` with its ``auto`` bucket sizes decided from ``model``'s parameters
    (``pretrain.perf.levers.resolve_zero``; the link from ``LOCAL_WORLD_SIZE`` ranks per node)."""
    import os

    from pretrain.perf import levers

    blocks = getattr(model, "blocks", None)
    block_params = sum(_numel(p) for p in blocks[0].parameters()) if blocks is not None and len(blocks) else 0
    zero, _ = levers.resolve_zero(zero, train, sum(_numel(p) for p in model.parameters()), block_params, world_size,
                                  gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return zero


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 (zero.Init): p is a 0-size stub
