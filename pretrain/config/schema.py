"""The experiment schema: one dataclass per config section, each field with its default.

The sections are what each component receives (``build_loader(cfg.data, ...)``,
``create_model(**cfg.model...)``, ``deepspeed_config(cfg.optim, cfg.train, cfg.zero)``); loading
and checking are ``load.py`` and ``checks.py``. A section one component consumes lives beside it
with its checks, and ``Config`` composes them: ``data:`` (``data_pipeline/config.py``), ``zero:``
(``pretrain/distributed/config.py``), ``checkpoint:`` (``pretrain/checkpointing/config.py``),
``logging:`` (``pretrain/observability/config.py``), ``eval:`` and ``validation:``
(``pretrain/evaluation/config.py``). Here: the model, optimizer and training job.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from data_pipeline.config import DataConfig
from pretrain.checkpointing.config import CheckpointConfig
from pretrain.distributed.config import ZeroConfig
from pretrain.evaluation.config import EvalConfig, ValidationConfig
from pretrain.observability.config import LoggingConfig


# --------------------------------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    name: str = "vit_base_patch16_224"
    """timm name: `vit_{tiny,small,base,large}_patch16_224`, `vit_base_patch32_224`,
    `vit_large_patch32_224`, `vit_huge_patch14_224`, `vit_giant_patch14_224` (g/14, 1.0 B),
    `vit_gigantic_patch14_224` (G/14, 1.8 B), `vit_{base,large}_patch16_384`, hybrids
    `vit_base_r50_s16_224` and `vit_base_r50_s16_384`; `test_vit` (timm's test model, 0.3 M parameters: for checking the
    machinery on a CPU)."""
    num_classes: int = 1000
    """Classes of the head; must match the shards' class list."""
    img_size: Optional[int] = None
    """Training resolution; null: the resolution in the model name."""
    drop_rate: float = 0.0
    """Dropout as the ViT paper applies it (vit_jax): after the position embedding's add, the
    attention's output projection and each MLP layer; none on the attention weights or before the
    head (timm's `pos_drop_rate` and `proj_drop_rate`)."""
    drop_path_rate: float = 0.0
    """Stochastic depth: block `i` of `depth` drops its residual branches at `rate x i / (depth - 1)`,
    0 in the first block, this rate in the last (timm's linear rule)."""
    patch_drop_rate: float = 0.0
    """Patch dropout in training (timm's `patch_drop_rate`, FLIP): each image keeps a random
    `max(1, int(patches x (1 - rate)))` of its patch tokens, every prefix token ([class],
    registers) always; none in evaluation. The blocks run on the kept tokens only (at 0.5 a step
    costs about half), and the logged FLOPs and MFU count those tokens. The mask is drawn from the
    rank's own generator, which checkpoints keep (exact resume); no parameters, so exports are
    unchanged. 0 = off."""
    representation_size: Optional[int] = None
    """Width of the tanh pre-logits layer of the paper's pre-training head; null: none."""
    global_pool: Literal["token", "avg", "map"] = "token"
    """Pooling before the head (timm's `global_pool`): `token` (the [class] token), `avg` (mean of
    the patch tokens, LayerNorm after pooling as timm's `fc_norm`) or `map` (big_vision's multi-head
    attention pooling: a learned probe attends over the patch tokens, then a residual MLP; timm's
    `AttentionPoolLatent`, keys `attn_pool.*`; +1.4 % forward FLOPs at B/16). Registers and the
    [class] token are left out of `avg` and `map`."""
    qk_norm: bool = False
    """LayerNorm over each head's queries and keys (timm's `qk_norm`, keys `attn.q_norm` /
    `attn.k_norm`): bounded attention logits at g/14-G/14 scale (stability past ViT-H)."""
    init_values: Optional[float] = None
    """LayerScale on both residual branches starting at this value (timm's `init_values`, keys
    `ls1.gamma` / `ls2.gamma`), e.g. `1e-5`; null: none."""
    reg_tokens: int = 0
    """Register tokens (Darcet et al. 2024, "Vision Transformers Need Registers"; timm's
    `reg_tokens`, key `reg_token`): learned tokens after the [class] token that every block attends
    to and no pooling reads; 4 in the paper. Each adds one token to every block's sequence."""
    class_token: bool = True
    """The [class] token (timm's `class_token`); `false` drops it (then `global_pool` is `avg` or
    `map`, as in big_vision's recipes) and one token from every block's sequence."""
    pos_embed: Literal["learned", "sincos2d"] = "learned"
    """Position embedding: `learned` (the paper's) or `sincos2d` (big_vision's fixed 2-D sin-cos,
    `posemb_sincos_2d`): not trained (no gradient, weight decay or optimizer state), recomputed for
    the grid at another resolution, and exported under timm's `pos_embed` (zeros for the [class]
    token and registers) so timm loads it as a learned embedding with equal values."""
    init_from: Optional[str] = None
    """Start from existing weights (e.g. continue from an ImageNet-21k model): a run directory, an
    exported or timm safetensors file, or a transformers ViT folder; null: a fresh model. How the
    weights are fitted: pretrain/weights/WEIGHTS.md."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "lamb"] = "adamw"
    """`adamw`, `sgd` or `lamb` (LAMB as timm's `Lamb` with its defaults: Adam moments with bias
    correction, L2 weight decay added to the update, each tensor's update scaled by the trust ratio
    ||w|| / ||update|| where the group decays; computed per whole parameter under every ZeRO stage;
    `optim.grad_clip` is timm's `max_grad_norm`; timm's own `eps` default is 1e-6)."""
    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's and LAMB's betas."""
    eps: float = 1e-8
    """AdamW's and LAMB's epsilon."""
    momentum: float = 0.9
    """SGD momentum (`sgd` only)."""
    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW, L2 in the update for LAMB, L2 on the gradient for SGD); none
    on biases, norms, LayerScale, position embedding, [class] and register tokens, the MAP probe."""
    grad_clip: float = 1.0
    """Global-norm gradient clipping; 0 disables clipping."""
    warmup_steps: int = 10_000
    """Linear warmup steps, then `schedule`."""
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    """Learning-rate decay after the warmup: `linear`, `cosine` or `constant`."""
    min_lr: float = 0.0
    """The learning rate the decay ends at (`linear`, `cosine`). The schedule scales every
    parameter group alike, so with `optim.layer_decay` a group ends at `min_lr` times its scale, as
    timm's scheduler does."""
    label_smoothing: float = 0.0
    """Label smoothing of the single-label loss (`bce`: index targets become `s / classes` off
    and `1 - s + s / classes` on, as timm's `BinaryCrossEntropy`); refused with `data.multi_label`,
    whose loss takes its targets as they are."""
    layer_decay: float = 1.0
    """Layer-wise learning-rate decay (BEiT, MAE and DeiT III fine-tuning), as timm's
    `param_groups_layer_decay`: the head (and `fc_norm`) keeps the full LR, block `i` (from 0) of
    `depth` gets `layer_decay ** (depth - i)`, the final norm that of the last block, the patch
    embedding, position embedding and [class] token `layer_decay ** (depth + 1)`; the LR schedule
    scales every group's own LR. 1.0 = off (two groups, decay and no decay)."""
    loss: Literal["ce", "bce"] = "ce"
    """The loss on single-label data: `ce` softmax cross-entropy, `bce` sigmoid binary cross-entropy
    averaged over images and classes (DeiT III; timm's `BinaryCrossEntropy`): index targets are
    smoothed by `optim.label_smoothing`, Mixup / CutMix targets used as mixed. Multi-label data
    (`data.multi_label`) always trains with sigmoid cross-entropy summed over classes."""
    bce_target_threshold: Optional[float] = None
    """`bce` only: targets above this value become 1, the others 0 (timm's `target_threshold`;
    DeiT III binarises its Mixup / CutMix targets with `gt(0.0)`, i.e. 0); null: targets as they are."""


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps of the whole run: a resumed run goes on up to this step, not this many more
    (the LR schedule's length too)."""
    global_batch_size: int = 4096
    """Images per optimizer step; must be divisible by micro batch x world size, the rest is
    gradient accumulation."""
    micro_batch_size: int = 64
    """Images per rank and forward/backward."""
    seed: int = 0
    """Seed of the model's initialisation, the data order and augmentations, the dropout
    streams."""
    precision: Literal["bf16", "bf16-autocast", "fp16", "fp32"] = "bf16"
    """How the model computes; the optimizer always updates fp32 master weights. `bf16`: DeepSpeed's
    `bf16` mode, the whole module in bf16 (weights, norms, residual stream, logits; the loss in
    fp32), gradients accumulated and reduced in fp32 (`train.reduce_dtype`). `bf16-autocast`: torch
    autocast (DeepSpeed's `torch_autocast`): the module stays fp32, the forward runs matmuls,
    convolutions and attention in bf16 and LayerNorm and the residual stream in fp32; closer to
    fp32 on the first update but slower, with fp32 weight gathers and more memory (the measurements
    and the choice: benchmarks/results/bf16-policy-cpu.md). `fp16`: DeepSpeed's `fp16` mode (whole module in fp16,
    fp32 masters, dynamic loss scaling: a step whose gradients overflow is skipped and the scale
    halved) for GPUs without bf16 (V100, T4). `fp32`: no 16-bit compute. `bf16` and `fp16` need
    `zero.stage` >= 1: at stage 0 DeepSpeed accumulates and reduces gradients in 16 bits and reads
    every gradient on the host each step, so that pair is refused in one line (stage 1 holds no
    more per rank)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Under `bf16` / `bf16-autocast`, the dtype gradients are summed in across ranks. `fp32` keeps
    the small gradients that a bf16 sum over 64-256 ranks rounds away (8 mantissa bits), at 2x the
    gradient bytes on the wire; `bf16` halves those bytes knowingly (the performance model prices
    both). Under `bf16` micro-batch gradients are then also accumulated in bf16 (DeepSpeed's
    `data_types.grad_accum_dtype`); under `bf16-autocast` they accumulate in fp32 on the fp32
    module, and `bf16` is the communication dtype of the weight matrices (Linear, Conv2d:
    DeepSpeed's `torch_autocast.lower_precision_safe_modules`), so at ZeRO-3 their weight gathers
    go in bf16 too. Other precisions refuse `bf16`."""
    startup_timeout_s: float = 3600.0
    """The bound on start-up: process group and DeepSpeed's communication set-up, model build,
    DeepSpeed init, checkpoint resume (a universal-checkpoint conversion on another world size),
    the first step; collectives wait this long (or `train.pg_timeout_s`, if longer) until the first
    step is done. Past it one line names the phase and the rank ends (a guard process: DeepSpeed's
    CPU shm set-up spins in C++ for a dead peer's buffer file, where no Python thread can run);
    larger than any step-time bound; 0 = off (the hang watchdog, if on, still bounds the first step
    at 3x `train.hang_timeout_s`)."""
    activation_checkpointing: Union[bool, int, Literal["auto", "selective"]] = "auto"
    """Recompute blocks in the backward instead of keeping their activations: `true` every block,
    `false` none, `N` >= 0 the first N blocks (the rest keep theirs; past the depth: all), `auto`
    the fewest blocks with which the run fits the device's memory by the memory model
    (`pretrain/perf/memory.py`; none on a CPU).
    Each checkpointed block costs its forward again (about a third more compute for that block).
    `selective`: every block op by op, keeping its matmul and attention outputs and recomputing
    only the element-wise work between them (`pretrain/models/recompute.py`): about 70 % of a
    block's activations kept, no matmul repeated. Start-up, `vit-launch check` and `vit-launch
    plan` say what `auto` chose and what each choice costs."""
    log_every_steps: int = 10
    """Steps per logging window (metrics.jsonl, W&B, the progress line)."""
    max_nonfinite_steps: int = 5
    """Non-finite losses in a row before the run stops, counted by micro-batch (with gradient
    accumulation a streak can end the run within fewer steps); a non-finite micro-batch is dropped on
    every rank (its gradients are zeroed on the device, the step still counts) and the streak is
    checked at the next sync point."""
    output_dir: str = "runs/default"
    """Metrics, config, summary, status, checkpoints, W&B files (layout:
    `pretrain/checkpointing/rundir.py`)."""
    hang_timeout_s: float = 600.0
    """A rank without progress this long dumps every thread's stack to
    `<output_dir>/hang/rank-R.txt` and the job ends (exit 3); checkpoints and evaluations get 3x,
    the first step (a run's, and each `train.resolution_schedule` phase's) `train.startup_timeout_s`
    but at least 3x; 0 = off."""
    pg_timeout_s: float = 1800.0
    """How long a collective waits for its peers (gloo / NCCL process-group timeout), from the end
    of the first step on."""
    sync_every_steps: int = 10
    """The loop reads the device (stop agreement across ranks, the non-finite verdict) only at log
    and checkpoint steps and every this many steps; a signal stops the run within this many steps.
    What that saves: pretrain/perf/PERFORMANCE.md."""
    compile: Union[bool, Literal["blocks", "model"]] = False
    """`torch.compile`: `blocks` each Transformer block's forward (regional: one compile reused by
    every block, seconds; every ZeRO stage), `model` the whole module (fuses the element-wise work
    between blocks too; a minute or more of compile; ZeRO 0-2, ZeRO-3 compiles `blocks`), `false`
    none; `true` means `blocks`. Both work with activation checkpointing; what each gains:
    pretrain/perf/PERFORMANCE.md."""
    resolution_schedule: list[list[float]] = field(default_factory=list)
    """Train most steps on fewer tokens: `[[fraction, px], ...]` or `[[fraction, px, micro batch],
    ...]`, each entry the fraction of `train.steps` at which a resolution starts (the first at 0.0),
    e.g. `[[0.0, 128, 256], [0.6, 192, 128], [0.9, 224]]`; empty: every step at `model.img_size`.
    Every rank switches at the same step boundary: the loader crops at the new size and the model
    resamples its position embedding to the new grid in the forward (the parameter stays at
    `model.img_size`, as timm's `dynamic_img_size`; exports unchanged). The optional micro batch keeps
    the global batch (fewer accumulation steps where the images are small; without it
    `train.micro_batch_size`). Resume and elastic resume work across a switch; the data plan and
    sample accounting are those of the fixed run; in-training evaluation runs at `model.img_size`.
    Metrics log `img_size` and count FLOPs at each step's resolution. What it saves:
    `vit-launch plan --config FILE` (pretrain/perf/PERFORMANCE.md)."""
    straggler_factor: float = 1.5
    """A rank whose own work (batch reading and forward; where collectives block the host, the CPU,
    also backward and step less the time spent in collectives), summed over the last
    `train.straggler_windows` logging windows, takes this many times the other ranks' median is
    named as a straggler (a rank slowed 40 % shows about 1.67x, whether uniformly or in bursts)."""
    straggler_windows: int = 6
    """The span of evidence: logging windows whose phase seconds are summed before a rank is judged
    (a burst lands in any phase, so single windows swing; sums over a span do not). Nobody is named
    before a full span; a slow rank is named in one line (`rank R on HOST: 2.0x the median step,
    mostly in forward`), in `straggler/*` metrics and in `<output_dir>/stragglers.json`;
    `vit-launch run --exclude-slow-hosts` leaves its host out at the next start."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights (timm's `ModelEmaV3` stepped with the
    step count: the first step copies the weights, then `ema = decay * ema + (1 - decay) * w`),
    updated after every optimizer step from the fp32 master weights, each rank its own ZeRO
    partition (4 B/param over the ranks, no communication); saved in checkpoints, evaluated beside
    the weights (`eval/ema/...`), exported by `vit-export --ema`. 0 = off; e.g. 0.9999. Cost:
    pretrain/perf/PERFORMANCE.md."""
    ema_warmup: bool = False
    """Warm the EMA decay up as timm's `ModelEmaV3(use_warmup=True)`: at step `t` the decay is
    `min(train.ema_decay, 1 - t ** (-2/3))` (gamma 1, power 2/3; 0 at the first step), so early
    weights are forgotten quickly."""
    straggler_span_s: float = 5.0
    """The span is lengthened past `train.straggler_windows` windows until it holds at least this
    many seconds of steps: a window of one short step is mostly scheduling noise."""


# keys that moved: a config naming the old key gets one line naming the new one; a config stored
# in an older checkpoint is read with the value moved
MOVED = {"eval.every_steps": "validation.every_steps", "eval.fewshot": "validation.fewshot_suites"}
# keys with no meaning in their section, and why: one line instead of an unknown key's near-miss
NOT_KEYS = {
    "validation.minival_fraction": "the probes fit each suite's whole train split and score its test split; "
                                   "the minival split is vit-transfer's sweep's (eval.minival_fraction)",
    "validation.seed": "the few-shot draws are seeded 0 to validation.fewshot_seeds - 1, as vit-transfer's; "
                       "the minival split's seed is eval.seed",
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The ViT."""
    data: DataConfig = field(default_factory=DataConfig)
    """Shards and the loader (``data_pipeline/config.py``)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training job."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """DeepSpeed ZeRO."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Defaults for ``vit-transfer``."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Evaluation while pre-training."""
    deepspeed: dict = field(default_factory=dict)
    """DeepSpeed config keys the sections above do not cover (e.g. `comms_logger`, `flops_profiler`,
    `zero_optimization.ignore_unused_parameters`), merged into the config a run hands DeepSpeed and
    read by DeepSpeed's own parser before any work. A key vitscale sets from the
    sections above may repeat its value; a different value is refused in one line naming the key to
    change instead (`vit-config --deepspeed --world-size N` prints the merged config)."""
