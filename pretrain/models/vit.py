"""The ViT family of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020).

Conv patch embedding, learnable [class] token, learnable 1-D position embeddings, pre-norm
encoder blocks (LN -> MSA -> residual, LN -> MLP(GELU) -> residual), final LayerNorm, optional
tanh pre-logits layer, linear head (zero-initialised). Today's options, each under timm's name:
register tokens (``reg_tokens``, Darcet et al. 2024), no [class] token (``class_token=False``),
big_vision's fixed 2-D sin-cos position embedding (``pos_embed='sincos2d'``) and multi-head
attention pooling (``global_pool='map'``, ``pretrain.models.pooling``). Fewer tokens for the same
model: patch dropout in training (``patch_drop_rate``) and any input size a multiple of the patch,
the position embeddings then resampled (or, sin-cos, computed) for its grid in the forward
(``pretrain.models.tokens``). The encoder block and its pieces live in ``pretrain.models.layers``.

Parameter names and shapes equal timm's model of the same name (``strict=True`` both ways) as
long as ``representation_size`` is None: timm 1.x dropped the pre-logits layer, ours keeps it as
``pre_logits.fc`` (the name older timm and the original JAX->PyTorch ports use). That holds for
every combination of the options above: ``timm.create_model(name, reg_tokens=..., class_token=...,
global_pool=...)`` takes our ``state_dict()`` with ``strict=True`` and gives the same logits. The
sin-cos embedding is a buffer under timm's name ``pos_embed`` (zeros in the prefix rows: big_vision
adds no position to its [class] token), so timm reads it as a learned embedding holding the same
values, while here it has no gradient, no weight decay and no optimizer state.

This module knows nothing of distribution: it imports no deepspeed, builds wherever the default
device is (its initialisation skips meta tensors), and activation checkpointing is a plain
per-block switch (``set_grad_checkpointing``: whole blocks, or op-level,
``pretrain.models.recompute``). Initial weights come from one CPU generator
(``init_seed``), drawn parameter by parameter in a fixed order and copied to wherever the
parameters live, so one seed gives the same weights on CPU or GPU, plain or ZeRO-3-partitioned,
on any world size.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Iterable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.models.arch import variant
from pretrain.models.hybrid import ResNetStem
from pretrain.models.init import fill, init_generator
from pretrain.models.layers import Block, LayerScale, Mlp
from pretrain.models.pooling import AttentionPool, sincos_pos_embed
from pretrain.models.tokens import HybridEmbed, PatchDropout, PatchEmbed, Size, resize_pos_embed

# Called around the initialisation of each module's own parameters; the default does nothing.
# A caller whose parameters are partitioned (ZeRO-3) passes a gather that makes them whole.
Gather = Callable[[list[nn.Parameter]], ContextManager]


def _no_gather(params: Iterable[nn.Parameter]) -> ContextManager:
    return contextlib.nullcontext()


# -------------------------------------------------------------------------------------- model
class VisionTransformer(nn.Module):
    def __init__(
        self,
        img_size: Size = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        patch_drop_rate: float = 0.0,
        representation_size: Optional[int] = None,
        global_pool: str = "token",
        backbone: Optional[nn.Module] = None,
        qk_norm: bool = False,
        init_values: Optional[float] = None,
        reg_tokens: int = 0,
        class_token: bool = True,
        pos_embed: str = "learned",
        defer_init: bool = False,
        init_seed: Optional[int] = None,
    ):
        """``drop_rate``: the ViT paper's dropout, where vit_jax applies it: after the position
        embedding's add, the attention's output projection and each MLP layer (timm's
        ``pos_drop_rate`` and ``proj_drop_rate``); none before the head (timm's ``drop_rate``, 0).
        ``global_pool``: ``token`` (the [class] token), ``avg`` (mean of the patch tokens, norm
        after pooling as ``fc_norm``) or ``map`` (``AttentionPool`` over the patch tokens).
        ``reg_tokens``: register tokens after the [class] token, in the sequence but in no pooling.
        ``class_token=False``: none (then ``avg`` or ``map``). ``pos_embed``: ``learned`` or
        ``sincos2d`` (fixed). ``patch_drop_rate``: the share of patch tokens dropped in training
        (:class:`PatchDropout`; no parameters; the prefix tokens always kept). ``defer_init``: leave
        the weights as the layers' constructors made them; the caller runs ``init_weights(gather,
        generator)`` later (ZeRO-3 builds partitioned parameters first). ``init_seed``: the
        initialisation's seed (None: one drawn from torch's global CPU generator, so
        ``torch.manual_seed`` still decides it)."""
        super().__init__()
        if global_pool not in ("token", "avg", "map"):
            raise ValueError(f"global_pool must be 'token', 'avg' or 'map', got {global_pool!r}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs the [class] token; use 'avg' or 'map' with class_token=False")
        if pos_embed not in ("learned", "sincos2d"):
            raise ValueError(f"pos_embed must be 'learned' or 'sincos2d', got {pos_embed!r}")
        if reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, got {reg_tokens}")
        norm_layer = lambda d: nn.LayerNorm(d, eps=1e-6)  # noqa: E731  (eps of the JAX original)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.embed_dim = embed_dim
        self.num_reg_tokens = reg_tokens
        self.has_class_token = class_token
        self.pos_embed_type = pos_embed
        self.num_prefix_tokens = int(class_token) + reg_tokens  # timm's: the tokens before the patches
        self.grad_checkpointing = 0  # blocks recomputed in the backward (set_grad_checkpointing)

        if backbone is None:
            self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        else:
            self.patch_embed = HybridEmbed(backbone, img_size, embed_dim)
        num_patches = self.patch_embed.grid_size[0] * self.patch_embed.grid_size[1]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        pe = torch.zeros(1, num_patches + self.num_prefix_tokens, embed_dim)
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(pe)
        else:  # a function of the grid: set by init_weights, never trained
            self.register_buffer("pos_embed", pe)
        self.pos_drop = nn.Dropout(drop_rate)
        # no module at all without patch dropout: under ZeRO-3 each module costs a hook pair per forward
        self.patch_drop = PatchDropout(patch_drop_rate, self.num_prefix_tokens) if patch_drop_rate else None

        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth, device="cpu")]
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, drop_rate, attn_drop_rate, dpr[i], norm_layer,
                  qk_norm=qk_norm, init_values=init_values)
            for i in range(depth)])
        # timm's layout: the final LN sits on the tokens for [class]-token pooling and after
        # pooling (fc_norm) for average pooling; names must match for strict loading.
        self.norm = norm_layer(embed_dim) if global_pool != "avg" else nn.Identity()
        self.attn_pool = AttentionPool(embed_dim, num_heads, Mlp(embed_dim, int(embed_dim * mlp_ratio)),
                                       norm_layer(embed_dim)) if global_pool == "map" else None
        self.fc_norm = norm_layer(embed_dim) if global_pool == "avg" else nn.Identity()
        if representation_size:
            self.pre_logits = nn.Sequential()
            self.pre_logits.add_module("fc", nn.Linear(embed_dim, representation_size))
            self.pre_logits.add_module("act", nn.Tanh())
            self.num_features = representation_size
        else:
            self.pre_logits = nn.Identity()
            self.num_features = embed_dim
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        if not defer_init:
            self.init_weights(generator=init_generator(init_seed))

    # -------------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self, gather: Optional[Gather] = None, generator: Optional[torch.Generator] = None) -> None:
        """The paper's (JAX) initialisation: Xavier-uniform linears (the attention's query, key and
        value kernels each over D x D, as flax's separate Dense layers), LeCun-normal patch conv,
        tiny-normal MLP biases, N(0, 0.02) position embeddings, zero [class] token and head,
        LayerScale at ``init_values`` (the hybrid's ResNet stem: its own rule); register tokens
        N(0, 1e-6) (timm, DINOv2); the MAP head as big_vision's ``MAPHead`` (Xavier-uniform probe
        of fan-in 1, key and value Xavier each); the sin-cos embedding computed for the grid.

        Module by module, each inside ``gather(its own parameters)``, so partitioned parameters
        (ZeRO-3) are whole only one module at a time. Every draw comes from ``generator`` (a CPU
        generator; None: a fresh one seeded from torch's global CPU generator) into a CPU fp32
        tensor in a fixed order, then is copied to the parameter's device and dtype: the same
        generator state gives the same weights on any device and layout."""
        gather = gather or _no_gather
        g = generator if generator is not None else init_generator(None)
        backbone = getattr(self.patch_embed, "backbone", None)
        if backbone is not None:
            backbone.init_weights(gather, g)
        self._init_encoder(gather, g)

    @torch.no_grad()
    def _init_encoder(self, gather: Gather, g: torch.Generator) -> None:
        root = []
        for name, m in self.named_modules():
            if name.startswith("patch_embed.backbone"):
                continue
            own = list(m.parameters(recurse=False))
            if not own:
                continue
            if m is self:
                root = own  # pos_embed, cls_token: last, as before
                continue
            with gather(own):
                _init_module(name, m, g)
        with gather(root) if root else contextlib.nullcontext():
            if self.pos_embed_type == "learned":
                fill(self.pos_embed, lambda t: nn.init.normal_(t, std=0.02, generator=g))
            elif not self.pos_embed.is_meta:
                self.pos_embed.copy_(sincos_pos_embed(self.grid_size, self.embed_dim, self.num_prefix_tokens))
            if self.cls_token is not None:
                nn.init.zeros_(self.cls_token)
            if self.reg_token is not None:  # after the draws the token-only model makes: its weights stay
                fill(self.reg_token, lambda t: nn.init.normal_(t, std=1e-6, generator=g))

    # ------------------------------------------------------------------------- public
    @property
    def patch_size(self) -> tuple[int, int]:
        return self.patch_embed.patch_size

    @property
    def img_size(self) -> tuple[int, int]:
        return self.patch_embed.img_size

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    def no_weight_decay(self) -> set[str]:
        """Parameters excluded from weight decay besides biases and norm weights: the tokens and
        the position embedding (timm's list), and the MAP probe (big_vision decays kernels only)."""
        return {"pos_embed", "cls_token", "reg_token", "attn_pool.latent"}

    def set_grad_checkpointing(self, enable=True) -> None:
        """Recompute blocks in the backward pass instead of keeping their activations: ``True``
        every block, ``False`` none, an int ``N`` the first ``N`` (the earliest blocks' activations
        live longest). Each costs its forward again (about 1/3 more compute for that block), and
        keeps only its input. ``"selective"``: every block op by op, keeping its matmul and
        attention outputs and recomputing only the element-wise work between them
        (``pretrain.models.recompute``). Results equal the non-checkpointed model."""
        depth = len(self.blocks)
        selective = enable == "selective"
        for blk in self.blocks:  # inside each block's forward, so that train.compile's blocks include it
            blk.checkpoint_ops = selective
        if selective:
            self.grad_checkpointing = 0
        else:
            self.grad_checkpointing = depth if enable is True else max(0, min(int(enable), depth))

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new zero-initialised head (transfer): the pooling's norm layer is kept as is."""
        if global_pool is not None and global_pool != self.global_pool:
            raise ValueError("changing global_pool would change the norm layout; rebuild the model")
        self.num_classes = num_classes
        p = next(self.parameters())
        self.head = nn.Linear(self.num_features, num_classes, device=p.device, dtype=p.dtype) \
            if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def _pos_embed(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The prefix tokens ([class], registers) prepended and the position embeddings added to the
        patch tokens of a ``grid``. A grid other than the model's (``train.resolution_schedule``)
        gets the learned embeddings' patch part resampled to it in the forward, the prefix rows kept,
        as timm's ``dynamic_img_size`` does: the parameter keeps the model's grid (exports
        unchanged), its gradient flows back through the bicubic interpolation, which costs one small
        (D, H, W) resample per forward. The sin-cos table is a function of the grid: it is computed
        for the new grid instead (big_vision's), (H*W, D) per forward, on the tokens' device: a
        table made on the host would be copied over, and on a GPU that copy waits for the stream."""
        pos = self.pos_embed
        if tuple(grid) != tuple(self.grid_size):
            if self.pos_embed_type == "sincos2d":
                pos = sincos_pos_embed(grid, self.embed_dim, self.num_prefix_tokens, device=x.device)
            else:
                pos = resize_pos_embed(pos, grid, self.grid_size, self.num_prefix_tokens)
        # The residual stream starts in the module's dtype. Under autocast (``bf16-autocast``) the
        # convolution gives bf16 tokens of an fp32 module; timm's concatenation with its fp32 prefix
        # tokens and its add of the fp32 position embedding promote them to fp32, which without a
        # prefix token only the add would do. The sin-cos buffer stays fp32 where DeepSpeed's bf16 /
        # fp16 mode casts only parameters: it is added in the module's dtype, as big_vision does.
        dtype = self.patch_embed.proj.weight.dtype
        x = x.to(dtype)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if prefix:
            x = torch.cat(prefix + [x], dim=1)
        return self.pos_drop(x + pos.to(dtype))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, prefix + kept patches, D) tokens after the final norm: [class], registers, then the
        patches (all of them, or in training the ones patch dropout keeps)."""
        grid = self.patch_embed.grid_of(x.shape[-2], x.shape[-1])
        x = self._pos_embed(self.patch_embed(x), grid)
        if self.patch_drop is not None:
            x = self.patch_drop(x)
        if self.grad_checkpointing and torch.is_grad_enabled():
            for i, blk in enumerate(self.blocks):
                # non-reentrant: works with ZeRO-3's parameter hooks, unused inputs and torch.compile
                x = checkpoint(blk, x, use_reentrant=False) if i < self.grad_checkpointing else blk(x)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) tokens -> (B, D): the [class] token, or the mean or MAP of the patch tokens
        (registers and [class] token left out, as timm)."""
        if self.global_pool == "token":
            return x[:, 0]
        x = x[:, self.num_prefix_tokens:]
        return self.attn_pool(x) if self.attn_pool is not None else x.mean(dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pooled, normed (``avg``) and through the pre-logits layer; the logits unless ``pre_logits``."""
        x = self.pre_logits(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_module(name: str, m: nn.Module, g: torch.Generator) -> None:
    """One module's own parameters, by the rules in ``VisionTransformer.init_weights``."""
    if isinstance(m, nn.Linear):
        if name == "head":
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)
            return
        if name.endswith("attn_pool.kv") or name.endswith("attn.qkv"):
            # the fused query / key / value kernels each Xavier over D x D, as the separate Dense
            # kernels of flax's attention (vit_jax, big_vision's encoder and MAPHead) are initialised
            fill(m.weight, lambda t: [nn.init.xavier_uniform_(part, generator=g)
                                      for part in t.chunk(t.shape[0] // t.shape[1])])
        else:
            fill(m.weight, lambda t: nn.init.xavier_uniform_(t, generator=g))
        if "mlp" in name:
            fill(m.bias, lambda t: nn.init.normal_(t, std=1e-6, generator=g))
        else:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):
        fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
        # LeCun normal: truncated normal with variance 1/fan_in (std corrected for truncation)
        std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
        fill(m.weight, lambda t: nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std, generator=g))
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, LayerScale):
        nn.init.constant_(m.gamma, m.init_values)
    elif isinstance(m, AttentionPool):
        # flax's xavier_uniform on big_vision's (1, 1, D) probe: fan-in 1, fan-out D
        bound = math.sqrt(6.0 / (1 + m.latent.shape[-1]))
        fill(m.latent, lambda t: nn.init.uniform_(t, -bound, bound, generator=g))


def create_model(name: str, *, num_classes: int = 1000, img_size: Optional[Size] = None,
                 drop_rate: float = 0.0, drop_path_rate: float = 0.0, patch_drop_rate: float = 0.0,
                 representation_size: Optional[int] = None, global_pool: str = "token",
                 qk_norm: bool = False, init_values: Optional[float] = None, reg_tokens: int = 0,
                 class_token: bool = True, pos_embed: str = "learned", defer_init: bool = False,
                 init_seed: Optional[int] = None, **kwargs) -> VisionTransformer:
    """Build a registered variant. ``with torch.device('meta'):`` builds it without memory.
    ``qk_norm`` / ``init_values`` / ``reg_tokens`` / ``class_token`` / ``global_pool`` /
    ``patch_drop_rate``: timm's options of the same names (QK LayerNorm, LayerScale, registers,
    [class] token, pooling, patch dropout in training); ``pos_embed``: ``learned`` or big_vision's
    fixed ``sincos2d``.
    ``defer_init``: skip the initialisation; call ``model.init_weights(gather, generator)``
    afterwards. ``init_seed``: the initialisation's own seed (``VisionTransformer``).
    The variant's shape (``patch_size``, ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``)
    yields to a keyword of the same name, as in ``timm.create_model``."""
    v = variant(name)
    img_size = img_size or v.img_size
    backbone = ResNetStem(v.stem_layers, in_chans=kwargs.get("in_chans", 3), defer_init=True) \
        if v.stem_layers else None
    shape = dict(patch_size=v.patch_size, embed_dim=v.embed_dim, depth=v.depth, num_heads=v.num_heads,
                 mlp_ratio=v.mlp_ratio)
    shape.update((k, kwargs.pop(k)) for k in list(shape) if k in kwargs)
    return VisionTransformer(
        img_size=img_size, **shape, qk_norm=qk_norm, init_values=init_values,
        reg_tokens=reg_tokens, class_token=class_token, pos_embed=pos_embed, defer_init=defer_init,
        init_seed=init_seed, num_classes=num_classes, drop_rate=drop_rate, drop_path_rate=drop_path_rate,
        patch_drop_rate=patch_drop_rate, representation_size=representation_size, global_pool=global_pool,
        backbone=backbone, **kwargs)
