"""Pre-trained weights from any checkpoint we accept, and the backbone built from them.

Accepted: (1) one of our run directories, any ZeRO stage (through ``pretrain.weights.export``'s
``load_run_weights``, which merges the fp32 shards); (2) an exported ``.safetensors`` file, whose
metadata may carry ``model`` / ``config`` JSON, ``model_name``, ``grid_size`` ("HxW"), ``step``,
``wandb_run_id`` and what pre-training cost up to that step (``device_seconds``, ``images_seen``,
``model_flops``); (3) a timm / torch state dict (``.pth``/``.bin``/``.pt``, read with
``weights_only=True``). Nothing here unpickles code.

The architecture comes, in increasing priority, from the tensors themselves (patch size, width,
depth, pooling, [class] and register tokens, the pre-logits layer are all visible in the shapes and
names, a sin-cos position embedding in its values), the file's metadata, and the user's explicit
``model.*`` keys. Position embeddings are resized by ``load_weights`` when
the evaluation resolution differs from the checkpoint's.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from data_pipeline.errors import ConfigError
from pretrain.models.arch import img_size_problem, list_models, model_defaults
from pretrain.models.pooling import sincos_pos_embed
from pretrain.models.vit import create_model
from pretrain.weights.load import WeightsError, load_weights, pos_embed_prefix_rows, prefix_rows, read_state_dict


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read or whose architecture cannot be told: a user mistake, so
    ``cli_errors`` prints it as one line (exit 2) naming the path."""


ARCH_KEYS = ("name", "img_size", "global_pool", "representation_size", "reg_tokens", "class_token", "pos_embed")
ARCH_DEFAULTS = {"global_pool": "token", "reg_tokens": 0, "class_token": True, "pos_embed": "learned"}


@dataclass
class Pretrained:
    state_dict: dict[str, torch.Tensor]
    arch: dict  # ARCH_KEYS: name, img_size (None: the name's), pooling, pre-logits width, tokens, position embedding
    grid: Optional[tuple[int, int]]  # the checkpoint's patch grid when known (non-square grids)
    step: Optional[int]
    wandb_run_id: Optional[str]
    source: str
    kind: str  # "run", "transformers" (a transformers ViT folder), "safetensors" or "state_dict"
    run_dir: Optional[str] = None
    classes: Optional[tuple[str, ...]] = None  # the head's class names in output order, where the source says them
    totals: Optional[dict] = None  # what pre-training did and cost up to this step (export.RUN_TOTALS), where known

    @property
    def img_size(self) -> int:
        return int(self.arch.get("img_size") or model_defaults(self.arch["name"])["img_size"])


def _shape_key(d: dict) -> tuple:
    return d["patch_size"], d["embed_dim"], d["depth"], "stem_stride" in d


def infer_arch(sd: dict[str, torch.Tensor]) -> dict:
    """Architecture keys readable from the tensors alone; {} when this is not a ViT state dict."""
    w, pe = sd.get("patch_embed.proj.weight"), sd.get("pos_embed")
    depth_ids = {int(k.split(".")[1]) for k in sd if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    if w is None or pe is None or w.ndim != 4 or not depth_ids:
        return {}
    dim, patch, depth = w.shape[0], w.shape[-1], max(depth_ids) + 1
    hybrid = any(k.startswith("patch_embed.backbone.") for k in sd)
    prefix, rows = prefix_rows(sd), pos_embed_prefix_rows(sd)
    n = pe.shape[1] - rows if rows is not None else -1  # -1: the shapes do not tell the grid
    side = math.isqrt(n) if n > 0 else 0
    names = [m for m in list_models() if _shape_key(model_defaults(m)) == (patch, dim, depth, hybrid)]
    if not names:
        return {}
    d = model_defaults(names[0])
    img = side * d["stride"] if side * side == n else None
    name = next((m for m in names if model_defaults(m)["img_size"] == img), names[0])
    rep = sd.get("pre_logits.fc.weight")
    pool = "map" if "attn_pool.latent" in sd else "avg" if "fc_norm.weight" in sd else "token"
    # a sin-cos embedding saved by timm or in bf16 is still its formula to bf16's rounding
    sincos = side * side == n and torch.allclose(pe.float(), sincos_pos_embed((side, side), dim, rows), atol=1e-2)
    return {"name": name, "img_size": img, "global_pool": pool,
            "representation_size": int(rep.shape[0]) if rep is not None else None,
            "reg_tokens": prefix - int("cls_token" in sd), "class_token": "cls_token" in sd,
            "pos_embed": "sincos2d" if sincos else "learned"}


def _meta_arch(meta: dict[str, str],
               where: str) -> tuple[dict, Optional[tuple[int, int]], Optional[int], Optional[str]]:
    """(arch, grid, step, wandb run id) from safetensors metadata written by ``vit-export``."""
    arch: dict = {}
    try:
        for key in ("config", "model"):  # the model section inside a full config, or on its own
            if meta.get(key):
                d = json.loads(meta[key])
                d = d.get("model", {}) if key == "config" else d
                arch.update({k: d[k] for k in ARCH_KEYS if k in d})
        if meta.get("model_name"):
            arch["name"] = meta["model_name"]
        grid = tuple(int(v) for v in meta["grid_size"].lower().split("x")) if meta.get("grid_size") else None
        if grid is not None and len(grid) != 2:
            raise ValueError(f"grid_size {meta['grid_size']!r}")
        step = int(meta["step"]) if meta.get("step") not in (None, "") else None
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where}: unreadable metadata ({e})") from None
    return arch, grid, step, meta.get("wandb_run_id") or None


def _read_run_dir(path: Path, prog: str) -> tuple[dict, dict]:
    """The single entry to run directories and transformers folders:
    ``pretrain.weights.export.load_run_weights``."""
    from pretrain.weights import hf
    from pretrain.weights.export import load_run_weights

    try:
        return load_run_weights(path, prog=prog)
    except CheckpointError:
        raise
    except Exception as e:  # a user-given path: any failure to read it is a one-line error
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        what = "transformers folder" if hf.is_hf_folder(path) else "run checkpoint"
        raise CheckpointError(f"{path}: cannot read {what}: {msg}") from None


def load_pretrained(path: str | Path, user_arch: Optional[dict] = None, prog: str = "vit-transfer") -> Pretrained:
    """Read a checkpoint of any accepted kind. ``user_arch``: model keys the user set explicitly;
    they win over metadata and inference. ``prog``: the command reading it, which labels the warning
    for a damaged checkpoint passed over."""
    p = Path(path)
    grid = step = run_id = run_dir = classes = totals = None
    arch: dict = {}
    if p.is_dir():
        from pretrain.weights import hf

        sd, info = _read_run_dir(p, prog)
        kind = "transformers" if hf.is_hf_folder(p) else "run"
        arch = {k: info["model"][k] for k in ARCH_KEYS if k in info.get("model", {})}
        grid = tuple(info["grid_size"]) if info.get("grid_size") else None
        step, run_id, run_dir = info.get("step"), info.get("wandb_run_id"), info.get("run_dir")
        from pretrain.weights.export import RUN_TOTALS, head_class_names

        classes = head_class_names(info)
        totals = {k: info.get(k) for k in RUN_TOTALS}
    elif not p.exists():
        raise CheckpointError(f"{p}: checkpoint not found")
    else:
        try:
            sd, meta = read_state_dict(p)
        except WeightsError as e:
            raise CheckpointError(str(e)) from None
        except Exception as e:  # a truncated or foreign file: say so in one line
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise CheckpointError(f"{p}: not a readable checkpoint ({type(e).__name__}: {first})") from None
        kind = "safetensors" if p.suffix == ".safetensors" else "state_dict"
        arch, grid, step, run_id = _meta_arch(meta, str(p))
        classes = _meta_classes(meta)
        totals = _meta_totals(meta, str(p))
    if not sd:
        raise CheckpointError(f"{p}: checkpoint holds no tensors")
    full = {**infer_arch(sd), **arch, **(user_arch or {})}
    if not full.get("name"):
        raise CheckpointError(f"{p}: cannot tell the architecture (no ViT tensors recognised, no metadata); "
                            "give it with model.name=... or --config FILE")
    if full["name"] not in list_models():
        raise CheckpointError(f"{p}: unknown model {full['name']!r}; known: {', '.join(list_models())}")
    for k, v in ARCH_DEFAULTS.items():
        full.setdefault(k, v)
    return Pretrained(sd, {k: full.get(k) for k in ARCH_KEYS}, grid, step, run_id, str(p), kind, run_dir, classes,
                      totals)


def _meta_totals(meta: dict[str, str], where: str) -> Optional[dict]:
    """What pre-training cost up to the exported step, as ``vit-export`` records it (an empty value:
    unknown); None for a file without them."""
    from pretrain.weights.export import RUN_TOTALS

    if not any(k in meta for k in RUN_TOTALS):
        return None
    try:
        return {k: (int if k == "images_seen" else float)(meta[k]) if meta.get(k) else None for k in RUN_TOTALS}
    except ValueError as e:
        raise CheckpointError(f"{where}: unreadable metadata ({e})") from None


def _meta_classes(meta: dict[str, str]) -> Optional[tuple[str, ...]]:
    """The head's class names a ``vit-export`` file records (its ``pretrained_cfg``'s
    ``label_names``, timm's key), or None."""
    try:
        names = json.loads(meta.get("pretrained_cfg") or "{}").get("label_names")
    except (ValueError, AttributeError):
        return None
    return tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) and names else None


def _pretrained_model(pre: Pretrained, *, img_size: int, num_classes: int, representation_size: Optional[int],
                      drop_path_rate: float, exclude: tuple) -> torch.nn.Module:
    """The ViT of ``pre.arch`` at ``img_size`` with ``pre``'s weights, bar those under ``exclude``."""
    a = pre.arch
    problem = img_size_problem(a["name"], img_size)
    if problem:
        raise CheckpointError(f"eval.img_size {img_size}: {problem}")
    # timm's qk_norm / LayerScale options are read from the tensors (any init value: gammas load)
    qk_norm = any(k.endswith("attn.q_norm.weight") for k in pre.state_dict)
    layer_scale = any(k.endswith("ls1.gamma") for k in pre.state_dict)
    model = create_model(a["name"], num_classes=num_classes, img_size=img_size,
                         global_pool=a["global_pool"] or "token", representation_size=representation_size,
                         drop_path_rate=drop_path_rate, qk_norm=qk_norm, init_values=1.0 if layer_scale else None,
                         reg_tokens=a["reg_tokens"], class_token=a["class_token"], pos_embed=a["pos_embed"])
    try:
        load_weights(model, pre.state_dict, strict=True, exclude=exclude, old_grid=pre.grid)
    except WeightsError as e:
        raise CheckpointError(f"{pre.source}: {e}") from None
    return model


def build_backbone(pre: Pretrained, *, img_size: int, num_classes: int = 0, finetune: bool = False,
                   drop_path_rate: float = 0.0) -> torch.nn.Module:
    """The pre-trained ViT at ``img_size`` (position embeddings resized when it differs).

    ``finetune=True`` follows the ViT paper: the whole pre-training head goes -- the tanh
    pre-logits layer too -- and one zero-initialised linear layer of ``num_classes`` replaces it.
    Frozen-feature protocols keep the pre-logits layer (big_vision's ``pre_logits`` representation)."""
    model = _pretrained_model(pre, img_size=img_size, num_classes=0,
                              representation_size=None if finetune else pre.arch.get("representation_size"),
                              drop_path_rate=drop_path_rate,
                              exclude=("head.", "pre_logits.") if finetune else ("head.",))
    if num_classes:
        model.reset_classifier(num_classes)  # zero-initialised
    return model


def build_classifier(pre: Pretrained, *, img_size: int) -> torch.nn.Module:
    """The pre-trained ViT with its own head, every tensor of the file loaded (``--protocol
    head``); CheckpointError when the file has no classifier (a ``head.weight`` of some classes)."""
    head = pre.state_dict.get("head.weight")
    if head is None or head.ndim != 2 or head.shape[0] == 0:
        raise CheckpointError(f"{pre.source}: has no classifier head (head.weight); --protocol head scores a "
                              "checkpoint's own classes, the other protocols train or probe new ones")
    return _pretrained_model(pre, img_size=img_size, num_classes=int(head.shape[0]),
                             representation_size=pre.arch.get("representation_size"), drop_path_rate=0.0, exclude=())
