"""Loading weights into a model from a state dict, a safetensors file, a ``.pth``/``.bin`` file
or a Hugging Face transformers ViT folder (config.json + model.safetensors or pytorch_model.bin,
names mapped back to ours and query / key / value fused: ``pretrain.weights.hf``).

Never unpickles arbitrary objects: ``.pth``/``.bin``/``.pt`` go through ``torch.load(weights_only=True)``.
Position embeddings are resized by 2-D interpolation when the patch grids differ (224 -> 384
fine-tuning), the prefix tokens' rows ([class], registers) kept; a timm ``no_embed_class=True``
file (patch rows only) gets zero prefix rows. A model with the fixed sin-cos
embedding keeps its own (computed for its grid) and reads none. Missing, unexpected and
shape-mismatched keys are reported by name.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from pretrain.models.tokens import resize_pos_embed
from pretrain.weights import hf

Source = Union[str, Path, Mapping[str, torch.Tensor]]
_WRAPPER_KEYS = ("state_dict", "model", "module", "model_state_dict")


class WeightsError(ValueError):
    """Weights that do not fit the model; the message names the keys."""


@dataclass
class LoadReport:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: (ckpt shape) vs (model shape)"
    resized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    values: dict = field(default_factory=dict, repr=False)  # name -> the tensor loaded, in the file's dtype

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        parts = []
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected),
                            ("shape mismatch", self.mismatched), ("resized", self.resized),
                            ("skipped", self.skipped)):
            if keys:
                shown = ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
                parts.append(f"{label}: {shown}")
        return "; ".join(parts) or "all keys matched"


def read_state_dict(source: Source) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict on CPU, metadata) from a mapping, a file or a transformers ViT folder. Unwraps
    {'state_dict': ...}-style containers and strips the 'module.' prefix of DDP / DeepSpeed
    wrappers."""
    meta: dict[str, str] = {}
    if isinstance(source, Mapping):
        sd = dict(source)
    elif Path(source).is_dir():
        return read_hf_folder(Path(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: weights file not found")
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                sd = {k: f.get_tensor(k) for k in f.keys()}
        elif path.suffix in (".pth", ".pt", ".bin", ".ckpt"):
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001  weights_only refuses pickled code; a damaged file fails too
                raise WeightsError(untrusted_pickle(path, e)) from None
        else:
            raise WeightsError(f"{path}: unknown weights format {path.suffix!r} "
                               "(expected .safetensors, .pth, .pt, .bin)")
    for key in _WRAPPER_KEYS:
        if key in sd and isinstance(sd[key], Mapping):
            sd = dict(sd[key])
            break
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise WeightsError(f"entries that are not tensors: {', '.join(bad[:5])}")
    return sd, meta


def untrusted_pickle(path: Path, err: Exception) -> str:
    """The one line for a ``.pth``/``.bin`` that ``torch.load(weights_only=True)`` refuses. torch's own
    message offers ``weights_only=False``, which runs whatever code the file pickled; the safe ways
    are said instead: a safetensors copy made knowingly, where the file is trusted."""
    import re

    text = " ".join(str(err).split())
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use| Check the documentation|$)", text)
    if "Weights only load failed" not in text:  # not a pickle torch reads at all (empty, cut short)
        return f"{path}: not a readable tensor state dict ({type(err).__name__}: {text[:160]})"
    why = found.group(1).strip().rstrip(".")[:120] if found else "not plain tensors"
    return (f"{path}: not loaded: torch.load(weights_only=True) refuses it ({why}): it holds Python objects "
            "beside its tensors, which unpickling could run as code, or it is damaged. If you trust the file, "
            "convert it once where you do: torch.load(..., weights_only=False) (which runs that code), then "
            "safetensors.torch.save_file of its tensors; give the .safetensors file")


def read_hf_folder(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict in our names, metadata with the patch grid) of a transformers ViT folder; its
    weight files are read as any other (safetensors, or ``torch.load(weights_only=True)``)."""
    if not hf.is_hf_folder(path):
        raise WeightsError(f"{path}: a folder, but not a transformers ViT folder (config.json with model_type "
                           f"'vit' and {' or '.join(hf.WEIGHT_FILES[::2])}); give a weights file")
    config = json.loads((path / hf.CONFIG).read_text())
    try:
        hf.check_config(config, str(path / hf.CONFIG))
    except ValueError as e:
        raise WeightsError(str(e)) from None
    sd: dict[str, torch.Tensor] = {}
    files = hf.weight_files(path)
    for f in files:
        sd.update(read_state_dict(f)[0])
    ours = hf.from_hf(sd)
    if not any(hf.is_vit_name(k) for k in ours):  # another model's weights (a BERT's), or none
        what = f"{files[0]}" if len(files) == 1 else f"{path}'s {len(files)} weight files"
        held = ", ".join(list(sd)[:3]) + (f" (+{len(sd) - 3} more)" if len(sd) > 3 else "") if sd else "no tensors"
        raise WeightsError(f"{what}: holds no ViT tensors ({held}); a transformers ViT folder's weights are "
                           "named embeddings.*, encoder.layer.*, layernorm.*, classifier.*")
    return ours, {**hf.folder_meta(config), "hf_config": json.dumps(config)}


def _grid_from_meta(meta: dict[str, str]) -> Optional[tuple[int, int]]:
    g = meta.get("grid_size")
    if g:
        h, w = g.lower().split("x")
        return int(h), int(w)
    return None


def prefix_rows(sd: Mapping[str, torch.Tensor]) -> int:
    """Rows of a state dict's ``pos_embed`` before its patch grid: one for a ``cls_token``, one per
    register (``reg_token``), as timm lays them out."""
    reg = sd.get("reg_token")
    return int("cls_token" in sd) + (int(reg.shape[1]) if reg is not None else 0)


def pos_embed_prefix_rows(sd: Mapping[str, torch.Tensor], grid: Optional[tuple[int, int]] = None) -> Optional[int]:
    """Rows of ``sd['pos_embed']`` before its patch grid: :func:`prefix_rows`, or 0 for timm's
    ``no_embed_class=True`` layout (DeiT III, register models such as ``vit_base_patch16_reg4_gap_256``),
    which holds the patch rows only and adds nothing to the prefix tokens. Told from the shapes: the
    rows are the ``grid``'s tokens (or the prefix plus them); without a grid, the rows are a square
    grid, or the prefix plus a square grid. None when both readings fit (e.g. 9 rows and 5 prefix
    tokens: 3x3, or [class], 4 registers and 2x2): then only the grid can tell."""
    p, pe = prefix_rows(sd), sd.get("pos_embed")
    if p == 0 or pe is None or pe.ndim != 3:
        return p
    n = int(pe.shape[1])
    if grid is not None:
        return 0 if n == grid[0] * grid[1] else p
    patches_only = math.isqrt(n) ** 2 == n
    with_prefix = n > p and math.isqrt(n - p) ** 2 == n - p
    if patches_only and with_prefix:
        return None
    return 0 if patches_only else p


@torch.no_grad()
def load_weights(model: torch.nn.Module, source: Source, *, strict: bool = True,
                 exclude: tuple[str, ...] = (), old_grid: Optional[tuple[int, int]] = None) -> LoadReport:
    """Load ``source`` into ``model``.

    ``exclude``: key prefixes not to load (e.g. ``("head.",)`` for a new transfer head); those
    keep the model's own initialisation and are reported as skipped, not missing.
    ``old_grid``: the checkpoint's patch grid when it is not square (safetensors files exported
    by vitscale carry it in their metadata). With ``strict=True`` any missing, unexpected or
    shape-mismatched key raises :class:`WeightsError` naming the keys; nothing is loaded then.
    """
    sd, meta = read_state_dict(source)
    report = LoadReport()
    for k in list(sd):
        if any(k.startswith(p) for p in exclude):
            report.skipped.append(k)
            del sd[k]
    own = model.state_dict()
    pe = sd.get("pos_embed")
    if pe is not None and getattr(model, "pos_embed_type", "learned") == "sincos2d":
        del sd["pos_embed"]  # a function of the model's grid, computed when it was built
        report.skipped.append("pos_embed")
    elif pe is not None and "pos_embed" in own and pe.shape != own["pos_embed"].shape:
        if pe.shape[-1] == own["pos_embed"].shape[-1]:
            grid = old_grid or _grid_from_meta(meta)
            rows = pos_embed_prefix_rows(sd, grid)
            if rows is None:
                raise WeightsError(f"pos_embed {tuple(pe.shape)} with {prefix_rows(sd)} prefix tokens reads as "
                                   "a square grid of patch rows alone and as prefix rows plus one; give the "
                                   "checkpoint's grid (old_grid)")
            resized = resize_pos_embed(pe, tuple(model.grid_size), grid, num_prefix_tokens=rows)
            note = ""
            if rows == 0 and prefix_rows(sd):
                # timm's no_embed_class: patches + pos, then the prefix prepended. Ours adds after the
                # prepend; a zero row gives each prefix token itself, so the outputs are timm's.
                resized = torch.cat([resized.new_zeros(1, prefix_rows(sd), pe.shape[-1]), resized], dim=1)
                note = " (patch rows only, timm's no_embed_class: prefix rows zero)"
            sd["pos_embed"] = resized
            report.resized.append(f"pos_embed: {tuple(pe.shape)} -> {tuple(resized.shape)}{note}")
    for k, v in list(sd.items()):
        if k in own and own[k].shape != v.shape:
            report.mismatched.append(f"{k}: {tuple(v.shape)} vs model {tuple(own[k].shape)}")
            del sd[k]
    skipped = set(report.skipped)
    report.missing = [k for k in own if k not in sd and k not in skipped]
    report.unexpected = [k for k in sd if k not in own]
    if strict and not report.clean:
        raise WeightsError(f"weights do not fit {type(model).__name__}: {report.summary()}")
    for k in report.unexpected:
        del sd[k]
    model.load_state_dict(sd, strict=False)
    report.values = sd  # (resized) as read: a module of lower precision rounds them, these do not
    return report
