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
  the [class] token (the patch tokens' mean with avg or map pooling) over the first images
  (Figure 6); ``rollout.png`` has a row per image, named by its file (class folder) or shard key,
  under the column names.
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
``softmax(q k^T / sqrt(d))`` from its own ``qkv`` projection and QK norms (``model.qk_norm``) --
one extra qkv matmul per block, paid only inside the context manager; the model and its training
forward are unchanged.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from data_pipeline.errors import ConfigError, Parser, cli_errors, path_arg
from data_pipeline.files import check_output_dir
from pretrain.evaluation.figures import (
    denormalize,
    draw_attention_distance,
    draw_embedding_filters,
    draw_position_similarity,
    draw_rollout,
)
from pretrain.evaluation.images import PROG, ImageSource
from pretrain.models.layers import Attention

NUM_COMPONENTS = 28  # Figure 7 left shows 28 components


# ----------------------------------------------------------------------- attention weights
def attention_probs(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, N) softmax attention of ``attn`` on its input ``x`` (B, N, C), in float32:
    what ``F.scaled_dot_product_attention`` computes internally (default scale 1/sqrt(head_dim),
    no mask), recomputed from the module's own qkv projection and its ``q_norm`` / ``k_norm``
    (``model.qk_norm``; identities without it), as ``Attention.forward`` applies them."""
    B, N, C = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]).float(), attn.k_norm(qkv[1]).float()
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
    source = ImageSource(images, img_size=img_size, augment=augment, limit=num_images, batch_size=batch_size,
                         device=device)
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
def check_device(name: Optional[str]) -> str:
    """``--device``: a device torch knows and this machine has (default: cuda when available, else cpu)."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA GPU on this machine; use --device cpu (or leave it out)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")
    return name


def parser() -> Parser:
    ap = Parser(prog=PROG, description="The ViT paper's analysis figures (Figure 7, Figure 6) for a checkpoint")
    ap.add_argument("--checkpoint", required=True, type=path_arg,
                    help="run directory (any ZeRO stage), .safetensors, timm state dict, "
                    "or a transformers ViT folder (config.json + weights)")
    ap.add_argument("--images", required=True, type=path_arg,
                    help="folder of images (any depth) or shards (manifest.json / its folder)")
    ap.add_argument("--output", required=True, type=path_arg, help="folder for the PNGs and JSON")
    ap.add_argument("--img-size", type=int, default=None, help="resolution (default: the checkpoint's)")
    ap.add_argument("--num-images", type=int, default=128, help="images for the attention distances (default 128)")
    ap.add_argument("--rollout-images", type=int, default=8, help="images drawn with attention rollout (default 8)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--wandb", action="store_true", help="log the figures into the checkpoint's W&B run")
    ap.add_argument("--config", default=None, type=path_arg,
                    help="YAML for data.augment.* (preprocessing) and logging.wandb.*")
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
        device = check_device(args.device)
        cfg = load_config(args.config, args.overrides)
        check_output_dir(args.output, inside=("rollout",))  # before any work: a mistake costs a second
        pre = load_pretrained(args.checkpoint, explicit_model_keys(args.config, args.overrides, cfg.model), PROG)
        if args.img_size is not None:
            from pretrain.models.arch import img_size_problem

            problem = img_size_problem(pre.arch["name"], args.img_size)
            if problem:
                raise ConfigError(f"--img-size {args.img_size}: {problem}")
        doc = analyze(pre, args.images, args.output, img_size=args.img_size, augment=replace(cfg.data.augment),
                      num_images=args.num_images, rollout_images=args.rollout_images,
                      batch_size=args.batch_size, device=device)
        step = doc["step"] if doc["step"] is not None else "?"  # a file without a step: as the figures say it
        print(f"{PROG}: {doc['model']['name']} step {step} at {doc['img_size']} px, "
              f"{doc['num_images']} images -> {Path(args.output) / 'analysis.json'}", file=sys.stderr)
        if args.wandb:
            where = log_wandb(doc, cfg.logging.wandb, run_dir=pre.run_dir or args.output)
            if where:
                print(f"{PROG}: W&B images logged at train/step={doc['step'] or 0} ({where})", file=sys.stderr)


if __name__ == "__main__":
    main()
