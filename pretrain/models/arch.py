"""Architectures by name, and what follows from an architecture alone: FLOPs and parameter counts.

No torch here: ``pretrain.perf.perfmodel`` and ``vit-launch plan`` price a layout from these numbers
without building anything. ``pretrain.models.vit`` builds the modules from the same table, and
tests compare :func:`param_count` / :func:`analytic_flops` with the built model and fvcore.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def stem_stride(layers: tuple[int, ...]) -> int:
    """Input pixels per output position of the stem: the /4 root, then /2 per stage after the first."""
    return 4 * 2 ** (len(layers) - 1)


def stem_channels(layers: tuple[int, ...]) -> int:
    return 256 * 2 ** (len(layers) - 1)



@dataclass(frozen=True)
class Variant:
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    img_size: int = 224
    mlp_ratio: float = 4.0
    stem_layers: tuple[int, ...] = ()  # ResNet stage depths for hybrids


REGISTRY: dict[str, Variant] = {}


def register(name: str, **arch) -> None:
    REGISTRY[name] = Variant(**arch)


# Table 1 of the paper (+ timm's Tiny / Small). Hybrid: R50 with stage 4 removed and its blocks
# moved to stage 3 (3, 4, 9), total stride 16, patch size 1 on the feature map.
register("vit_tiny_patch16_224", patch_size=16, embed_dim=192, depth=12, num_heads=3)
register("vit_small_patch16_224", patch_size=16, embed_dim=384, depth=12, num_heads=6)
register("vit_base_patch16_224", patch_size=16, embed_dim=768, depth=12, num_heads=12)
register("vit_base_patch32_224", patch_size=32, embed_dim=768, depth=12, num_heads=12)
register("vit_large_patch16_224", patch_size=16, embed_dim=1024, depth=24, num_heads=16)
register("vit_large_patch32_224", patch_size=32, embed_dim=1024, depth=24, num_heads=16)
register("vit_huge_patch14_224", patch_size=14, embed_dim=1280, depth=32, num_heads=16)
# "Scaling Vision Transformers" (Zhai et al. 2021), Table 2: g/14 is 1408 wide with a 6144 MLP,
# G/14 1664 wide with an 8192 MLP; timm writes these as the ratios 48/11 and 64/13 (same widths).
register("vit_giant_patch14_224", patch_size=14, embed_dim=1408, depth=40, num_heads=16, mlp_ratio=48 / 11)
register("vit_gigantic_patch14_224", patch_size=14, embed_dim=1664, depth=48, num_heads=16, mlp_ratio=64 / 13)
register("vit_base_patch16_384", patch_size=16, embed_dim=768, depth=12, num_heads=12, img_size=384)
register("vit_large_patch16_384", patch_size=16, embed_dim=1024, depth=24, num_heads=16, img_size=384)
register("vit_base_r50_s16_224", patch_size=1, embed_dim=768, depth=12, num_heads=12,
         stem_layers=(3, 4, 9))
register("vit_base_r50_s16_384", patch_size=1, embed_dim=768, depth=12, num_heads=12, img_size=384,
         stem_layers=(3, 4, 9))
# timm's `test_vit` (64 wide, 6 blocks, a 192 MLP): a model for checking the machinery, not for
# learning anything; a training step of it on a CPU costs a tenth of ViT-Ti's at the same batch.
register("test_vit", patch_size=16, embed_dim=64, depth=6, num_heads=2, mlp_ratio=3.0)


def list_models() -> list[str]:
    return sorted(REGISTRY)


def variant(name: str) -> Variant:
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(list_models())}")
    return REGISTRY[name]


def model_defaults(name: str) -> dict:
    """Architecture of a registered variant as a dict (no tensors are built). ``stride``: input
    pixels per token, per side; hybrids also give ``stem_layers`` and ``stem_stride``."""
    v = variant(name)
    d = dict(patch_size=v.patch_size, embed_dim=v.embed_dim, depth=v.depth, num_heads=v.num_heads,
             img_size=v.img_size, stride=v.patch_size, stem_layers=v.stem_layers,
             mlp_hidden=int(v.embed_dim * v.mlp_ratio))
    if v.stem_layers:
        d["stem_stride"] = stem_stride(v.stem_layers)
        d["stride"] = v.patch_size * d["stem_stride"]
    return d


def img_size_problem(name: str, px) -> Optional[str]:
    """What is wrong with ``px`` as an input size of ``name``, in words a key or flag can lead
    (``f"{key} {px}: {problem}"``), or None: the size must be a positive multiple of the input pixels
    per token (the patch, times a hybrid's stem stride)."""
    stride = model_defaults(name)["stride"]
    if px != int(px) or px <= 0 or int(px) % stride:
        return f"must be a positive multiple of {name}'s patch size {stride}"
    return None


def patch_keep(tokens: int, rate: float) -> int:
    """Patch tokens an image keeps in training under patch dropout at ``rate`` (timm's
    ``PatchDropout``: ``max(1, int(L * (1 - rate)))``); all of them at rate 0."""
    return tokens if not rate else max(1, int(tokens * (1.0 - rate)))


def _stem_macs(h: int, w: int, layers: tuple[int, ...], in_chans: int = 3, width: int = 64) -> tuple[int, int, int]:
    """Multiply-adds of the hybrid's ResNet (convs + GroupNorms); returns (macs, h, w) out."""
    ceil = lambda a, s: -(-a // s)  # noqa: E731  TF 'SAME' output size
    macs = 0
    h, w = ceil(h, 2), ceil(w, 2)
    macs += h * w * width * in_chans * 49 + 5 * h * w * width  # 7x7/2 conv + GN
    h, w = ceil(h, 2), ceil(w, 2)  # max-pool (not counted by fvcore)
    cin = width
    for i, depth in enumerate(layers):
        cout, stride = 256 * 2 ** i, 1 if i == 0 else 2
        for j in range(depth):
            s = stride if j == 0 else 1
            mid = cout // 4
            oh, ow = ceil(h, s), ceil(w, s)
            if s != 1 or cin != cout:
                macs += oh * ow * cout * cin + 5 * oh * ow * cout  # projection shortcut
            macs += h * w * mid * cin + 5 * h * w * mid  # 1x1
            macs += oh * ow * mid * mid * 9 + 5 * oh * ow * mid  # 3x3 (strided)
            macs += oh * ow * cout * mid + 5 * oh * ow * cout  # 1x1
            h, w, cin = oh, ow, cout
    return macs, h, w


def prefix_tokens(reg_tokens: int = 0, class_token: bool = True) -> int:
    """Tokens before the patches ([class], then registers): timm's ``num_prefix_tokens``."""
    return int(class_token) + reg_tokens


def grid_tokens(name: str, img_size=None) -> int:
    """Patch tokens at ``img_size`` (a hybrid's 'SAME'-padded stem keeps partial positions)."""
    a = model_defaults(name)
    img = img_size or a["img_size"]
    h, w = (img, img) if isinstance(img, int) else img
    s = a["stride"]
    if a["stem_layers"]:
        return -(-h // s) * -(-w // s)
    return (h // s) * (w // s)


def seq_len(name: str, img_size=None, reg_tokens: int = 0, class_token: bool = True) -> int:
    """Tokens every encoder block sees: the patch grid plus the prefix tokens."""
    return grid_tokens(name, img_size) + prefix_tokens(reg_tokens, class_token)


def map_head_macs(d: int, hidden: int, patches: int) -> int:
    """Multiply-adds of the MAP head (``pretrain.models.pooling.AttentionPool``) over ``patches``
    tokens: the probe's query, keys and values of every token, the probe's one attention row (its
    scores and weighted sum), the output projection, its LayerNorm and the MLP on one token."""
    return d * d + patches * d * 2 * d + 2 * patches * d + d * d + 5 * d + 2 * d * hidden


def analytic_flops(name: str, img_size=None, num_classes: int = 1000, global_pool: str = "token",
                   representation_size: Optional[int] = None, qk_norm: bool = False, breakdown: bool = False,
                   reg_tokens: int = 0, class_token: bool = True, patch_drop_rate: float = 0.0,
                   layer_scale: bool = False, pos_embed: str = "learned"):
    """The same count as :func:`forward_flops`, from the architecture alone (no tensors). Register
    tokens and the [class] token lengthen the sequence of every block; ``map`` pooling adds
    :func:`map_head_macs` (in ``head``). ``patch_drop_rate``: a training forward's, the blocks, the
    final norm and the MAP head on the patch tokens patch dropout keeps (:func:`patch_keep`; the
    prefix tokens all kept); the patch embedding still sees every patch. ``layer_scale`` and
    ``pos_embed`` (taken with the rest of :func:`config_options`) change no count: LayerScale's
    multiply and the position embedding's add are element-wise, counted by neither."""
    a = model_defaults(name)
    img = img_size or a["img_size"]
    h, w = (img, img) if isinstance(img, int) else img
    d, depth, p = a["embed_dim"], a["depth"], a["patch_size"]
    if "stem_stride" in a:
        embed, gh, gw = _stem_macs(h, w, a["stem_layers"])
        cin = stem_channels(a["stem_layers"])
        embed += gh * gw * cin * d
    else:
        gh, gw = h // p, w // p
        embed = gh * gw * 3 * p * p * d
    kept = patch_keep(gh * gw, patch_drop_rate)
    n = kept + prefix_tokens(reg_tokens, class_token)
    hidden = a["mlp_hidden"]  # 4 d, except g/14 and G/14
    per_block = (
        (4 if qk_norm else 2) * 5 * n * d  # two LayerNorms (+ the queries' and keys' with qk_norm)
        + n * d * 3 * d  # qkv
        + 2 * n * n * d  # Q K^T and A V over all heads
        + n * d * d  # output projection
        + 2 * n * d * hidden  # MLP
    )
    blocks = depth * per_block
    final_norm = 5 * d if global_pool == "avg" else 5 * n * d  # after pooling (fc_norm), else on every token
    pool = map_head_macs(d, hidden, kept) if global_pool == "map" else 0
    feat = d
    head = 0
    if representation_size:
        head += d * representation_size
        feat = representation_size
    head += feat * num_classes
    total = embed + blocks + final_norm + pool + head
    if breakdown:
        return dict(embed=embed, blocks=blocks, head=head + final_norm + pool, total=total)
    return total


def config_options(m) -> dict:
    """The options of a ``model:`` config section (``pretrain.config.schema.ModelConfig``) that change
    what the model holds or computes beyond its name, resolution and classes, as :func:`param_count`,
    :func:`param_tensors`, :func:`analytic_flops` and ``pretrain.perf.memory.analytic_shape`` take
    them (``model.init_values`` as ``layer_scale``): the one list every estimate of the built model
    reads, so none prices a model the config does not build."""
    return dict(global_pool=m.global_pool, representation_size=m.representation_size, qk_norm=m.qk_norm,
                layer_scale=bool(m.init_values), reg_tokens=m.reg_tokens, class_token=m.class_token,
                pos_embed=m.pos_embed)


def config_macs(m, img_size: int, breakdown: bool = False):
    """:func:`analytic_flops` of a ``model:`` config section (``pretrain.config.schema.ModelConfig``)
    at ``img_size`` px, as a training forward runs it (the tokens patch dropout keeps)."""
    return analytic_flops(m.name, img_size, m.num_classes, breakdown=breakdown, patch_drop_rate=m.patch_drop_rate,
                          **config_options(m))


def _stem_params(layers: tuple[int, ...], in_chans: int = 3, width: int = 64) -> tuple[int, int]:
    """(parameters, largest module's own parameters) of the hybrid's ResNet: bias-free
    weight-standardised convs, each followed by a GroupNorm (weight + bias)."""
    total = largest = in_chans * width * 49
    total += 2 * width
    cin = width
    for i, depth in enumerate(layers):
        cout = 256 * 2 ** i
        mid = cout // 4
        for j in range(depth):
            stride = 1 if (i == 0 or j > 0) else 2
            convs = [cin * mid, 9 * mid * mid, mid * cout] + ([cin * cout] if (stride != 1 or cin != cout) else [])
            total += sum(convs) + 2 * (mid + mid + cout) + (2 * cout if len(convs) == 4 else 0)
            largest = max(largest, *convs)
            cin = cout
    return total, largest


def block_param_count(name: str, qk_norm: bool = False, layer_scale: bool = False) -> int:
    """Parameters of one Transformer block (two LayerNorms, qkv and projection, the MLP; the
    normalised Q/K's norms and the LayerScale gammas when on): what ZeRO-3 gathers at once for a
    block that is one leaf module (``zero.leaf_blocks``)."""
    a = model_defaults(name)
    d, m, hd = a["embed_dim"], a["mlp_hidden"], a["embed_dim"] // a["num_heads"]
    return (4 * d + 3 * d * d + 3 * d + d * d + d + d * m + m + m * d + d
            + (4 * hd if qk_norm else 0) + (2 * d if layer_scale else 0))


def _map_params(d: int, m: int) -> list[int]:
    """Element counts of the MAP head's tensors: probe, query, key + value, projection, norm, MLP."""
    return [d, d * d, d, 2 * d * d, 2 * d, d * d, d, d, d, d * m, m, m * d, d]


def _top_params(d: int, tokens: int, reg_tokens: int, class_token: bool, pos_embed: str) -> list[int]:
    """The root module's own tensors: [class] token, registers, a learned position embedding (the
    sin-cos one is a buffer, no parameter)."""
    return ([d] if class_token else []) + ([reg_tokens * d] if reg_tokens else []) + \
        ([(tokens + prefix_tokens(reg_tokens, class_token)) * d] if pos_embed == "learned" else [])


def param_count(name: str, img_size=None, num_classes: int = 1000, global_pool: str = "token",
                representation_size: Optional[int] = None, qk_norm: bool = False,
                layer_scale: bool = False, reg_tokens: int = 0, class_token: bool = True,
                pos_embed: str = "learned") -> tuple[int, int]:
    """(parameters, parameters of the largest single module) of the model ``pretrain.models.vit``
    builds with these arguments. The second is what ZeRO-3 gathers at once at most when DeepSpeed
    fetches each module's own parameters (``zero.leaf_blocks=false``); leaf blocks are fetched
    whole (:func:`block_param_count`)."""
    a = model_defaults(name)
    d, depth, m = a["embed_dim"], a["depth"], a["mlp_hidden"]
    tokens = grid_tokens(name, img_size)
    if a["stem_layers"]:
        stem, stem_largest = _stem_params(a["stem_layers"])
        embed = stem + stem_channels(a["stem_layers"]) * d + d
        modules = [stem_largest, stem_channels(a["stem_layers"]) * d + d]
    else:
        p = a["patch_size"]
        embed = 3 * p * p * d + d
        modules = [embed]
    top = sum(_top_params(d, tokens, reg_tokens, class_token, pos_embed))
    block = block_param_count(name, qk_norm, layer_scale)
    head_in = representation_size or d
    head = 2 * d + (d * representation_size + representation_size if representation_size else 0) \
        + head_in * num_classes + num_classes
    modules += [top, 3 * d * d + 3 * d, d * m + m, head_in * num_classes + num_classes]
    if global_pool == "map":
        head += sum(_map_params(d, m))
        modules += [d, 2 * d * d + 2 * d]  # the probe (the pool's own), key + value
    if representation_size:
        modules.append(d * representation_size + representation_size)
    return embed + top + depth * block + head, max(modules)


def param_tensors(name: str, img_size=None, num_classes: int = 1000, global_pool: str = "token",
                  representation_size: Optional[int] = None, qk_norm: bool = False, layer_scale: bool = False,
                  reg_tokens: int = 0, class_token: bool = True, pos_embed: str = "learned") -> list[int]:
    """Element counts of the model's parameter tensors, in the order of the forward: what ZeRO-3
    partitions one by one, and its persistence threshold compares against."""
    a = model_defaults(name)
    img = img_size or a["img_size"]
    d, m, hd = a["embed_dim"], a["mlp_hidden"], a["embed_dim"] // a["num_heads"]
    arch = dict(global_pool=global_pool, representation_size=representation_size, qk_norm=qk_norm,
                layer_scale=layer_scale, reg_tokens=reg_tokens, class_token=class_token, pos_embed=pos_embed)
    total, _ = param_count(name, img, num_classes, **arch)
    if a["stem_layers"]:
        c = stem_channels(a["stem_layers"])
        embed = [c * d, d]
        stem = _stem_params(a["stem_layers"])[0]
    else:
        p = a["patch_size"]
        embed, stem = [3 * p * p * d, d], 0
    top = _top_params(d, grid_tokens(name, img), reg_tokens, class_token, pos_embed)
    qk = [hd, hd, hd, hd] if qk_norm else []  # the queries' and keys' LayerNorms
    gamma = [d] if layer_scale else []
    block = [d, d, 3 * d * d, 3 * d, *qk, d * d, d, *gamma, d, d, d * m, m, m * d, d, *gamma]
    pool = _map_params(d, m) if global_pool == "map" else []
    feat = representation_size or d
    pre_logits = [d * representation_size, representation_size] if representation_size else []
    out = (([stem] if stem else []) + embed + top + block * a["depth"] + [d, d] + pool + pre_logits
           + [feat * num_classes, num_classes])
    assert sum(out) == total, (name, sum(out), total)
    return out
