"""``vit-analyze``: the ViT paper's analysis figures for any checkpoint (Figure 7, Figure 6).

    vit-analyze --checkpoint RUN_OR_FILE --images DIR_OR_SHARDS --output DIR [--wandb]
                [--img-size 384] [--num-images 128] [--rollout-images 8] [--config FILE] [a.b=c ...]
    python -m pretrain.evaluation.analyze ...                       # the same

RUN_OR_FILE: a run directory (any ZeRO stage), an exported ``.safetensors`` file or a timm state
dict -- whatever ``pretrain.weights.pretrained.load_pretrained`` reads. DIR_OR_SHARDS: a folder
of images (any depth; taken round-robin over its folders, so the images drawn come from several
classes; files that are not images, or do not decode, are skipped and counted on stderr and in
``analysis.json``) or our shards (a ``manifest.json``, its folder or a brace pattern). Images
are prepared as for evaluation: shorter side to ``img_size / data.augment.eval_crop_pct``, center
crop, normalised with ``data.augment.mean/std`` ((0.5, 0.5, 0.5) unless ``--config`` / overrides
say otherwise). ``--img-size`` other than the checkpoint's resizes the position embeddings (2-D
interpolation, as for fine-tuning at 384 px).

Writes into DIR:

* ``embedding_filters.png`` -- the first 28 principal components of the patch-embedding filters
  (Figure 7 left); not defined for hybrids, whose embedding sees CNN features, not RGB pixels.
* ``position_similarity.png`` -- per patch position, the cosine similarity of its position
  embedding to every other position's (Figure 7 center).
* ``attention_distance.png`` / ``.json`` -- mean attention distance in pixels of every head
  against depth over the images (Figure 7 right, the "receptive field" of a head).
* ``rollout/rollout_NNN.png`` and ``rollout.png`` -- attention rollout (Abnar & Zuidema 2020) of
  the [class] token over the first images (Figure 6); ``rollout.png`` has a row per image, named
  by its file (class folder) or shard key, under the column names.
* ``analysis.json`` -- what was analysed (``rollout_images``: the images drawn; ``skipped``),
  and where each figure is.

An unwritable ``--output`` is one line and exit 2 before the checkpoint is read. The pass over the
images reports progress on stderr (``pretrain.observability.progress``: a bar on a terminal, else a line
every ``VITSCALE_PROGRESS_S`` seconds, default 10).

``--wandb`` logs the figures as W&B images (``analysis/*``) into the checkpoint's own W&B run at
the checkpoint's step (``train/step``, as ``vit-transfer`` does); mode and project come from
``logging.wandb.*`` (offline by default).

Attention probabilities: our ``Attention`` calls ``F.scaled_dot_product_attention``, which never
materialises the softmax. :func:`record_attention` hooks each attention module and recomputes
``softmax(q k^T / sqrt(d))`` from its own ``qkv`` projection -- one extra qkv matmul per block,
paid only inside the context manager; the model and its training forward are unchanged.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from data_pipeline.errors import ConfigError, Parser, cli_errors
from data_pipeline.shards.sources import IMG_EXTENSIONS
from pretrain.models.vit import Attention

PROG = "vit-analyze"
NUM_COMPONENTS = 28  # Figure 7 left shows 28 components


# ----------------------------------------------------------------------- attention weights
def attention_probs(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, N) softmax attention of ``attn`` on its input ``x`` (B, N, C), in float32:
    what ``F.scaled_dot_product_attention`` computes internally (default scale 1/sqrt(head_dim),
    no mask), recomputed from the module's own qkv projection."""
    B, N, C = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = qkv[0].float(), qkv[1].float()
    return torch.softmax(q @ k.transpose(-2, -1) * attn.head_dim ** -0.5, dim=-1)


def attention_modules(model: torch.nn.Module) -> list[Attention]:
    """The model's attention modules in depth order."""
    return [m for m in model.modules() if isinstance(m, Attention)]


@contextlib.contextmanager
def record_attention(model: torch.nn.Module, sink: Callable[[int, torch.Tensor], None]):
    """Inside the block, every forward of ``model`` also calls ``sink(layer, probs)`` for each
    encoder block (probs: (B, heads, N, N), float32, detached). The hooks are removed on exit.
    Costs one extra qkv projection per block; meant for analysis under ``torch.no_grad()``."""
    handles = []

    def hook_for(layer: int):
        def hook(module, inputs, output):
            sink(layer, attention_probs(module, inputs[0]).detach())
        return hook

    try:
        for i, m in enumerate(attention_modules(model)):
            handles.append(m.register_forward_hook(hook_for(i)))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def attention_maps(model: torch.nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
    """Per layer (B, heads, N, N) attention probabilities of one forward pass."""
    maps: dict[int, torch.Tensor] = {}
    with record_attention(model, lambda layer, p: maps.__setitem__(layer, p)):
        model(images)
    return [maps[i] for i in sorted(maps)]


# ---------------------------------------------------------------------------------- numbers
def patch_centres(grid: tuple[int, int], pixels_per_patch: float) -> torch.Tensor:
    """(h*w, 2) pixel coordinates (row, col) of patch centres, row-major like the token order."""
    rows, cols = torch.meshgrid(torch.arange(grid[0], dtype=torch.float64),
                                torch.arange(grid[1], dtype=torch.float64), indexing="ij")
    return (torch.stack([rows.flatten(), cols.flatten()], dim=1) + 0.5) * pixels_per_patch


def mean_attention_distance(probs: torch.Tensor, grid: tuple[int, int], pixels_per_patch: float,
                            num_prefix_tokens: int = 1) -> torch.Tensor:
    """(B, heads): for each image and head, the pixel distance between a query patch and the
    patches it attends to, weighted by the attention, averaged over query patches (the paper's
    Figure 7 right, Appendix D.7). The [class] token has no place in the image: it is left out as
    query and as key, and each query's weights on the patches are renormalised to sum to one."""
    p = num_prefix_tokens
    a = probs[..., p:, p:].double()
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
    xy = patch_centres(grid, pixels_per_patch).to(a.device)
    if a.shape[-1] != xy.shape[0]:
        raise ValueError(f"attention over {a.shape[-1]} patches does not fit a {grid[0]}x{grid[1]} grid")
    dist = torch.cdist(xy, xy)  # (N, N)
    return (a * dist).sum(-1).mean(-1)


def attention_rollout(layers: list[torch.Tensor], residual: bool = True) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): (B, N, N) flow of attention from the input
    tokens to the last layer's. Per layer the heads are averaged; ``residual`` adds the identity
    for the skip connection (0.5 A + 0.5 I) and renormalises rows; layers multiply from the
    first: R = A_L ... A_2 A_1."""
    roll = None
    for probs in layers:
        a = probs.double().mean(dim=1)
        if residual:
            a = 0.5 * a + 0.5 * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
            a = a / a.sum(-1, keepdim=True)
        roll = a if roll is None else a @ roll
    if roll is None:
        raise ValueError("attention rollout needs at least one layer")
    return roll


def rollout_map(roll: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1,
                global_pool: str = "token") -> torch.Tensor:
    """(B, h, w) attention of the model's output on each patch: the [class] token's row of the
    rollout, or for average pooling the mean of the patch rows."""
    p = num_prefix_tokens
    rows = roll[:, 0, p:] if global_pool == "token" else roll[:, p:, p:].mean(dim=1)
    return rows.reshape(-1, grid[0], grid[1])


def embedding_components(weight: torch.Tensor, k: int = NUM_COMPONENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the patch-embedding filters: ``weight`` (D, 3, P, P) is D filters
    of 3*P*P pixels; returns ((k', 3, P, P) components, (k',) explained-variance ratios),
    k' = min(k, D, 3*P*P). Components are unit vectors; their sign is arbitrary (SVD's)."""
    D = weight.shape[0]
    x = weight.detach().double().reshape(D, -1)
    x = x - x.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    k = min(k, vh.shape[0])
    var = s ** 2
    return vh[:k].reshape(k, *weight.shape[1:]).float(), (var[:k] / var.sum().clamp_min(1e-30)).float()


def position_similarity(pos_embed: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """(h, w, h, w): cosine similarity of the position embedding of patch (r, c) to that of every
    patch (r', c'). ``pos_embed``: (1, prefix + h*w, D) or (prefix + h*w, D)."""
    pe = pos_embed.detach().reshape(-1, pos_embed.shape[-1])[num_prefix_tokens:].double()
    if pe.shape[0] != grid[0] * grid[1]:
        raise ValueError(f"{pe.shape[0]} position embeddings do not fit a {grid[0]}x{grid[1]} grid")
    pe = F.normalize(pe, dim=-1)
    return (pe @ pe.T).reshape(grid[0], grid[1], grid[0], grid[1]).float()


def similarity_by_distance(sim: torch.Tensor) -> dict[int, float]:
    """Mean position-embedding similarity of patch pairs by their rounded grid distance
    (a number to compare across checkpoints: learned embeddings fall with distance)."""
    h, w = sim.shape[:2]
    xy = patch_centres((h, w), 1.0)
    d = torch.cdist(xy, xy).round().long().flatten()
    s = sim.reshape(h * w, h * w).flatten().double()
    out = {}
    for k in torch.unique(d).tolist():
        out[int(k)] = float(s[d == k].mean())
    return out


# ----------------------------------------------------------------------------------- images
SKIPPED_SHOWN = 5  # skipped file names printed in the one stderr line (analysis.json keeps 1,000)


def _image_files(root: Path) -> tuple[list[str], list[str]]:
    """(image files, other files) below ``root`` (hidden files and folders left out). Images are
    ordered round-robin over their folders -- the first of every folder (class), then the second
    of each, ... -- so the first few images drawn come from several classes, not all from the
    first folder in sorted order. Deterministic: folders and files in sorted order."""
    by_folder: dict[str, list[str]] = {}
    others = []
    for dirpath, dirnames, names in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(dirpath, f)
            if f.lower().endswith(IMG_EXTENSIONS):
                by_folder.setdefault(dirpath, []).append(path)
            else:
                others.append(path)
    folders = list(by_folder.values())
    files = [f[i] for i in range(max(map(len, folders), default=0)) for f in folders if i < len(f)]
    return files, others


def _is_image_folder(spec: str) -> bool:
    from data_pipeline.shards.manifest import MANIFEST_NAME

    p = Path(spec)
    return p.is_dir() and not (p / MANIFEST_NAME).is_file()


class ImageSource:
    """Normalised (B, 3, S, S) float32 batches of at most ``limit`` images, each with a name, from
    a folder of images (any depth, classes interleaved: :func:`_image_files`) or shards (manifest
    order), prepared as for evaluation. As vit-shards does, files that are not images (by
    extension) and images that do not decode are skipped and counted in ``skipped`` (reason ->
    count; ``skipped_files`` names them) rather than failing the analysis.

        src = ImageSource(spec, img_size=224, augment=cfg.data.augment, limit=128)
        for x, names in src: ...
    """

    def __init__(self, spec: str, *, img_size: int, augment, limit: int, batch_size: int = 32):
        self.spec, self.img_size, self.augment, self.limit, self.batch_size = spec, img_size, augment, limit, batch_size
        self.skipped: dict[str, int] = {}
        self.skipped_files: list[str] = []
        if _is_image_folder(spec):
            self.files, others = _image_files(Path(spec))
            for path in others:
                self._skip("not_image", path)
            if not self.files:
                raise ConfigError(f"--images {spec}: no image files in this folder or below "
                                  f"({', '.join(IMG_EXTENSIONS)})"
                                  + (f"; {len(others)} other files skipped" if others else ""))
            self.total: Optional[int] = min(limit, len(self.files))
        else:
            if not Path(spec).exists() and "{" not in spec and "://" not in spec:
                raise ConfigError(f"--images {spec}: no such folder or manifest")
            from data_pipeline.config import DataConfig
            from data_pipeline.loading.loader import build_loader

            self.files = None
            self.loader = build_loader(DataConfig(val_shards=spec, workers=0, augment=augment),
                                       batch_size=batch_size, img_size=img_size, train=False)
            self.total = min(limit, self.loader.plan.shardset.total)

    def _skip(self, reason: str, path: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skipped_files) < 1000:
            self.skipped_files.append(os.path.relpath(path, self.spec))

    def _counts(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))

    def skipped_line(self) -> str:
        """One line naming the skipped files ('' if none), as vit-shards prints it."""
        if not self.skipped:
            return ""
        total = sum(self.skipped.values())
        shown = ", ".join(self.skipped_files[:SKIPPED_SHOWN]) + (", ..." if total > SKIPPED_SHOWN else "")
        return f"{PROG}: --images {self.spec}: skipped {total} files ({self._counts()}): {shown}"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        batches = self._folder() if self.files is not None else self._shards()
        seen = 0
        for x, names in batches:
            x, names = x[:self.limit - seen], names[:self.limit - seen]
            seen += x.shape[0]
            yield x, names
            if seen >= self.limit:
                return
        if seen == 0:
            raise ConfigError(f"--images {self.spec}: no readable images"
                              + (f" (skipped {self._counts()})" if self.skipped else ""))

    def _folder(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        # one process, file by file: a file that does not decode is skipped here, where the
        # transfer splits' DataLoader (whose benchmark numbers must not have holes) would stop
        from pretrain.transfer.data import FileImages, View, SampleTransform, normalize

        view = View(self.img_size, resize="crop", crop_pct=self.augment.eval_crop_pct,
                    mean=tuple(self.augment.mean), std=tuple(self.augment.std))
        transform = SampleTransform(view, train=False)
        images = FileImages(f"--images {self.spec}", self.files, [0] * len(self.files))
        xs, names, taken = [], [], 0
        for i, path in enumerate(self.files):
            if taken >= self.limit:
                break
            try:
                xs.append(transform(images.image(i)))
            except Exception:  # any decode failure of a user's file: skipped and counted (vit-shards' rule)
                self._skip("unreadable", path)
                continue
            names.append(os.path.relpath(path, self.spec))
            taken += 1
            if len(xs) == self.batch_size:
                yield normalize(torch.stack(xs), view), names
                xs, names = [], []
        if xs:
            yield normalize(torch.stack(xs), view), names

    def _shards(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        for x, y in self.loader:
            classes = [f" (class {int(c)})" for c in y] if y.ndim == 1 else [""] * len(y)
            yield x, [f"{k}{c}" for k, c in zip(self.loader.last_keys, classes)]


def denormalize(x: torch.Tensor, mean, std) -> np.ndarray:
    """(B, 3, H, W) normalised -> (B, H, W, 3) floats in [0, 1] for drawing."""
    m = torch.tensor(mean, dtype=x.dtype).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, 3, 1, 1)
    return (x.cpu() * s + m).clamp(0, 1).permute(0, 2, 3, 1).numpy()


# ---------------------------------------------------------------------------------- drawing
def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def draw_embedding_filters(components: torch.Tensor, ratios: torch.Tensor, path: Path, title: str) -> Path:
    """Components in a 4 x 7 grid, each scaled to [0, 1] on its own (as in Figure 7 left)."""
    plt = _plt()
    k = components.shape[0]
    cols = 7
    rows = math.ceil(k / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.1, rows * 1.1 + 0.5), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < k:
            c = components[i]
            c = (c - c.min()) / (c.max() - c.min()).clamp_min(1e-12)
            ax.imshow(c.permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_title(f"{100 * float(ratios[i]):.1f}%", fontsize=6)
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def draw_position_similarity(sim: torch.Tensor, path: Path, title: str) -> Path:
    """One small map per patch position, laid out on the patch grid (Figure 7 center); drawn as a
    single tiled image so a 27x27 grid (ViT-H/14 at 384 px) stays one imshow, not 729 axes."""
    plt = _plt()
    h, w = sim.shape[:2]
    pad = 1
    tile = np.full((h * (h + pad) - pad, w * (w + pad) - pad), np.nan)
    for r in range(h):
        for c in range(w):
            tile[r * (h + pad):r * (h + pad) + h, c * (w + pad):c * (w + pad) + w] = sim[r, c].numpy()
    fig, ax = plt.subplots(figsize=(6, 5.4))
    im = ax.imshow(tile, vmin=-1, vmax=1, cmap="viridis", interpolation="nearest")
    step = max(1, h // 7)
    ax.set_yticks([r * (h + pad) + h / 2 - 0.5 for r in range(0, h, step)], [str(r + 1) for r in range(0, h, step)])
    step = max(1, w // 7)
    ax.set_xticks([c * (w + pad) + w / 2 - 0.5 for c in range(0, w, step)], [str(c + 1) for c in range(0, w, step)])
    ax.set_ylabel("Input patch row")
    ax.set_xlabel("Input patch column")
    ax.set_title(title, fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="Cosine similarity")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def draw_attention_distance(dist: np.ndarray, path: Path, title: str, img_size: int) -> Path:
    """Every head a dot at (layer, mean distance), coloured by head (Figure 7 right)."""
    plt = _plt()
    L, H = dist.shape
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    cmap = plt.get_cmap("tab20" if H > 10 else "tab10")
    for h in range(H):
        ax.scatter(np.arange(1, L + 1), dist[:, h], s=10, color=cmap(h % cmap.N), label=f"Head {h + 1}")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_ylim(0, max(img_size / 2, float(dist.max()) * 1.05))  # the paper's axis: 0-120 px at 224
    ax.set_xlim(0.5, L + 0.5)
    ax.set_title(title, fontsize=8)
    if H <= 16:
        ax.legend(fontsize=5, ncol=2, loc="lower right", markerscale=0.8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _upsample(maps: torch.Tensor, size: int) -> np.ndarray:
    m = maps.float()
    m = m / m.flatten(1).amax(1).clamp_min(1e-12).view(-1, 1, 1)
    return F.interpolate(m[:, None], size=(size, size), mode="bilinear", align_corners=False)[:, 0].numpy()


ROLLOUT_COLUMNS = ("input", "attention rollout", "masked by rollout")


def draw_rollout(images: np.ndarray, maps: torch.Tensor, out_dir: Path, title: str,
                 names: Optional[list[str]] = None) -> list[Path]:
    """Per image: input, rollout heat map over it, and the input masked by the map (Figure 6).
    Also one ``rollout.png`` with a row per image, the columns named above the first row and each
    row named by its image (``names``: file path or shard key). Returns the per-image paths, then
    the grid."""
    plt = _plt()
    size = images.shape[1]
    masks = _upsample(maps, size)
    names = list(names or [""] * len(images))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def panels(axes, img, mask):
        axes[0].imshow(img)
        axes[1].imshow(img)
        axes[1].imshow(mask, cmap="jet", alpha=0.5, vmin=0, vmax=1)
        axes[2].imshow(img * mask[..., None])
        for ax in axes:
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)

    for i, (img, mask, name) in enumerate(zip(images, masks, names)):
        fig, axes = plt.subplots(1, 3, figsize=(6, 2.2), layout="constrained")
        panels(axes, img, mask)
        for ax, col in zip(axes, ROLLOUT_COLUMNS):
            ax.set_title(col, fontsize=7)
        if name:
            fig.suptitle(name, fontsize=7)
        paths.append(out_dir / f"rollout_{i:03d}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    # constrained layout: the title, column names and rows are packed without the fixed margins
    # (the default subplot box left a band of white under the title that grew with the row count)
    fig, axes = plt.subplots(len(images), 3, figsize=(6, 1.9 * len(images) + 0.5), squeeze=False,
                             layout="constrained")
    for row, img, mask, name in zip(axes, images, masks, names):
        panels(row, img, mask)
        row[0].set_ylabel(_short(name), fontsize=6)  # axis ticks are off, the label stays
    for ax, col in zip(axes[0], ROLLOUT_COLUMNS):
        ax.set_title(col, fontsize=8)
    fig.suptitle(title, fontsize=8)
    paths.append(out_dir.parent / "rollout.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _short(name: str, width: int = 28) -> str:
    """A row label that fits beside a 2-inch panel: the end of a long path, with its class folder."""
    return name if len(name) <= width else "..." + name[-(width - 3):]


# --------------------------------------------------------------------------------- analysis
@torch.no_grad()
def analyze(pre, images: str, out_dir: str | Path, *, img_size: Optional[int] = None, augment=None,
            num_images: int = 128, rollout_images: int = 8, batch_size: int = 32,
            device: str = "cpu") -> dict:
    """Write every figure for ``pre`` (a ``load_pretrained`` result) into ``out_dir``; returns
    the summary also written as ``analysis.json``."""
    from data_pipeline.config import AugmentConfig
    from data_pipeline.files import write_atomic
    from pretrain.observability.progress import Progress
    from pretrain.weights.pretrained import build_backbone

    augment = augment or AugmentConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    img_size = int(img_size or pre.img_size)
    source = ImageSource(images, img_size=img_size, augment=augment, limit=num_images, batch_size=batch_size)
    model = build_backbone(pre, img_size=img_size).to(device).eval()
    name, grid, prefix = pre.arch["name"], tuple(model.grid_size), model.num_prefix_tokens
    px = img_size / grid[0]  # pixels per token: the patch size, or the CNN stride for hybrids
    step = f"step {pre.step}" if pre.step is not None else "step ?"
    label = f"{name} @ {img_size}px, {step}"
    doc: dict = {"checkpoint": pre.source, "checkpoint_kind": pre.kind, "step": pre.step,
                 "wandb_run_id": pre.wandb_run_id, "model": dict(pre.arch), "img_size": img_size,
                 "grid": list(grid), "pixels_per_patch": px, "images": images, "figures": {}}

    # -- Figure 7 left: RGB embedding filters
    if hasattr(model.patch_embed, "backbone"):
        doc["embedding_filters"] = "not defined for hybrids: the patch embedding sees CNN features, not RGB pixels"
        print(f"{PROG}: {name}: embedding filters skipped ({doc['embedding_filters']})", file=sys.stderr)
    else:
        comps, ratios = embedding_components(model.patch_embed.proj.weight.cpu())
        doc["figures"]["embedding_filters"] = str(draw_embedding_filters(
            comps, ratios, out / "embedding_filters.png", f"RGB embedding filters (first {len(comps)} PCs), {label}"))
        doc["embedding_filters"] = {"explained_variance": [round(float(r), 6) for r in ratios]}

    # -- Figure 7 center: position-embedding similarity
    sim = position_similarity(model.pos_embed.cpu(), grid, prefix)
    doc["figures"]["position_similarity"] = str(draw_position_similarity(
        sim, out / "position_similarity.png", f"Position embedding similarity, {label}"))
    doc["position_similarity_by_distance"] = {str(k): round(v, 6) for k, v in similarity_by_distance(sim).items()}

    # -- Figure 7 right and Figure 6: one pass over the images for distances and rollout
    L = len(attention_modules(model))
    total = torch.zeros(L, model.blocks[0].attn.num_heads, dtype=torch.float64)
    layer_maps: dict[int, torch.Tensor] = {}
    shown, shown_names, roll_maps, n = [], [], [], 0

    def sink(layer: int, probs: torch.Tensor) -> None:
        total[layer] += mean_attention_distance(probs, grid, px, prefix).sum(0).cpu()
        layer_maps[layer] = probs

    with Progress(source.total, f"{PROG} attention", "img") as bar:
        for x, names in source:
            with record_attention(model, sink):
                model(x.to(device))
            n += x.shape[0]
            k = min(rollout_images - len(shown), x.shape[0])
            if k > 0:
                roll = attention_rollout([layer_maps[i][:k] for i in range(L)])
                roll_maps.append(rollout_map(roll, grid, prefix, model.global_pool).cpu())
                shown.extend(denormalize(x[:k], augment.mean, augment.std))
                shown_names.extend(names[:k])
            layer_maps.clear()
            bar.update(x.shape[0])
    if source.skipped:
        print(source.skipped_line(), file=sys.stderr)
    doc["skipped"], doc["skipped_files"] = dict(source.skipped), source.skipped_files
    dist = (total / n).numpy()
    doc["num_images"] = n
    doc["figures"]["attention_distance"] = str(draw_attention_distance(
        dist, out / "attention_distance.png", f"Mean attention distance, {label}, {n} images", img_size))
    numbers = {k: doc[k] for k in ("checkpoint", "step", "model", "img_size", "grid", "pixels_per_patch")}
    numbers.update(num_images=n, unit="pixels", layers=[
        {"layer": i + 1, "heads": [round(float(v), 4) for v in dist[i]], "mean": round(float(dist[i].mean()), 4)}
        for i in range(L)])
    write_atomic(out / "attention_distance.json", json.dumps(numbers, indent=1))
    doc["figures"]["attention_distance_json"] = str(out / "attention_distance.json")
    doc["attention_distance_mean_per_layer"] = [layer["mean"] for layer in numbers["layers"]]
    if shown:
        paths = draw_rollout(np.stack(shown), torch.cat(roll_maps), out / "rollout",
                             f"Attention rollout, {label}", shown_names)
        doc["figures"]["rollout"] = [str(p) for p in paths[:-1]]
        doc["rollout_images"] = shown_names
        doc["figures"]["rollout_grid"] = str(paths[-1])
    write_atomic(out / "analysis.json", json.dumps(doc, indent=1))
    return doc


# --------------------------------------------------------------------------------------- W&B
def log_wandb(doc: dict, wandb_cfg, *, run_dir: Optional[str] = None) -> Optional[str]:
    """The figures as W&B images into the checkpoint's own run at its step (``train/step``, the
    x-axis ``pretrain.observability.metrics`` uses), plus the per-layer mean attention distance as numbers.
    Without a run id (a foreign state dict) they go to a new run, and stderr says so."""
    from pretrain.observability.metrics import open_checkpoint_run

    run = open_checkpoint_run(doc, wandb_cfg, PROG, "--wandb given", run_dir)
    if run is None:
        return None
    import wandb

    try:
        run.define_metric("analysis/*", step_metric="train/step")
        figs = doc["figures"]
        caption = f"{doc['model']['name']} @ {doc['img_size']}px"
        logged = {"train/step": doc.get("step") or 0}
        for key in ("embedding_filters", "position_similarity", "attention_distance", "rollout_grid"):
            if key in figs:
                logged[f"analysis/{key}"] = wandb.Image(figs[key], caption=caption)
        for i, v in enumerate(doc["attention_distance_mean_per_layer"]):
            logged[f"analysis/mean_attention_distance/layer_{i + 1:02d}"] = v
        run.log(logged)
        return run.dir
    finally:
        run.finish()


# --------------------------------------------------------------------------------------- CLI
def check_output_dir(output: str) -> None:
    """ConfigError (one line) when the figures cannot be written into ``output`` or its
    ``rollout/`` folder: a file there, or no file can be created (nearest existing folder)."""
    from data_pipeline.files import unwritable

    for folder in (Path(output), Path(output) / "rollout"):
        why = unwritable(folder)
        if why:
            raise ConfigError(f"--output {output}: {why}; choose a writable --output folder")


def parser() -> Parser:
    ap = Parser(prog=PROG, description="The ViT paper's analysis figures (Figure 7, Figure 6) for a checkpoint")
    ap.add_argument("--checkpoint", required=True, help="run directory (any ZeRO stage), .safetensors or timm state dict")
    ap.add_argument("--images", required=True, help="folder of images (any depth) or shards (manifest.json / its folder)")
    ap.add_argument("--output", required=True, help="folder for the PNGs and JSON")
    ap.add_argument("--img-size", type=int, default=None, help="resolution (default: the checkpoint's)")
    ap.add_argument("--num-images", type=int, default=128, help="images for the attention distances (default 128)")
    ap.add_argument("--rollout-images", type=int, default=8, help="images drawn with attention rollout (default 8)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--wandb", action="store_true", help="log the figures into the checkpoint's W&B run")
    ap.add_argument("--config", default=None, help="YAML for data.augment.* (preprocessing) and logging.wandb.*")
    ap.add_argument("overrides", nargs="*", help="a.b=c overrides (model.*, data.augment.*, logging.wandb.*)")
    return ap


def main(argv=None) -> None:
    args = parser().parse_intermixed_args(argv)
    from pretrain.config import load_config
    from pretrain.transfer.cli import explicit_model_keys
    from pretrain.weights.pretrained import load_pretrained

    with cli_errors(PROG):
        for flag in ("num_images", "rollout_images", "batch_size"):
            v = getattr(args, flag)
            if v < (0 if flag == "rollout_images" else 1):
                raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {v}")
        cfg = load_config(args.config, args.overrides)
        check_output_dir(args.output)  # before any work: a mistake costs a second, not the analysis
        pre = load_pretrained(args.checkpoint, explicit_model_keys(args.config, args.overrides, cfg.model))
        if args.img_size is not None:
            from pretrain.models.arch import model_defaults

            stride = model_defaults(pre.arch["name"])["stride"]
            if args.img_size <= 0 or args.img_size % stride:
                raise ConfigError(f"--img-size {args.img_size} is not a positive multiple of the patch size "
                                  f"{stride} of {pre.arch['name']}")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        doc = analyze(pre, args.images, args.output, img_size=args.img_size, augment=replace(cfg.data.augment),
                      num_images=args.num_images, rollout_images=args.rollout_images,
                      batch_size=args.batch_size, device=device)
        print(f"{PROG}: {doc['model']['name']} step {doc['step']} at {doc['img_size']} px, "
              f"{doc['num_images']} images -> {Path(args.output) / 'analysis.json'}", file=sys.stderr)
        if args.wandb:
            where = log_wandb(doc, cfg.logging.wandb, run_dir=pre.run_dir or args.output)
            if where:
                print(f"{PROG}: W&B images logged at train/step={doc['step'] or 0} ({where})", file=sys.stderr)


if __name__ == "__main__":
    main()
