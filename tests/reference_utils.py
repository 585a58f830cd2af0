"""Plain-PyTorch references shared by the tests that check a training step of ours against one:
the relative error of a whole update, the samples a run recorded read back by key from the tar
shards (with the deterministic crop those runs configure), and the fine-tune recipe of the ViT
paper written with torch's own optimizer, clipping and scheduler on timm's model; and big_vision's
fixed position embedding (not installed), re-implemented from its code."""
from __future__ import annotations

import io
import math
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# data.augment settings under which RandomResizedCrop takes its documented fallback on every demo
# image (aspect 0.7-1.4): no crop of aspect 4 fits, so the crop is the full-width centre band of
# height W / 4, resized; no flip. (Aspect 1 is not enough: an image one pixel off square fits a
# 95 x 95 crop at a random offset.)
FIXED_CROP = ("data.augment.crop_scale=[1.0,1.0]", "data.augment.crop_ratio=[4.0,4.0]", "data.augment.hflip=0.0")


FP32_BOUND = 1e-5  # relative error of the whole update: reduction order only
# AdamW divides each element by the root of its own squared-gradient average, so rounding in a tiny
# gradient becomes a full-sized difference in its update: the reference itself, summed over our
# micro-batches instead of the whole batch, drifts 9e-5 to 3.2e-4 from the whole-batch reference (test_vit;
# ViT-Ti 4e-5 to 8e-5). Our error may be what the reference's own noise is, twice over.
NOISE_FACTOR = 2.0


def update_error(before: dict, ours: dict, ref: dict) -> tuple[float, float]:
    """(relative error of our whole update ``ours - before`` against the reference's ``ref -
    before``, the reference update's squared norm). Dicts of name -> tensor over ``ref``'s names."""
    num = den = 0.0
    for name, b in ref.items():
        a, b = ours[name].detach().float() - before[name], b.detach().float() - before[name]
        num, den = num + float((a - b).pow(2).sum()), den + float(b.pow(2).sum())
    assert den > 0, "the reference did not move"
    return (num / den) ** 0.5, den


def recorded_steps(run_dir: Path) -> dict[int, list[str]]:
    """The sample keys of each step, from the ``data.record_samples`` logs of every rank."""
    steps = defaultdict(list)
    for f in sorted((Path(run_dir) / "samples").glob("rank-*.tsv")):
        for line in f.read_text().splitlines():
            step, _epoch, key = line.split("\t")
            steps[int(step)].append(key)
    return dict(steps)


def read_back(shards: Path, keys: list[str], img_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels) of ``keys``, read from the tar files beside the manifest ``shards`` and
    preprocessed with torchvision as the :data:`FIXED_CROP` settings make training do."""
    from PIL import Image
    from torchvision.transforms.v2 import functional as TF

    members: dict = {}  # key -> {ext: bytes}
    for tar in sorted(Path(shards).parent.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                key, ext = m.name.split(".", 1)
                members.setdefault(key, {})[ext] = t.extractfile(m).read()
    images, labels = [], []
    for k in keys:
        img = TF.pil_to_tensor(Image.open(io.BytesIO(members[k]["jpg"])).convert("RGB"))
        h, w = img.shape[-2:]
        band = int(round(w / 4.0))  # RandomResizedCrop's fallback for a ratio above the image's: full width
        img = TF.resized_crop(img, (h - band) // 2, 0, band, w, [img_size, img_size], antialias=True)
        images.append((img.float() / 255 - 0.5) / 0.5)
        labels.append(int(members[k]["cls"]))
    return torch.stack(images), torch.tensor(labels)


def timm_start(path: Path, name: str, img_size: int = 64, num_classes: int = 10, **arch) -> dict:
    """A known start for a whole-path run: timm's model ``name`` (``arch``: timm's ``reg_tokens``,
    ``global_pool``, ...) with every weight moved by N(0, 0.02) (no zero head: every layer moves at
    the first step), written to ``path`` for ``model.init_from``. Returns its state dict."""
    import timm

    from pretrain.weights.export import write_safetensors

    torch.manual_seed(3)
    start = timm.create_model(name, img_size=img_size, num_classes=num_classes, **arch)
    with torch.no_grad():
        for p in start.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    write_safetensors(start.state_dict(), path, {"model.name": name})
    return start.state_dict()


def timm_model(state: dict, name: str, img_size: int = 64, num_classes: int = 10, **arch) -> torch.nn.Module:
    """timm's model ``name`` holding ``state`` (``arch``: timm's options, as :func:`timm_start`)."""
    import timm

    model = timm.create_model(name, img_size=img_size, num_classes=num_classes, **arch)
    model.load_state_dict(state)
    return model


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: not on biases, norm weights, the position embedding,
    the [class] and register tokens (big_vision, timm) or the MAP probe (big_vision decays kernels
    only)."""
    def flat(n, p):
        return p.ndim <= 1 or n in ("pos_embed", "cls_token", "reg_token", "attn_pool.latent")

    return [{"params": [p for n, p in model.named_parameters() if not flat(n, p)], "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if flat(n, p)], "weight_decay": 0.0}]


def timm_layer_decay_groups(model: torch.nn.Module, name: str, weight_decay: float, layer_decay: float, lr: float,
                            **timm_kwargs) -> list[dict]:
    """Groups over ``model``'s parameters as timm makes them: ``timm.optim.param_groups_layer_decay``
    on timm's ``name`` (built with ``timm_kwargs``; parameter names are ours), each group's
    ``weight_decay`` and ``lr`` = ``lr`` x its ``lr_scale``."""
    import timm
    from timm.optim import param_groups_layer_decay

    ref = timm.create_model(name, **timm_kwargs)
    groups = param_groups_layer_decay(ref, weight_decay=weight_decay, no_weight_decay_list=ref.no_weight_decay(),
                                      layer_decay=layer_decay)
    names = {id(p): n for n, p in ref.named_parameters()}
    ours = dict(model.named_parameters())
    return [{"params": [ours[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"],
             "lr": lr * g["lr_scale"]} for g in groups]


def reference_schedule(opt, warmup: int, steps: int, schedule: str, min_ratio: float):
    """The learning rate from torch's schedulers: warmup from 1/warmup of the base up to it, then
    held (constant) or decayed (linear / cosine) to ``min_ratio`` of it at the last of ``steps``."""
    sch = torch.optim.lr_scheduler
    decay_steps = steps - warmup
    if schedule == "constant" or decay_steps <= 0:
        after = sch.ConstantLR(opt, factor=1.0, total_iters=0)
    elif schedule == "linear":
        after = sch.LinearLR(opt, start_factor=1.0, end_factor=min_ratio, total_iters=decay_steps)
    else:
        base = opt.param_groups[0]["lr"]
        after = sch.CosineAnnealingLR(opt, T_max=decay_steps, eta_min=min_ratio * base)
    if warmup == 0:
        return after
    # (the groups' LRs are all the base here: one eta_min serves every group)
    up = sch.LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0, total_iters=max(1, warmup - 1))
    return sch.SequentialLR(opt, [up, after], milestones=[warmup])


def train_reference(model: torch.nn.Module, opt, sched, batches, *, clip: float = 0.0, split: int = 0,
                    loss=F.cross_entropy, after_step=None) -> list[float]:
    """Plain PyTorch steps, one per global batch ``(images, targets)`` of ``batches``: the gradient of
    the mean ``loss`` over the batch, ``clip_grad_norm_`` at ``clip`` (0: none), ``opt.step()``,
    ``sched.step()``, then ``after_step(step)`` (counted from 1; e.g. an EMA's update). ``split``: each
    step's gradient summed over chunks of that many images instead (the same mathematics in another
    floating-point order: how far two exact implementations drift apart). Returns every step's
    gradient norm."""
    norms = []
    for step, (images, targets) in enumerate(batches, 1):
        opt.zero_grad()
        if split:
            for lo in range(0, len(images), split):
                x, t = images[lo:lo + split], targets[lo:lo + split]
                (loss(model(x), t) * (len(x) / len(images))).backward()
        else:
            loss(model(images), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        sched.step()
        if after_step is not None:
            after_step(step)
    return norms


def finetune_reference(backbone: dict, name: str, img_size: int, num_classes: int, batches, *, steps: int,
                       lr: float, warmup: int, clip: float) -> tuple[dict, dict, list[float]]:
    """The ViT paper's fine-tune recipe in plain PyTorch, written from the recipe: timm's ``name``
    with the ``backbone`` weights (any ``head.*`` in it dropped) and a new zero-initialised head,
    ``torch.optim.SGD`` with momentum 0.9 and no weight decay, ``clip_grad_norm_`` at ``clip``, and
    ``LambdaLR``: linear warmup ``(t + 1) / warmup`` times a cosine from 1 down towards 0 at
    ``steps``. ``steps`` batches of ``batches``; returns the weights before and after, and every
    step's gradient norm."""
    import timm

    model = timm.create_model(name, img_size=img_size, num_classes=num_classes)
    missing, unexpected = model.load_state_dict({k: v for k, v in backbone.items() if not k.startswith("head.")},
                                                strict=False)
    assert sorted(missing) == ["head.bias", "head.weight"] and not unexpected, (missing, unexpected)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)

    def factor(t: int) -> float:
        progress = min(1.0, max(0.0, (t - warmup) / (steps - warmup)))
        return min(1.0, (t + 1) / warmup if warmup else 1.0) * 0.5 * (1 + math.cos(math.pi * progress))

    norms = train_reference(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor),
                            [b for _, b in zip(range(steps), batches)], clip=clip)
    assert len(norms) == steps, f"{len(norms)} batches for {steps} steps"
    return before, {n: p.detach() for n, p in model.named_parameters()}, norms


def deit_finetune_reference(backbone: dict, name: str, img_size: int, num_classes: int, batches, *, steps: int,
                            lr: float, warmup: int, min_lr: float, weight_decay: float, layer_decay: float,
                            smoothing: float, ema_decay: float) -> tuple[dict, dict, dict]:
    """The DeiT / MAE fine-tune in plain PyTorch with timm's pieces: timm's ``name`` with the
    ``backbone`` weights and a zero head, timm's ``param_groups_layer_decay`` (the model's
    ``no_weight_decay()``, as timm's ``create_optimizer_v2`` passes it) into ``torch.optim.AdamW``
    with each group at ``lr x lr_scale`` (MAE's ``lr_sched``), ``LambdaLR``: linear warmup, then a
    cosine from 1 to ``min_lr / lr``, timm's ``LabelSmoothingCrossEntropy``, no clipping, and timm's
    ``ModelEmaV3`` with its decay warm-up, updated after optimizer step ``t`` with ``step=t`` (timm's
    ``train.py``). Returns the weights before and after, and the EMA's."""
    import timm
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import param_groups_layer_decay
    from timm.utils import ModelEmaV3

    model = timm.create_model(name, img_size=img_size, num_classes=num_classes)
    model.load_state_dict({k: v for k, v in backbone.items() if not k.startswith("head.")}, strict=False)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = param_groups_layer_decay(model, weight_decay=weight_decay, layer_decay=layer_decay,
                                      no_weight_decay_list=model.no_weight_decay())
    for g in groups:
        g["lr"] = lr * g["lr_scale"]
    opt = torch.optim.AdamW(groups, lr=lr)
    ratio = min_lr / lr

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        progress = min(1.0, (t - warmup) / (steps - warmup))
        return ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    ema = ModelEmaV3(model, decay=ema_decay, use_warmup=True)
    loss_fn = LabelSmoothingCrossEntropy(smoothing=smoothing)
    model.train()
    for t, (images, targets) in zip(range(1, steps + 1), batches):
        opt.zero_grad()
        loss_fn(model(images), targets).backward()
        opt.step()
        sched.step()
        ema.update(model, step=t)
    return before, {n: p.detach() for n, p in model.named_parameters()}, \
        {n: p.detach() for n, p in ema.module.named_parameters()}


def big_vision_posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.0) -> np.ndarray:
    """big_vision's ``posemb_sincos_2d`` (``big_vision/models/vit.py``), line for line in numpy
    (jnp -> np): what its ViT adds at the input's own patch grid."""
    y, x = np.mgrid[:h, :w]
    assert width % 4 == 0
    omega = np.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / (temperature ** omega)
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return pe[None, :, :]
