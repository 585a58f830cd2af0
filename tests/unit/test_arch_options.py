"""Today's architecture options against the implementations their users know: big_vision's
``posemb_sincos_2d`` (not installed: re-implemented in tests/reference_utils.py) and ``MAPHead``
(re-implemented below, both from ``big_vision/models/vit.py``), timm's position-embedding
resampling with register tokens, and the ways weights leave and re-enter (the transfer backbone,
resizing, the arch read from tensors).
timm parity of every combination: tests/unit/test_model.py; FLOPs: tests/unit/test_flops.py."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from reference_utils import big_vision_posemb_sincos_2d
from safetensors.torch import save_file

from pretrain.models.arch import seq_len
from pretrain.models.pooling import sincos_2d
from pretrain.models.tokens import resize_pos_embed
from pretrain.models.vit import create_model
from pretrain.weights.load import load_weights


# --------------------------------------------------------------------------- big_vision, re-implemented
def big_vision_map_head(x: torch.Tensor, p: dict, heads: int) -> torch.Tensor:
    """big_vision's ``MAPHead.__call__`` on flax-layout parameters (kernels in x out): the probe
    tiled over the batch, flax's ``MultiHeadDotProductAttention(probe, x)`` (per-head query / key /
    value projections, queries scaled by 1/sqrt(head dim), softmax over the keys, the output
    projection), then ``x + MlpBlock(LayerNorm(x))`` and the first (only) token. LayerNorm eps is
    flax's default 1e-6. GELU is the exact one, as in every MLP of our ViT and timm's (flax's
    ``nn.gelu`` defaults to the tanh approximation: a choice of the whole model, not of MAP)."""
    n, length, d = x.shape
    hd = d // heads
    probe = p["probe"].expand(n, 1, d)
    q = (probe @ p["query/kernel"] + p["query/bias"]).reshape(n, 1, heads, hd) / math.sqrt(hd)
    k = (x @ p["key/kernel"] + p["key/bias"]).reshape(n, length, heads, hd)
    v = (x @ p["value/kernel"] + p["value/bias"]).reshape(n, length, heads, hd)
    w = torch.einsum("nqhd,nkhd->nhqk", q, k).softmax(dim=-1)
    out = torch.einsum("nhqk,nkhd->nqhd", w, v).reshape(n, 1, d) @ p["out/kernel"] + p["out/bias"]
    y = F.layer_norm(out, (d,), p["LayerNorm_0/scale"], p["LayerNorm_0/bias"], eps=1e-6)
    y = F.gelu(y @ p["Dense_0/kernel"] + p["Dense_0/bias"]) @ p["Dense_1/kernel"] + p["Dense_1/bias"]
    return (out + y)[:, 0]


def load_big_vision_map(pool: torch.nn.Module, p: dict) -> None:
    """big_vision's MAPHead parameters into ours by the mapping timm's ``_load_weights`` uses for
    big_vision's .npz files (kernels transposed, key and value stacked into ``kv``)."""
    with torch.no_grad():
        pool.latent.copy_(p["probe"])
        pool.q.weight.copy_(p["query/kernel"].T)
        pool.q.bias.copy_(p["query/bias"])
        pool.kv.weight.copy_(torch.cat([p["key/kernel"].T, p["value/kernel"].T]))
        pool.kv.bias.copy_(torch.cat([p["key/bias"], p["value/bias"]]))
        pool.proj.weight.copy_(p["out/kernel"].T)
        pool.proj.bias.copy_(p["out/bias"])
        pool.norm.weight.copy_(p["LayerNorm_0/scale"])
        pool.norm.bias.copy_(p["LayerNorm_0/bias"])
        for i, fc in enumerate((pool.mlp.fc1, pool.mlp.fc2)):
            fc.weight.copy_(p[f"Dense_{i}/kernel"].T)
            fc.bias.copy_(p[f"Dense_{i}/bias"])


def random_map_params(d: int, hidden: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"probe": (1, 1, d), "query/kernel": (d, d), "query/bias": (d,), "key/kernel": (d, d), "key/bias": (d,),
              "value/kernel": (d, d), "value/bias": (d,), "out/kernel": (d, d), "out/bias": (d,),
              "LayerNorm_0/scale": (d,), "LayerNorm_0/bias": (d,), "Dense_0/kernel": (d, hidden),
              "Dense_0/bias": (hidden,), "Dense_1/kernel": (hidden, d), "Dense_1/bias": (d,)}
    p = {k: torch.randn(s, generator=g) * (d ** -0.5 if "kernel" in k else 0.1) for k, s in shapes.items()}
    p["LayerNorm_0/scale"] += 1.0
    return p


# ------------------------------------------------------------------------------------- sin-cos
@pytest.mark.parametrize("grid, width", [((2, 2), 192), ((4, 6), 64), ((14, 14), 768), ((24, 24), 1024)])
def test_sincos_equals_big_vision(grid, width):
    ref = torch.from_numpy(big_vision_posemb_sincos_2d(*grid, width)).float()[0]
    got = sincos_2d(grid, width)
    assert got.shape == (grid[0] * grid[1], width) and got.dtype == torch.float32
    assert (got - ref).abs().max() < 1e-6


def test_sincos_model_computes_in_the_parameters_dtype_with_an_fp32_buffer():
    """DeepSpeed's bf16 mode casts the parameters and keeps buffers in fp32
    (``_cast_module_mixed_precision`` without ``buffer_dtype``): the sin-cos table is added in the
    tokens' dtype, so the blocks see bf16 as under a whole-module cast, with equal logits."""
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, class_token=False, global_pool="avg",
                     pos_embed="sincos2d")
    with torch.no_grad():
        m.head.weight.normal_(generator=torch.Generator().manual_seed(0))
    whole = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, class_token=False, global_pool="avg",
                         pos_embed="sincos2d")
    whole.load_state_dict(m.state_dict())
    whole.to(torch.bfloat16)  # buffers too
    for p in m.parameters():  # as DeepSpeed: parameters only
        p.data = p.data.to(torch.bfloat16)
    assert m.pos_embed.dtype == torch.float32
    x = torch.randn(2, 3, 32, 32).to(torch.bfloat16)
    out = m(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, whole(x))


def test_sincos_model_holds_it_untrained_after_its_prefix():
    """Zeros for the [class] and register tokens (big_vision adds no position to its [class]
    token), the sin-cos of the grid after them; a buffer: no gradient, no optimizer group, no
    weight decay, unchanged by a step; timm reads it as a learned ``pos_embed``."""
    from pretrain.config.schema import OptimConfig
    from pretrain.distributed.engine import build_optimizer, param_groups

    m = create_model("vit_tiny_patch16_224", img_size=64, num_classes=3, reg_tokens=4, pos_embed="sincos2d")
    ref = torch.from_numpy(big_vision_posemb_sincos_2d(4, 4, 192)).float()
    assert torch.equal(m.pos_embed[:, :5], torch.zeros(1, 5, 192))
    assert (m.pos_embed[:, 5:] - ref).abs().max() < 1e-6
    assert "pos_embed" not in dict(m.named_parameters()) and "pos_embed" in m.state_dict()
    groups = param_groups(m, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))
    no_decay = {id(p) for p in groups[1]["params"]}
    assert id(m.reg_token) in no_decay and id(m.cls_token) in no_decay
    before = m.pos_embed.clone()
    opt = build_optimizer(m, OptimConfig(lr=0.1, weight_decay=0.5), offload=False)
    with torch.no_grad():
        m.head.weight.normal_()
    F.cross_entropy(m(torch.randn(2, 3, 64, 64)), torch.tensor([0, 2])).backward()
    opt.step()
    assert torch.equal(m.pos_embed, before) and m.pos_embed.grad is None
    assert m.reg_token.grad is not None and m.reg_token.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- MAP
@pytest.mark.parametrize("d, heads, tokens", [(192, 3, 16), (64, 4, 7)])
def test_map_head_equals_big_vision_map_head(d, heads, tokens):
    from pretrain.models.layers import Mlp
    from pretrain.models.pooling import AttentionPool

    p = random_map_params(d, 4 * d)
    pool = AttentionPool(d, heads, Mlp(d, 4 * d), torch.nn.LayerNorm(d, eps=1e-6)).eval()
    load_big_vision_map(pool, p)
    x = torch.randn(3, tokens, d, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, ref = pool(x), big_vision_map_head(x, p, heads)
    assert got.shape == (3, d) and (got - ref).abs().max() < 1e-5


def test_map_model_pools_the_patch_tokens_with_big_vision_map_head():
    """The whole model: the head reads big_vision's MAPHead of the normed patch tokens (the [class]
    token and the registers left out, as timm's ``pool_include_prefix=False``); timm's
    ``AttentionPoolLatent`` takes the same parameters and gives the same logits."""
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=5, reg_tokens=4, global_pool="map").eval()
    p = random_map_params(192, 768, seed=2)
    load_big_vision_map(m.attn_pool, p)
    with torch.no_grad():
        m.head.weight.normal_()
        x = torch.randn(2, 3, 32, 32)
        tokens = m.forward_features(x)
        assert tokens.shape[1] == seq_len("vit_tiny_patch16_224", 32, reg_tokens=4) == 1 + 4 + 4
        ref = big_vision_map_head(tokens[:, 5:], p, 3)
        assert (m.forward_head(tokens, pre_logits=True) - ref).abs().max() < 1e-5
        t = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5, reg_tokens=4, global_pool="map")
        t.load_state_dict(m.state_dict(), strict=True)
        assert (t.eval()(x) - m(x)).abs().max() < 1e-5


def test_map_and_register_init_follow_big_vision_and_timm():
    """The probe: flax's Xavier-uniform on big_vision's (1, 1, D) shape (fan-in 1, fan-out D);
    key and value kernels (and the encoder's query, key and value) each Xavier over D x D, as
    flax's separate Dense layers; MLP
    biases N(0, 1e-6), attention biases zero. Registers N(0, 1e-6) (timm, DINOv2). The token-only
    model's weights do not move when the options are added (same seed)."""
    d = 768
    m = create_model("vit_base_patch16_224", img_size=32, num_classes=3, reg_tokens=4, global_pool="map", init_seed=0)
    a = m.attn_pool
    bound = math.sqrt(6 / (1 + d))
    assert a.latent.abs().max() <= bound and a.latent.abs().max() > 0.95 * bound
    key, value = a.kv.weight.chunk(2)
    query, key_, value_ = m.blocks[0].attn.qkv.weight.chunk(3)  # the encoder's, as vit_jax's flax attention
    for w in (key, value, a.q.weight, a.proj.weight, query, key_, value_):
        assert w.abs().max() <= math.sqrt(6 / (2 * d)) and w.abs().max() > 0.99 * math.sqrt(6 / (2 * d))
    assert torch.equal(a.q.bias, torch.zeros(d)) and torch.equal(a.kv.bias, torch.zeros(2 * d))
    assert 0 < a.mlp.fc1.bias.std() < 1e-5 and torch.equal(a.norm.weight, torch.ones(d))
    assert 0.5e-6 < m.reg_token.std() < 2e-6
    plain = create_model("vit_base_patch16_224", img_size=32, num_classes=3, init_seed=0).state_dict()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in plain.items() if k != "pos_embed")


# ------------------------------------------------------------------------------ resizing, loading
@pytest.mark.parametrize("prefix", [0, 1, 5])
def test_resize_keeps_every_prefix_token_as_timm(prefix):
    from timm.layers import resample_abs_pos_embed

    pe = torch.randn(1, prefix + 16, 32)
    ours = resize_pos_embed(pe, (6, 6), num_prefix_tokens=prefix)
    ref = resample_abs_pos_embed(pe, [6, 6], num_prefix_tokens=prefix)
    assert ours.shape == (1, prefix + 36, 32) and torch.equal(ours[:, :prefix], pe[:, :prefix])
    assert (ours - ref).abs().max() < 1e-6


def test_registers_without_class_token_load_at_another_resolution(tmp_path):
    """A 32 px file of a model with registers and no [class] token into the same model at 64 px:
    the register rows kept, the grid resized as timm resizes it; a sin-cos model keeps its own
    embedding for the new grid and reads none."""
    from timm.layers import resample_abs_pos_embed

    kw = dict(num_classes=4, class_token=False, reg_tokens=2, global_pool="avg")
    src = create_model("vit_tiny_patch16_224", img_size=32, **kw)
    with torch.no_grad():
        src.pos_embed.normal_()
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    dst = create_model("vit_tiny_patch16_224", img_size=64, **kw)
    rep = load_weights(dst, tmp_path / "w.safetensors")
    assert rep.resized and torch.equal(dst.reg_token, src.reg_token)
    assert (dst.pos_embed - resample_abs_pos_embed(src.pos_embed, [4, 4], num_prefix_tokens=2)).abs().max() < 1e-6

    fixed = create_model("vit_tiny_patch16_224", img_size=64, pos_embed="sincos2d", **kw)
    expect = fixed.pos_embed.clone()
    rep = load_weights(fixed, tmp_path / "w.safetensors")
    assert rep.skipped == ["pos_embed"] and not rep.resized and torch.equal(fixed.pos_embed, expect)
    assert torch.equal(fixed.blocks[2].mlp.fc1.weight, src.blocks[2].mlp.fc1.weight)


NO_EMBED_CLASS = [dict(class_token=False, reg_tokens=4, global_pool="avg"),  # vit_*_reg4_gap's layout
                  dict(reg_tokens=4), dict()]  # [class] and registers; DeiT III's [class] alone


@pytest.mark.parametrize("kw", NO_EMBED_CLASS, ids=["reg4-gap", "cls-reg4", "cls"])
def test_a_timm_no_embed_class_file_gives_timms_outputs(tmp_path, kw):
    """timm's ``no_embed_class=True`` saves position rows for the patches only and adds them before
    the prefix tokens are prepended. Loaded here, the prefix rows are zero: the same tokens as timm's
    ``_pos_embed``, the same features and logits, at the file's grid and resized to another as timm's
    ``checkpoint_filter_fn`` resizes it; vit-transfer reads the file's grid from the shapes."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    from pretrain.weights.pretrained import load_pretrained

    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5, no_embed_class=True, **kw).eval()
    sd = {k: torch.randn_like(v) * 0.05 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    assert sd["pos_embed"].shape == (1, 4, 192)
    save_file(sd, str(tmp_path / "w.safetensors"))
    pre = load_pretrained(tmp_path / "w.safetensors")
    assert pre.img_size == 32 and pre.arch["reg_tokens"] == kw.get("reg_tokens", 0)
    for px in (32, 48):
        ours = create_model("vit_tiny_patch16_224", img_size=px, num_classes=5, **kw).eval()
        rep = load_weights(ours, tmp_path / "w.safetensors")
        assert "no_embed_class" in rep.summary() and not ours.pos_embed[:, :ours.num_prefix_tokens].any()
        timm_px = ref
        if px != 32:
            timm_px = timm.create_model("vit_tiny_patch16_224", img_size=px, num_classes=5, no_embed_class=True,
                                        **kw).eval()
            timm_px.load_state_dict(checkpoint_filter_fn(dict(sd), timm_px))
        x = torch.randn(2, 3, px, px)
        with torch.no_grad():
            grid = ours.patch_embed.grid_size
            assert torch.equal(ours._pos_embed(ours.patch_embed(x), grid), timm_px._pos_embed(timm_px.patch_embed(x)))
            torch.testing.assert_close(ours.forward_features(x), timm_px.forward_features(x), rtol=0, atol=1e-6)
            torch.testing.assert_close(ours(x), timm_px(x), rtol=0, atol=1e-6)


def test_patch_rows_or_prefix_rows_not_told_apart_is_refused_until_the_grid_is_given():
    """9 rows with [class] and 4 registers: a 3x3 grid alone, or the prefix and 2x2. No guess: the
    checkpoint's grid decides."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    from pretrain.weights.load import WeightsError

    ref = timm.create_model("vit_tiny_patch16_224", img_size=48, num_classes=0, no_embed_class=True, reg_tokens=4)
    ours = create_model("vit_tiny_patch16_224", img_size=64, num_classes=0, reg_tokens=4).eval()
    with pytest.raises(WeightsError, match="old_grid"):
        load_weights(ours, ref.state_dict())
    load_weights(ours, ref.state_dict(), old_grid=(3, 3))
    at64 = timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=0, no_embed_class=True, reg_tokens=4)
    at64.load_state_dict(checkpoint_filter_fn(ref.state_dict(), at64))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), at64.eval()(x), rtol=0, atol=1e-6)


def test_arch_read_from_tensors_builds_the_transfer_backbone(tmp_path):
    """A bare state dict (no metadata) says its registers, missing [class] token, MAP head and sin-cos
    embedding (by its values); vit-transfer's backbone is that model at another resolution, and
    its frozen features are the model's own pooling; eval.pool=token is refused in one line."""
    from pretrain.config import ConfigError, load_config
    from pretrain.transfer.evaluate import make_protocol
    from pretrain.transfer.protocols.features import pooled
    from pretrain.transfer.protocols.finetune import Dist
    from pretrain.weights.pretrained import build_backbone, load_pretrained

    kw = dict(class_token=False, reg_tokens=3, global_pool="map", pos_embed="sincos2d")
    src = create_model("vit_tiny_patch16_224", img_size=32, num_classes=4, **kw)
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    pre = load_pretrained(tmp_path / "w.safetensors")
    assert {k: pre.arch[k] for k in kw} == kw and pre.img_size == 32
    bb = build_backbone(pre, img_size=64).eval()
    assert bb.num_prefix_tokens == 3 and bb.pos_embed.shape == (1, 3 + 16, 192)
    assert (bb.pos_embed[0, 3:] - sincos_2d((4, 4), 192)).abs().max() == 0
    assert torch.equal(bb.attn_pool.kv.weight, src.attn_pool.kv.weight)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        tokens = bb.forward_features(x)
        torch.testing.assert_close(pooled(bb, tokens, "model"), bb.attn_pool(tokens[:, 3:]))
        torch.testing.assert_close(pooled(bb, tokens, "avg"), tokens[:, 3:].mean(1))
    cfg = load_config(None, ["eval.protocol=linear", "eval.pool=token"])
    with pytest.raises(ConfigError, match=r"eval.pool=token: .* without the \[class\] token"):
        make_protocol(cfg, pre, 32, torch.device("cpu"), Dist(), lambda msg: None)


# --------------------------------------------------------------------------------- config, resume
@pytest.mark.parametrize("override, needle", [
    (["model.class_token=false"], "model.class_token: false needs model.global_pool=avg or map"),
    (["model.reg_tokens=-1"], "model.reg_tokens: must be >= 0"),
    (["model.global_pool=max"], "model.global_pool"),
    (["model.pos_embed=rope"], "model.pos_embed"),
    (["model.img_size=0"], "model.img_size: 0 must be a positive multiple of"),  # not "the name's size"
    (["model.representation_size=-1"], "model.representation_size: must be a positive width or null"),
    (["model.representation_size=0"], "model.representation_size: must be a positive width or null"),
])
def test_bad_architecture_keys_are_one_line(override, needle):
    from pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=needle):
        load_config(None, override)
    load_config(None, ["model.class_token=false", "model.global_pool=map", "model.reg_tokens=4",
                       "model.pos_embed=sincos2d"])


def test_changing_the_token_layout_blocks_a_resume():
    from pretrain.checkpointing.checkpoint import config_changes

    old = {"model": {"name": "vit_tiny_patch16_224"}}  # a run from before the keys existed
    new = {"model": {"name": "vit_tiny_patch16_224", "reg_tokens": 0, "class_token": True, "pos_embed": "learned"}}
    assert config_changes(old, new) == []
    assert config_changes(new, {"model": dict(new["model"], reg_tokens=4, class_token=False,
                                              pos_embed="sincos2d")}) == [
        "model.reg_tokens=0->4", "model.class_token=True->False", "model.pos_embed=learned->sincos2d"]


def test_the_performance_model_sees_the_token_count_and_the_map_head():
    """The sequence every block sees (the built model's), the parameters and FLOPs the plan prices."""
    from pretrain.config import load_config
    from pretrain.models.arch import analytic_flops
    from pretrain.perf import memory
    from pretrain.perf.compute import compute_seconds
    from pretrain.perf.perfmodel import layout_from_config

    for over in ([], ["model.reg_tokens=4", "model.global_pool=map"],
                 ["model.class_token=false", "model.global_pool=avg"]):
        cfg = load_config(None, ["model.name=vit_tiny_patch16_224", "model.img_size=64", "model.num_classes=10", *over])
        m = create_model("vit_tiny_patch16_224", img_size=64, num_classes=10, reg_tokens=cfg.model.reg_tokens,
                         class_token=cfg.model.class_token, global_pool=cfg.model.global_pool)
        shape = memory.model_shape(cfg.model)
        with torch.no_grad():
            assert shape.seq_len == m.forward_features(torch.zeros(1, 3, 64, 64)).shape[1], over
        assert shape.params == sum(p.numel() for p in m.parameters())
        lay = layout_from_config(cfg, nodes=1, gpus_per_node=8, gpu="h100-sxm")
        assert compute_seconds(lay, 32)["model_flops"] == 6 * 32 * analytic_flops(
            "vit_tiny_patch16_224", 64, 10, cfg.model.global_pool, reg_tokens=cfg.model.reg_tokens,
            class_token=cfg.model.class_token)


def test_in_training_fewshot_features_are_the_models_pre_logits(tmp_path):
    """The features the in-training few-shot probe fits are ``forward_head(pre_logits=True)``:
    here MAP over the patch tokens and the pre-logits layer, not the first token after the norm."""
    import torch.distributed as dist

    from data_pipeline.config import DataConfig
    from pretrain.evaluation.config import ValidationConfig
    from pretrain.evaluation.in_training import InTrainingEval

    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=5, reg_tokens=4, global_pool="map",
                     representation_size=48).eval()

    class Engine:  # what the evaluator calls: the engine's forward, its module and device
        device, module = torch.device("cpu"), m

        def __call__(self, x):
            return m(x)

    g = torch.Generator().manual_seed(0)
    xs, ys = [torch.randn(3, 3, 32, 32, generator=g) for _ in range(2)], [torch.tensor([0, 1, 2])] * 2
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ev = InTrainingEval(ValidationConfig(), DataConfig(), batch=3, seed=0, rank=0, world=1, img_size=32,
                            num_classes=5, dtype=torch.float32)
        with torch.no_grad():
            feats, labels = ev._features(Engine(), zip(xs, ys))
            expect = m.forward_head(m.forward_features(torch.cat(xs)), pre_logits=True)
    finally:
        dist.destroy_process_group()
    assert feats.shape == (6, 48) and torch.equal(labels, torch.cat(ys))
    torch.testing.assert_close(feats, expect)
