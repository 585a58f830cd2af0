"""vit-analyze's figures: matplotlib drawings (files only, no display) of the numbers
``pretrain.evaluation.analyze`` computes -- Figure 7's embedding filters, position similarity and
attention distances, Figure 6's attention rollout."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


def denormalize(x: torch.Tensor, mean, std) -> np.ndarray:
    """(B, 3, H, W) normalised -> (B, H, W, 3) floats in [0, 1] for drawing."""
    m = torch.tensor(mean, dtype=x.dtype).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, 3, 1, 1)
    return (x.cpu() * s + m).clamp(0, 1).permute(0, 2, 3, 1).numpy()


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
