"""Metrics sinks (rank 0 only): W&B (online / offline / disabled) and ``metrics.jsonl``.

The W&B run id is generated once and stored in every checkpoint, so a resumed job continues the
same W&B run (``resume='allow'``) and its steps only increase. Run config carries world size,
global batch, ZeRO stage and model FLOPs so W&B can draw scaling curves across runs of a group.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import torch

from pretrain.observability.config import LoggingConfig
from pretrain.observability.flops import mfu


def throughput(images: int, elapsed: float, world_size: int, flops_model: float, flops_hw: float,
               peak: Optional[float]) -> dict:
    """img/s (global and per device), TFLOP/s per device, MFU and HFU from one logging window."""
    ips = images / elapsed
    per_dev = ips / world_size
    out = {"images_per_sec": ips, "images_per_sec_per_device": per_dev,
           "tflops_per_device": flops_model * per_dev / 1e12,
           "hw_tflops_per_device": flops_hw * per_dev / 1e12}
    m, h = mfu(flops_model, per_dev, peak), mfu(flops_hw, per_dev, peak)
    if m is not None:
        out["mfu"], out["hfu"] = m, h
    return out


def peak_memory_gb() -> float:
    """Peak device memory (CUDA) or peak resident set size of this process (CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb / 2 ** 20


class MetricsLogger:
    """Rank 0 writes; other ranks get a logger whose calls do nothing."""

    def __init__(self, cfg: LoggingConfig, run_dir: str | Path, *, rank: int, run_config: dict,
                 run_id: Optional[str] = None, resume_step: Optional[int] = None):
        """``resume_step``: the step of the checkpoint this attempt resumed from. Records of later
        steps (logged by an attempt that crashed before its next checkpoint) are cut from
        metrics.jsonl, since this attempt logs those steps again; W&B, whose steps only increase,
        is not sent the steps it already holds (an exact resume recomputes them identically).
        A fresh start (no ``resume_step``) in a run directory that already holds a metrics.jsonl
        (an attempt that crashed before its first checkpoint) keeps that file beside the new one as
        ``metrics.K.jsonl`` and starts a new file (and, with no run id in a checkpoint, a new W&B
        run), so no step appears twice."""
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.wandb_run = None
        self._jsonl = None
        self._service = None
        self._wandb_has_until = -1  # W&B already holds the steps up to here (a crashed attempt's)
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            path = self.run_dir / "metrics.jsonl"
            if resume_step is not None:
                self._wandb_has_until = cut_back(path, resume_step)
            elif path.is_file() and path.stat().st_size:
                kept = set_aside(path)
                print(f"metrics: a fresh start: the earlier attempt's records are kept in {kept}; "
                      f"{path.name} starts anew", file=sys.stderr, flush=True)
            self._jsonl = open(path, "a", buffering=1)
        if cfg.wandb.mode != "disabled":
            self._start_wandb(cfg, run_config)

    def _start_wandb(self, cfg: LoggingConfig, run_config: dict) -> None:
        """Online falls back to offline when W&B cannot start within ``init_timeout_s`` (no API
        key, no network, server down): one line says so and how to upload later. Offline that
        fails too leaves metrics.jsonl alone; training never dies or stalls for W&B."""
        import wandb

        w = cfg.wandb
        self.run_id = self.run_id or uuid.uuid4().hex[:12]
        os.environ.setdefault("WANDB_SILENT", "true")
        # A W&B service inherited from a parent process (a notebook, a test runner) would be shared
        # by every run it starts; one that outlived a kill -9'ed attempt still holds this run id
        # ("run ID ... is in use") and the resumed run could not log. Each run starts its own, out
        # of reach of the signals that stop the job (pretrain/observability/wandb_service.py).
        self._new_service()

        def init(mode: str):
            # init_timeout bounds the server handshake (retries included); login_timeout any
            # prompt for a key. Measured with no key: 0.3 s; a closed port: init_timeout + 0.3 s
            settings = wandb.Settings(console="off", x_disable_stats=False, init_timeout=w.init_timeout_s,
                                      login_timeout=w.init_timeout_s)
            return wandb.init(mode=mode, project=w.project, entity=w.entity, group=w.group, name=w.name,
                              tags=list(w.tags) or None, id=self.run_id, resume="allow", dir=str(self.run_dir),
                              config=run_config, settings=settings)

        try:
            self.wandb_run = init(w.mode)
        except Exception as e:
            if w.mode != "online":
                return self._drop_wandb(e)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}" if str(e).strip() else type(e).__name__
            err: Optional[Exception] = None
            for attempt in range(4):
                try:
                    # a fresh service: the first keeps the half-started run ("run ID ... is in use")
                    wandb.teardown()
                    self._new_service(abandon=True)
                    self.wandb_run = init("offline")
                    break
                except Exception as e2:  # the service may still hold the online attempt for a moment
                    err = e2
                    if "in use" not in str(e2):
                        break
                    if attempt == 2:  # it will not let go: an offline run of its own (the id is saved)
                        self.run_id = uuid.uuid4().hex[:12]
                    time.sleep(1.0 + attempt)
            if self.wandb_run is None:
                return self._drop_wandb(err)
            print(f"metrics: W&B online could not start ({why}); logging offline to {self.wandb_dir} instead: "
                  f"upload it later with `wandb sync {self.wandb_dir}`", file=sys.stderr, flush=True)
        # one x-axis for everything: the optimizer step
        self.wandb_run.define_metric("train/*", step_metric="train/step")
        self.wandb_run.define_metric("transfer/*", step_metric="train/step")
        self.wandb_run.define_metric("eval/*", step_metric="train/step")

    def _new_service(self, abandon: bool = False) -> None:
        """Point wandb at a new guarded service (``abandon``: end the current one first; it holds
        only a run that never started)."""
        from pretrain.observability import wandb_service

        if abandon and self._service is not None:
            self._service.end()
        os.environ.pop("WANDB_SERVICE", None)
        self._service = wandb_service.start()
        if self._service is not None:
            os.environ["WANDB_SERVICE"] = self._service.token

    @property
    def wandb_dir(self) -> Optional[str]:
        return self.wandb_run.dir.rsplit("/files", 1)[0] if self.wandb_run is not None else None

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self.wandb_run is not None and step > self._wandb_has_until:
            try:
                self.wandb_run.log({"train/step": step, **{k if k.startswith("eval/") else f"train/{k}": v
                                                            for k, v in metrics.items()}}, step=step)
            except Exception as e:  # W&B must never stop training (its service may die on SIGTERM)
                self._drop_wandb(e)

    def summarize(self, values: dict) -> None:
        """Figures of the whole run into the W&B run's summary (its runs table: one column each,
        to sort runs by), beside the history ``log`` writes."""
        if not self.enabled or self.wandb_run is None:
            return
        try:
            self.wandb_run.summary.update(values)
        except Exception as e:  # W&B must never stop training
            self._drop_wandb(e)

    def print(self, step: int, metrics: dict, steps: int = 0, note: str = "") -> None:
        """The progress line: ``step 40/100 loss=... device_hours=...``, of ``steps`` when given,
        then ``note`` (the forecast: ``window.Forecast.note``)."""
        if not self.enabled:
            return
        keys = ("loss", "lr", "grad_norm", "images_per_sec", "tflops_per_device", "mfu", "data_wait_share",
                "device_hours")
        parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics and metrics[k] is not None]
        print(f"step {step}{f'/{steps}' if steps else ''} " + " ".join(parts + ([note] if note else [])),
              file=sys.stderr, flush=True)

    def _drop_wandb(self, err: Exception) -> None:
        print(f"metrics: W&B disabled for the rest of this run ({type(err).__name__}: {err}); "
              "metrics.jsonl continues", file=sys.stderr, flush=True)
        self.wandb_run = None

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as e:
                self._drop_wandb(e)
        if self._service is not None:  # its guardian ends it once this process is gone (wandb_service)
            import wandb

            wandb.teardown()
            self._service = None
            os.environ.pop("WANDB_SERVICE", None)


def set_aside(path: Path) -> Path:
    """Rename ``path`` (metrics.jsonl) to the first free ``metrics.K.jsonl`` beside it; returns that."""
    k = 1
    while (kept := path.with_name(f"{path.stem}.{k}{path.suffix}")).exists():
        k += 1
    path.rename(kept)
    return kept


def cut_back(path: Path, step: int) -> int:
    """Drop the records of ``path`` (metrics.jsonl) after ``step``, atomically; returns the largest
    step it held (-1 when empty or absent). A torn last line (a kill mid-write) goes too."""
    from data_pipeline.files import write_atomic

    if not path.exists():
        return -1
    kept, last = [], -1
    for line in path.read_text().splitlines():
        try:
            rec_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        last = max(last, rec_step)
        if rec_step <= step:
            kept.append(line)
    write_atomic(path, "".join(ln + "\n" for ln in kept))
    return last


def open_checkpoint_run(doc: dict, wandb_cfg, prog: str, what: str, run_dir: Optional[str] = None):
    """The W&B run a checkpoint came from (``doc['wandb_run_id']``), resumed so that results logged
    later (transfer scores, analysis figures) land at the checkpoint's ``train/step``; without a run
    id (a foreign state dict), a new run, and stderr says so. None when W&B is disabled."""
    if wandb_cfg.mode == "disabled":
        print(f"{prog}: {what} but logging.wandb.mode=disabled; not logging", file=sys.stderr)
        return None
    import wandb

    run_id = doc.get("wandb_run_id")
    if not run_id:
        print(f"{prog}: {doc['checkpoint']} names no W&B run; logging to a new run", file=sys.stderr)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(id=run_id or None, resume="allow" if run_id else None, mode=wandb_cfg.mode,
                      project=wandb_cfg.project, entity=wandb_cfg.entity, group=wandb_cfg.group,
                      dir=run_dir or ".", settings=wandb.Settings(console="off"))
