"""The experiment schema: one dataclass per config section, each field with its default.

The sections are what each component receives (``build_loader(cfg.data, ...)``,
``create_model(**cfg.model...)``, ``deepspeed_config(cfg.optim, cfg.train, cfg.zero)``); loading
and checking are ``load.py`` and ``checks.py``. The ``data:`` section is the data pipeline's own
(``data_pipeline/config.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from data_pipeline.config import DataConfig


# --------------------------------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    name: str = "vit_base_patch16_224"
    """timm name: `vit_{tiny,small,base,large}_patch16_224`, `vit_base_patch32_224`,
    `vit_large_patch32_224`, `vit_huge_patch14_224`, `vit_giant_patch14_224` (g/14, 1.0 B),
    `vit_gigantic_patch14_224` (G/14, 1.8 B), `vit_{base,large}_patch16_384`, hybrid
    `vit_base_r50_s16_224`."""
    num_classes: int = 1000
    """Classes of the head; must match the shards' class list."""
    img_size: Optional[int] = None
    """Training resolution; null: the resolution in the model name."""
    drop_rate: float = 0.0
    """Dropout."""
    drop_path_rate: float = 0.0
    """Stochastic depth."""
    representation_size: Optional[int] = None
    """Width of the tanh pre-logits layer of the paper's pre-training head; null: none."""
    global_pool: Literal["token", "avg"] = "token"
    """`token` ([class] token) or `avg`."""
    qk_norm: bool = False
    """LayerNorm over each head's queries and keys (timm's `qk_norm`, keys `attn.q_norm` /
    `attn.k_norm`): bounded attention logits at g/14-G/14 scale (stability past ViT-H)."""
    init_values: Optional[float] = None
    """LayerScale on both residual branches starting at this value (timm's `init_values`, keys
    `ls1.gamma` / `ls2.gamma`), e.g. `1e-5`; null: none."""
    init_from: Optional[str] = None
    """Start from existing weights (e.g. continue from an ImageNet-21k model): a run directory, an
    exported or timm safetensors file, or a transformers ViT folder; null: a fresh model. How the
    weights are fitted: pretrain/weights/WEIGHTS.md."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """`adamw` or `sgd`."""
    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's betas."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    momentum: float = 0.9
    """SGD momentum (`sgd` only)."""
    weight_decay: float = 0.1
    """Decoupled weight decay; none on biases, norms, position embedding, [class] token."""
    grad_clip: float = 1.0
    """Global-norm gradient clipping; 0 disables clipping."""
    warmup_steps: int = 10_000
    """Linear warmup steps, then `schedule`."""
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    """Learning-rate decay after the warmup: `linear`, `cosine` or `constant`."""
    min_lr: float = 0.0
    """The learning rate the decay ends at."""
    label_smoothing: float = 0.0
    """Label smoothing of the classification loss."""


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to run."""
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
    the first step; collectives wait this long until the first step is done. Past it one line
    names the phase and the rank ends (a guard process: DeepSpeed's CPU shm set-up spins in C++
    for a dead peer's buffer file, where no Python thread can run); larger than any step-time
    bound; 0 = off."""
    activation_checkpointing: Union[bool, int, Literal["auto"]] = "auto"
    """Recompute blocks in the backward instead of keeping their activations: `true` every block,
    `false` none, `N` the first N blocks (the rest keep theirs), `auto` the fewest blocks with which
    the run fits the device's memory by the memory model (`pretrain/perf/memory.py`; none on a CPU).
    Each checkpointed block costs its forward again (about a third more compute for that block).
    Start-up, `vit-launch check` and `vit-launch plan` say what `auto` chose and what it costs."""
    log_every_steps: int = 10
    """Steps per logging window (metrics.jsonl, W&B, the progress line)."""
    max_nonfinite_steps: int = 5
    """Non-finite losses in a row before the run stops; a non-finite micro-batch is dropped on
    every rank (its gradients are zeroed on the device, the step still counts) and the streak is
    checked at the next sync point."""
    output_dir: str = "runs/default"
    """Metrics, config, summary, status, checkpoints, W&B files (layout:
    `pretrain/checkpointing/rundir.py`)."""
    hang_timeout_s: float = 600.0
    """A rank without progress this long dumps every thread's stack to
    `<output_dir>/hang/rank-R.txt` and the job ends (exit 3); the first step and checkpoints get
    3x; 0 = off."""
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
    straggler_span_s: float = 5.0
    """The span is lengthened past `train.straggler_windows` windows until it holds at least this
    many seconds of steps: a window of one short step is mostly scheduling noise."""


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
    node), so the backward all-gather stays on NVLink, for `2 x params / hpz` bytes per GPU."""
    quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): int8 weight all-gather; needs DeepSpeed's CUDA quantizer, so a CPU
    run refuses it in one line."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): int4 gradient all-to-all; needs DeepSpeed's CUDA quantizer, so a CPU
    run refuses it in one line."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Where checkpoints go; null: `<train.output_dir>/checkpoints`."""
    every_steps: int = 1000
    """Save every this many steps (and at the end, and on SIGTERM)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Resume automatically from the newest complete checkpoint."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on
    (`pretrain/checkpointing/async_save.py`). YAML key `checkpoint.async` (a Python keyword, so
    the field is named async_save; `checkpoint.async_save` is also accepted); see
    pretrain/checkpointing/CHECKPOINTS.md."""


@dataclass
class WandbConfig:
    mode: Literal["online", "offline", "disabled"] = "offline"
    """`online`, `offline` or `disabled`."""
    project: str = "vitscale"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (user or team); null: W&B's default."""
    group: Optional[str] = None
    """W&B group; `vit-launch sweep` sets one shared by its runs."""
    name: Optional[str] = None
    """W&B run name; null: W&B's."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""
    init_timeout_s: float = 30.0
    """`online`: the longest wait for W&B at start-up (no API key, no network); then the run logs
    offline and says how to `wandb sync`. Training never stalls or dies for W&B."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    jsonl: bool = True
    """Write `metrics.jsonl` in the run directory."""


@dataclass
class ValidationConfig:
    """Evaluation while pre-training (``pretrain/evaluation/in_training.py``): validation loss / top-k over
    ``data.val_shards`` and few-shot probes, every ``every_steps`` steps."""
    every_steps: int = 0
    """Evaluate while pre-training every N steps and at the last one; 0 = off (see
    pretrain/evaluation/EVALUATION.md)."""
    fewshot_suites: list[str] = field(default_factory=list)
    """Few-shot probes while pre-training: vit-transfer suite names, `NAME` or `NAME:PATH` (e.g.
    `demo`, `cifar100:/data/cifar-100-python`, `imagefolder:/data/pets`)."""
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    """The probes' shots per class."""
    fewshot_seeds: int = 3
    """The probes' seeds (draws of the few-shot examples), averaged."""
    fewshot_l2: float = 1024.0
    """The probes' ridge penalty (big_vision's l2_reg = 2**10)."""
    tasks: list[str] = field(default_factory=list)
    """VTAB-1k tasks to probe (empty: all present)."""
    minival_fraction: float = 0.02
    """The val split cut from train where a suite has none (big_vision)."""
    seed: int = 0
    """Seed of that split."""


# transfer suites by name, and whether each needs a folder (eval.data_root, NAME:PATH); the
# builders of each are pretrain/transfer/suites.py, which registers exactly these names
SUITE_NEEDS_ROOT = {"cifar100": True, "vtab1k": True, "demo": False, "imagefolder": True, "shards": True}

# keys that moved: a config naming the old key gets one line naming the new one; a config stored
# in an older checkpoint is read with the value moved
MOVED = {"eval.every_steps": "validation.every_steps", "eval.fewshot": "validation.fewshot_suites"}


@dataclass
class EvalConfig:
    """Transfer evaluation of a checkpoint (``vit-transfer``, ``pretrain/transfer``); evaluation
    while pre-training is ``ValidationConfig``. Plain keys are the settings
    used without a sweep; ``sweep_*`` are the grids searched on train -> val when sweeping."""
    suite: str = "cifar100"
    """vit-transfer's suite: a name in `pretrain.transfer.suites.SUITES`."""
    protocol: Literal["finetune", "linear", "fewshot"] = "linear"
    """vit-transfer's protocol: `finetune`, `linear` or `fewshot`."""
    data_root: Optional[str] = None
    """The suite's data folder (`--data-root`)."""
    tasks: list[str] = field(default_factory=list)
    """VTAB-1k: run only these tasks (empty: all present)."""
    img_size: Optional[int] = None
    """Evaluation resolution; null: the checkpoint's resolution, else the position embedding is
    resized."""
    pool: Literal["model", "token", "avg"] = "model"
    """Frozen features: `model` = the model's own pre-logits, `token` or `avg`."""
    batch_size: int = 64
    """Images per batch."""
    workers: int = 2
    """Data-loading worker processes."""
    seed: int = 0
    """Seed of the new head, the fine-tune data order and the minival split."""
    steps: int = 500
    """Fine-tune steps (ViT paper / big_vision: SGD momentum 0.9, no weight decay, cosine +
    warmup)."""
    lr: float = 0.01
    """Fine-tune learning rate."""
    warmup_steps: int = 100
    """Fine-tune warmup steps."""
    grad_clip: float = 1.0
    """Fine-tune global-norm clipping; 0 disables clipping."""
    train_augment: Optional[bool] = None
    """Fine-tune with random crops and flips; null: off for vtab1k (flips change structured
    labels), on otherwise."""
    linear_l2: float = 1e-4
    """Linear probe (multinomial logistic regression): L2 penalty on the weights."""
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    """Few-shot (big_vision's regularised least squares to +-1 targets): shots per class."""
    fewshot_seeds: int = 3
    """Few-shot: seeds (draws of the examples), averaged."""
    fewshot_l2: float = 1024.0
    """Few-shot ridge penalty (big_vision's l2_reg = 2**10)."""
    sweep: Optional[bool] = None
    """Hyper-parameter sweep: select on train -> val, retrain on train+val, report test; null: on
    for vtab1k (train800 -> val200), off otherwise."""
    sweep_lr: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01, 0.03])
    """Fine-tune learning rates searched when sweeping."""
    sweep_linear_l2: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    """Linear-probe L2 penalties searched when sweeping."""
    sweep_fewshot_l2: list[float] = field(default_factory=lambda: [64.0, 256.0, 1024.0, 4096.0])
    """Few-shot ridge penalties searched when sweeping."""
    minival_fraction: float = 0.02
    """The val split cut from train where a suite has none (big_vision)."""
    wandb: bool = False
    """Log the results into the pre-training W&B run (same id, at the checkpoint's step)."""
    watch_poll_s: float = 30.0
    """`--watch`: seconds between looks for new checkpoints."""
    watch_idle_timeout_s: Optional[float] = None
    """`--watch`: stop after this long without a new checkpoint; null: never."""


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
