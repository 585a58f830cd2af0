"""Export a run's weights: one safetensors file with timm names, or a Hugging Face transformers folder.

    python -m pretrain.export RUN_OR_CKPT OUT.safetensors [--step N] [--ema]          # timm (default)
    python -m pretrain.export RUN_OR_CKPT OUT_DIR --format hf [--step N] [--ema]      # transformers

Works from any ZeRO stage: DeepSpeed's ``zero_to_fp32`` merges the fp32 master-weight shards of
stages 1-3 (the exact weights the optimizer holds, also when training in bf16); stage 0 stores
the whole module. The timm file's metadata records the model section of the config, the patch
grid, the step, the W&B run id (so ``load_weights`` and ``vit-transfer`` need nothing else), what
pre-training cost up to that step (``RUN_TOTALS``) and
timm's ``pretrained_cfg`` (input size, mean, std, crop, interpolation, classes); the command
prints the ``timm.create_model`` call that loads it with that preprocessing. ``--format hf``
writes what ``ViTForImageClassification.from_pretrained`` loads (``pretrain.weights.hf``), with a model
card made from the run directory. RUN_OR_CKPT may also be a transformers ViT folder: that
converts it (to timm names, or to a folder again). ``--ema`` exports the weights' moving average
(``train.ema_decay``) instead, assembled from the checkpoint's per-rank EMA files
(``pretrain.distributed.ema.read_full``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from data_pipeline.errors import DataError, Parser, cli_errors, path_arg
from data_pipeline.storage.s3 import S3Prefix
from data_pipeline.storage.urls import is_s3, last_part
from pretrain.checkpointing import rundir
from pretrain.config import AugmentConfig, ConfigError, from_dict, image_size
from pretrain.distributed import ema as weight_ema
from pretrain.models.arch import model_defaults, prefix_tokens
from pretrain.models.pooling import sincos_pos_embed
from pretrain.weights import hf


class ExportError(ValueError):
    pass


class ExportRescued(RuntimeError):
    """The output could not be written at the end; the weights went elsewhere (the message says where)."""


def find_checkpoint(run_dir: str | Path, step: Optional[int] = None, prog: str = "vit-export") -> Path:
    """A complete, verified checkpoint of a run (``pretrain.checkpointing.rundir.find_checkpoint``); a damaged
    newest one is skipped with a warning on stderr labelled ``prog`` (the command reading the run), and
    left where it is (training owns it). With none
    intact, the one error names the damaged ones (no warning before it), or, for a folder that looks
    like a transformers one, what is wrong with its config.json."""
    said: list[str] = []
    try:
        found = rundir.find_checkpoint(run_dir, step, warn=said.append)
    except LookupError as e:
        raise ExportError(hf.folder_problem(run_dir) or str(e)) from None
    for msg in said:
        print(f"{prog}: warning: {msg}", file=sys.stderr, flush=True)
    return found


def consolidate(ckpt: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """fp32 full state dict from one DeepSpeed checkpoint directory, on CPU; ``ema``: the weights'
    moving average instead (ExportError when the run kept none). A fixed sin-cos position embedding
    (``model.pos_embed=sincos2d``) is written from its formula: it has no fp32 master (a bf16 module
    holds it rounded), ZeRO-1's bf16 optimizer files do not hold it, and the average has no copy."""
    info = json.loads((ckpt / "run.json").read_text())
    stage = info["config"]["zero"]["stage"]
    if ema:
        try:
            sd = weight_ema.read_full(ckpt)
        except (LookupError, ValueError) as e:
            raise ExportError(str(e)) from None
    elif stage == 0:
        # our own file, written by this program: DeepSpeed's module state is a plain state dict
        states = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        sd = states["module"]
    else:  # ZeRO's fp32 master weights; BF16_Optimizer's files too (ZeRO-1, bf16, fp32 accumulation)
        from pretrain.distributed.ds_compat import fp32_state_dict

        sd = fp32_state_dict(ckpt)
    sd = {k: v.detach().float().contiguous() for k, v in sd.items()}
    m = from_dict(info["config"]).model
    if m.pos_embed == "sincos2d":
        img, d = image_size(m), model_defaults(m.name)
        grid = (img // d["stride"], img // d["stride"])
        sd["pos_embed"] = sincos_pos_embed(grid, d["embed_dim"], prefix_tokens(m.reg_tokens, m.class_token))
    return sd


# what a checkpoint's run.json says the run did and cost up to its step (RunTotals.record)
RUN_TOTALS = ("device_seconds", "images_seen", "model_flops")


def run_info(ckpt: Path) -> dict:
    """What a checkpoint's run.json says, without reading weights: model (config section), config
    (the whole), step, wandb_run_id, img_size, grid_size, checkpoint (path), run_dir."""
    run = json.loads((ckpt / "run.json").read_text())
    cfg = from_dict(run["config"])
    img = image_size(cfg.model)
    stride = model_defaults(cfg.model.name)["stride"]
    return {"model": run["config"]["model"], "config": run["config"], "step": run["step"],
            "wandb_run_id": run.get("wandb_run_id"), "img_size": img, "grid_size": [img // stride, img // stride],
            "checkpoint": str(ckpt), "run_dir": str(Path(cfg.train.output_dir)),
            "world_size": run.get("world_size"), **{k: run.get(k) for k in RUN_TOTALS}}


def _hf_folder_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A transformers ViT folder read like a run: our names, and ``info`` with the architecture
    read from its config.json (no step, no run)."""
    from pretrain.weights.load import WeightsError, read_state_dict

    try:
        sd, meta = read_state_dict(path)
        config = json.loads(meta["hf_config"])
        model = hf.arch_from_config(config, sd, str(path / hf.CONFIG))
    except (WeightsError, ValueError) as e:
        raise ExportError(str(e)) from None
    gh, gw = (int(v) for v in meta["grid_size"].split("x"))
    labels = [config.get("id2label", {}).get(str(i)) for i in range(model["num_classes"])]
    return {k: v.float().contiguous() for k, v in sd.items()}, {
        "model": model, "config": {"model": model}, "step": None, "wandb_run_id": None, "img_size": model["img_size"],
        "grid_size": [gh, gw], "checkpoint": str(path), "run_dir": None, "labels": labels}


def load_run_weights(run_dir: str | Path, step: Optional[int] = None, ema: bool = False,
                     prog: str = "vit-export") -> tuple[dict[str, torch.Tensor], dict]:
    """(fp32 state dict, info) of a run (``run_info``), or of a transformers ViT folder; ``ema``: the
    run's moving average of the weights; ``prog``: the command whose warnings these are."""
    if hf.is_hf_folder(run_dir):
        if ema:
            raise ExportError(f"{run_dir}: a transformers folder holds no EMA of the weights; drop --ema")
        return _hf_folder_weights(Path(run_dir))
    ckpt = find_checkpoint(run_dir, step, prog)
    return consolidate(ckpt, ema), run_info(ckpt)


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it: set and put back
    os.umask(mask)
    return mask


def write_safetensors(sd: dict[str, torch.Tensor], out: Path, meta: dict) -> Path:
    """Atomically (temp file beside ``out``, then rename), with the mode of a normal new file:
    safetensors writes through a 0600 temp file, which would keep other users from the weights."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(sd, str(tmp), metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _rescue_dirs(run_dir: str | Path) -> list[Path]:
    """Where the weights go when OUT cannot be written at the end: the run directory (not inside a
    checkpoint), then $TMPDIR."""
    p = Path(run_dir).absolute()
    if (p / rundir.COMPLETE).is_file():  # one checkpoint: its run directory holds the checkpoints
        p = p.parent
    if p.name == "checkpoints" and (p.parent / "config.yaml").is_file():
        p = p.parent
    return [p, Path(tempfile.gettempdir())]


def preprocessing(info: dict) -> dict:
    """How the run's evaluation prepares an image: mean, std, crop_pct, interpolation. From the
    run's ``data.augment``; for a converted transformers folder from its preprocessor_config.json;
    else the defaults."""
    aug = (info.get("config") or {}).get("data", {}).get("augment")
    d = AugmentConfig()
    out = {"mean": list(d.mean), "std": list(d.std), "crop_pct": d.eval_crop_pct, "interpolation": "bilinear"}
    if aug:
        out.update(mean=list(aug["mean"]), std=list(aug["std"]), crop_pct=aug.get("eval_crop_pct", d.eval_crop_pct))
    elif info.get("run_dir") is None and (Path(info["checkpoint"]) / "preprocessor_config.json").is_file():
        p = json.loads((Path(info["checkpoint"]) / "preprocessor_config.json").read_text())
        out.update(mean=list(p.get("image_mean", d.mean)), std=list(p.get("image_std", d.std)))
    return out


def timm_pretrained_cfg(info: dict, labels: Optional[list[str]] = None) -> dict:
    """timm's ``pretrained_cfg`` for the exported file: what ``timm.data.resolve_data_config``
    reads (input size, mean, std, crop, interpolation) and the class count the head has."""
    m, prep, img = info["model"], preprocessing(info), info["img_size"]
    cfg = {"architecture": m["name"], "num_classes": int(m.get("num_classes", 1000)), "input_size": [3, img, img],
           "fixed_input_size": True, "crop_mode": "center", "classifier": "head", **prep}
    if labels:
        cfg["label_names"] = list(labels)
    return cfg


def timm_call(info: dict, out: Path, pcfg: dict) -> str:
    """The ``timm.create_model(...)`` call that loads ``out`` with this run's architecture and
    preprocessing. ``custom_load=False``: timm's own ViT configs load .npz files otherwise."""
    m = info["model"]
    args = [repr(m["name"]), "pretrained=True", f"img_size={info['img_size']}", f"num_classes={pcfg['num_classes']}"]
    if m.get("global_pool", "token") != "token":
        args.append(f"global_pool={m['global_pool']!r}")
    if m.get("reg_tokens"):
        args.append(f"reg_tokens={m['reg_tokens']}")
    if m.get("class_token") is False:
        args.append("class_token=False")
    if m.get("qk_norm"):
        args.append("qk_norm=True")
    if m.get("init_values"):
        args.append(f"init_values={m['init_values']!r}")
    overlay = [f"file={str(out.absolute())!r}", "custom_load=False", f"num_classes={pcfg['num_classes']}",
               f"input_size={tuple(pcfg['input_size'])}", f"mean={tuple(pcfg['mean'])}", f"std={tuple(pcfg['std'])}",
               f"crop_pct={pcfg['crop_pct']}", f"interpolation={pcfg['interpolation']!r}"]
    return f"timm.create_model({', '.join(args)}, pretrained_cfg_overlay=dict({', '.join(overlay)}))"


def class_names(info: dict) -> tuple[Optional[list[str]], Optional[str]]:
    """(class names, data set name): a converted folder's labels, else the run's shard manifest."""
    if info.get("labels") and all(info["labels"]):
        return info["labels"], None
    data = (info.get("config") or {}).get("data")
    return hf.shard_source(from_dict(info["config"]).data) if data else (None, None)


def head_class_names(info: dict) -> Optional[tuple[str, ...]]:
    """The name of each of the head's outputs, in order, where the weights' source says them (a
    converted folder's labels, else the run's shard manifest), else None; transformers'
    placeholders ``LABEL_i`` are not names. Best effort, as the names are only a check: a run's
    config this release cannot read gives None."""
    try:
        names, _ = class_names(info)
    except (ConfigError, KeyError, TypeError, ValueError):
        return None
    n = (info.get("model") or {}).get("num_classes")
    if not names or len(names) != n or all(x == f"LABEL_{i}" for i, x in enumerate(names)):
        return None
    return tuple(names)


def _run_root(info: dict, given: Path) -> Optional[Path]:
    """The run directory holding metrics.jsonl / summary.json: the one named on the command line,
    the checkpoint's grandparent, or ``train.output_dir``."""
    if info.get("run_dir") is None:
        return None
    ckpt = Path(info["checkpoint"])
    for p in (given, ckpt.parent.parent, Path(info["run_dir"])):
        if (p / "metrics.jsonl").is_file() or (p / "summary.json").is_file():
            return p
    return None


def export_hf(run_dir: str | Path, out: str | Path, step: Optional[int] = None, ema: bool = False) -> dict:
    """Write a transformers folder (``pretrain.weights.hf``). A model transformers' ViT cannot express is
    refused from run.json alone, before the weights are consolidated."""
    from pretrain.checkpointing.checkpoint import check_writable

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; --format hf writes a folder (config.json, model.safetensors, ...)")
    check_writable(out if out.is_dir() else out.parent, "output folder")
    if hf.is_hf_folder(run_dir):
        sd, info = load_run_weights(run_dir, step, ema)
        hf.check_expressible(info["model"])
    else:
        ckpt = find_checkpoint(run_dir, step)
        info = run_info(ckpt)
        hf.check_expressible(info["model"])  # before consolidating (minutes for a large ZeRO-3 run)
        sd = consolidate(ckpt, ema)
    classes, dataset = class_names(info)
    labels = hf.labels_for(int(info["model"].get("num_classes", 0)), classes)
    prep = preprocessing(info)
    card = hf.model_card(info["config"], info["step"], labels, dataset, _run_root(info, Path(run_dir)),
                         sum(v.numel() for v in sd.values()), prep,
                         totals={k: info.get(k) for k in RUN_TOTALS})
    hf.write_folder(out, sd, hf.hf_config(info["model"], labels), hf.preprocessor_config(info["img_size"], prep["mean"],
                                                                                        prep["std"]),
                    card, write_safetensors)
    return {**info, "output": str(out), "tensors": hf.hf_tensor_count(sd), "labels": labels}


def export(run_dir: str | Path, out: str | Path, step: Optional[int] = None, ema: bool = False) -> dict:
    """Write one safetensors file in timm's names; ``pretrained_cfg`` and ``timm_call`` in the result.
    ``ema``: the run's moving average of the weights (metadata ``weights: ema``)."""
    from pretrain.checkpointing.checkpoint import check_writable

    out = Path(out)
    if out.is_dir():
        raise ExportError(f"{out} is a folder; name the file, e.g. {out / 'model.safetensors'}")
    check_writable(out.parent, "output folder")  # before consolidating (minutes for a large ZeRO-3 run)
    sd, info = load_run_weights(run_dir, step, ema)
    classes, _ = class_names(info)
    pcfg = timm_pretrained_cfg(info, classes if classes and len(classes) == info["model"].get("num_classes") else None)
    meta = {"format": "pt", "model_name": info["model"]["name"], "model": json.dumps(info["model"]),
            "grid_size": "x".join(map(str, info["grid_size"])), "img_size": str(info["img_size"]),
            "step": "" if info["step"] is None else str(info["step"]), "wandb_run_id": info["wandb_run_id"] or "",
            "pretrained_cfg": json.dumps(pcfg), "weights": "ema" if ema else "weights",
            **{k: "" if info.get(k) is None else str(info[k]) for k in RUN_TOTALS}}
    try:
        write_safetensors(sd, out, meta)
    except OSError as e:
        why = f"cannot write {out} ({e.strerror or e})"
        for d in _rescue_dirs(run_dir):
            try:
                saved = write_safetensors(sd, d / out.name, meta)
            except OSError:
                continue
            raise ExportRescued(f"{why}; the weights were saved to {saved} instead") from None
        raise ExportRescued(f"{why}, nor in {' or '.join(map(str, _rescue_dirs(run_dir)))}") from None
    return {**info, "output": str(out), "tensors": len(sd), "pretrained_cfg": pcfg,
            "timm_call": timm_call(info, out, pcfg)}


def check_apart(run_dir: str | Path, out: str | Path) -> None:
    """An export never writes into what it reads: a transformers folder it converts (its
    ``config.json`` and weights would be replaced by the export's own) or a run's checkpoints."""
    read = Path(run_dir).resolve()
    if not hf.is_hf_folder(run_dir):  # the checkpoints' root: the run dir may hold an export beside them
        read = read.parent if rundir.step_of(read) is not None else rundir.checkpoint_root(read).resolve()
    o = Path(out).resolve()
    if o == read or read in o.parents:
        raise ExportError(f"{out}: inside {read}, which this export reads; choose an output outside it")


def export_to(run_dir: str | Path, out: str | Path, step: Optional[int] = None, fmt: str = "timm",
              ema: bool = False) -> dict:
    """``export`` (``fmt`` timm) or ``export_hf`` (hf) to a local path, or to ``s3://bucket/key``:
    there the bucket is checked first (before consolidating), the export is staged in a temporary
    folder and uploaded one object per file (multipart, retried as shards are), the safetensors file
    at the URL itself, a transformers folder's files under the URL as a prefix."""
    if not is_s3(str(out)):
        check_apart(run_dir, out)
        return (export_hf if fmt == "hf" else export)(run_dir, out, step, ema)
    url = str(out).rstrip("/")
    prefix, name = (url, "hf") if fmt == "hf" else url.rsplit("/", 1)
    if fmt != "hf" and (prefix == "s3:/" or not name.endswith(".safetensors")):
        raise ExportError(f"{out}: name the object, e.g. s3://bucket/models/vit.safetensors")
    place = S3Prefix(prefix)
    place.prepare()
    with tempfile.TemporaryDirectory(prefix="vit-export-") as tmp:
        local = Path(tmp) / name
        r = (export_hf if fmt == "hf" else export)(run_dir, local, step, ema)
        for f in sorted(local.iterdir()) if fmt == "hf" else [local]:
            with open(f, "rb") as src, place.create(f.name) as up:  # a failed upload is aborted on close
                shutil.copyfileobj(src, up, 8 << 20)
                up.commit()
    r["output"] = url
    if fmt != "hf":
        r["timm_call"] = timm_call(r, Path(name), r["pretrained_cfg"])  # once downloaded beside the script
    return r


def main(argv=None) -> None:
    ap = Parser(prog="vit-export", description="Export a run's weights for timm or transformers")
    ap.add_argument("run_dir", type=path_arg,
                    help="run directory, its checkpoints/ directory, one checkpoint, or a transformers ViT folder")
    ap.add_argument("output", type=path_arg, help="OUT.safetensors (--format timm) or a folder (--format hf); "
                                                  "either may be s3://bucket/key (one object per file)")
    ap.add_argument("--format", choices=["timm", "hf"], default="timm",
                    help="timm: one safetensors file in timm's names (default); hf: a transformers "
                         "ViTForImageClassification folder with a model card")
    ap.add_argument("--step", type=int, default=None, help="export this step instead of the newest")
    ap.add_argument("--ema", action="store_true", help="export the moving average of the weights (train.ema_decay) "
                                                        "instead of the weights")
    args = ap.parse_args(argv)
    with cli_errors("vit-export", ExportError, hf.HFUnsupported, DataError):  # DataError: the store refused
        try:  # stdout is the loading call's alone: the rest goes to stderr, DeepSpeed's log lines included
            with contextlib.redirect_stdout(sys.stderr):
                r = export_to(args.run_dir, args.output, args.step, args.format, args.ema)
        except ExportRescued as e:  # not a user mistake (the folder passed the check): exit 1, one line
            print(f"vit-export: error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    step = "" if r["step"] is None else f" step {r['step']}"
    what = " (EMA of the weights)" if args.ema else ""
    print(f"vit-export: {r['model']['name']}{step}{what} from {r['checkpoint']} -> {r['output']} "
          f"({r['tensors']} tensors)", file=sys.stderr)
    # in the store, the loading line reads the download: the file beside the script, the folder by its own name
    local = Path(last_part(r["output"]) if args.format == "hf" else ".") if is_s3(args.output) else None
    if local is not None:
        print(f"vit-export: in the store; download it first (aws s3 cp{' --recursive' if args.format == 'hf' else ''} "
              f"{r['output']} {local})", file=sys.stderr)
    if args.format == "hf":
        print(f"from transformers import ViTForImageClassification; "
              f"ViTForImageClassification.from_pretrained({str((local or Path(r['output'])).absolute())!r})")
        return
    if r["model"].get("representation_size"):
        print("vit-export: note: timm 1.x drops the pre-logits layer (model.representation_size) when loading: "
              "its logits differ from ours; load the file with pretrain.weights.load instead", file=sys.stderr)
    print(f"import timm; m = {r['timm_call']}")


if __name__ == "__main__":
    main()
