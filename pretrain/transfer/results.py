"""Results: one JSON document per evaluated checkpoint, a Markdown table, and W&B logging into the
pre-training run.

``results.json`` (``--watch`` writes ``{"watch": RUN_DIR, "evaluations": [document, ...]}``)::

    {"checkpoint": ..., "checkpoint_kind": "run|transformers|safetensors|state_dict", "step": 1000,
     "model": {"name": ..., "img_size": ..., "global_pool": ..., "representation_size": ...},
     "pretraining": {"device_hours": 1.2e3, "images_seen": ..., "model_flops": ...},  # None: unknown
     "wandb_run_id": ..., "run_dir": ...,  # the pre-training run's, where the checkpoint says them
     "suite": "vtab1k", "protocol": "linear", "img_size": 224, "sweep": true,  # settings chosen on val
     "settings": {the resolved eval section},
     "tasks": {"caltech101": {"task", "group", "accuracy", "setting", "val_accuracy", "details",
                              "num_classes", "chance", "num_train", "num_test", "seconds"}, ...},
     "groups": {"natural": {"mean", "tasks", "of"}, ...},      # vtab1k only
     "mean": 0.61, "missing": ["sun397", ...], "seconds": 812.0, "world_size": 1, "device_hours": 0.23}

``num_train``: the training images the final fit uses (train and val together; 0 for ``head``); for
few-shot, the pool each seed draws its ``k`` images per class from (the table's cell says
``k x classes of pool``).
``pretraining``: what pre-training did and cost up to the evaluated step, as the checkpoint says it
(a run's ``run.json``, a ``vit-export`` file's metadata); each figure None where it does not.
``seconds``, ``world_size`` and ``device_hours``: what this evaluation itself took (a fine-tune's
devices x its wall-clock, the model's build and the data's reading included), the other part of a
fine-tuned model's cost.

W&B: the same run id as pre-training and the checkpoint's step as ``train/step`` -- the x-axis
``pretrain.observability.metrics`` defines for ``transfer/*`` -- so transfer curves sit beside the loss curve;
``train/device_hours`` rides in the same row where known, so they can be drawn against GPU-hours too;
W&B's own step counter is left alone, so a transfer result for an older step is never dropped
as out of order.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from data_pipeline.files import unwritable, write_atomic
from pretrain.observability.metrics import open_checkpoint_run
from pretrain.transfer import vtab
from pretrain.transfer.errors import TransferError
from pretrain.transfer.sweep import TaskResult


def assemble(results: list[TaskResult], *, missing: list[str], suite: str, protocol: str, pre, img_size: int,
             sweep: bool, settings: dict, seconds: float, world: int = 1) -> dict:
    acc = {r.task: r.accuracy for r in results}
    doc = {"checkpoint": pre.source, "checkpoint_kind": pre.kind, "step": pre.step, "model": dict(pre.arch),
           "pretraining": pretraining(pre.totals),
           "wandb_run_id": pre.wandb_run_id, "suite": suite, "protocol": protocol, "img_size": img_size,
           "sweep": sweep, "settings": settings, "tasks": {r.task: r.to_dict() for r in results}}
    if suite == "vtab1k":
        summary = vtab.summarize(acc)
        doc.update(groups=summary["groups"], mean=summary["mean"], missing=summary["missing"])
    else:
        doc.update(mean=sum(acc.values()) / len(acc) if acc else None, missing=list(missing))
    doc.update(seconds=seconds, world_size=world, device_hours=seconds * world / 3600)
    return doc


def pretraining(totals: Optional[dict]) -> dict:
    """``doc["pretraining"]`` from a checkpoint's totals (``Pretrained.totals``): device-hours,
    images and model FLOPs up to its step, each None where the checkpoint does not say it."""
    t = totals or {}
    secs = t.get("device_seconds")
    return {"device_hours": None if secs is None else secs / 3600, "images_seen": t.get("images_seen"),
            "model_flops": t.get("model_flops")}


def _cost(doc: dict) -> str:
    """The header's words on what pre-training cost up to the checkpoint, where it is known."""
    p = doc.get("pretraining") or {}
    parts = ([f"{p['device_hours']:.3g} device-hours"] if p.get("device_hours") is not None else []) + (
        [f"{p['images_seen']:,} images"] if p.get("images_seen") is not None else []) + (
        [f"{p['model_flops']:.3g} model FLOPs"] if p.get("model_flops") is not None else [])
    return f"; pre-training {', '.join(parts)}" if parts else ""


def write_json(path: str | Path, obj) -> Path:
    """Atomic: a reader (or a crash) never sees half a file."""
    return write_atomic(path, json.dumps(obj, indent=1))


RESULTS_MAX_BYTES = 64 << 20  # larger than any results or --watch file: a file beyond it is not ours


def is_results(obj) -> bool:
    """Whether ``obj`` (a JSON document) is one evaluation's results, as ``assemble`` makes them."""
    return isinstance(obj, dict) and {"suite", "protocol", "tasks"} <= set(obj) and isinstance(obj["tasks"], dict)


def check_output(path: str | Path, watch: bool = False) -> None:
    """TransferError (one line) when ``path`` cannot be written, or holds a file that is not results
    of ours (a checkpoint, a config: replacing it would lose it); called before any evaluation, so
    a mistake costs a second, not the evaluation. A real file is created and removed in the
    nearest existing folder: permission bits say nothing for root, on NFS or under ``chattr +i``.
    ``watch``: the file ``--watch`` continues (whose run it belongs to, its caller checks)."""
    p = Path(path)
    if p.is_dir():
        raise TransferError(f"--output {p}: is a folder; name a file, e.g. --output {p / 'results.json'}")
    if p.is_file():
        try:  # results are kilobytes; a checkpoint named by mistake may be gigabytes: not read whole
            doc = json.loads(p.read_bytes()) if p.stat().st_size <= RESULTS_MAX_BYTES else None
        except (ValueError, UnicodeDecodeError, OSError):
            doc = None
        ours = (isinstance(doc, dict) and "watch" in doc) if watch else is_results(doc)
        if not ours:
            what = "--watch results" if watch else "one evaluation's results (a vit-transfer --output)"
            raise TransferError(f"--output {p}: exists and is not {what}; it is left as it is: choose "
                                "another --output")
    why = unwritable(p.parent)  # write_atomic creates missing folders: their nearest parent counts
    if why:
        raise TransferError(f"--output {p}: {why}; choose a writable --output")


def save_json(path: str | Path, obj) -> tuple[Path, Optional[str]]:
    """Write ``obj`` to ``path``; when that fails (the folder went read-only or full during the
    evaluation), to a file in ``$TMPDIR`` instead. Returns (where it is, None) or (the fallback,
    a one-line message saying what failed and where the results are): results are never lost."""
    try:
        return write_json(path, obj), None
    except OSError as e:
        why = e.strerror or type(e).__name__
    stem = Path(path).stem or "results"
    fallback = Path(tempfile.gettempdir()) / f"vit-transfer-{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    try:
        write_json(fallback, obj)
    except OSError as e2:
        raise TransferError(f"--output {path}: cannot write ({why}), nor {fallback} ({e2.strerror}); "
                            "the results table above is all that is left") from None
    return fallback, f"--output {path}: cannot write ({why}); the results are saved in {fallback}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _setting(s: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items())


def headline_shots(doc: dict) -> Optional[int]:
    """The shot count a few-shot document's accuracies are (big_vision's 10-shot, else the largest)."""
    shots = {r["details"].get("headline_shots") for r in doc["tasks"].values()} - {None}
    return shots.pop() if len(shots) == 1 else None


def headline_k(doc: dict) -> Optional[int]:
    """The neighbour count a kNN document's accuracies are (DINO's 20, else the largest)."""
    ks = {r["details"].get("headline_k") for r in doc["tasks"].values()} - {None}
    return ks.pop() if len(ks) == 1 else None


def real_only(r: dict) -> bool:
    """Whether a task result's accuracy is ReaL top-1 (``--protocol head`` on a set with no labels of
    its own, ImageNet val as distributed, scored by ``eval.real_labels`` alone), not top-1 against
    the set's labels."""
    d = r.get("details") or {}
    return "real_top1" in d and "top1" not in d


def _details(d: dict) -> str:
    """The Details cell: every shot count (few-shot), every k (kNN), top-5 and ReaL (head), the
    trained weights' accuracy beside the EMA's (fine-tune)."""
    if "shots" in d:  # few-shot: every shot count, mean over seeds (and where a class had fewer)
        return " / ".join(f"{k}-shot {_pct(v['mean'])}"
                          + (f" (a class had {v['fewest_of_a_class']})" if "fewest_of_a_class" in v else "")
                          for k, v in d["shots"].items())
    if "k" in d and isinstance(d["k"], dict):  # kNN: top-1 of every k (and where fewer neighbours existed)
        return " / ".join(f"{k}-NN {_pct(v['top1'])}" + (f" ({v['neighbours']} exist)" if "neighbours" in v else "")
                          for k, v in d["k"].items())
    parts = []
    if "top5" in d:
        parts.append(f"top-5 {_pct(d['top5'])}")
    if "real_top1" in d:
        parts.append(f"ReaL {_pct(d['real_top1'])} ({d['real_scored']} images)")
    if "accuracy_no_ema" in d:
        parts.append(f"EMA weights; trained weights {_pct(d['accuracy_no_ema'])}")
    return " / ".join(parts)


def markdown(doc: dict) -> str:
    step = f"step {doc['step']}" if doc.get("step") is not None else "step ?"
    k = headline_shots(doc) if doc["protocol"] == "fewshot" else None
    seeds = (doc.get("settings") or {}).get("fewshot_seeds")
    nn = headline_k(doc) if doc["protocol"] == "knn" else None
    real = {name: real_only(r) for name, r in doc["tasks"].items()}
    all_real = bool(real) and all(real.values())  # else a ReaL figure among top-1s is marked in its cell
    top1 = (f"{k}-shot top-1 (%)" if k else f"{nn}-NN top-1 (%)" if nn else "ReaL top-1 (%)" if all_real
            else "Top-1 (%)")
    # few-shot fits k images of each class drawn from the training split: the split is the pool, not
    # what was fitted, so the cell says both
    fewshot = doc["protocol"] == "fewshot"
    train = "Train (shots x classes of pool)" if fewshot else "Train"
    lines = [f"**{doc['model']['name']}** ({step}, {doc['checkpoint']}{_cost(doc)}) -- {doc['suite']} / "
             f"{doc['protocol']} at {doc['img_size']} px" + (", swept on val" if doc.get("sweep") else "")
             + (f"; top-1 is {k}-shot" + (f", mean of {seeds} seed{'s' * (seeds != 1)}" if seeds else "")
                + " (every shot count under Details)" if k else "")
             + (f"; top-1 is {nn}-NN (every k under Details)" if nn else ""), "",
             f"| Task | Group | {top1} | Chance (%) | Setting | Details | {train} | Test |",
             "|---|---|---:|---:|---|---|---:|---:|"]
    for name, r in doc["tasks"].items():
        details = _details(r["details"])
        shots = r["details"].get("headline_shots") if fewshot else None
        n_train = f"{shots} x {r['num_classes']} of {r['num_train']}" if shots else r["num_train"]
        acc = _pct(r["accuracy"]) + (" (ReaL)" if real[name] and not all_real else "")
        lines.append(f"| {name} | {r['group'] or ''} | {acc} | {_pct(r['chance'])} "
                     f"| {_setting(r['setting'])} | {details} | {n_train} | {r['num_test']} |")
    for g, s in (doc.get("groups") or {}).items():
        lines.append(f"| **{g}** ({s['tasks']}/{s['of']}) | | {_pct(s['mean'])} | | | | | |")
    if doc["suite"] == "vtab1k":
        lines.append(f"| **mean** ({len(doc['tasks'])}/{len(vtab.TASKS)}) | | {_pct(doc['mean'])} | | | | | |")
    elif len(doc["tasks"]) > 1:
        lines.append(f"| **mean** | | {_pct(doc['mean'])} | | | | | |")
    if doc.get("missing"):
        lines += ["", f"Missing ({len(doc['missing'])}): {', '.join(doc['missing'])} "
                      "-- means are over the tasks present."]
    if doc.get("device_hours") is not None:
        n = doc.get("world_size") or 1
        lines += ["", f"Evaluated in {doc['device_hours']:.3g} device-hours ({n} device{'s' if n > 1 else ''} x "
                      f"{doc['seconds'] / 60:.3g} min)."]
    return "\n".join(lines)


def wandb_metrics(doc: dict) -> dict:
    prefix = f"transfer/{doc['suite']}/{doc['protocol']}"
    m = {f"{prefix}/{t}": r["accuracy"] for t, r in doc["tasks"].items()}
    for t, r in doc["tasks"].items():
        for k, v in r["details"].get("shots", {}).items():
            m[f"{prefix}/{t}_{k}shot"] = v["mean"]
        knn = r["details"].get("k")
        for k, v in (knn.items() if isinstance(knn, dict) else ()):
            m[f"{prefix}/{t}_{k}nn"] = v["top1"]
        for key in ("top5", "real_top1", "real_top5", "accuracy_no_ema"):
            if key in r["details"]:
                m[f"{prefix}/{t}_{key}"] = r["details"][key]
    for g, s in (doc.get("groups") or {}).items():
        if s["mean"] is not None:
            m[f"{prefix}/{g}"] = s["mean"]
    if doc.get("mean") is not None:
        m[f"{prefix}/mean"] = doc["mean"]
    if doc.get("device_hours") is not None:  # what the evaluation itself cost
        m[f"{prefix}/device_hours"] = doc["device_hours"]
    return m


def log_wandb(doc: dict, wandb_cfg, *, run_dir: Optional[str] = None) -> Optional[str]:
    """Log ``doc`` into the pre-training run (``doc['wandb_run_id']``); returns the run's path.
    Without a run id (a foreign state dict) the results go to a new run, and stderr says so."""
    run = open_checkpoint_run(doc, wandb_cfg, "vit-transfer", "eval.wandb=true", run_dir)
    if run is None:
        return None
    try:
        run.define_metric("transfer/*", step_metric="train/step")
        step = doc.get("step") or 0
        hours = (doc.get("pretraining") or {}).get("device_hours")
        run.log({"train/step": step, **({"train/device_hours": hours} if hours is not None else {}),
                 **wandb_metrics(doc)})
        return run.dir
    finally:
        run.finish()
