"""The training recipe's pieces against the implementations their users know, in one process:
pre-training's layer-wise LR decay (timm's ``param_groups_layer_decay``), LAMB (timm's ``Lamb``), the BCE loss
(timm's ``BinaryCrossEntropy``), the weights' EMA (timm's ``ModelEmaV3``) and its checkpoint files,
and the config keys that turn them on. Under DeepSpeed, at every ZeRO stage:
tests/integration/test_reference_step.py (one step against plain PyTorch) and
tests/integration/test_elastic_ckpt.py (resume on another world size)."""
import copy
import json

import pytest
import timm
import torch

from pretrain.config import ConfigError, load_config
from pretrain.config.schema import OptimConfig
from pretrain.distributed.ema import WeightEma, decay_at, read_full, write_pieces
from pretrain.distributed.engine import optimizer_groups
from pretrain.distributed.lamb import Lamb
from pretrain.models.losses import classification_loss
from pretrain.models.vit import create_model


def _scales(model, groups) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g.get("lr_scale", 1.0), g["weight_decay"], g.get("lr")) for g in groups
            for p in g["params"]}


@pytest.mark.parametrize("name, kwargs", [
    ("vit_tiny_patch16_224", {}), ("vit_tiny_patch16_224", {"global_pool": "avg"}),
    ("vit_small_patch16_224", {"qk_norm": True, "init_values": 1e-5})])
def test_pretraining_groups_with_layer_decay_equal_timm_param_groups_layer_decay(name, kwargs):
    """optim.layer_decay: every parameter's LR (optim.lr x its scale) and weight decay equal those
    timm gives the same name on its own model (same parameter names: the weights contract); 1.0 is
    the two groups without scales."""
    from timm.optim import param_groups_layer_decay

    ours = create_model(name, img_size=64, num_classes=10, **kwargs)
    ref = timm.create_model(name, img_size=64, num_classes=10, pretrained=False, **kwargs)
    want = {n: (s, wd, 2e-3 * s) for n, (s, wd, _) in _scales(ref, param_groups_layer_decay(
        ref, weight_decay=0.05, no_weight_decay_list=ref.no_weight_decay(), layer_decay=0.65)).items()}
    got = _scales(ours, optimizer_groups(ours, OptimConfig(lr=2e-3, weight_decay=0.05, layer_decay=0.65)))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12), (k, got[k], want[k])
    assert len({s for s, _, _ in got.values()}) == len(ours.blocks) + 2
    plain = optimizer_groups(ours, OptimConfig(lr=2e-3, weight_decay=0.05))
    assert [g["name"] for g in plain] == ["decay", "no_decay"] and all("lr" not in g for g in plain)


def test_the_schedule_scales_each_group_s_own_base_lr():
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)
    opt = torch.optim.SGD(optimizer_groups(m, OptimConfig(lr=2e-3, layer_decay=0.5)), lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.25)
    assert [g["lr"] for g in opt.param_groups] == [2e-3 * g["lr_scale"] * 0.25 for g in opt.param_groups]
    assert sched.base_lrs == [2e-3 * g["lr_scale"] for g in opt.param_groups]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_lamb_equals_timm_lamb_over_three_steps(clip):
    """Same parameters, gradients and hyper-parameters (layer-decay groups, decay and no decay): our
    LAMB equals timm's with its defaults (bias correction, trust ratio where a group decays). With
    timm's own clipping (max_grad_norm 1.0, its default) ours gets the gradients clipped as the
    engine clips them (optim.grad_clip: torch's clip_grad_norm_ here)."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    twin = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    mine = optimizer_groups(model, OptimConfig(lr=1e-2, weight_decay=0.05, layer_decay=0.75))
    theirs_params = dict(twin.named_parameters())
    theirs = [dict(g, params=[theirs_params[names[id(p)]] for p in g["params"]]) for g in mine]
    ours = Lamb(mine, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.05)
    ref = timm.optim.Lamb(theirs, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.05, max_grad_norm=clip)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            g = torch.randn_like(p) * 3
            p.grad, q.grad = g.clone(), g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        ours.step()
        ref.step()
    with torch.no_grad():
        num = sum(float((p - q).pow(2).sum()) for p, q in zip(model.parameters(), twin.parameters()))
        den = sum(float((q - start[n]).pow(2).sum()) for n, q in twin.named_parameters())
    assert den > 0 and (num / den) ** 0.5 <= (1e-6 if clip else 0.0), (num / den) ** 0.5
    state = ours.state[next(model.parameters())]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 3  # as torch's AdamW


@pytest.mark.parametrize("smoothing, threshold, soft", [(0.0, None, False), (0.1, None, False), (0.1, 0.2, False),
                                                        (0.1, None, True), (0.0, 0.2, True)])
def test_bce_equals_timm_binary_cross_entropy(smoothing, threshold, soft):
    """optim.loss=bce against timm.loss.BinaryCrossEntropy on the same logits and targets: class
    indices smoothed, Mixup targets as mixed, both binarised above a threshold; the sum reduction
    is the mean times the image count (evaluation adds batches)."""
    from timm.loss import BinaryCrossEntropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 10, generator=g) * 3
    labels = torch.randint(0, 10, (8,), generator=g)
    one_hot = torch.nn.functional.one_hot(labels, 10).float()
    targets = 0.7 * one_hot + 0.3 * one_hot.flip(0) if soft else labels
    want = BinaryCrossEntropy(smoothing=smoothing, target_threshold=threshold)(logits, targets)
    got = classification_loss(logits, targets, multi_label=False, smoothing=smoothing, loss="bce",
                              target_threshold=threshold)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    total = classification_loss(logits, targets, multi_label=False, smoothing=smoothing, loss="bce",
                                target_threshold=threshold, reduction="sum")
    torch.testing.assert_close(total, want * 8, rtol=1e-6, atol=0)


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_decay_is_timm_model_ema_v3s(warmup):
    from timm.utils.model_ema import ModelEmaV3

    ref = ModelEmaV3(torch.nn.Linear(2, 2), decay=0.9999, use_warmup=warmup)
    for step in (1, 2, 3, 10, 1000, 10 ** 6):
        assert decay_at(step, 0.9999, warmup) == ref.get_decay(step), step


class _Plain:
    """What ``WeightEma`` reads of a DeepSpeed engine at ZeRO-0 (the optimizer steps the module's own
    fp32 parameters): the module, its optimizer, the stage."""

    def __init__(self, module):
        self.module, self.optimizer = module, torch.optim.SGD(module.parameters(), lr=0.1)

    def zero_optimization_stage(self) -> int:
        return 0


def test_ema_of_the_weights_equals_timm_model_ema_v3_and_round_trips_its_files(tmp_path):
    """Stepped as training does (an SGD step, then ``update(step)``), the EMA equals timm's
    ModelEmaV3 updated with the step on a copy of the same model; swapped in, the module computes
    with it and afterwards with its own weights again; its file holds it whole (read_full) and loads
    into another EMA (load)."""
    from timm.utils.model_ema import ModelEmaV3

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # the zero head would give every layer a zero gradient
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = _Plain(model)
    ema = WeightEma(engine, 0.9, warmup=True)
    ref = ModelEmaV3(model, decay=0.9, use_warmup=True)
    x = torch.randn(2, 3, 32, 32)
    for step in range(1, 5):
        engine.optimizer.zero_grad()
        model(x).square().mean().backward()
        engine.optimizer.step()
        ema.update(step)
        ref.update(model, step=step)
    # the EMA moved, and not with the weights: an error relative to its move sees a wrong decay
    want = [w.detach() for w in ref.module.parameters()]
    moved = sum(float((w - s).pow(2).sum()) for w, s in zip(want, start.values())) ** 0.5
    behind = sum(float((w - p.detach()).pow(2).sum()) for w, p in zip(want, model.parameters())) ** 0.5
    error = sum(float((got.view(w.shape) - w).pow(2).sum()) for w, got in zip(want, ema.values)) ** 0.5
    print(f"EMA moved {moved:.3g}, {behind:.3g} behind the weights, {error:.2g} from timm's")
    assert moved > 0.1 and behind > 0.01 * moved and error <= 1e-6 * moved, (moved, behind, error)
    with torch.no_grad():
        before = model(x)
        with ema.swapped():
            swapped = model(x)
            torch.testing.assert_close(swapped, ref.module(x), rtol=1e-6, atol=1e-6)
        assert (swapped - before).abs().max() > 1e-3  # the swap is seen at all
        assert torch.equal(model(x), before)

    tensors, meta = ema.pieces()
    write_pieces(tmp_path / "ema_rank_00000.safetensors", tensors, meta)
    whole = read_full(tmp_path)
    assert whole.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(whole[n], p.detach()) for n, p in ref.module.named_parameters())
    other = WeightEma(_Plain(create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)), 0.9)
    assert other.load(tmp_path) and all(torch.equal(a, b) for a, b in zip(other.values, ema.values))
    assert not WeightEma(engine, 0.9).load(tmp_path / "nowhere")
    wrong = WeightEma(_Plain(create_model("vit_tiny_patch16_224", img_size=32, num_classes=7)), 0.9)
    with pytest.raises(ValueError, match="head.weight of shape"):
        wrong.load(tmp_path)
    with pytest.raises(LookupError, match="trained without train.ema_decay"):
        read_full(tmp_path / "nowhere")


def test_ema_files_of_pieces_assemble_whatever_layout_wrote_them(tmp_path):
    """Pieces written by two 'ranks' that split a tensor where ZeRO would (``<name>@<first element>``):
    read_full joins them, and a missing piece is named."""
    w = torch.arange(10.0)
    meta = {"format": "vitscale-ema", "shapes": json.dumps({"w": [2, 5]})}
    write_pieces(tmp_path / "ema_rank_00000.safetensors", {"w@0": w[:7].clone()}, meta)
    write_pieces(tmp_path / "ema_rank_00001.safetensors", {"w@7": w[7:].clone()}, meta)
    assert torch.equal(read_full(tmp_path)["w"], w.view(2, 5))
    (tmp_path / "ema_rank_00001.safetensors").unlink()
    with pytest.raises(ValueError, match="hold 7 of the 10 values of w"):
        read_full(tmp_path)


@pytest.mark.parametrize("overrides, needle", [
    (["optim.layer_decay=0"], "optim.layer_decay: must be in (0, 1]"),
    (["optim.layer_decay=1.5"], "optim.layer_decay: must be in (0, 1]"),
    (["optim.bce_target_threshold=0.2"], "applies to optim.loss=bce only"),
    (["optim.loss=bce", "optim.bce_target_threshold=1.5"], "optim.bce_target_threshold: must be in [0, 1)"),
    (["optim.loss=bce", "data.multi_label=true"], "optim.loss=bce is for single-label data"),
    (["optim.name=adam"], "optim.name"),
    (["train.ema_decay=1.0"], "train.ema_decay: must be in [0, 1)"),
    (["train.ema_warmup=true"], "train.ema_warmup: warms up the EMA's decay: set train.ema_decay"),
])
def test_recipe_keys_refuse_impossible_values(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_recipe_keys_load():
    cfg = load_config(None, ["optim.name=lamb", "optim.layer_decay=0.65", "optim.loss=bce",
                             "optim.bce_target_threshold=0.2", "train.ema_decay=0.9999", "train.ema_warmup=true"])
    assert (cfg.optim.name, cfg.optim.layer_decay, cfg.optim.loss, cfg.optim.bce_target_threshold) == \
        ("lamb", 0.65, "bce", 0.2)
    assert (cfg.train.ema_decay, cfg.train.ema_warmup) == (0.9999, True)
