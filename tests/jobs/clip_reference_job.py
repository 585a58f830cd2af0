"""Run by the deepspeed runner from tests/integration/test_reference_step.py: a few optimizer steps
of our engine (``pretrain.distributed.engine.initialize``, 2 ranks) against plain PyTorch on the
same global batches, for each case given; rank 0 writes, per case, the relative error of the
whole update (our fp32 masters from where DeepSpeed started them), the cosine between the two
updates, the reference's first gradient norm, the reference's own floating-point noise (the same
steps summed over our micro-batches instead of the whole batch) and how far DeepSpeed's masters
started from the given weights.

    deepspeed --num_gpus 2 --module tests.jobs.clip_reference_job OUT.json '{"name": {case}, ...}'

A case sets ``stage`` (ZeRO 0-3), ``optim`` (sgd / adamw / lamb; ``lr`` and ``eps`` other than its
defaults), ``steps``, ``gas`` (micro-batches per
step), ``ckpt`` (activation checkpointing), ``clip`` (optim.grad_clip), ``momentum``, ``wd``
(weight decay), ``precision``, the learning-rate schedule: ``schedule`` (constant / linear /
cosine), ``warmup`` (steps) and ``min_ratio`` (optim.min_lr / optim.lr), ``layer_decay``
(optim.layer_decay), and the loss: ``smoothing`` (optim.label_smoothing), ``multi_label`` (sigmoid
targets, data.multi_label) or ``loss`` ``bce`` (optim.loss) with ``threshold``
(optim.bce_target_threshold) and ``mixed`` (Mixup-like soft targets), and ``offload_params``
(zero.offload_params), ``reduce`` (train.reduce_dtype), ``compile`` (train.compile: the Transformer
blocks compiled by inductor, as training does), ``leaf_blocks`` (zero.leaf_blocks; rank 0 also writes
how many modules DeepSpeed made ZeRO-3 leaves) and ``ema`` / ``ema_warmup`` (train.ema_decay /
train.ema_warmup: rank 0 also writes how far our EMA is from timm's ``ModelEmaV3`` stepped on the
reference and from the decay applied by plain arithmetic to the weights our run had after each
step, and how the module computes with the EMA swapped in and after it is swapped out), ``phases``
(train.resolution_schedule: per step ``[px, gas]``, the engine switched to that micro batch between
steps as training switches it) and ``patch_drop`` (model.patch_drop_rate). Every case starts from
the same weights (``bf16_start``: rounded to bf16 first); the batches of step t are the same on
every rank and in the reference. ``arch`` (model.reg_tokens, class_token, global_pool, pos_embed;
``depth``, the variant's overridden as timm's ``create_model`` allows): the reference is timm's
model with the same options holding the same weights, its ``pos_embed`` frozen for ``sincos2d``.

With ``phases`` or ``patch_drop`` the reference model is timm's too (``dynamic_img_size``, its own
``PatchDropout`` keeping the prefix tokens) holding the same weights. Patch dropout draws each
image's kept tokens from the generator of the process that runs the forward: both sides seed it
alike before each micro-batch of each rank, and the reference sums the micro-batches' gradients as
our ranks split them. (A ``sincos2d`` table at another size is not timm's: timm resamples it, ours
computes it for the new grid; tests/unit/test_fewer_tokens.py checks that one against big_vision's.)

The reference is written from the algorithm, not from our code (here and in tests/reference_utils.py,
which the whole-path tests share): the mean loss over the whole
global batch (cross-entropy against ``1 - smoothing`` on the label plus ``smoothing`` spread over
every class, or for multi-label targets the sigmoid cross-entropy summed over classes), while our
side trains with ``pretrain.models.losses.classification_loss`` as training does;
``torch.nn.utils.clip_grad_norm_``, ``torch.optim.SGD`` / ``AdamW`` with weight decay on weight
matrices only (not on biases, norm weights, the position embedding or the [class] token, as in
big_vision and timm, nor on register tokens or the MAP probe; with ``layer_decay`` timm's own
``param_groups_layer_decay`` on timm's model), timm's ``Lamb`` (``optim: lamb``) and
``BinaryCrossEntropy`` (``loss: bce``), and torch's own schedulers for the learning rate:
``LinearLR`` from 1/warmup for the warmup, then ``LinearLR`` or ``CosineAnnealingLR`` down to
``min_ratio`` of the base at the last step, joined by ``SequentialLR``."""
import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.utils import z3_leaf_module

from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed import ds_compat
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.ema import WeightEma, read_full, write_pieces
from pretrain.distributed.engine import initialize
from pretrain.distributed.precision import compute_dtype
from pretrain.distributed.process import init_distributed
from pretrain.models.losses import classification_loss
from pretrain.models.vit import create_model
from pretrain.perf.collector import after_imports
from tests.dist_utils import TINY_MODEL
from tests.reference_utils import (
    decay_groups,
    deit_finetune_reference,
    finetune_reference,
    reference_schedule,
    timm_layer_decay_groups,
    train_reference,
    update_error,
)

MICRO, IMG, CLASSES = 4, 32, 10  # MICRO: images per rank per step, whatever the accumulation
FINETUNED = "vit_tiny_patch16_224"  # the fine-tune cases' checkpoint (tests/transfer_fixtures.py's tiny_model)
LR = {"sgd": 0.1, "adamw": 1e-3, "lamb": 5e-3}
BETAS, EPS = (0.9, 0.999), 1e-8
DEFAULTS = dict(stage=3, optim="sgd", steps=1, gas=1, ckpt=False, clip=0.0, momentum=0.0, wd=0.0, precision="fp32",
                schedule="constant", warmup=0, min_ratio=0.0, smoothing=0.0, multi_label=False,
                offload_params=False, reduce="fp32", compile=False, leaf_blocks=True, layer_decay=1.0, loss="ce",
                threshold=None, mixed=False, ema=0.0, ema_warmup=False, eps=EPS,
                bf16_start=False, lr=None, arch={}, phases=None, patch_drop=0.0)


def base_model(arch: dict | None = None) -> torch.nn.Module:
    model = create_model(TINY_MODEL, img_size=IMG, num_classes=CLASSES, init_seed=0, **(arch or {}))
    with torch.no_grad():  # a head that is not zero, so every layer has a gradient at the first step
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    return model


def model_options(case: dict) -> dict:
    """The model's options of a case: its ``arch`` and, with ``patch_drop``, model.patch_drop_rate."""
    return {**case["arch"], **({"patch_drop_rate": case["patch_drop"]} if case["patch_drop"] else {})}


def phase(case: dict, step: int) -> tuple[int, int]:
    """(px, micro-batches per step) of ``step``."""
    return tuple(case["phases"][step]) if case["phases"] else (IMG, case["gas"])


def mask_seed(step: int, rank: int, micro: int) -> int:
    """The generator's seed before the forward of one micro-batch of one rank (patch dropout)."""
    return 10_000 + 100 * step + 10 * rank + micro


def batch(step: int, world: int, multi_label: bool = False, mixed: bool = False, img: int = IMG):
    """The global batch of ``step``: images (scaled so that gradients are large enough to clip) and
    labels (class indices, multi-hot rows with about 3 of 10 classes on, or ``mixed``: each one-hot
    row mixed 0.7 : 0.3 with the batch's reversed, as Mixup does)."""
    g = torch.Generator().manual_seed(100 + step)
    images = torch.randn(MICRO * world, 3, img, img, generator=g) * 3
    if multi_label:
        return images, (torch.rand(MICRO * world, CLASSES, generator=g) < 0.3).float()
    labels = torch.randint(0, CLASSES, (MICRO * world,), generator=g)
    if mixed:
        one_hot = F.one_hot(labels, CLASSES).float()
        return images, 0.7 * one_hot + 0.3 * one_hot.flip(0)
    return images, labels


def reference_loss(logits: torch.Tensor, targets: torch.Tensor, case: dict) -> torch.Tensor:
    """Mean over images, from the formulas: sigmoid cross-entropy summed over classes (multi-label), or
    cross-entropy against the smoothed target ``(1 - s) * one_hot + s / classes``; ``bce``: timm's
    ``BinaryCrossEntropy``."""
    if case["loss"] == "bce":
        from timm.loss import BinaryCrossEntropy

        return BinaryCrossEntropy(smoothing=case["smoothing"], target_threshold=case["threshold"])(logits, targets)
    if case["multi_label"]:
        return -(targets * F.logsigmoid(logits) + (1 - targets) * F.logsigmoid(-logits)).sum(1).mean()
    logp = F.log_softmax(logits, dim=1)
    nll = -logp.gather(1, targets[:, None])[:, 0]
    return ((1 - case["smoothing"]) * nll - case["smoothing"] * logp.mean(1)).mean()


def reference_model(base: torch.nn.Module, case: dict) -> torch.nn.Module:
    """The plain-PyTorch model a case's reference trains: a copy of ours, or timm's model of the
    case's options holding our weights: ``arch``'s (a fixed sin-cos embedding frozen there),
    ``dynamic_img_size`` with ``phases`` (another size: the embedding's patch grid resampled),
    timm's ``PatchDropout`` with ``patch_drop``."""
    if not (case["arch"] or case["phases"] or case["patch_drop"]):
        return copy.deepcopy(base)
    import timm

    model = timm.create_model(TINY_MODEL, img_size=IMG, num_classes=CLASSES,
                              dynamic_img_size=bool(case["phases"]), patch_drop_rate=case["patch_drop"],
                              **{k: v for k, v in case["arch"].items() if k != "pos_embed"})
    model.load_state_dict(base.state_dict(), strict=True)
    if case["arch"].get("pos_embed") == "sincos2d":
        model.pos_embed.requires_grad_(False)
    return model


def reference_optimizer(model: torch.nn.Module, case: dict, max_grad_norm=None):
    """The case's optimizer over ``model``: torch's SGD / AdamW or timm's Lamb (its defaults; clipping
    inside only with ``max_grad_norm``), over weight-decay groups or timm's layer-decay groups."""
    from timm.optim import Lamb

    lr = case["lr"] or LR[case["optim"]]
    if case["layer_decay"] != 1.0:
        groups = timm_layer_decay_groups(model, TINY_MODEL, case["wd"], case["layer_decay"], lr,
                                         img_size=IMG, num_classes=CLASSES)
    else:
        groups = decay_groups(model, case["wd"])
    if case["optim"] == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=case["momentum"])
    if case["optim"] == "lamb":
        return Lamb(groups, lr=lr, betas=BETAS, eps=case["eps"], max_grad_norm=max_grad_norm)
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=case["eps"])


def reference(model: torch.nn.Module, case: dict, world: int, split: bool = False):
    """Plain PyTorch: ``case["steps"]`` steps on the whole global batch; the first gradient norm and
    timm's ``ModelEmaV3`` of the steps (None without ``ema``). ``split``: each step's gradient summed
    over the micro-batches our ranks take (the same mathematics in another floating-point order: how
    far two exact implementations drift apart)."""
    from timm.utils.model_ema import ModelEmaV3

    opt = reference_optimizer(model, case)  # clipped by train_reference, as DeepSpeed clips ours
    sched = reference_schedule(opt, case["warmup"], case["steps"], case["schedule"], case["min_ratio"])
    batches = [batch(step, world, case["multi_label"], case["mixed"], phase(case, step)[0])
               for step in range(case["steps"])]
    ema = ModelEmaV3(model, decay=case["ema"], use_warmup=case["ema_warmup"]) if case["ema"] else None
    after_step = (lambda step: ema.update(model, step=step)) if ema else None
    if case["patch_drop"]:
        norms = masked_reference(model, opt, sched, batches, case, world, reverse=split, after_step=after_step)
    else:
        norms = train_reference(model, opt, sched, batches, clip=case["clip"],
                                split=MICRO // case["gas"] if split else 0,
                                loss=lambda logits, targets: reference_loss(logits, targets, case),
                                after_step=after_step)
    return norms[0], ema


def ema_arithmetic(per_step: list[dict], case: dict) -> dict:
    """The decay applied by hand over the weights after each step (timm's rule written out: the first
    step's weights as they are; then ``d`` = ``ema``, or with warmup ``min(ema, 1 - t ** (-2/3))`` at
    step ``t``)."""
    avg = None
    for t, w in enumerate(per_step, 1):
        d = 0.0 if t == 1 else (min(case["ema"], 1 - t ** (-2 / 3)) if case["ema_warmup"] else case["ema"])
        avg = {n: v.clone() for n, v in w.items()} if avg is None else {n: d * avg[n] + (1 - d) * w[n] for n in avg}
    return avg


def ema_checks(engine, ema: WeightEma, case: dict, rank: int, world: int) -> dict:
    """Collective: our EMA whole (each rank's pieces written to files and assembled, as a checkpoint's
    are), and the logits of a fixed batch before, during and after ``ema.swapped()``."""
    import torch.distributed as dist

    folder = [tempfile.mkdtemp(prefix="ema-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    if ema.owns_pieces():
        tensors, meta = ema.pieces()
        write_pieces(Path(folder[0]) / f"ema_rank_{rank:05d}.safetensors", tensors, meta)
    dist.barrier()
    x = batch(99, world)[0][:4].to(compute_dtype(case["precision"]))
    engine.eval()
    with torch.no_grad():
        before = engine(x).float()
        with ema.swapped():
            during = engine(x).float()
        after = engine(x).float()
    engine.train()
    whole = None
    if rank == 0:
        whole = read_full(folder[0])
        shutil.rmtree(folder[0])
    return {"ema": whole, "x": x.float(), "before": before, "during": during, "after": after,
            "precision": case["precision"]}


def masked_reference(model, opt, sched, batches, case: dict, world: int, reverse: bool,
                     after_step=None) -> list[float]:
    """Plain PyTorch with patch dropout: each step's gradient summed over the micro-batches our ranks
    take, each forward after the seed our side sets (``reverse``: summed in the other order, the
    reference's own noise), then ``after_step(step)`` (counted from 1). Every step's gradient norm."""
    norms = []
    for step, (images, targets) in enumerate(batches):
        per = MICRO // phase(case, step)[1]
        chunks = [(r, m) for r in range(world) for m in range(MICRO // per)]
        opt.zero_grad()
        for r, m in reversed(chunks) if reverse else chunks:
            lo = r * MICRO + m * per
            torch.manual_seed(mask_seed(step, r, m))
            (reference_loss(model(images[lo:lo + per]), targets[lo:lo + per], case) * (per / len(images))).backward()
        clip = case["clip"] if case["clip"] > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
        if after_step is not None:
            after_step(step + 1)
    return norms


def ours(model: torch.nn.Module, case: dict, rank: int, world: int):
    """Our engine: each rank its micro-batches of every step, DeepSpeed reduces, clips and steps."""
    lr = case["lr"] or LR[case["optim"]]
    optim = OptimConfig(name=case["optim"], lr=lr, betas=list(BETAS), eps=case["eps"],
                        momentum=case["momentum"], weight_decay=case["wd"], grad_clip=case["clip"],
                        warmup_steps=case["warmup"], schedule=case["schedule"],
                        min_lr=case["min_ratio"] * lr, layer_decay=case["layer_decay"],
                        loss=case["loss"], bce_target_threshold=case["threshold"])
    gas = phase(case, 0)[1]
    train = TrainConfig(steps=case["steps"], global_batch_size=MICRO * world, micro_batch_size=MICRO // gas,
                        precision=case["precision"], activation_checkpointing=case["ckpt"], reduce_dtype=case["reduce"],
                        compile=case["compile"])
    zero = ZeroConfig(stage=case["stage"], offload_params=case["offload_params"], leaf_blocks=case["leaf_blocks"])
    engine, _ = initialize(model, optim, train, zero, world)
    start = weights(engine)  # the fp32 masters DeepSpeed made (from the bf16-rounded module in bf16)
    ema = WeightEma(engine, case["ema"], case["ema_warmup"]) if case["ema"] else None
    twin = SameGradients(start, case) if case["optim"] == "lamb" else None
    dtype = compute_dtype(case["precision"])
    per_step = []
    for step in range(case["steps"]):
        img, gas = phase(case, step)
        per = MICRO // gas
        if case["phases"]:  # between optimizer steps, as pretrain.distributed.phases switches it
            assert ds_compat.set_micro_batch(engine, per) == gas
        images, labels = batch(step, world, case["multi_label"], case["mixed"], img)
        mine = images[rank * MICRO:(rank + 1) * MICRO], labels[rank * MICRO:(rank + 1) * MICRO]
        for m in range(gas):
            x, y = mine[0][m * per:(m + 1) * per], mine[1][m * per:(m + 1) * per]
            if case["patch_drop"]:
                torch.manual_seed(mask_seed(step, rank, m))
            engine.backward(classification_loss(engine(x.to(dtype)), y, multi_label=case["multi_label"],
                                                smoothing=case["smoothing"], loss=optim.loss,
                                                target_threshold=optim.bce_target_threshold))
            if twin is not None and m == gas - 1:
                twin.step(engine)
            engine.step()
        if ema is not None:
            ema.update(step + 1)
            per_step.append(weights(engine))
    leaves = sum(z3_leaf_module(m) for m in engine.module.modules())
    extra = {**ema_checks(engine, ema, case, rank, world), "arithmetic": ema_arithmetic(per_step, case)} if ema else {}
    end = weights(engine)
    if twin is not None:
        extra["same_gradients_error"] = update_error(start, end, twin.weights())[0]
    return start, end, leaves, extra


class SameGradients:
    """timm's Lamb (its own clipping at ``clip``) on a plain copy of our starting masters, stepped
    with the gradients our engine reduced, gathered whole before each of its steps: what our LAMB
    must do with the same parameters and gradients, whatever ZeRO spreads over the ranks."""

    def __init__(self, start: dict, case: dict):
        self.model = base_model(model_options(case))
        self.model.load_state_dict(start)
        self.opt = reference_optimizer(self.model, case, max_grad_norm=case["clip"] or None)
        self.sched = reference_schedule(self.opt, case["warmup"], case["steps"], case["schedule"], case["min_ratio"])

    def step(self, engine) -> None:
        """Collective (ZeRO-3 gathers each gradient)."""
        from deepspeed.utils import safe_get_full_grad

        grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in engine.module.named_parameters()}
        for n, p in self.model.named_parameters():
            p.grad = grads[n]
        self.opt.step()
        self.sched.step()

    def weights(self) -> dict:
        return {n: p.detach() for n, p in self.model.named_parameters()}


def weights(engine) -> dict:
    """Collective: every weight in full, the fp32 master where DeepSpeed keeps one apart; and the
    buffers (a fixed sin-cos ``pos_embed``)."""
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=engine.zero_optimization_stage() == 3):
            master = deepspeed.utils.safe_get_full_fp32_param(p)
            out[name] = (master if master is not None else p).detach().float().clone()
    for name, b in engine.module.named_buffers():
        out[name] = b.detach().float().clone()
    return out


def compare(start: dict, end: dict, ref: torch.nn.Module, before: dict) -> dict:
    """Relative error of our whole update (``end - start``) against the reference's, and their cosine."""
    num = den = dot = ours_sq = 0.0
    for name, q in ref.named_parameters():
        a, b = end[name] - start[name], q.detach() - before[name]
        num += float((a - b).pow(2).sum())
        den += float(b.pow(2).sum())
        dot += float((a * b).sum())
        ours_sq += float(a.pow(2).sum())
    return {"relative_error": (num / den) ** 0.5, "cosine": dot / (ours_sq * den) ** 0.5}


def start_offset(start: dict, before: dict, ref: torch.nn.Module) -> float:
    """How far our masters started from the given weights, relative to the reference's update."""
    num = sum(float((start[n] - before[n]).pow(2).sum()) for n in before)
    den = sum(float((q.detach() - before[n]).pow(2).sum()) for n, q in ref.named_parameters())
    return (num / den) ** 0.5


def ema_results(extra: dict, ref_ema: torch.nn.Module, twin_ema: torch.nn.Module, before: dict, start: dict) -> dict:
    """Our EMA against timm's: the relative error of its movement from where our masters started
    against timm's from the given weights (as ``compare`` does for the weights; the reference's own
    noise: timm's EMA of the split reference); against the arithmetic over our run's weights (the
    largest difference over the largest value); and the module's logits with the EMA swapped in,
    against plain PyTorch on our EMA computing in the module's precision, and after the swap, against
    those before it."""
    ours_ema, ref = extra["ema"], dict(ref_ema.named_parameters())
    num = sum(float(((ours_ema[n] - start[n]) - (q.detach() - before[n])).pow(2).sum()) for n, q in ref.items())
    den = sum(float((q.detach() - before[n]).pow(2).sum()) for n, q in ref.items())
    arithmetic = extra["arithmetic"]
    gap = max(float((ours_ema[n] - arithmetic[n]).abs().max()) for n in arithmetic)
    scale = max(float(v.abs().max()) for v in arithmetic.values())
    plain = base_model().eval()  # computing as the module does: in bf16 (DeepSpeed's bf16), under autocast
    plain.load_state_dict(ours_ema)
    precision = extra["precision"]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
        want = plain.to(compute_dtype(precision))(extra["x"].to(compute_dtype(precision))).float()
    return {"ema_error": (num / den) ** 0.5,
            "ema_noise": update_error(before, dict(twin_ema.named_parameters()), ref)[0],
            "ema_arithmetic_error": gap / scale,
            "ema_logits_error": float((extra["during"] - want).norm() / want.norm()),
            "ema_changes_logits": float((extra["during"] - extra["before"]).norm() / extra["before"].norm()),
            "swap_restores_module": bool(torch.equal(extra["before"], extra["after"]))}


def finetune_cases(spec: dict, rank: int, world: int) -> dict:
    """vit-transfer's fine-tune under the deepspeed runner (``Finetune.train`` with ZeRO ``spec["stages"]``)
    against the recipe in plain PyTorch (``tests/reference_utils.py``) on the global batches: every
    rank's share of each step, read from the split as each rank reads it. ``spec``: the ImageFolder
    ``root``, the ``checkpoint`` file, ``steps``, ``warmup``, ``lr``, ``batch`` (global); ``deit``:
    the same for ``--recipe deit`` (layer decay, AdamW, label smoothing, EMA; mixing and drop path
    off), results ``finetune-deit-z{stage}`` with the EMA's error ``ema_relative_error``."""
    from safetensors.torch import load_file

    from pretrain.config import load_config
    from pretrain.transfer.evaluate import make_protocol
    from pretrain.transfer.protocols.finetune import Dist
    from pretrain.transfer.suites import imagefolder
    from pretrain.weights.pretrained import load_pretrained

    task = imagefolder(spec["root"], minival_fraction=0.25, seed=0)
    out = {}
    for stage in spec["stages"]:
        cfg = load_config(None, ["eval.protocol=finetune", f"eval.steps={spec['steps']}", f"eval.lr={spec['lr']}",
                                 f"eval.warmup_steps={spec['warmup']}", f"eval.batch_size={spec['batch']}",
                                 "eval.workers=0", "eval.train_augment=false", "train.precision=fp32",
                                 f"zero.stage={stage}"])
        protocol = make_protocol(cfg, load_pretrained(spec["checkpoint"]), 32, torch.device("cpu"),
                                 Dist(rank, world, deepspeed=True), lambda m: None)
        runner, _ = protocol.train(task, task.trainval, {"lr": spec["lr"]})
        got = weights(runner.engine)
        shares = [task.trainval.batches(protocol.view_of(task), batch_size=spec["batch"] // world, train=True,
                                        seed=cfg.eval.seed, rank=r, world=world) for r in range(world)]
        batches = ((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])) for parts in zip(*shares))
        before, ref, norms = finetune_reference(load_file(spec["checkpoint"]), FINETUNED, 32,
                                                task.num_classes, batches, steps=spec["steps"], lr=spec["lr"],
                                                warmup=spec["warmup"], clip=protocol.recipe.grad_clip)
        out[f"finetune-z{stage}"] = {"relative_error": update_error(before, got, ref)[0], "grad_norms": norms}
        if spec.get("deit"):
            out[f"finetune-deit-z{stage}"] = deit_case(spec, task, stage, rank, world)
    return out


def deit_case(spec: dict, task, stage: int, rank: int, world: int) -> dict:
    from safetensors.torch import load_file

    from pretrain.config import load_config
    from pretrain.transfer.evaluate import make_protocol
    from pretrain.transfer.protocols.finetune import Dist
    from pretrain.weights.pretrained import load_pretrained

    d = spec["deit"]
    cfg = load_config(None, ["eval.protocol=finetune", "eval.recipe=deit", f"eval.steps={spec['steps']}",
                             f"eval.lr={d['lr']}", f"eval.min_lr={d['min_lr']}", f"eval.ema_decay={d['ema']}",
                             f"eval.warmup_steps={spec['warmup']}", f"eval.batch_size={spec['batch']}",
                             "eval.mixup_alpha=0", "eval.cutmix_alpha=0", "eval.drop_path_rate=0", "eval.workers=0",
                             "eval.train_augment=false", "train.precision=fp32", f"zero.stage={stage}"])
    protocol = make_protocol(cfg, load_pretrained(spec["checkpoint"]), 32, torch.device("cpu"),
                             Dist(rank, world, deepspeed=True), lambda m: None)
    r = protocol.recipe
    runner, _ = protocol.train(task, task.trainval, {"lr": d["lr"]})
    got = weights(runner.engine)
    names = [n for n, _ in runner.engine.module.named_parameters()]
    shares = [task.trainval.batches(protocol.view_of(task), batch_size=spec["batch"] // world, train=True,
                                    seed=cfg.eval.seed, rank=q, world=world) for q in range(world)]
    batches = ((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])) for parts in zip(*shares))
    before, ref, ref_ema = deit_finetune_reference(
        load_file(spec["checkpoint"]), FINETUNED, 32, task.num_classes, batches, steps=spec["steps"],
        lr=d["lr"], warmup=spec["warmup"], min_lr=d["min_lr"], weight_decay=r.weight_decay,
        layer_decay=r.layer_decay, smoothing=r.label_smoothing, ema_decay=d["ema"])
    return {"relative_error": update_error(before, got, ref)[0],
            "ema_relative_error": update_error(before, dict(zip(names, runner.ema.state())), ref_ema)[0],
            "layer_decay": r.layer_decay}


def main():
    after_imports()  # as vit-train: DeepSpeed's gc.collect calls per engine walk only what is newer
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, cases = args[0], json.loads(args[1])
    rank, _, world = init_distributed()
    torch.set_num_threads(1)
    results = {}
    for name, given in cases.items():
        case = {**DEFAULTS, **given}
        base = base_model(model_options(case))
        if case["bf16_start"]:  # weights bf16 holds exactly: DeepSpeed's bf16 masters start where the reference does
            with torch.no_grad():
                for p in base.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        if rank == 0:  # the references are plain PyTorch on the whole global batch: rank 0 alone needs them
            ref, twin = reference_model(base, case), reference_model(base, case)
            before = {n: p.detach().clone() for n, p in ref.named_parameters()}
            norm, ref_ema = reference(ref, case, world)
            _, twin_ema = reference(twin, case, world, split=True)
        start, end, leaves, extra = ours(base, case, rank, world)
        if rank != 0:
            continue
        twin_weights = {n: p.detach() for n, p in twin.named_parameters()}
        results[name] = {**compare(start, end, ref, before), "reference_grad_norm": norm, "leaf_modules": leaves,
                         "reference_noise": compare(before, twin_weights, ref, before)["relative_error"],
                         "masters_start_offset": start_offset(start, before, ref)}
        if extra.get("ema") is not None:
            results[name].update(ema_results(extra, ref_ema.module, twin_ema.module, before, start))
        if "same_gradients_error" in extra:
            results[name]["same_gradients_error"] = extra["same_gradients_error"]
    if len(args) > 2:  # vit-transfer's fine-tune: a JSON spec (finetune_cases)
        results.update(finetune_cases(json.loads(args[2]), rank, world))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
    # one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
    # after its results are written, which the runner reports as a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
