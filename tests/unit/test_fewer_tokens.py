"""Fewer tokens for the same model: patch dropout and position embeddings resampled to another
resolution against timm (with its prefix tokens: registers, no [class] token, MAP; under autocast
too) and a sin-cos table against big_vision's at the new grid, the FLOPs they count, the
resolution schedule's phases and checks, the loader cropping at a new size from the same
position, the batches regrouped per step, the memory model's largest phase and the plan's price
of a schedule."""
import dataclasses

import pytest
import timm
import torch
from reference_utils import big_vision_posemb_sincos_2d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.step_batches import regrouped, sized_batches
from data_pipeline.loading.synthetic import SyntheticLoader
from pretrain.config import AugmentConfig, ConfigError, DataConfig, check_world_size, load_config
from pretrain.config.phases import Phase, phase_at, resolution_phases
from pretrain.config.schema import TrainConfig
from pretrain.models.arch import analytic_flops, patch_keep
from pretrain.models.tokens import resize_pos_embed
from pretrain.models.vit import create_model
from pretrain.observability.flops import forward_flops
from pretrain.observability.window import Forecast, Window, duration
from pretrain.perf import memory, perfmodel

NAME = "vit_tiny_patch16_224"


def twins(img: int, rate: float, **kw):
    """Our model with a random head, and timm's (``dynamic_img_size``, its own ``PatchDropout``)
    holding the same weights."""
    ours = create_model(NAME, img_size=img, num_classes=10, patch_drop_rate=rate, init_seed=0, **kw)
    with torch.no_grad():
        ours.head.weight.normal_(generator=torch.Generator().manual_seed(1))
    ref = timm.create_model(NAME, img_size=img, num_classes=10, patch_drop_rate=rate, dynamic_img_size=True, **kw)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


# ------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("rate, size", [(0.5, 64), (0.25, 64), (0.75, 48), (0.5, 96)])
def test_patch_dropout_is_timms(rate, size):
    """The same draw from the same generator state keeps the same tokens as timm's PatchDropout, at
    the model's resolution and at others; none are dropped in evaluation."""
    ours, ref = twins(64, rate)
    x = torch.randn(3, 3, size, size)
    torch.manual_seed(5)
    a = ours.train()(x)
    torch.manual_seed(5)
    b = ref.train()(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ours.eval()(x), ref.eval()(x), rtol=0, atol=0)
    torch.manual_seed(6)
    assert not torch.equal(ours.train()(x), a)  # another draw, another subset


def test_patch_dropout_keeps_timms_count_and_the_class_token():
    for tokens in (1, 3, 16, 196, 256):
        for rate in (0.0, 0.1, 0.5, 0.75, 0.9):
            assert patch_keep(tokens, rate) == (tokens if rate == 0 else max(1, int(tokens * (1 - rate))))
    model = create_model(NAME, img_size=64, num_classes=10, patch_drop_rate=0.5, init_seed=0).train()
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(2, 3, 64, 64)
    model(x)
    assert seen[0].shape == (2, 1 + patch_keep(16, 0.5), 192)
    torch.testing.assert_close(seen[0][:, 0], (model.cls_token + model.pos_embed[:, :1])[:, 0].expand(2, -1))
    patches = model.patch_embed(x) + model.pos_embed[:, 1:]
    for i in range(2):  # each kept token is one of the image's own patch tokens
        assert all(any(torch.allclose(t, p) for p in patches[i]) for t in seen[0][i, 1:])


@pytest.mark.parametrize("size", [32, 48, 96])
def test_position_embeddings_resample_as_timms_dynamic_img_size(size):
    """Another resolution than the model's: the stored grid resampled in the forward, the parameter
    unchanged, and its gradient through the interpolation equal to timm's."""
    ours, ref = twins(64, 0.0)
    x = torch.randn(2, 3, size, size)
    a, b = ours(x), ref(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    assert ours.pos_embed.shape == (1, 17, 192)
    torch.testing.assert_close(ours.pos_embed.grad, ref.pos_embed.grad, rtol=1e-4, atol=1e-6)


# the prefix-token layouts timm builds with the same option names: registers after the [class]
# token, registers alone, no prefix at all; MAP or average pooling of the patch tokens
PREFIXES = {"reg4": dict(reg_tokens=4), "reg4-map": dict(reg_tokens=4, global_pool="map"),
            "nocls-reg2-avg": dict(reg_tokens=2, class_token=False, global_pool="avg"),
            "nocls-map": dict(class_token=False, global_pool="map")}


@pytest.mark.parametrize("arch", list(PREFIXES.values()), ids=list(PREFIXES))
def test_prefix_tokens_with_patch_dropout_and_another_size_are_timms(arch):
    """timm's ``VisionTransformer(reg_tokens=..., class_token=..., global_pool=..., patch_drop_rate=...,
    dynamic_img_size=True)`` on the same weights and the same draws: the same logits and gradients at
    the model's size and at another, in training and evaluation. Patch dropout keeps every prefix
    token ([class], registers) and draws among the patches only; the resample moves only the
    embedding's patch grid, the prefix rows stay as stored."""
    ours, ref = twins(64, 0.5, **arch)
    n = ours.num_prefix_tokens
    assert n == ref.num_prefix_tokens == int(arch.get("class_token", True)) + arch.get("reg_tokens", 0)
    seen = []
    ours.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    for size in (64, 48):
        ours.zero_grad(), ref.zero_grad()
        x = torch.randn(3, 3, size, size)
        torch.manual_seed(5)
        a = ours.train()(x)
        torch.manual_seed(5)
        b = ref.train()(x)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        a.square().sum().backward()
        b.square().sum().backward()
        theirs = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        grid = (size // 16) ** 2
        assert seen[-1].shape == (3, n + patch_keep(grid, 0.5), 192)
        prefix = [t for t in (ours.cls_token, ours.reg_token) if t is not None]
        if prefix:  # every prefix token, each with its own stored position row
            want = torch.cat(prefix, dim=1) + ours.pos_embed[:, :n]
            torch.testing.assert_close(seen[-1][:, :n], want.expand(3, -1, -1))
        torch.testing.assert_close(ours.eval()(x), ref.eval()(x), rtol=1e-5, atol=1e-5)
    assert ours.pos_embed.shape == (1, n + 16, 192)



@pytest.mark.parametrize("arch", [PREFIXES["nocls-map"], dict(class_token=False, global_pool="avg"),
                                  PREFIXES["reg4"]], ids=["nocls-map", "nocls-avg", "reg4"])
@pytest.mark.parametrize("size", [64, 48])
def test_under_autocast_the_residual_stream_is_timms_fp32_with_or_without_prefix_tokens(arch, size):
    """``train.precision=bf16-autocast``: an fp32 module whose convolution gives bf16 tokens. timm's
    stream is fp32 from the position embedding's add on (its prefix tokens' concatenation promotes
    it first where there are any); so is ours, with patch dropout, at the model's size and another,
    with the same tokens into every block and the same features out."""
    ours, ref = twins(64, 0.5, **arch)
    seen, theirs = [], []
    ours.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ref.blocks[0].register_forward_pre_hook(lambda m, args: theirs.append(args[0]))
    x = torch.randn(2, 3, size, size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(5)
        a = ours.train().forward_features(x)
        torch.manual_seed(5)
        b = ref.train().forward_features(x)
    assert seen[0].dtype == theirs[0].dtype == torch.float32
    torch.testing.assert_close(seen[0], theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


class _HostTensors(TorchDispatchMode):
    """The ops that see a tensor on the host (inputs or outputs), in dispatch order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten((args, kwargs, out))[0]):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("pos_embed", ["learned", "sincos2d"])
def test_a_training_step_at_another_size_makes_nothing_on_the_host(pos_embed):
    """A step at another size than the model's (the resampled or recomputed position embedding,
    patch dropout's draw, dropout, stochastic depth), forward and backward, makes every tensor on
    the model's device: on a GPU a table made on the host is copied over, and that copy waits for
    the stream every step. The model and input on the meta device, every op's tensors looked at."""
    model = create_model(NAME, img_size=64, num_classes=10, pos_embed=pos_embed, patch_drop_rate=0.5,
                         drop_rate=0.1, drop_path_rate=0.1, reg_tokens=2).to("meta").train()
    with _HostTensors() as seen:
        loss = model(torch.empty(2, 3, 48, 48, device="meta")).sum()
        loss.backward()
    assert loss.device.type == "meta" and seen.ops == [], seen.ops[:10]

@pytest.mark.parametrize("arch", [dict(), dict(reg_tokens=2, class_token=False, global_pool="map")])
def test_a_sincos_table_at_another_size_is_big_visions_for_that_grid(arch):
    """``pos_embed='sincos2d'`` at another size than the model's: the table is big_vision's
    ``posemb_sincos_2d`` of the input's own grid (what big_vision's ViT adds), not the stored one
    resampled; the prefix rows get none; the buffer keeps the model's grid; patch dropout then keeps
    the prefix and draws among those patches."""
    model = create_model(NAME, img_size=64, num_classes=10, pos_embed="sincos2d", init_seed=0, **arch).eval()
    n = model.num_prefix_tokens
    stored = model.pos_embed.clone()
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        model(x)
        table = torch.from_numpy(big_vision_posemb_sincos_2d(3, 3, 192)).float()
        torch.testing.assert_close(seen[0][:, n:], model.patch_embed(x) + table)
        prefix = [t for t in (model.cls_token, model.reg_token) if t is not None]
        if prefix:
            torch.testing.assert_close(seen[0][:, :n], torch.cat(prefix, dim=1).expand(2, -1, -1))
        resampled = resize_pos_embed(stored, (3, 3), (4, 4), n)[:, n:]
        assert (resampled - table).abs().max() > 1e-2  # a resample would be another table
    assert torch.equal(model.pos_embed, stored) and model.pos_embed.shape == (1, n + 16, 192)
    dropping = create_model(NAME, img_size=64, num_classes=10, pos_embed="sincos2d", patch_drop_rate=0.5,
                            init_seed=0, **arch).train()
    dropping.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        dropping(x)
    kept, patches = seen[-1], model.patch_embed(x) + table
    assert kept.shape == (2, n + patch_keep(9, 0.5), 192)
    for i in range(2):  # each kept token one of the image's own patch tokens at the new grid's position
        assert all(any(torch.allclose(t, q, atol=1e-6) for q in patches[i]) for t in kept[i, n:])


def test_a_patch_dropout_model_exports_what_timm_loads(tmp_path):
    """No parameters of its own: the state dict is the plain model's, and timm's plain model loads the
    export and gives the same logits in evaluation."""
    from safetensors.torch import load_file

    from pretrain.weights.export import write_safetensors

    ours = create_model(NAME, img_size=64, num_classes=10, patch_drop_rate=0.5, init_seed=0)
    plain = create_model(NAME, img_size=64, num_classes=10, init_seed=0)
    assert list(ours.state_dict()) == list(plain.state_dict())
    path = write_safetensors(ours.state_dict(), tmp_path / "w.safetensors", {"model.name": NAME})
    ref = timm.create_model(NAME, img_size=64, num_classes=10).eval()
    ref.load_state_dict(load_file(str(path)), strict=True)
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours.eval()(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("img, rate, arch", [(32, 0.0, {}), (96, 0.0, {}), (64, 0.5, {}), (48, 0.75, {}),
                                             (48, 0.5, PREFIXES["reg4-map"]), (64, 0.5, PREFIXES["nocls-reg2-avg"])])
def test_flops_follow_the_resolution_and_the_kept_tokens(img, rate, arch):
    """fvcore's count of a training forward at ``img`` px (patch dropout on; with prefix tokens, every
    one kept, and MAP over the kept patches) is the analytic one the metrics and the plan use."""
    model = create_model(NAME, img_size=64, num_classes=10, patch_drop_rate=rate, **arch)
    assert forward_flops(model, img_size=img, train=True) == analytic_flops(NAME, img, 10, patch_drop_rate=rate,
                                                                            **arch)
    if rate:  # evaluation: every token
        assert forward_flops(model, img_size=img) == analytic_flops(NAME, img, 10, **arch)


def test_a_window_counts_each_steps_flops_at_its_own_resolution():
    w = Window("cpu")
    w.add(torch.zeros(2), 64, (1.0e9, 1.5e9), 128)
    w.add(torch.zeros(2), 64, (3.0e9, 4.0e9), 224)
    assert w.flops_per_image() == (2.0e9, 2.75e9) and w.img_size == 224


def test_the_forecast_weighs_the_steps_left_by_their_phases_flops():
    """Steps 1-10 at 1 FLOP, 11-20 at 4: a first step, then 4 more in 8 s (2 s per FLOP) leave
    5 x 1 + 10 x 4 FLOPs, 90 s; counting steps alone would say 30 s."""
    f = Forecast([Phase(1, 10, 112, 64), Phase(11, 20, 224, 64)], {112: (1.0, 1.5), 224: (4.0, 6.0)}, 20)
    assert f.seconds_left(5, now=10.0) is None  # before the first step is done: no pace yet
    f.start(1, now=2.0)
    assert f.seconds_left(1, now=2.0) is None
    assert f.seconds_left(5, now=10.0) == pytest.approx(90.0)
    assert f.seconds_left(15, now=2.0 + 2 * (9 + 5 * 4)) == pytest.approx(2 * 5 * 4)  # in the second phase
    assert f.seconds_left(20, now=100.0) == 0.0
    # train.steps raised past the schedule on a resume: the steps beyond it at the last phase's cost
    beyond = Forecast([Phase(1, 10, 112, 64)], {112: (1.0, 1.5)}, 14)
    beyond.start(11, now=0.0)
    assert beyond.seconds_left(12, now=3.0) == pytest.approx(6.0)
    assert f.note(5, 1.0, world=2, now=10.0) == "eta=1.5m (~1.05 device-hours in all)"
    assert f.note(20, 1.0, world=2, now=100.0) == ""  # done: nothing left to forecast
    assert f.note(5, None, world=2, now=10.0) == "eta=1.5m"  # the run's device-hours unknown: the time alone
    got = [duration(s) for s in (45, 90, 12 * 60, 3.2 * 3600, 30 * 3600, 4.1 * 86400)]
    assert got == ["45s", "1.5m", "12m", "3.2h", "30h", "4.1d"]


def test_the_forecast_goes_at_the_pace_of_the_phase_running():
    """Steps 1-10 at 1 FLOP take 2 s per FLOP; step 11, the first at 4 FLOPs, takes 80 s (its shape
    compiled), then the phase runs at 1 s per FLOP (a higher MFU). Until step 12 the forecast goes at
    the first phase's pace; from then on at the second's, its first step left out: 20 s left at
    step 15 (the pace since step 1 would say 79 s)."""
    f = Forecast([Phase(1, 10, 112, 64), Phase(11, 20, 224, 64)], {112: (1.0, 1.5), 224: (4.0, 6.0)}, 20)
    f.start(1, now=2.0)
    assert f.seconds_left(10, now=20.0) == pytest.approx(2 * 10 * 4)
    f.start(11, now=100.0)
    assert f.seconds_left(11, now=100.0) == pytest.approx(2 * 9 * 4)  # no second step yet: the last pace
    assert f.seconds_left(15, now=116.0) == pytest.approx(5 * 4)
    assert f.seconds_left(20, now=136.0) == 0.0
    f.start(11, now=500.0)  # marked once: a phase's pace counts from its first step in the invocation
    assert f.seconds_left(15, now=116.0) == pytest.approx(5 * 4)
    # an invocation resumed mid-phase counts from its own first step
    resumed = Forecast([Phase(1, 10, 112, 64), Phase(11, 20, 224, 64)], {112: (1.0, 1.5), 224: (4.0, 6.0)}, 20)
    resumed.start(6, now=0.0)
    assert resumed.seconds_left(8, now=3.0) == pytest.approx(1.5 * (2 + 40))


# ----------------------------------------------------------------------------------- the phases
def test_phases_by_fraction_of_the_steps():
    t = TrainConfig(steps=1000, global_batch_size=512, micro_batch_size=64,
                    resolution_schedule=[[0.0, 128, 256], [0.6, 192, 128], [0.9, 224]])
    phases = resolution_phases(t, 224)
    assert phases == [Phase(1, 600, 128, 256), Phase(601, 900, 192, 128), Phase(901, 1000, 224, 64)]
    sizes = [phase_at(phases, s).img_size for s in (1, 600, 601, 900, 901, 1000, 1001)]
    assert sizes == [128] * 2 + [192] * 2 + [224] * 3
    assert resolution_phases(dataclasses.replace(t, resolution_schedule=[]), 224) == [Phase(1, 1000, 224, 64)]
    # rounded, not floored (0.29 x 100 is 28.999... in floats); a phase without a step is left out
    t = TrainConfig(steps=100, resolution_schedule=[[0.0, 64], [0.29, 96], [0.291, 112], [0.5, 128]])
    assert [(p.first, p.last, p.img_size) for p in resolution_phases(t, 128)] == [(1, 29, 64), (30, 50, 112),
                                                                                (51, 100, 128)]


@pytest.mark.parametrize("schedule, says", [
    ("[[0.1,32]]", "the first entry must start at 0.0"),
    ("[[0,32],[0.5,48],[0.5,64]]", "must rise from 0.0"),
    ("[[0,32],[1.0,64]]", "stay below 1"),
    ("[[0,40]]", "resolution 40 must be a positive multiple of vit_tiny_patch16_224's patch size 16"),
    ("[[0,32,0]]", "micro batch 0 must be a positive integer"),
    ("[[0,32,48]]", "entry 0: micro batch 48 x world size 1 = 48 does not divide train.global_batch_size=64"),
    ("[[0,32,64,1]]", "expected [fraction, px] or [fraction, px, micro batch]"),
])
def test_a_bad_schedule_is_one_line_naming_the_key(schedule, says):
    with pytest.raises(ConfigError, match="train.resolution_schedule") as e:
        load_config("configs/tiny_cpu.yaml", [f"train.resolution_schedule={schedule}"])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_phase_micro_batch_must_fit_the_world_size():
    t = TrainConfig(global_batch_size=64, micro_batch_size=8, resolution_schedule=[[0, 32, 16], [0.5, 64]])
    assert check_world_size(t, 2) == 4
    with pytest.raises(ConfigError, match="entry 0: micro batch 16 x world size 8 = 128 does not divide"):
        check_world_size(t, 8)
    with pytest.raises(ConfigError, match="model.patch_drop_rate: must be in"):
        load_config("configs/tiny_cpu.yaml", ["model.patch_drop_rate=1.0"])


# ----------------------------------------------------------------------------------- the batches
def _data(shards, workers: int) -> DataConfig:
    return DataConfig(train_shards=str(shards), workers=workers, shuffle_buffer=20,
                      augment=AugmentConfig(randaugment_ops=2))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_size_crops_the_same_samples_from_the_same_position(demo_train, workers):
    """After 5 batches at 32 px the loader switches to 48 px: the batches that follow are bit for bit
    those of a loader at 48 px from the start, and the samples those of the run at 32 px."""
    def make(size):
        return build_loader(_data(demo_train, workers), rank=1, world_size=2, batch_size=12, seed=5, img_size=size)

    small, big, switched = make(32), make(48), make(32)
    it = iter(small)
    keys32 = [(next(it), small.last_keys)[1] for _ in range(10)]
    it = iter(big)
    ref = [(next(it), big.last_keys) for _ in range(10)]
    it = iter(switched)
    for _ in range(5):
        next(it)
    switched.set_img_size(48)
    it.close()
    it = iter(switched)
    for k in range(5, 10):
        (x, y), want = next(it), ref[k][0]
        assert x.shape[-1] == 48 and torch.equal(x, want[0]) and torch.equal(y, want[1]), k
        assert switched.last_keys == ref[k][1] == keys32[k]
    assert switched.state().batch == 10 and switched.counters["samples"] == 120


def test_batches_by_step_follow_the_phases(demo_train):
    """Two loader batches per step; steps 1-2 at 32 px, then 48 px from step 3: the step's images at
    its size, the samples in the loader's order, the micro batches cut as each phase says."""
    phases = [Phase(1, 2, 32, 24), Phase(3, 4, 48, 6)]
    loader = build_loader(_data(demo_train, 1), batch_size=12, seed=5, img_size=32)
    plain = build_loader(_data(demo_train, 1), batch_size=12, seed=5, img_size=32)
    it = iter(plain)
    order = [(next(it), plain.last_keys)[1] for _ in range(8)]

    keys = []

    def stream():
        for batch in sized_batches(loader, lambda s: phase_at(phases, s).img_size, 0, 2):
            keys.append(loader.last_keys)
            yield batch

    out = list(zip(range(2 + 8), regrouped(stream(), lambda s: phase_at(phases, s).micro_batch, 0, 24)))
    assert [x.shape[0] for _, (x, _) in out] == [24, 24] + [6] * 8
    assert [x.shape[-1] for _, (x, _) in out] == [32, 32] + [48] * 8
    assert keys == order
    assert loader.state().batch == 8


def test_regrouped_cuts_and_joins_within_a_step():
    src = [(torch.arange(i * 4, i * 4 + 4), torch.arange(i * 4, i * 4 + 4)) for i in range(12)]
    micro = {1: 8, 2: 2, 3: 16}
    out = [x.tolist() for x, _ in regrouped(iter(src), lambda s: micro[s], 0, 16)]
    assert [len(x) for x in out] == [8, 8] + [2] * 8 + [16]
    assert sum(out, []) == list(range(48))
    same = list(regrouped(iter(src[:4]), lambda s: 4, 0, 16))
    assert all(a[0] is b[0] for a, b in zip(same, src[:4]))  # nothing to cut: the batches themselves


def test_the_synthetic_loader_changes_size_and_keeps_its_position():
    loader = SyntheticLoader(DataConfig(synthetic=True), batch_size=4, img_size=32, num_classes=10, seed=0, rank=0)
    it = iter(loader)
    next(it), next(it)
    loader.set_img_size(48)
    x, _ = next(iter(loader))
    assert x.shape == (4, 3, 48, 48) and loader.state().batches == 3


# ---------------------------------------------------------------------------- memory and the plan
def test_the_memory_estimate_takes_the_phase_with_the_most_activations():
    cfg = load_config("configs/vit_l16_in21k.yaml", ["train.global_batch_size=4096", "train.micro_batch_size=64"])
    shape = memory.model_shape(cfg.model)
    fixed = memory.estimate(cfg, 64, shape)
    low_first = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, resolution_schedule=[[0.0, 128, 128], [0.5, 224, 32]]))
    est = memory.estimate(low_first, 64, shape)
    kw = dict(precision="bf16", dropout=True)  # the config's bf16 and model.drop_rate
    at_128 = memory.activation_bytes(memory.trained_shape(shape, 128), 128, **kw)
    at_224 = memory.activation_bytes(shape, 32, **kw)
    assert est.activations == max(at_128, at_224) and est.largest == ((128, 128) if at_128 > at_224 else (224, 32))
    assert est.activations < fixed.activations  # no phase holds micro 64 at 224 px
    dropped = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, patch_drop_rate=0.5))
    assert memory.estimate(dropped, 64, shape).activations < 0.6 * fixed.activations



def test_the_trained_shape_counts_every_prefix_token():
    """The blocks' sequence under a schedule and patch dropout: the kept patches of that size plus
    every prefix token (patch dropout keeps them), as the built model runs it."""
    for arch in PREFIXES.values():
        full = memory.analytic_shape(NAME, img_size=64, num_classes=10, **arch)
        shape = memory.trained_shape(full, 48, 0.5)
        model = create_model(NAME, img_size=64, num_classes=10, patch_drop_rate=0.5, **arch).train()
        seen = []
        model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        model(torch.randn(1, 3, 48, 48))
        assert shape.seq_len == seen[0].shape[1] == model.num_prefix_tokens + patch_keep(9, 0.5), arch


def test_the_plan_prices_each_phase_and_the_whole_run():
    cfg = load_config("configs/vit_l16_in21k.yaml", ["train.resolution_schedule=[[0,128],[0.6,192],[0.9,224]]"])
    lay = perfmodel.layout_from_config(cfg, nodes=8, gpus_per_node=8, gpu="h100-sxm")
    phases = resolution_phases(cfg.train, 224)
    price = perfmodel.price_tokens(lay, phases)
    assert [r.img_size for r in price.phases] == [128, 192, 224] and price.steps == cfg.train.steps
    assert price.seconds == pytest.approx(sum(r.prediction.step_seconds * (r.last - r.first + 1) for r in price.phases))
    assert price.phases[0].prediction.images_per_second > 2 * price.phases[2].prediction.images_per_second
    assert 0.4 < price.seconds / price.fixed_seconds < 0.7 and 0.4 < price.flops / price.fixed_flops < 0.6
    assert price.phases[2].prediction.step_seconds == pytest.approx(price.fixed.step_seconds)
    one = perfmodel.price_tokens(lay, [Phase(1, cfg.train.steps, 224, 64)])
    assert one.seconds == pytest.approx(one.fixed_seconds) and one.flops == pytest.approx(one.fixed_flops)
    half = perfmodel.predict(dataclasses.replace(lay, patch_drop_rate=0.5))
    assert half.train_flops_per_image == pytest.approx(
        6 * analytic_flops("vit_large_patch16_224", 224, 21843, patch_drop_rate=0.5))


def test_vit_launch_plan_shows_the_phases_and_the_saving(capsys):
    from launch.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", "configs/vit_l16_in21k.yaml", "--world-size", "64", "--gpu", "h100-sxm",
              "train.resolution_schedule=[[0,128],[0.6,192],[0.9,224]]"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "fewer tokens    311,946 steps" in out and "1-187,168   128" in out and "x the compute" in out
    assert "memory: the largest phase (224 px, micro 64)" in out
