"""Layer-wise lr decay groups (``pretrain.distributed.layer_decay``) equal timm's
``param_groups_layer_decay`` on timm's model of the same name (the same parameter names as ours):
the same groups in the same order, each with its lr scale, weight decay and parameters."""
import pytest
import timm
import torch

from pretrain.distributed.layer_decay import layer_decay_groups, layer_of
from pretrain.models.vit import create_model


def _named(groups: list[dict], names_of: dict) -> list[tuple]:
    return [(round(g["lr_scale"], 12), g["weight_decay"], [names_of[id(p)] for p in g["params"]]) for g in groups]


VARIANTS = {
    "token": dict(num_classes=7),
    "avg-pool (fc_norm)": dict(num_classes=7, global_pool="avg"),
    "no head": dict(num_classes=0),
    # registers join the stem; without the [class] token the stem is registers and embedding alone
    "registers": dict(num_classes=7, reg_tokens=4),
    "registers, no [class] token": dict(num_classes=7, reg_tokens=2, class_token=False, global_pool="avg"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layer_decay", [0.65, 0.75])
def test_groups_equal_timm(variant, layer_decay):
    from timm.optim import param_groups_layer_decay

    kw = dict(img_size=32, **VARIANTS[variant])
    ours = create_model("vit_tiny_patch16_224", **kw)
    theirs = timm.create_model("vit_tiny_patch16_224", **kw)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    want = param_groups_layer_decay(theirs, weight_decay=0.05, layer_decay=layer_decay,
                                    no_weight_decay_list=theirs.no_weight_decay())
    got = layer_decay_groups(ours.named_parameters(), weight_decay=0.05, layer_decay=layer_decay,
                             no_weight_decay=ours.no_weight_decay())
    assert _named(got, {id(p): n for n, p in ours.named_parameters()}) == \
        _named(want, {id(p): n for n, p in theirs.named_parameters()})


def test_layers_of_a_vit_with_head():
    """Stem 0, block i at i + 1, the final norm with the last block, the head on top: scales from
    decay^13 (stem) to 1 (head) for 12 blocks."""
    names = ["cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.norm1.weight", "blocks.11.mlp.fc2.bias",
             "norm.weight", "head.weight"]
    assert layer_of(names) == {"cls_token": 0, "pos_embed": 0, "patch_embed.proj.weight": 0,
                               "blocks.0.norm1.weight": 1, "blocks.11.mlp.fc2.bias": 2, "norm.weight": 2,
                               "head.weight": 3}  # only the layers present are counted
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)
    groups = layer_decay_groups(m.named_parameters(), weight_decay=0.05, layer_decay=0.5,
                                no_weight_decay=m.no_weight_decay())
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert scale[id(m.head.weight)] == 1.0 and scale[id(m.norm.weight)] == 0.5
    assert scale[id(m.blocks[0].attn.qkv.weight)] == 0.5 ** 12 and scale[id(m.pos_embed)] == 0.5 ** 13
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decay[id(m.pos_embed)] == decay[id(m.blocks[3].attn.qkv.bias)] == 0.0
    assert decay[id(m.blocks[3].attn.qkv.weight)] == 0.05


def test_frozen_parameters_count_as_layers_but_join_no_group():
    m = create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)
    m.patch_embed.requires_grad_(False)
    groups = layer_decay_groups(m.named_parameters(), weight_decay=0.05, layer_decay=0.5)
    ids = {id(p) for g in groups for p in g["params"]}
    assert id(m.patch_embed.proj.weight) not in ids and id(m.pos_embed) in ids
    assert next(g for g in groups if any(p is m.pos_embed for p in g["params"]))["lr_scale"] == 0.5 ** 13
    with torch.no_grad():  # the groups make an optimizer that steps
        torch.optim.AdamW([dict(g, lr=1e-3 * g["lr_scale"]) for g in groups], lr=1e-3)
