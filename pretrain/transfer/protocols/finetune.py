"""Fine-tuning with a new head, by one of two recipes (``pretrain.transfer.protocols.recipes``): the ViT
paper / big_vision's (SGD with momentum 0.9, no weight decay, global gradient-norm clipping at 1,
cosine decay after a linear warmup) or DeiT / MAE's (AdamW with layer-wise lr decay, label
smoothing, Mixup / CutMix, drop path, an EMA of the weights). Either way the pre-training head is
replaced by one zero-initialised linear layer, optionally at a higher resolution (position
embeddings resized).

One process: plain PyTorch (the CPU tests, one GPU). Started by the deepspeed runner
(WORLD_SIZE > 1): model and optimizer go through ``deepspeed.initialize`` with a ZeRO config built by
``pretrain.distributed.engine.deepspeed_config`` from the run's ``zero`` section (stage 3 shards a ViT-H that
would not fit one device with its optimizer state) and the precision mode of ``train.precision``
(``pretrain.distributed.precision``), as in pre-training.
Every rank trains on its own share of each batch (mixed within that share); accuracy is summed over ranks.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_pipeline.loading.plan import mix_seed
from data_pipeline.loading.transforms import mix_batch
from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed.layer_decay import layer_decay_groups
from pretrain.distributed.precision import compute_dtype, needs_grad_scaler, plain_autocast_dtype
from pretrain.distributed.process import lockstep
from pretrain.distributed.schedule import lr_multiplier
from pretrain.transfer.errors import TransferError
from pretrain.transfer.protocols.ema import WeightEma
from pretrain.transfer.protocols.recipes import BETAS, EPS, MOMENTUM, Recipe
from pretrain.weights.pretrained import Pretrained, build_backbone

TAG_MIX = 11  # mix_seed's first part for the fine-tune's Mixup / CutMix draws


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    deepspeed: bool = False  # True under the deepspeed runner


def finetune_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Cross-entropy in fp32: against class indices (smoothed as torch's ``label_smoothing`` and
    timm's ``LabelSmoothingCrossEntropy``), or against soft targets, the rows Mixup / CutMix make
    (already smoothed: timm's ``SoftTargetCrossEntropy``)."""
    logits = logits.float()
    if targets.is_floating_point():
        return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
    return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)


def mixed_batch(x: torch.Tensor, y: torch.Tensor, recipe: Recipe, num_classes: int, seed: int):
    """``(x, targets)`` of one training batch: Mixup / CutMix of the batch with itself reversed
    (``data_pipeline``'s ``mix_batch``, timm's ``Mixup`` in ``batch`` mode) on smoothed one-hot
    targets (timm's ``mixup_target``); without mixing, the class indices unchanged."""
    if not recipe.mixes:
        return x, y
    off = recipe.label_smoothing / num_classes
    targets = F.one_hot(y, num_classes).float() * (1.0 - recipe.label_smoothing) + off
    return mix_batch(x, targets, recipe, seed)


def build_optimizer(model: torch.nn.Module, recipe: Recipe, lr: float) -> torch.optim.Optimizer:
    """SGD (paper) or AdamW (deit) over the layer-decay groups (``pretrain.distributed.layer_decay``):
    each group starts at ``lr x lr_scale``, which the schedule then scales."""
    groups = layer_decay_groups(model.named_parameters(), weight_decay=recipe.weight_decay,
                                layer_decay=recipe.layer_decay, no_weight_decay=model.no_weight_decay())
    for g in groups:
        g["lr"] = lr * g["lr_scale"]
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS)


class _Plain:
    """One process: the optimizer, clipping and the schedule by hand. On GPUs the forward autocasts to the
    16-bit dtype of ``train.precision`` (both bf16 modes: plain PyTorch keeps the module fp32);
    fp16 scales the loss with torch's GradScaler (dynamic, skips a step whose gradients overflow)."""

    def __init__(self, model, opt, sched, clip: float, device: torch.device, precision: str, smoothing: float = 0.0):
        self.model, self.opt, self.sched, self.clip, self.device = model.to(device), opt, sched, clip, device
        self.smoothing = smoothing
        self.amp = plain_autocast_dtype(device, precision)
        self.scaler = torch.amp.GradScaler(device.type) if needs_grad_scaler(self.amp) else None
        self.ema = None

    def ema_gather(self):
        return None

    def train_step(self, x, y) -> torch.Tensor:
        self.model.train()
        with torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            logits = self.model(x.to(self.device, non_blocking=True))
        loss = finetune_loss(logits, y.to(self.device), self.smoothing)
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
        else:  # the norm is clipped on the unscaled gradients; an overflowing step is skipped
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.scaler.step(self.opt)
            self.scaler.update()
        self.sched.step()
        return loss.detach()

    @torch.no_grad()
    def logits(self, x) -> torch.Tensor:
        self.model.eval()
        with torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            return self.model(x.to(self.device, non_blocking=True)).float()


class _DeepSpeed:
    """The same step through a DeepSpeed engine (ZeRO stage from the run's config)."""

    def __init__(self, model, opt, sched, *, lr: float, recipe: Recipe, ev, zero, precision: str, world: int,
                 checkpointing=False):
        import deepspeed

        from pretrain.distributed import ds_compat
        from pretrain.distributed.engine import deepspeed_config, plain_linear_for_selective, resolved_zero

        ds_compat.import_muon_uncompiled()
        optim = OptimConfig(name=recipe.optimizer, lr=lr, momentum=MOMENTUM, betas=list(BETAS), eps=EPS,
                            weight_decay=recipe.weight_decay, grad_clip=recipe.grad_clip)
        train = TrainConfig(steps=ev.steps, global_batch_size=ev.batch_size, micro_batch_size=ev.batch_size // world,
                            precision=precision, activation_checkpointing=checkpointing)
        plain_linear_for_selective(checkpointing)
        zero = resolved_zero(model, train, zero, world)
        ds_cfg = deepspeed_config(optim, train, zero, world)  # clipping is DeepSpeed's here
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_cfg)
        self.model = self.engine.module  # what _Plain calls its model (ZeRO-3: parameters partitioned)
        self.device = self.engine.device
        self.dtype = compute_dtype(precision)
        self.smoothing = recipe.label_smoothing
        self.ema = None

    def ema_gather(self):
        """ZeRO-3: the context that makes partitioned parameters whole (and, writing, sets them
        from rank 0's values on every rank)."""
        if self.engine.zero_optimization_stage() != 3:
            return None
        import deepspeed

        return lambda params, writes: deepspeed.zero.GatheredParameters(params, modifier_rank=0 if writes else None)

    def train_step(self, x, y) -> torch.Tensor:
        self.engine.train()
        loss = finetune_loss(self.engine(x.to(self.device, self.dtype)), y.to(self.device), self.smoothing)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    @torch.no_grad()
    def logits(self, x) -> torch.Tensor:
        self.engine.eval()
        return self.engine(x.to(self.device, self.dtype)).float()


def top1(runner, split, view, *, batch_size: int, dist_info: Dist, workers: int = 0) -> float:
    """Top-1 of ``runner`` on ``split``, each rank on its share, counts summed over ranks."""
    import torch.distributed as dist

    sync = dist_info.world > 1
    device = runner.device
    correct, total = 0, 0
    batches = split.batches(view, batch_size=batch_size, train=False, rank=dist_info.rank, world=dist_info.world,
                            workers=workers, device=device)
    # ZeRO-3 gathers parameters inside every forward: all ranks run the same number of forwards
    for batch in (lockstep(batches, device) if sync else batches):
        if batch is None:  # this rank ran out: a dummy forward
            runner.logits(torch.zeros(1, 3, view.img_size, view.img_size))
            continue
        x, y = batch
        correct += int((runner.logits(x).argmax(1).cpu() == y).sum())
        total += len(y)
    if sync:
        counts = torch.tensor([correct, total], dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        correct, total = int(counts[0]), int(counts[1])
    if total == 0:
        raise TransferError(f"{split.name}: no examples to evaluate")
    return correct / total


class Finetune:
    name = "finetune"

    def __init__(self, pre: Pretrained, *, img_size: int, ev, recipe: Recipe, view_of, device: torch.device,
                 precision: str, zero=None, grad_checkpointing: bool = False, dist_info: Dist = Dist(), log=None):
        if ev.batch_size % dist_info.world:
            raise TransferError(f"eval.batch_size={ev.batch_size} is not divisible by the world size {dist_info.world}")
        self.pre, self.img_size, self.ev, self.recipe, self.view_of = pre, img_size, ev, recipe, view_of
        self.device, self.precision, self.zero, self.grad_ckpt = device, precision, zero, grad_checkpointing
        self.dist = dist_info
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def grid(self, sweep: bool) -> list[dict]:
        return [{"lr": v} for v in self.recipe.sweep_lr] if sweep else [{"lr": self.recipe.lr}]

    def train(self, task, fit, setting: dict):
        """A fresh model fine-tuned on ``fit`` with ``setting``: ``(runner, last reported loss)``.
        The runner's ``model`` is the trained model (its parameters ZeRO-partitioned under the
        deepspeed runner at stage 3; ``engine`` there is the DeepSpeed engine); its ``ema`` the
        :class:`WeightEma` when the recipe keeps one."""
        ev, recipe, lr = self.ev, self.recipe, setting["lr"]
        torch.manual_seed(ev.seed)  # same initial head / drop-path stream for every setting
        model = build_backbone(self.pre, img_size=self.img_size, num_classes=task.num_classes, finetune=True,
                               drop_path_rate=recipe.drop_path_rate)
        model.set_grad_checkpointing(self.grad_ckpt)
        if not self.dist.deepspeed:
            model.to(self.device)
        opt = build_optimizer(model, recipe, lr)
        min_ratio = min(1.0, recipe.min_lr / lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier("cosine", ev.warmup_steps, ev.steps, min_ratio))
        if self.dist.deepspeed:
            runner = _DeepSpeed(model, opt, sched, lr=lr, recipe=recipe, ev=ev, zero=self.zero,
                                precision=self.precision, world=self.dist.world, checkpointing=self.grad_ckpt)
        else:
            runner = _Plain(model, opt, sched, recipe.grad_clip, self.device, self.precision, recipe.label_smoothing)
        if recipe.ema_decay > 0:
            gather = runner.ema_gather()
            runner.ema = WeightEma(list(runner.model.parameters()), recipe.ema_decay, recipe.ema_warmup,
                                   **({"gather": gather} if gather else {}))
        micro = ev.batch_size // self.dist.world
        batches = fit.batches(self.view_of(task), batch_size=micro, train=True, seed=ev.seed, rank=self.dist.rank,
                              world=self.dist.world, workers=ev.workers, device=self.device)
        recent = []
        every = max(1, ev.steps // 5)
        for step in range(1, ev.steps + 1):
            x, y = next(batches)
            if recipe.mixes:  # mixed where the step runs: no pass over the batch on the host
                x, y = x.to(runner.device, non_blocking=True), y.to(runner.device, non_blocking=True)
            x, y = mixed_batch(x, y, recipe, task.num_classes, mix_seed(TAG_MIX, ev.seed, step, self.dist.rank))
            recent.append(runner.train_step(x, y))
            if runner.ema is not None:
                runner.ema.update(step)
            if step % every == 0 or step == ev.steps:
                loss = float(torch.stack(recent).mean())  # one device sync per report, not per step
                recent = []
                if self.dist.rank == 0:
                    self.log(f"  finetune {task.name} lr={lr:g}: step {step}/{ev.steps} loss {loss:.4f}")
        return runner, loss

    def fit_score(self, task, fit, evaluate, setting: dict) -> tuple[float, dict]:
        ev = self.ev
        runner, loss = self.train(task, fit, setting)

        def score(trained) -> float:
            return top1(trained, evaluate, self.view_of(task), batch_size=ev.batch_size // self.dist.world,
                        dist_info=self.dist, workers=ev.workers)

        acc = score(runner)
        details = {"final_loss": loss, "steps": ev.steps, "batch_size": ev.batch_size, "img_size": self.img_size,
                   "recipe": {k: list(v) if isinstance(v, tuple) else v  # what ran: the setting's lr
                              for k, v in dataclasses.asdict(dataclasses.replace(self.recipe, lr=setting["lr"])).items()
                              if k != "sweep_lr"}}
        if runner.ema is not None:  # timm's choice: the averaged weights are the result
            details["accuracy_no_ema"] = acc
            runner.ema.copy_to_model()
            acc = score(runner)
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return acc, details
