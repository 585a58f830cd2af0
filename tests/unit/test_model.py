"""The ViT family: forward/backward of every variant, timm parity, checkpointing, weight loading."""
import pickle
import subprocess
import sys

import pytest
import timm
import torch
from safetensors.torch import save_file

from pretrain.models.arch import list_models, model_defaults
from pretrain.models.tokens import resize_pos_embed
from pretrain.models.vit import create_model
from pretrain.weights.load import WeightsError, load_weights

SMALL_ENOUGH = ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
                "vit_base_patch32_224", "vit_base_patch16_384", "vit_base_r50_s16_224"]
BIG = ["vit_large_patch16_224", "vit_large_patch32_224", "vit_large_patch16_384", "vit_huge_patch14_224",
       "vit_giant_patch14_224", "vit_gigantic_patch14_224"]


def test_registry_has_the_timm_names():
    for name in SMALL_ENOUGH + BIG + ["vit_base_r50_s16_384"]:
        assert name in list_models()
    with pytest.raises(KeyError, match="unknown model"):
        create_model("vit_giant_patch99_224")


@pytest.mark.parametrize("name", SMALL_ENOUGH)
def test_forward_backward_small_input(name):
    torch.manual_seed(0)
    patch = model_defaults(name)["patch_size"] * model_defaults(name).get("stem_stride", 1)
    img = 2 * patch
    m = create_model(name, num_classes=5, img_size=img, drop_path_rate=0.1, drop_rate=0.1)
    x = torch.randn(2, 3, img, img)
    out = m(x)
    assert out.shape == (2, 5)
    out.float().pow(2).sum().backward()  # head is zero-initialised: the loss's gradient reaches it
    assert torch.isfinite(out).all()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert m.head.weight.grad.abs().sum() == 0  # d(sum out^2)/dW = 0 at W = 0, out = 0
    m.zero_grad()
    torch.nn.functional.cross_entropy(m(x), torch.tensor([1, 3])).backward()
    assert m.head.weight.grad.abs().sum() > 0 and m.patch_embed.proj.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("name", BIG)
def test_big_variants_on_meta_device(name):
    with torch.device("meta"):
        m = create_model(name)
        out = m(torch.empty(2, 3, *m.img_size))
    assert out.shape == (2, 1000) and out.is_meta


@pytest.mark.parametrize("name, millions", [("vit_base_patch16_224", 86.57), ("vit_large_patch16_224", 304.33),
                                            ("vit_huge_patch14_224", 632.05),
                                            # Zhai et al. 2021 Table 2: 1011 M and 1843 M without the head
                                            ("vit_giant_patch14_224", 1012.61), ("vit_gigantic_patch14_224", 1844.44)])
def test_parameter_counts_match_table1(name, millions):
    with torch.device("meta"):
        m = create_model(name, num_classes=1000)
    n = sum(p.numel() for p in m.parameters())
    assert abs(n / 1e6 - millions) < 0.005, n


def test_meta_build_and_no_deepspeed_import():
    code = ("import sys, torch; import pretrain.models.vit as M\n"
            "with torch.device('meta'): m = M.create_model('vit_huge_patch14_224')\n"
            "assert all(p.is_meta for p in m.parameters())\n"
            "assert 'deepspeed' not in sys.modules, 'model code must not import deepspeed'\n"
            "assert 'timm' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


PARITY = [("vit_tiny_patch16_224", dict(img_size=64)),
          ("vit_tiny_patch16_224", dict(img_size=32, qk_norm=True, init_values=1e-5)),
          ("vit_small_patch16_224", dict(img_size=48, global_pool="avg")),
          ("vit_base_patch32_224", dict(img_size=64, num_classes=10)),
          ("vit_base_r50_s16_224", dict(img_size=64, num_classes=10)),
          # registers, no [class] token, MAP, the fixed sin-cos embedding (timm holds it as a learned one)
          ("vit_tiny_patch16_224", dict(img_size=32, reg_tokens=4, global_pool="map")),
          ("vit_tiny_patch16_224", dict(img_size=48, reg_tokens=1)),
          # the variant's shape overridden by keyword, as timm's create_model allows
          ("vit_small_patch16_224", dict(img_size=32, depth=3, num_heads=4, mlp_ratio=2.0)),
          ("vit_small_patch16_224", dict(img_size=32, class_token=False, global_pool="avg", pos_embed="sincos2d")),
          ("vit_tiny_patch16_224", dict(img_size=32, class_token=False, reg_tokens=2, global_pool="map",
                                        pos_embed="sincos2d", qk_norm=True)),
          ("vit_base_r50_s16_224", dict(img_size=64, num_classes=10, reg_tokens=4, global_pool="map"))]


def _parity_id(p) -> str:
    return "-".join([p[0]] + [f"{k}={v}" for k, v in p[1].items() if k not in ("img_size", "num_classes")])


@pytest.mark.parametrize("name, kw", PARITY, ids=[_parity_id(p) for p in PARITY])
def test_timm_parity_both_ways(name, kw):
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, **{k: v for k, v in kw.items() if k != "pos_embed"}).eval()
    sd = {k: torch.randn_like(v) * 0.05 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    ours = create_model(name, **kw).eval()
    assert set(ours.state_dict()) == set(sd)
    ours.load_state_dict(sd, strict=True)
    x = torch.randn(2, 3, kw["img_size"], kw["img_size"])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    # and back: our weights into timm
    ours2 = create_model(name, **kw).eval()
    ref.load_state_dict(ours2.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours2(x), ref(x), rtol=1e-5, atol=1e-5)


def test_timm_parity_in_training_with_dropout_and_stochastic_depth():
    """A training forward and backward draw the same masks in the same order as timm's and scale
    them the same way: equal outputs and gradients under one seed."""
    kw = dict(img_size=32, num_classes=10, drop_rate=0.2, drop_path_rate=0.5)
    torch.manual_seed(0)
    # our drop_rate is the ViT paper's one dropout: timm's after the position embedding and the
    # projections, none before the head (timm's drop_rate)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, pos_drop_rate=0.2, proj_drop_rate=0.2,
                            **{**kw, "drop_rate": 0.0}).train()
    sd = {k: torch.randn_like(v) * 0.05 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    ours = create_model("vit_tiny_patch16_224", **kw).train()
    ours.load_state_dict(sd, strict=True)
    x = torch.randn(4, 3, 32, 32)
    outs = []
    for m in (ours, ref):
        torch.manual_seed(1)
        out = m(x)
        out.pow(2).sum().backward()
        outs.append((out.detach(), m.blocks[5].mlp.fc1.weight.grad))
    assert (outs[0][0] == 0).sum() < outs[0][0].numel()  # not every path dropped
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["vit_giant_patch14_224", "vit_gigantic_patch14_224", "vit_huge_patch14_224"])
@pytest.mark.parametrize("opts", [{}, dict(qk_norm=True, init_values=1e-5)], ids=["plain", "qknorm-ls"])
def test_timm_names_and_shapes_past_vit_h(name, opts):
    """g/14 (MLP 6144 = 1408 * 48/11) and G/14 (8192 = 1664 * 64/13), with and without timm's
    qk_norm / LayerScale: same names and shapes as timm, strict loading both ways (meta device)."""
    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False, num_classes=1000, **opts)  # timm's H/14 defaults to 0
        ours = create_model(name, num_classes=1000, **opts)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(ref)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(ours.state_dict(), strict=True)
    sd = ours.state_dict()
    if opts:
        d = model_defaults(name)["embed_dim"]
        assert sd["blocks.0.attn.q_norm.weight"].shape == sd["blocks.0.attn.k_norm.bias"].shape == (d // 16,)
        assert sd["blocks.0.ls1.gamma"].shape == sd["blocks.0.ls2.gamma"].shape == (d,)
    else:
        assert not any("q_norm" in k or ".ls1." in k for k in sd)
    if name != "vit_huge_patch14_224":
        assert sd["blocks.0.mlp.fc1.weight"].shape == {"vit_giant_patch14_224": (6144, 1408),
                                                       "vit_gigantic_patch14_224": (8192, 1664)}[name]


def test_qk_norm_and_layerscale_init_and_forward():
    torch.manual_seed(0)
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, qk_norm=True, init_values=1e-3)
    b = m.blocks[0]
    assert torch.all(b.ls1.gamma == 1e-3) and torch.all(b.ls2.gamma == 1e-3)
    assert torch.all(b.attn.q_norm.weight == 1) and torch.all(b.attn.k_norm.bias == 0)
    out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    # init_values=None or 0 means no LayerScale, as timm ("if init_values")
    for iv in (None, 0.0):
        assert isinstance(create_model("vit_tiny_patch16_224", img_size=32, init_values=iv).blocks[0].ls1,
                          torch.nn.Identity)


def test_representation_size_adds_tanh_pre_logits():
    m = create_model("vit_tiny_patch16_224", img_size=32, representation_size=48, num_classes=3)
    assert m.state_dict()["pre_logits.fc.weight"].shape == (48, 192)
    feats = m.forward_head(m.forward_features(torch.randn(2, 3, 32, 32)), pre_logits=True)
    assert feats.shape == (2, 48) and feats.abs().max() <= 1.0  # tanh range


@pytest.mark.parametrize("ckpt", [True, 5, "selective"])
def test_grad_checkpointing_same_loss_and_grads(ckpt):
    """Whole blocks (all, the first 5) or op by op, with dropout and stochastic depth: the masks
    are drawn again from the saved random state, so the step is the one without checkpointing."""
    torch.manual_seed(0)
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=4, drop_rate=0.1, drop_path_rate=0.2)
    torch.nn.init.normal_(m.head.weight, std=0.02)  # non-zero head so every gradient is non-trivial
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 3])

    def loss_and_grads(ckpt):
        m.zero_grad()
        m.set_grad_checkpointing(ckpt)
        torch.manual_seed(1)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    l0, g0 = loss_and_grads(False)
    l1, g1 = loss_and_grads(ckpt)
    assert torch.equal(l0, l1)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-6, atol=1e-7, msg=n)
    assert all(b.checkpoint_ops == (ckpt == "selective") for b in m.blocks)
    m.set_grad_checkpointing(False)  # back off: no block checkpoints any more
    assert not m.grad_checkpointing and not any(b.checkpoint_ops for b in m.blocks)


def test_pos_embed_resize_keeps_class_token_and_interpolates():
    # an embedding linear in the grid position stays (nearly) linear after resizing
    old = (4, 6)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, old[0]), torch.linspace(0, 1, old[1]), indexing="ij")
    grid = torch.stack([yy, xx], -1).reshape(1, -1, 2)
    cls = torch.tensor([[[7.0, -7.0]]])
    pe = torch.cat([cls, grid], dim=1)
    out = resize_pos_embed(pe, (8, 12), old_grid=old)
    assert out.shape == (1, 1 + 96, 2)
    assert torch.equal(out[:, :1], cls)
    g = out[0, 1:].reshape(8, 12, 2)
    assert torch.all(g[1:, :, 0] >= g[:-1, :, 0] - 1e-4) and torch.all(g[:, 1:, 1] >= g[:, :-1, 1] - 1e-4)
    assert g[..., 0].min() > -0.1 and g[..., 0].max() < 1.1
    assert torch.equal(resize_pos_embed(pe, old, old_grid=old), pe)
    with pytest.raises(ValueError, match="not a square"):
        resize_pos_embed(pe, (8, 8))


def test_load_weights_224_to_384_and_formats(tmp_path):
    src = create_model("vit_tiny_patch16_224", num_classes=10)
    sd = src.state_dict()
    # safetensors, .pth (weights_only) and a wrapped, DDP-prefixed dict all load
    save_file(sd, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "w.pth")
    for source in (sd, tmp_path / "w.safetensors", tmp_path / "w.pth"):
        dst = create_model("vit_tiny_patch16_224", num_classes=10, img_size=384)
        rep = load_weights(dst, source)
        assert dst.pos_embed.shape == (1, 1 + 24 * 24, 192)
        assert any("pos_embed" in r for r in rep.resized)
        assert torch.equal(dst.pos_embed[:, 0], src.pos_embed[:, 0])
        assert torch.equal(dst.blocks[3].mlp.fc1.weight, src.blocks[3].mlp.fc1.weight)
        x = torch.randn(1, 3, 384, 384)
        assert torch.isfinite(dst(x)).all()


def test_load_weights_reports_keys_by_name(tmp_path):
    src = create_model("vit_tiny_patch16_224", num_classes=10).state_dict()
    dst = create_model("vit_tiny_patch16_224", num_classes=3)
    src["extra.weight"] = torch.zeros(1)
    del src["norm.bias"]
    with pytest.raises(WeightsError) as e:
        load_weights(dst, src)
    msg = str(e.value)
    assert "norm.bias" in msg and "extra.weight" in msg and "head.weight" in msg
    before = dst.head.weight.clone()
    rep = load_weights(dst, src, strict=False, exclude=("head.",))
    assert rep.missing == ["norm.bias"] and rep.unexpected == ["extra.weight"]
    assert "head.weight" in rep.skipped and torch.equal(dst.head.weight, before)


class _Evil:
    def __reduce__(self):
        return (open, ("/tmp/vitscale-should-not-exist", "w"))


def test_load_weights_refuses_pickled_code(tmp_path):
    import os
    target = "/tmp/vitscale-should-not-exist"
    if os.path.exists(target):
        os.remove(target)
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"pos_embed": _Evil()}, f)
    with pytest.raises(WeightsError, match="refuses it") as e:
        load_weights(create_model("vit_tiny_patch16_224", img_size=32), path)
    assert not os.path.exists(target)
    # torch's advice (weights_only=False) runs that code: the line says so and names the safe way
    assert "weights_only=False) (which runs that code)" in str(e.value) and "safetensors" in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_weights(create_model("vit_tiny_patch16_224", img_size=32), tmp_path / "missing.safetensors")


def test_a_torch_saved_state_dict_with_an_object_says_how_to_convert_it_safely(tmp_path):
    """A real ``torch.save`` of a state dict holding an object besides its tensors (a training
    script's ``args``): one line naming the class torch refused, with the safe way to go on and
    without torch's bare advice to load it with ``weights_only=False``."""
    import argparse

    path = tmp_path / "checkpoint.pth"
    torch.save({"pos_embed": torch.zeros(1), "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(WeightsError) as e:
        load_weights(create_model("vit_tiny_patch16_224", img_size=32), path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path}: not loaded: torch.load(weights_only=True) refuses it")
    assert "argparse.Namespace" in line and "unpickling could run as code" in line
    assert "Re-running" not in line and "(which runs that code)" in line and "safetensors.torch.save_file" in line


def test_qk_norm_and_layerscale_travel_to_transfer_and_resume_checks(tmp_path):
    """A pre-trained state dict with timm's q_norm / ls gammas builds its transfer backbone with
    the same options (read from the tensors); toggling either key is a resume-blocking change,
    while older runs' configs (without the keys) still resume."""
    from pretrain.checkpointing.checkpoint import config_changes
    from pretrain.weights.pretrained import build_backbone, load_pretrained

    src = create_model("vit_tiny_patch16_224", img_size=32, num_classes=4, qk_norm=True, init_values=1e-5)
    torch.nn.init.normal_(src.blocks[1].ls2.gamma)
    path = str(tmp_path / "w.safetensors")
    save_file(src.state_dict(), path)
    m = build_backbone(load_pretrained(path), img_size=32)
    assert torch.equal(m.blocks[1].ls2.gamma, src.blocks[1].ls2.gamma)
    assert torch.equal(m.blocks[0].attn.q_norm.weight, src.blocks[0].attn.q_norm.weight)
    old = {"model": {"name": "vit_tiny_patch16_224"}}
    new = {"model": {"name": "vit_tiny_patch16_224", "qk_norm": False, "init_values": None}}
    assert config_changes(old, new) == []
    assert config_changes(new, {"model": dict(new["model"], qk_norm=True, init_values=1e-5)}) == [
        "model.qk_norm=False->True", "model.init_values=None->1e-05"]
