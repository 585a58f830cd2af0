"""The shipped recipe configs against their sources' hyper-parameters. Each source's settings are
written down here as its code states them (DeiT III: README_revenge.md's training commands with
main.py's defaults for the flags they leave out; big_vision: configs/vit_s16_i1k.py with its model,
optimizer and pre-processing defaults) and translated by the stated rule (epochs to steps, big_vision's
weight decay to torch's convention, RandAugment levels to torchvision's magnitude scale); the config
must hold the translation. Where a rule is arithmetic on a library's convention, the library or a
plain re-implementation of the source's code checks it: one AdamW step of ours equals big_vision's
optax chain, and torchvision's RandAugment at the config's magnitude applies timm's or big_vision's
rotate and shear strengths (and others where they agree). What a config cannot express is listed in
its header."""
import math
import re

import pytest
import torch
from torchvision.transforms import v2

from pretrain.config import load_config
from pretrain.distributed.engine import build_optimizer
from pretrain.distributed.schedule import lr_multiplier

IMAGENET_1K = 1_281_167  # ImageNet-1k train images: the epoch the step counts are made of
IMAGENET_21K = 14_197_122  # the full ImageNet-21k release's images
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# DeiT (facebookresearch/deit) main.py's defaults for what the DeiT III commands leave out
DEIT_MAIN = dict(opt_eps=1e-8, min_lr=1e-5, clip_grad=None, src=False, repeated_aug=True, drop=0.0,
                 eval_crop_ratio=0.875)
DEIT_LAYER_SCALE_INIT = 1e-4  # models_v2.py: vit_models(init_scale=1e-4), kept by deit_*_patch16_LS
DEIT_BCE_THRESHOLD = 0.0  # engine.py: with --bce-loss, targets = targets.gt(0.0)
FUSED_LAMB_MAX_GRAD_NORM = 1.0  # apex FusedLAMB's default, which timm's create_optimizer leaves as is
DEIT_MODELS = {"deit_base_patch16_LS": "vit_base_patch16_224", "deit_large_patch16_LS": "vit_large_patch16_224"}

# README_revenge.md: "Training on ImageNet-1k" and "finetuning for ViT-B, L and H at resolution 224x224"
DEIT3 = {
    "configs/deit3_b16_in1k.yaml": dict(
        model="deit_base_patch16_LS", batch=256, gpus=8, nodes=1, lr=3e-3, epochs=800, weight_decay=0.05,
        input_size=192, smoothing=0.0, warmup_epochs=5, opt="fusedlamb", mixup=0.8, cutmix=1.0, drop_path=0.2,
        reprob=0.0, bce_loss=True, three_augment=True, aa=None, unscale_lr=True),
    "configs/deit3_l16_in1k.yaml": dict(
        model="deit_large_patch16_LS", batch=64, gpus=8, nodes=4, lr=3e-3, epochs=800, weight_decay=0.05,
        input_size=192, smoothing=0.0, warmup_epochs=5, opt="fusedlamb", mixup=0.8, cutmix=1.0, drop_path=0.45,
        reprob=0.0, bce_loss=True, three_augment=True, aa=None, unscale_lr=True),
    "configs/deit3_b16_in1k_ft224.yaml": dict(
        model="deit_base_patch16_LS", batch=64, gpus=8, nodes=1, lr=1e-5, epochs=20, weight_decay=0.1,
        input_size=224, smoothing=0.1, warmup_epochs=5, opt="adamw", mixup=0.8, cutmix=1.0, drop_path=0.2,
        reprob=0.0, bce_loss=False, three_augment=False, aa="rand-m9-mstd0.5-inc1", unscale_lr=True,
        repeated_aug=False),
    "configs/deit3_l16_in1k_ft224.yaml": dict(
        model="deit_large_patch16_LS", batch=64, gpus=8, nodes=1, lr=1e-5, epochs=20, weight_decay=0.1,
        input_size=224, smoothing=0.1, warmup_epochs=5, opt="adamw", mixup=0.8, cutmix=1.0, drop_path=0.45,
        reprob=0.0, bce_loss=False, three_augment=False, aa="rand-m9-mstd0.5-inc1", unscale_lr=True,
        repeated_aug=False),
    # "Training on ImageNet-21k"; --src (a simple random crop) has no key here: its header says so
    "configs/deit3_l16_in21k.yaml": dict(
        model="deit_large_patch16_LS", batch=64, gpus=8, nodes=4, lr=1e-3, epochs=240, weight_decay=0.02,
        input_size=224, smoothing=0.1, warmup_epochs=5, opt="fusedlamb", mixup=0.0, cutmix=1.0, drop_path=0.3,
        reprob=0.0, bce_loss=False, three_augment=True, aa=None, unscale_lr=True, repeated_aug=False, src=True,
        images=IMAGENET_21K),
}

# big_vision configs/vit_s16_i1k.py, and the defaults it relies on: models/vit.py (dropout 0,
# head_zeroinit), pp/ops_image.py (inception crop area 5-100 %, aspect 0.75-1.33), optax.py (weight
# decay on kernels, not multiplied by the lr), utils.py (warmup then cosine to 0)
BIG_VISION_S16 = dict(variant="S/16", width=384, rep_size=True, pool_type="gap", posemb="sincos2d", dropout=0.0,
                      batch_size=1024, total_epochs=90, lr=1e-3, wd=1e-4, warmup_steps=10_000, decay_type="cosine",
                      grad_clip_norm=1.0, b1=0.9, b2=0.999, eps=1e-8, mixup_p=0.2, randaug=(2, 10),
                      crop_area=(5, 100), crop_ratio=(0.75, 1.33), value_range=(-1, 1), resize_small=256,
                      central_crop=224, loss="softmax_xent")

TIMM_RANDAUGMENT_OPS = 2  # timm's rand_augment_transform: num_layers 2 unless the name has an "n" part


def deit_translation(flags: dict) -> dict:
    """Our keys' values for a DeiT III command (``flags``) over main.py's defaults."""
    f = {**DEIT_MAIN, "images": IMAGENET_1K, **flags}
    batch, epoch = f["batch"] * f["gpus"] * f["nodes"], f["images"]
    # the lr as given; no random erasing (no key here); a simple random crop (--src, no key either) is
    # named in the config's header (test_deit3_configs_hold_the_deit3_commands)
    assert f["unscale_lr"] and f["reprob"] == 0.0
    randaug = (0, None)
    if f["aa"]:  # timm's name parts as its rand_augment_transform splits them: "m9" -> m = 9
        parts = dict(re.split(r"(\d.*)", part)[:2] for part in f["aa"].split("-")[1:])
        randaug = (TIMM_RANDAUGMENT_OPS, 3 * int(parts["m"]))  # timm's level L of 10 = torchvision's 3L of 30
    constant = f["min_lr"] >= f["lr"]  # timm's cosine from lr to min_lr >= lr is flat
    return {
        "model.name": DEIT_MODELS[f["model"]], "model.img_size": f["input_size"],
        "model.drop_path_rate": f["drop_path"], "model.drop_rate": f["drop"],
        "model.init_values": DEIT_LAYER_SCALE_INIT,
        "optim.name": {"fusedlamb": "lamb", "adamw": "adamw"}[f["opt"]], "optim.lr": f["lr"],
        "optim.eps": f["opt_eps"], "optim.betas": [0.9, 0.999], "optim.weight_decay": f["weight_decay"],
        "optim.grad_clip": FUSED_LAMB_MAX_GRAD_NORM if f["opt"] == "fusedlamb" else (f["clip_grad"] or 0.0),
        "optim.schedule": "constant" if constant else "cosine",
        "optim.min_lr": 0.0 if constant else f["min_lr"],
        "optim.warmup_steps": round(f["warmup_epochs"] * epoch / batch),
        "optim.loss": "bce" if f["bce_loss"] else "ce",
        "optim.bce_target_threshold": DEIT_BCE_THRESHOLD if f["bce_loss"] else None,
        "optim.label_smoothing": f["smoothing"],
        "train.global_batch_size": batch, "train.steps": round(f["epochs"] * epoch / batch),
        "train.ema_decay": 0.0,  # main.py's EMA is kept but never what it evaluates or releases as `model`
        "data.repeat_augment": 3 if f["repeated_aug"] else 1,  # RASampler's num_repeats
        "data.augment.three_augment": f["three_augment"],
        "data.augment.randaugment_ops": randaug[0],
        "data.augment.mixup_alpha": f["mixup"], "data.augment.cutmix_alpha": f["cutmix"],
        "data.augment.crop_scale": [0.08, 1.0],  # RandomResizedCropAndInterpolation's default scale
        "data.augment.hflip": 0.5,
        "data.augment.mean": IMAGENET_MEAN, "data.augment.std": IMAGENET_STD,
        "data.augment.eval_crop_pct": f["eval_crop_ratio"],
        **({"data.augment.randaugment_magnitude": randaug[1]} if randaug[1] is not None else {}),
    }


def _value(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("config", sorted(DEIT3))
def test_deit3_configs_hold_the_deit3_commands(config):
    cfg = load_config(config)
    want = deit_translation(DEIT3[config])
    got = {k: _value(cfg, k) for k in want}
    assert got == want, {k: (got[k], v) for k, v in want.items() if got[k] != v}
    if DEIT3[config].get("src"):  # what the config cannot express is named in its header
        assert "simple random crop (--src" in open(config).read()


def test_deit3_in21k_schedule_ends_at_the_commands_size():
    """The low-resolution phase departs from the command, which trains at 224 px throughout: the
    last phase is the command's size, the model's own, and the header says how to restore it."""
    cfg = load_config("configs/deit3_l16_in21k.yaml")
    flags = DEIT3["configs/deit3_l16_in21k.yaml"]
    phases = cfg.train.resolution_schedule
    assert phases[0][0] == 0.0 and phases[-1][1] == flags["input_size"] == cfg.model.img_size
    assert all(p[1] < flags["input_size"] for p in phases[:-1])
    assert "train.resolution_schedule=[]" in open("configs/deit3_l16_in21k.yaml").read()


def test_deit3_fine_tunes_start_from_their_pre_training():
    for size in ("b", "l"):
        pre = load_config(f"configs/deit3_{size}16_in1k.yaml")
        ft = load_config(f"configs/deit3_{size}16_in1k_ft224.yaml")
        assert ft.model.init_from == pre.train.output_dir and ft.model.name == pre.model.name
        assert ft.train.output_dir != pre.train.output_dir


def test_big_vision_s16_config_holds_vit_s16_i1k():
    bv, cfg = BIG_VISION_S16, load_config("configs/plain_vit_s16_in1k.yaml")
    m, o, a = cfg.model, cfg.optim, cfg.data.augment
    assert m.name == "vit_small_patch16_224" and bv["variant"] == "S/16"
    assert m.representation_size == (bv["width"] if bv["rep_size"] is True else bv["rep_size"])
    assert (m.class_token, m.global_pool, m.pos_embed) == (False, "avg", "sincos2d")  # gap: no [class] token
    assert m.drop_rate == bv["dropout"] and m.drop_path_rate == 0.0 and m.init_values is None
    assert cfg.train.global_batch_size == bv["batch_size"]
    assert cfg.train.steps == round(bv["total_epochs"] * IMAGENET_1K / bv["batch_size"])
    assert (o.name, o.lr, o.betas, o.eps, o.grad_clip) == ("adamw", bv["lr"], [bv["b1"], bv["b2"]], bv["eps"],
                                                           bv["grad_clip_norm"])
    assert o.lr * o.weight_decay == pytest.approx(bv["wd"])  # see test_big_vision_weight_decay_...
    assert (o.warmup_steps, o.schedule, o.min_lr) == (bv["warmup_steps"], bv["decay_type"], 0.0)
    assert (o.loss, o.label_smoothing, o.layer_decay) == ("ce", 0.0, 1.0) and bv["loss"] == "softmax_xent"
    assert a.crop_scale == [bv["crop_area"][0] / 100, bv["crop_area"][1] / 100]
    assert a.crop_ratio == list(bv["crop_ratio"]) and a.hflip == 0.5
    assert (a.randaugment_ops, a.randaugment_magnitude) == (bv["randaug"][0], 3 * bv["randaug"][1])
    assert (a.mixup_alpha, a.cutmix_alpha, a.three_augment) == (bv["mixup_p"], 0.0, False)
    lo, hi = bv["value_range"]  # value_range(-1, 1): x / 255 * (hi - lo) + lo = (x / 255 - mean) / std
    assert a.mean == [-lo / (hi - lo)] * 3 and a.std == [1 / (hi - lo)] * 3
    assert a.eval_crop_pct == bv["central_crop"] / bv["resize_small"]
    assert cfg.data.repeat_augment == 1 and cfg.train.ema_decay == 0.0


def _big_vision_schedule(step: int, total: int, warmup: int) -> float:
    """big_vision utils.create_learning_rate_schedule(decay_type='cosine', base=1), re-implemented."""
    progress = min(max((step - warmup) / float(total - warmup), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress)) * min(1.0, step / warmup)


def test_big_vision_weight_decay_and_schedule_equal_ours_after_warmup():
    """Three steps of big_vision's optimizer (optax.py: clip_by_global_norm, scale_by_adam,
    scale(lr), add_decayed_weights(wd) on kernels, scale_by_schedule, scale(-1)), re-implemented in
    plain torch with vit_s16_i1k.py's values, equal three steps of the optimizer the config builds
    (torch's AdamW, lr x our schedule, the global-norm clip DeepSpeed applies) on the same gradients,
    after the warmup where both schedules are the same function."""
    bv, cfg = BIG_VISION_S16, load_config("configs/plain_vit_s16_in1k.yaml")
    total, warmup = cfg.train.steps, cfg.optim.warmup_steps
    ours_factor = lr_multiplier(cfg.optim.schedule, warmup, total, cfg.optim.min_lr / cfg.optim.lr)
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(6, 5)
    with torch.no_grad():
        model.weight.normal_(generator=gen)
        model.bias.normal_(generator=gen)
    kernel, bias = model.weight.detach().clone(), model.bias.detach().clone()
    opt = build_optimizer(model, cfg.optim, offload=False)
    mu = [torch.zeros_like(kernel), torch.zeros_like(bias)]
    nu = [torch.zeros_like(kernel), torch.zeros_like(bias)]
    for count, step in enumerate(range(30_000, 30_003)):
        assert ours_factor(step) == pytest.approx(_big_vision_schedule(step, total, warmup), rel=1e-12)
        grads = [torch.randn(kernel.shape, generator=gen) * 3, torch.randn(bias.shape, generator=gen) * 3]
        # ours
        model.weight.grad, model.bias.grad = grads[0].clone(), grads[1].clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        for g in opt.param_groups:
            g["lr"] = cfg.optim.lr * ours_factor(step)
        opt.step()
        # big_vision's chain
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        grads = [g if norm < bv["grad_clip_norm"] else g / norm * bv["grad_clip_norm"] for g in grads]
        params = [kernel, bias]
        for i, (p, g) in enumerate(zip(params, grads)):
            mu[i] = bv["b1"] * mu[i] + (1 - bv["b1"]) * g
            nu[i] = bv["b2"] * nu[i] + (1 - bv["b2"]) * g * g
            m_hat, v_hat = mu[i] / (1 - bv["b1"] ** (count + 1)), nu[i] / (1 - bv["b2"] ** (count + 1))
            u = m_hat / (torch.sqrt(v_hat) + bv["eps"])
            u = bv["lr"] * u + (bv["wd"] * p if i == 0 else 0.0)  # wd_mults: '.*/kernel$' only
            params[i] = p - _big_vision_schedule(step, total, warmup) * u
        kernel, bias = params
    torch.testing.assert_close(model.weight.detach(), kernel, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(model.bias.detach(), bias, rtol=1e-5, atol=1e-7)


def _torchvision_strengths(magnitude: int, size: int = 224) -> dict:
    space = v2.RandAugment(num_ops=2, magnitude=magnitude)._AUGMENTATION_SPACE
    return {op: float(space[op][0](31, size, size)[magnitude]) for op in ("Rotate", "ShearX", "Brightness", "Color",
                                                                          "Contrast", "Sharpness", "Posterize")}


def test_randaugment_magnitude_gives_big_vision_level_10():
    """big_vision's randaug(2, 10) (pp/autoaugment.py, level 10 of _MAX_LEVEL 10): rotate 30 deg,
    shear 0.3, enhance factor level / 10 x 1.8 + 0.1 = 1.9, posterize to 4 bits; torchvision's
    RandAugment at the config's magnitude rotates, shears and posterizes as much, and enhances by
    1 +- 0.9, of which big_vision draws only the 1.9 (the other differences: the config's header)."""
    level = BIG_VISION_S16["randaug"][1]
    got = _torchvision_strengths(load_config("configs/plain_vit_s16_in1k.yaml").data.augment.randaugment_magnitude)
    assert got["Rotate"] == pytest.approx(level / 10 * 30.0) and got["ShearX"] == pytest.approx(level / 10 * 0.3)
    for op in ("Brightness", "Color", "Contrast", "Sharpness"):
        assert 1 + got[op] == pytest.approx(level / 10 * 1.8 + 0.1)
    assert got["Posterize"] == int(level / 10 * 4)


@pytest.mark.parametrize("config", ["configs/deit3_b16_in1k_ft224.yaml", "configs/deit3_l16_in1k_ft224.yaml"])
def test_randaugment_magnitude_gives_timms_rand_m9(config):
    """DeiT III's fine-tune RandAugment, timm's rand-m9-mstd0.5-inc1 (its mean level 9): timm's own
    op arguments at that level equal torchvision's at the config's magnitude for the ops both have."""
    from timm.data.auto_augment import LEVEL_TO_ARG

    level = int(DEIT3[config]["aa"].split("-")[1][1:])
    got = _torchvision_strengths(load_config(config).data.augment.randaugment_magnitude)
    assert got["Rotate"] == pytest.approx(abs(LEVEL_TO_ARG["Rotate"](level, {})[0]))
    assert got["ShearX"] == pytest.approx(abs(LEVEL_TO_ARG["ShearX"](level, {})[0]))
    for op in ("Brightness", "Color", "Contrast", "Sharpness"):  # inc1: the increasing variants, 1 +- 0.81
        assert got[op] == pytest.approx(abs(LEVEL_TO_ARG[op + "Increasing"](level, {})[0] - 1.0))


# big_vision pp/autoaugment.py, distort_image_with_randaugment: its ops, its fill (replace_value), and
# level_to_arg's arguments at level L of _MAX_LEVEL 10, as its code states them
BIG_VISION_RANDAUG_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "Color",
                          "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateX", "TranslateY",
                          "Cutout", "SolarizeAdd")
BIG_VISION_FILL = 128


def _big_vision_arg(op: str, level: float) -> float:
    return {"Posterize": int((level / 10) * 4), "Solarize": int((level / 10) * 256),
            "Color": (level / 10) * 1.8 + 0.1}[op]


def _randaugment_fills(ra) -> set:
    """The corner values RandAugment leaves where a geometric op uncovers a grey 200 image's corner
    (its centre kept), over 100 seeds."""
    fills = set()
    for seed in range(100):
        torch.manual_seed(seed)
        out = ra(torch.full((3, 16, 16), 200, dtype=torch.uint8))
        if out[0, 8, 8] == 200 and out[0, 0, 0] != 200:
            fills.add(int(out[0, 0, 0]))
    return fills


def test_randaugment_magnitude_doc_states_what_each_library_does():
    """Every strength and difference the `data.augment.randaugment_magnitude` description states,
    checked against torchvision's RandAugment at every magnitude, timm's own level arguments and op
    lists, and big_vision's as its code states them."""
    from timm.data import create_transform
    from timm.data.auto_augment import LEVEL_TO_ARG, RandAugment, rand_augment_transform

    from pretrain.config.reference import field_docs

    doc = " ".join(field_docs()["data.augment.randaugment_magnitude"].split())
    ra = v2.RandAugment(num_ops=2, magnitude=30)
    space = ra._AUGMENTATION_SPACE

    def tv(op, m):
        return float(space[op][0](31, 224, 224)[m])

    claims = {
        "each op drawn from its 14 (Identity among them)": len(space) == 14 and "Identity" in space,
        "uncovered pixels black": _randaugment_fills(v2.RandAugment(num_ops=1, magnitude=30)) == {0},
        "with a random sign": all(space[op][1] for op in ("Rotate", "ShearX", "TranslateX", "Brightness", "Color")),
        "M rotates M degrees, shears 0.01 M": all(tv("Rotate", m) == pytest.approx(m)
                                                   and tv("ShearX", m) == pytest.approx(0.01 * m) for m in range(31)),
        "translates M / 30 x 150 / 331 of the side": all(tv("TranslateX", m) == pytest.approx(m / 30 * 150 / 331 * 224)
                                                         for m in range(31)),
        "factors to 1 +- 0.03 M": all(tv(op, m) == pytest.approx(0.03 * m) for op in ("Brightness", "Color", "Contrast",
                                                                                       "Sharpness") for m in range(31)),
        "posterizes to 8 - round(M / 7.5) bits": all(tv("Posterize", m) == 8 - round(m / 7.5) for m in range(31)),
        "solarizes above 255 (1 - M / 30)": all(255 * tv("Solarize", m) == pytest.approx(255 * (1 - m / 30), abs=1e-4)
                                                for m in range(31)),
        "rotates and shears as M = 3L does": all(
            (L / 10 * 30, L / 10 * 0.3) == pytest.approx((tv("Rotate", 3 * L), tv("ShearX", 3 * L)))  # big_vision
            and abs(LEVEL_TO_ARG["Rotate"](L, {})[0]) == pytest.approx(tv("Rotate", 3 * L))
            and abs(LEVEL_TO_ARG["ShearX"](L, {})[0]) == pytest.approx(tv("ShearX", 3 * L)) for L in range(11)),
        "also draws Invert, Cutout and SolarizeAdd": set(BIG_VISION_RANDAUG_OPS) - set(space)
        == {"Invert", "Cutout", "SolarizeAdd"},
        "fills with grey 128": BIG_VISION_FILL == 128,
        "solarizes above 25.6 L (nothing at 10)": _big_vision_arg("Solarize", 10) == 256
        and all(_big_vision_arg("Solarize", L) == int(25.6 * L) for L in range(11)),
        "keeps int(0.4 L) bits": all(_big_vision_arg("Posterize", L) == int(0.4 * L) for L in range(11)),
        "colour factors to 0.1 + 0.18 L (1.9 at 10, never a random sign)": all(
            _big_vision_arg("Color", L) == pytest.approx(0.1 + 0.18 * L) for L in range(11)),
        "applies each drawn op with probability 0.5": {op.prob for op in rand_augment_transform("rand-m9", {}).ops}
        == {0.5},
        "also draws Invert and SolarizeAdd": {"Invert", "SolarizeAdd"}
        <= {op.name for op in rand_augment_transform("rand-m9", {}).ops},
        "fills with the mean pixel": next(t for t in create_transform(224, is_training=True, auto_augment="rand-m9",
                                                                      mean=(0.2, 0.4, 0.6)).transforms
                                          if isinstance(t, RandAugment)).ops[0].kwargs["fillcolor"] == (51, 102, 153),
        "has big_vision's solarize, posterize and colour factors": all(
            LEVEL_TO_ARG[op](L, {})[0] == pytest.approx(_big_vision_arg(op, L))
            for op in ("Solarize", "Posterize", "Color") for L in range(11)),
        "with `inc1` its colour factors are 1 +- 0.09 L, as M = 3L here": all(
            abs(LEVEL_TO_ARG["ColorIncreasing"](L, {})[0] - 1) == pytest.approx(max(0.09 * L, 0.0))
            and tv("Color", 3 * L) == pytest.approx(0.09 * L) for L in range(11)),
        "posterizes to 4 - int(0.4 L) bits": all(LEVEL_TO_ARG["PosterizeIncreasing"](L, {})[0] == 4 - int(0.4 * L)
                                                 for L in range(11)),
    }
    assert [c for c in claims if c not in doc] == [], "the description states these no longer"
    assert [c for c, holds in claims.items() if not holds] == []
    # why a timm level L is not M = 3L: without inc1 its colour factor at 9 is 1.72, never 1 +- 0.81
    assert LEVEL_TO_ARG["Brightness"](9, {})[0] not in (pytest.approx(1 - tv("Brightness", 27)),
                                                        pytest.approx(1 + tv("Brightness", 27)))
