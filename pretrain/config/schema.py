"""The experiment schema: one dataclass per config section, each field with its default.

The sections are what each component receives (``build_loader(cfg.data, ...)``,
``create_model(**cfg.model...)``, ``deepspeed_config(cfg.optim, cfg.train, cfg.zero)``); loading
and checking are ``load.py`` and ``checks.py``. The ``data:`` section is the data pipeline's own
(``data_pipeline/config.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from data_pipeline.config import DataConfig


# --------------------------------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    name: str = "vit_base_patch16_224"
    num_classes: int = 1000
    img_size: Optional[int] = None  # None: the resolution in the model name
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    representation_size: Optional[int] = None  # tanh pre-logits layer (the paper's pre-training head)
    global_pool: Literal["token", "avg"] = "token"
    # stability past ViT-H (timm's options of the same names): LayerNorm over each head's queries
    # and keys; LayerScale on both residual branches, initialised at init_values (null: none)
    qk_norm: bool = False
    init_values: Optional[float] = None
    # start pre-training from existing weights (a run directory, an exported or timm safetensors
    # file, a transformers ViT folder): position embeddings resized, the head kept when its shape
    # fits num_classes, else freshly initialised. A resumed run ignores it (the checkpoint wins).
    init_from: Optional[str] = None


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 10_000
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    min_lr: float = 0.0
    label_smoothing: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    global_batch_size: int = 4096
    micro_batch_size: int = 64  # per rank, per forward/backward
    seed: int = 0
    precision: Literal["bf16", "fp32"] = "bf16"
    # dtype of gradient accumulation and of the gradient reduction across ranks under bf16:
    # fp32 keeps small gradients that a bf16 sum of many ranks rounds away, at 2x the bytes on the wire
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # start-up (DeepSpeed init, a universal-checkpoint conversion, the first collectives) may take this
    # long before the job ends naming the phase; larger than any step-time bound
    startup_timeout_s: float = 3600.0
    activation_checkpointing: bool = False
    log_every_steps: int = 10
    max_nonfinite_steps: int = 5  # this many non-finite losses in a row stop the run
    output_dir: str = "runs/default"
    # a rank without progress this long dumps its stacks to <output_dir>/hang/ and ends the job
    # (the first step and checkpoints get 3x); 0 disables the watchdog
    hang_timeout_s: float = 600.0
    pg_timeout_s: float = 1800.0  # process-group (gloo / NCCL) collective timeout
    # the loop reads the device (stop agreement across ranks, the non-finite verdict) only at log
    # and checkpoint steps and every this many steps: a signal stops the run within this many steps
    sync_every_steps: int = 10
    # compile each Transformer block's forward (regional torch.compile; every ZeRO stage, see README)
    compile: bool = False
    # a rank whose batch reading + forward takes this many times the other ranks' median, in this
    # many logging windows in a row, is named as a straggler (metrics straggler/*, one line)
    straggler_factor: float = 1.5
    straggler_windows: int = 3


@dataclass
class ZeroConfig:
    stage: int = 1
    offload_optimizer: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    # ZeRO++ (stage 3 only): hpZ keeps a secondary weight partition inside groups of this many GPUs
    # (one node), qwZ all-gathers int8 weights, qgZ reduces int4 gradients (both need CUDA kernels)
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None: <train.output_dir>/checkpoints
    every_steps: int = 1000
    keep_last: int = 3
    resume: bool = True  # resume automatically from the latest complete checkpoint
    # write in the background while training goes on (pretrain/checkpointing/async_save.py); YAML key
    # `checkpoint.async` (a Python keyword, so the field is named async_save)
    async_save: bool = False


@dataclass
class WandbConfig:
    mode: Literal["online", "offline", "disabled"] = "offline"
    project: str = "vitscale"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # online only: how long wandb.init may wait for the server (or a missing API key) before the
    # run goes on offline; training never stalls or dies for W&B
    init_timeout_s: float = 30.0


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    jsonl: bool = True


@dataclass
class ValidationConfig:
    """Evaluation while pre-training (``pretrain/evaluation/in_training.py``): validation loss / top-k over
    ``data.val_shards`` and few-shot probes, every ``every_steps`` steps."""
    every_steps: int = 0  # 0: off
    # few-shot probes: vit-transfer suite names, NAME or NAME:PATH
    # (e.g. demo, cifar100:/data/cifar-100-python, imagefolder:/data/pets)
    fewshot_suites: list[str] = field(default_factory=list)
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    fewshot_seeds: int = 3
    fewshot_l2: float = 1024.0  # big_vision's l2_reg = 2**10
    tasks: list[str] = field(default_factory=list)  # vtab1k: probe only these (empty: all present)
    minival_fraction: float = 0.02  # val split cut from train where a suite has none (big_vision)
    seed: int = 0


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
    suite: str = "cifar100"  # a name in pretrain.transfer.suites.SUITES
    protocol: Literal["finetune", "linear", "fewshot"] = "linear"
    data_root: Optional[str] = None
    tasks: list[str] = field(default_factory=list)  # vtab1k: run only these (empty: all present)
    img_size: Optional[int] = None  # None: the checkpoint's resolution; else pos-embed resized
    pool: Literal["model", "token", "avg"] = "model"  # frozen features: model = its pre-logits
    batch_size: int = 64
    workers: int = 2
    seed: int = 0
    # fine-tune (ViT paper / big_vision): SGD momentum 0.9, no weight decay, cosine + warmup
    steps: int = 500
    lr: float = 0.01
    warmup_steps: int = 100
    grad_clip: float = 1.0  # 0 disables clipping
    train_augment: Optional[bool] = None  # None: off for vtab1k (flips change structured labels)
    # linear probe: multinomial logistic regression, L2 penalty on the weights
    linear_l2: float = 1e-4
    # few-shot: big_vision's regularised least squares to +-1 targets
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    fewshot_seeds: int = 3
    fewshot_l2: float = 1024.0  # big_vision's l2_reg = 2**10
    # hyper-parameter sweep: select on train -> val, retrain on train+val, report test
    sweep: Optional[bool] = None  # None: on for vtab1k (train800 -> val200), off otherwise
    sweep_lr: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01, 0.03])
    sweep_linear_l2: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    sweep_fewshot_l2: list[float] = field(default_factory=lambda: [64.0, 256.0, 1024.0, 4096.0])
    minival_fraction: float = 0.02  # val split cut from train where a suite has none (big_vision)
    # results: log into the pre-training W&B run (same id, at the checkpoint's step)
    wandb: bool = False
    watch_poll_s: float = 30.0  # --watch: seconds between looks for new checkpoints
    watch_idle_timeout_s: Optional[float] = None  # --watch: stop after this long without one


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)




