"""Builders for the transfer tests: learnable synthetic images, datasets in the exact official
layouts (cifar-100-python pickles, VTAB-1k task folders, ImageFolder), and tiny checkpoints.

The synthetic task: the class is the colour of a square drawn at a random place, size and
shade on a noisy background -- learnable from pixels, and linearly visible in the features of
even a randomly initialised ViT, so every protocol must land far above chance.
"""
from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import torch
from PIL import Image

COLOURS = np.array([[220, 40, 40], [40, 200, 60], [50, 70, 230], [230, 210, 40]], dtype=np.float32)


def colour_image(label: int, rng: np.random.Generator, size: int = 24) -> np.ndarray:
    """uint8 (size, size, 3): noisy grey background, a square of the class's colour."""
    img = rng.normal(128, 30, (size, size, 3))
    s = int(rng.integers(size // 2, size - 2))
    y, x = rng.integers(0, size - s + 1, 2)
    img[y:y + s, x:x + s] = COLOURS[label] + rng.normal(0, 20, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def save_png(arr: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, "RGB").save(path)


# ------------------------------------------------------------------------------------- CIFAR
class _Py2Pickler(pickle._Pickler):
    """Protocol 2 as Python 2's cPickle wrote the official files: byte strings as (SHORT_)BINSTRING
    opcodes, not Python 3's ``_codecs.encode`` call, so the restricted unpickler sees exactly
    the globals of the real files (numpy's ``_reconstruct``, ``ndarray``, ``dtype``)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_str(self, obj: bytes):
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256
                   else pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_str


def py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def write_cifar100(root: Path, n_train: int = 200, n_test: int = 100, seed: int = 0) -> Path:
    """The official ``cifar-100-python`` layout: pickles of dicts with bytes keys, ``data`` as
    (N, 3072) uint8 rows in channel-major order, ``fine_labels`` lists. Labels use 4 of the 100
    classes (colours) so a tiny model can learn them."""
    d = root / "cifar-100-python"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("train", n_train), ("test", n_test)):
        labels = [int(i % 4) * 25 for i in range(n)]  # fine labels 0, 25, 50, 75
        imgs = np.stack([colour_image(lab // 25, rng, 32) for lab in labels])
        data = imgs.transpose(0, 3, 1, 2).reshape(n, 3072)
        (d / name).write_bytes(py2_pickle({
            b"filenames": [f"img_{i}.png".encode() for i in range(n)], b"batch_label": name.encode(),
            b"fine_labels": labels, b"coarse_labels": [lab // 5 for lab in labels], b"data": data}))
    (d / "meta").write_bytes(py2_pickle({b"fine_label_names": [f"class{i}".encode() for i in range(100)],
                                         b"coarse_label_names": [f"super{i}".encode() for i in range(20)]}))
    return d


# -------------------------------------------------------------------------------------- VTAB
def write_vtab_task(root: Path, folder: str, n_classes: int = 4, n_test: int = 40, seed: int = 0,
                    counts=(800, 200), size: int = 24) -> Path:
    """One task folder in the PyTorch VTAB-1k layout: images/ plus train800.txt, val200.txt,
    train800val200.txt (= train800 + val200) and test.txt with lines ``images/x.png label``.
    ``counts`` shrinks train800/val200 for speed; the file names stay the official ones."""
    d = root / folder
    rng = np.random.default_rng(seed)
    lines = {}
    for split, n in (("train800", counts[0]), ("val200", counts[1]), ("test", n_test)):
        rows = []
        for i in range(n):
            lab = i % n_classes
            rel = f"images/{split}_{i:04d}.png"
            save_png(colour_image(lab, rng, size), d / rel)
            rows.append(f"{rel} {lab}")
        lines[split] = rows
    lines["train800val200"] = lines["train800"] + lines["val200"]
    for split, rows in lines.items():
        (d / f"{split}.txt").write_text("\n".join(rows) + "\n")
    return d


def write_imagefolder(root: Path, n_train: int = 12, n_test: int = 8, seed: int = 0, with_val: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    names = ["red", "green", "blue", "yellow"]
    splits = [("train", n_train), ("test", n_test)] + ([("val", n_test)] if with_val else [])
    for split, n in splits:
        for lab, name in enumerate(names):
            for i in range(n):
                save_png(colour_image(lab, rng), root / split / name / f"{i:03d}.png")
    return root


# ------------------------------------------------------------------------------- checkpoints
def tiny_model(img_size: int = 32, seed: int = 0, **kw):
    from pretrain.models.vit import create_model

    torch.manual_seed(seed)
    return create_model("vit_tiny_patch16_224", img_size=img_size, num_classes=10, **kw)


def save_safetensors(model, path: Path, metadata: dict | None = None) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=metadata)
    return path


def exported_metadata(model_section: dict, step: int, grid: tuple, run_id: str = "",
                      totals: dict | None = None) -> dict:
    """The metadata ``vit-export`` writes; ``totals``: what pre-training cost up to ``step``."""
    return {"format": "pt", "model_name": model_section["name"], "model": json.dumps(model_section),
            "grid_size": f"{grid[0]}x{grid[1]}", "step": str(step), "wandb_run_id": run_id,
            **{k: str(v) for k, v in (totals or {}).items()}}


def write_run_dir(run: Path, model, steps: dict, final: int, run_id: str = "run123abc", overrides=()) -> Path:
    """A run directory in the layout ``pretrain.checkpointing.checkpoint`` writes at ZeRO stage 0: per step a
    DeepSpeed module file, run.json and the COMPLETE marker; ``latest`` names the newest.
    ``steps``: {step: complete?}; ``overrides``: more keys of the run's config."""
    from pretrain.config import load_config, to_dict

    cfg = load_config(None, ["model.name=vit_tiny_patch16_224", "model.img_size=32", "model.num_classes=10",
                             "zero.stage=0", f"train.steps={final}", f"train.output_dir={run}", *overrides])
    ck = run / "checkpoints"
    for step, complete in steps.items():
        d = ck / f"step_{step:08d}"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": model.state_dict()}, d / "mp_rank_00_model_states.pt")
        (d / "run.json").write_text(json.dumps({"config": to_dict(cfg), "step": step, "wandb_run_id": run_id,
                                                "world_size": 1}))
        if complete:
            (d / "COMPLETE").write_text(json.dumps({"step": step}))
            (ck / "latest").write_text(d.name)
    return run
