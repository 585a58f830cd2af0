"""Pre-training entry point.

    deepspeed [runner options] --module pretrain.train --config FILE [a.b=c ...]
    python -m pretrain.train --config FILE [a.b=c ...]          # one process

Setup lives in small builders; ``train_loop`` is the loop. Every rank runs the same code; only
rank 0 writes metrics. Resumes automatically from the newest complete checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from data_pipeline.files import write_json
from data_pipeline.loading.sample_log import SampleLog
from data_pipeline.loading.workers import stop_workers
from pretrain.checkpointing import checkpoint
from pretrain.distributed import ds_compat
from pretrain.resilience import faults
from pretrain.resilience import watchdog
from pretrain.observability.clock import PHASES, StepClock
from pretrain.config import (Config, ConfigError, cli_errors, check_world_size, image_size, load_config,
                             save_config, to_dict)
from pretrain.distributed.process import (init_distributed, is_peer_error, launched, set_collective_timeout,
                                  unreachable_peers)
from pretrain.distributed.engine import deepspeed_config, initialize
from pretrain.evaluation.in_training import InTrainingEval
from pretrain.observability.flops import analytic_flops, peak_tflops, train_flops_per_image
from pretrain.resilience.lifecycle import EXIT_INTERRUPTED, EXIT_OK, StopRequest
from pretrain.models.losses import classification_loss
from pretrain.observability.metrics import MetricsLogger, peak_memory_gb, throughput
from pretrain.weights.init_from import build_model, load_init_weights, num_params  # noqa: F401  (tests import them here)
from pretrain.distributed.precision import check_precision, compute_dtype
from pretrain.checkpointing.rundir import RunDir
from pretrain.step import NonFiniteGuard, NonFiniteLoss, train_step
from pretrain.resilience.straggler import StragglerDetector
from pretrain.resilience.watchdog import StartupGuard, Watchdog


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (one line: the folder, why, the last good checkpoint)."""


class Progress:
    """Start-up lines on rank 0 (stderr), with seconds since start: building the model, DeepSpeed
    init, loading a checkpoint and the first batch take 10-90 s that would otherwise be silent."""

    def __init__(self, rank: int):
        self.on, self.t0 = rank == 0, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.on:
            print(f"vit-train: {msg} [{time.perf_counter() - self.t0:.1f} s]", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- builders
def check_machine(cfg: Config, world_size: int) -> int:
    """Before any expensive work: the precision on this device, the batch on this world size, and
    the DeepSpeed config these sections make (a refused combination is one line here)."""
    check_precision(cfg.train.precision)
    deepspeed_config(cfg.optim, cfg.train, cfg.zero, world_size)
    if cfg.model.init_from and not Path(cfg.model.init_from).exists():
        raise ConfigError(f"model.init_from={cfg.model.init_from}: not found")
    return check_world_size(cfg.train, world_size)


def set_cpu_threads(local_world: int, data_workers: int) -> None:
    """On CPU, ranks (and their data workers) share the cores, and torch's default of one thread
    per core in every rank oversubscribes them many times over: each rank gets its share of the
    cores, less one per node left to the data workers."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        per_rank = (os.cpu_count() or 1) // max(1, local_world) - (1 if data_workers > 0 else 0)
        torch.set_num_threads(max(1, per_rank))


# ----------------------------------------------------------------------------------- components
class Checkpointer:
    """Decides at each step whether it saves (``train.steps``, ``checkpoint.every_steps``, a stop)
    and writes the checkpoint with the loader position, so the loop only calls ``maybe_save``.
    With ``checkpoint.async`` the files are written in the background (``pretrain/checkpointing/async_save.py``):
    a save in flight is completed at sync points when every rank has written it, and waited for
    before the next save, on a stop and at the end (``close``)."""

    def __init__(self, cfg: Config, engine, loader, ckpt_dir: Path, run_info: dict, logger: MetricsLogger,
                 samples: Optional[SampleLog]):
        self.every, self.last, self.keep = cfg.checkpoint.every_steps, cfg.train.steps, cfg.checkpoint.keep_last
        self.engine, self.loader, self.dir, self.run_info = engine, loader, ckpt_dir, run_info
        self.logger, self.samples = logger, samples
        self.saver = None
        if cfg.checkpoint.async_save:
            from pretrain.checkpointing.async_save import Saver

            self.saver = Saver(engine, dist.get_rank(), checkpoint.finish_async(self.keep))
        self.blocked_s: list[float] = []  # seconds each save held the training thread
        self.waited_s: list[float] = []  # of which waiting for the previous asynchronous save

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last

    def maybe_save(self, step: int, stopping: bool = False, sync: bool = False) -> None:
        saving = stopping or self.due(step)
        try:
            if self.saver is not None and sync and not saving:
                self.saver.poll()  # a sync point: complete the save in flight if every rank wrote it
            if not saving:
                return
            if self.samples is not None:
                self.samples.flush()
            t0 = time.perf_counter()
            state = dict(rank_state={"loader": self.loader.state_dict()},
                         run_info={**self.run_info, "wandb_run_id": self.logger.run_id})
            if self.saver is None:
                checkpoint.save(self.engine, self.dir, step, keep_last=self.keep, **state)
            else:
                waited = self.saver.waited_s
                checkpoint.save_async(self.engine, self.saver, self.dir, step, **state)
                if stopping or step == self.last:
                    self.saver.close()
                self.waited_s.append(self.saver.waited_s - waited)
            self.blocked_s.append(time.perf_counter() - t0)
        except (OSError, RuntimeError) as e:
            self._failed(step, e)

    def close(self) -> None:
        """The save in flight, if any, complete and on disk (collective)."""
        if self.saver is None:
            return
        step = self.saver.pending[0] if self.saver.pending else 0
        try:
            self.saver.close()
        except (OSError, RuntimeError) as e:
            self._failed(step, e)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that could not be written (folder made read-only, disk full; torch.save's writer
        says so with a RuntimeError, also on the background thread): one line saying what survives,
        not a traceback. Other errors go on unchanged."""
        err = e if isinstance(e, OSError) else checkpoint._as_os_error(e, self.dir / checkpoint.tag_for(step))
        if not isinstance(err, OSError):
            raise e
        raise CheckpointWriteError(checkpoint.save_failed(self.dir, step, err)) from None


class Window:
    """What a logging window sums on the device between sync points: losses, images."""

    def __init__(self, device):
        self.loss = torch.zeros(2, device=device)  # (sum of kept losses, their count)
        self.images = 0

    def add(self, loss: torch.Tensor, images: int) -> None:
        self.loss += loss
        self.images += images


def batch_stream(loader, samples: Optional[SampleLog], start_step: int, accumulation: int) -> Iterator:
    """The loader's batches; with ``data.record_samples`` each batch's keys are logged at its step."""
    for i, batch in enumerate(loader):
        if samples is not None:
            samples.write(start_step + 1 + i // accumulation, loader.last_epoch, loader.last_keys)
        yield batch


def window_metrics(engine, window: Window, clock: StepClock, *, step: int, world: int, global_batch: int,
                   flops: tuple[float, float], guard: NonFiniteGuard, loader) -> tuple[dict, dict]:
    """The log step's metrics (a sync point: the device finishes the window, then the clock is
    read) and this rank's phase seconds of the window."""
    elapsed, phases = clock.close_window()
    dist.all_reduce(window.loss)
    total, count = window.loss.tolist()
    gn = engine.get_global_grad_norm()
    metrics = {"loss": total / count if count else None, "lr": engine.get_lr()[0],
               "grad_norm": float(gn) if gn is not None else None, "examples_seen": step * global_batch,
               "data_wait_share": phases["data"] / elapsed, "peak_memory_gb": peak_memory_gb(),
               "nonfinite_skipped": guard.total, **throughput(window.images * world, elapsed, world, *flops, peak_tflops()),
               **{f"phase_share/{p}": phases[p] / elapsed for p in PHASES},  # rank 0's step-time breakdown
               **{f"data/{k}": v for k, v in _sum_counters(loader.counters).items()}}
    return metrics, phases


def straggler_check(detector: Optional[StragglerDetector], phases: dict, device) -> tuple[dict, Optional[str]]:
    """Every rank's phase seconds of the window to rank 0 (one small all-gather); its verdict."""
    if detector is None:
        return {}, None
    mine = torch.tensor([phases[p] for p in PHASES], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    per_rank = [dict(zip(PHASES, t.tolist())) for t in every]
    return detector.observe(per_rank)


# ----------------------------------------------------------------------------------------- loop
def train_loop(cfg: Config, engine, batches: Iterator, loader, logger: MetricsLogger, checkpointer: Checkpointer,
               *, start_step: int, world: int, flops: tuple[float, float], stop: StopRequest, clock: StepClock,
               startup: StartupGuard, detector: Optional[StragglerDetector] = None,
               evaluator: Optional[InTrainingEval] = None, say: Callable[[str], None] = lambda msg: None) -> dict:
    """Steps until ``train.steps`` or an agreed stop. Between sync points (log and checkpoint steps,
    every ``train.sync_every_steps``) nothing is read on the host."""
    t, device = cfg.train, engine.device
    guard = NonFiniteGuard(t.max_nonfinite_steps, engine.module.parameters(), device)
    loss_of = partial(classification_loss, multi_label=cfg.data.multi_label, smoothing=cfg.optim.label_smoothing)
    dtype, window = compute_dtype(t.precision), Window(device)
    history, step, stopped = [], start_step, False
    while step < t.steps:
        clock.begin_step(step + 1, startup=step == start_step)
        window.add(*train_step(engine, batches, guard, clock, step + 1, loss_of, dtype))
        clock.end_step()
        step += 1
        if step == start_step + 1:  # start-up is over: step-time bounds from here on
            startup.done()
            set_collective_timeout(t.pg_timeout_s)
            say(f"step {step} done; a line every {t.log_every_steps} steps")
        sync = (step % t.log_every_steps == 0 or checkpointer.due(step) or step % t.sync_every_steps == 0)
        if sync:  # before the log and any checkpoint of these steps
            guard.verdict()

        clock.beat("log")
        if step % t.log_every_steps == 0 or step == t.steps:
            metrics, phases = window_metrics(engine, window, clock, step=step, world=world, flops=flops,
                                             global_batch=t.global_batch_size, guard=guard, loader=loader)
            straggling, line = straggler_check(detector, phases, device)
            logger.log(step, {**metrics, **straggling})
            logger.print(step, metrics)
            if line:
                say(f"straggler: {line}")
            history.append(metrics["loss"])
            window = Window(device)

        if evaluator is not None and evaluator.due(step, t.steps):  # its own data and RNG, left out of img/s
            clock.beat("eval", slow=True)
            results = evaluator(engine, step)
            logger.log(step, results)
            clock.exclude(evaluator.last_seconds)
            say(f"eval at step {step}: " + " ".join(f"{k[5:]}={v:.4g}" for k, v in results.items()))

        clock.beat("stop")
        stopped = sync and stop.agreed(device)  # a signal stops every rank within train.sync_every_steps
        clock.beat("checkpoint", slow=True)
        checkpointer.maybe_save(step, stopping=stopped, sync=sync)
        if stopped:
            break
    clock.beat("end", slow=True)
    checkpointer.close()
    startup.done()  # a run resumed at its last step takes no step
    guard.close()
    return {"step": step, "losses": history, "nonfinite_skipped": guard.total, "preempted": stopped,
            "stop_reason": stop.reason}


def _sum_counters(counters: dict) -> dict:
    """Loader counters summed over ranks (an all-gather of a small dict, only at log steps)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(counters))
    total: dict = {}
    for c in gathered:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


# ----------------------------------------------------------------------------------------- main
def run(cfg: Config) -> dict:
    from data_pipeline.loading.loader import build_loader

    stop = StopRequest(watch_launcher=launched())  # first: a signal during start-up is kept, not fatal
    t = cfg.train
    startup = StartupGuard(t.startup_timeout_s)  # until the first step is done
    startup.phase("process group and DeepSpeed's communication set-up")
    build_lock = ds_compat.report_build_lock_wait()  # DeepSpeed's CPU shm op may be JIT-built here
    rank, local_rank, world = init_distributed(max(t.pg_timeout_s, t.startup_timeout_s))
    build_lock.cancel()
    if rank == 0:
        ds_compat.check_version()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), cfg.data.workers)
    check_machine(cfg, world)
    layout = RunDir.of(t.output_dir, cfg.checkpoint.dir)
    run_dir, ckpt_dir = layout.root, layout.checkpoints
    # before any expensive work: an unwritable folder would otherwise fail at the first save
    checkpoint.check_writable(run_dir, "train.output_dir")
    if cfg.checkpoint.dir:
        checkpoint.check_writable(ckpt_dir, "checkpoint.dir")
    if cfg.checkpoint.resume:  # a changed shape key, said before the model build and DeepSpeed init
        checkpoint.check_resumable(ckpt_dir, to_dict(cfg))
    say = Progress(rank)
    watchdog.clear(layout.hang, rank)
    dog = Watchdog(layout.hang, rank, world, t.hang_timeout_s, startup_s=t.startup_timeout_s)
    img = image_size(cfg.model)

    say(f"building {cfg.model.name} ({img} px) on {world} rank(s)")
    startup.phase("model build")
    torch.manual_seed(t.seed)  # anything drawn before the per-rank streams below is the same on every rank
    model = build_model(cfg)
    if cfg.model.init_from and not (cfg.checkpoint.resume and checkpoint.latest_complete(ckpt_dir) is not None):
        load_init_weights(model, cfg, say)
    say(f"DeepSpeed init: ZeRO-{cfg.zero.stage}, {t.precision}, {num_params(model) / 1e6:.1f}M parameters")
    startup.phase("DeepSpeed initialize")
    engine, ds_cfg = initialize(model, cfg.optim, t, cfg.zero, world)
    loader = build_loader(cfg.data, rank=rank, world_size=world, batch_size=t.micro_batch_size,
                          seed=t.seed, img_size=img, train=True)
    if loader.num_classes != cfg.model.num_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the shards have "
                          f"{loader.num_classes} classes; set model.num_classes={loader.num_classes}")

    if cfg.checkpoint.resume and checkpoint.latest_complete(ckpt_dir) is not None:
        say(f"resuming: verifying and loading the newest checkpoint in {ckpt_dir}")
    startup.phase("checkpoint resume (a universal-checkpoint conversion on another world size)")
    resumed = checkpoint.resume(engine, ckpt_dir, config=to_dict(cfg)) if cfg.checkpoint.resume else None
    start, run_id = 0, None
    if resumed:
        info, states = resumed
        start, run_id = info["step"], info.get("wandb_run_id")
        loader.load_state_dicts([st["loader"] for st in states])  # same layout: this rank's, bit-exact
    else:
        torch.manual_seed(t.seed + 1000 * (rank + 1))  # per-rank dropout / drop-path streams

    fwd = analytic_flops(cfg.model.name, img, cfg.model.num_classes, cfg.model.global_pool,
                         cfg.model.representation_size, qk_norm=cfg.model.qk_norm, breakdown=True)
    flops = train_flops_per_image(fwd["total"], fwd["blocks"] if t.activation_checkpointing else 0)
    gas = ds_cfg["gradient_accumulation_steps"]
    run_config = {**to_dict(cfg), "world_size": world, "zero_stage": cfg.zero.stage,
                  "global_batch_size": t.global_batch_size, "model_gflops_fwd": fwd["total"] / 1e9,
                  "train_flops_per_image": flops[0], "gradient_accumulation": gas}
    predicted = _prediction(cfg, world)
    if predicted:
        run_config["predicted"] = predicted
        say(f"performance model for this layout on {predicted['gpu']}: {predicted['images_per_second']:,.0f} img/s, "
            f"MFU {predicted['mfu']:.1%} (measured img/s and MFU follow in the log lines)")
    if cfg.logging.wandb.mode == "online":
        say(f"starting W&B online (offline after logging.wandb.init_timeout_s={cfg.logging.wandb.init_timeout_s:g})")
    logger = MetricsLogger(cfg.logging, run_dir, rank=rank, run_config=run_config, run_id=run_id,
                           resume_step=start if resumed else None)
    if rank == 0:
        save_config(cfg, layout.config)
        where = f"resuming from step {start}" if resumed else "starting from scratch"
        print(f"vit-train: {cfg.model.name} on {world} rank(s), ZeRO-{cfg.zero.stage}, {t.precision}, "
              f"{where}; run dir {run_dir}", file=sys.stderr, flush=True)
    samples = SampleLog(layout.samples, rank).open(start) if cfg.data.record_samples else None
    if samples is not None and rank == 0:  # after an elastic resume onto fewer ranks, the old ranks'
        for r in range(world, len(resumed[1]) if resumed else 0):  # logs are cut back to the step too
            SampleLog(layout.samples, r).open(start).close()
    evaluator = InTrainingEval(cfg.validation, cfg.data, batch=t.micro_batch_size, seed=t.seed, rank=rank,
                               world=world, img_size=img, num_classes=cfg.model.num_classes,
                               dtype=compute_dtype(t.precision))
    evaluator = evaluator if evaluator.enabled else None
    checkpointer = Checkpointer(cfg, engine, loader, ckpt_dir, {"config": to_dict(cfg)}, logger, samples)
    batches = faults.wrap_batches(batch_stream(loader, samples, start, gas), rank=rank, start_step=start,
                                  accumulation=gas)
    clock = StepClock(engine.device, dog)
    clock.begin_step(start, startup=True)
    hosts = _hosts()
    detector = StragglerDetector(hosts, t.straggler_factor, t.straggler_windows,
                                 record=layout.stragglers if rank == 0 else None) if world > 1 else None
    say(f"waiting for the first batch (data.workers={cfg.data.workers})")
    startup.phase("first step (first batch, first collectives)")
    t0 = time.time()
    try:
        result = train_loop(cfg, engine, batches, loader, logger, checkpointer, start_step=start, world=world,
                            flops=flops, stop=stop, clock=clock, startup=startup, detector=detector,
                            evaluator=evaluator, say=say)
    except BaseException as e:
        dog.hold_if_fired()  # a hang report in progress decides the exit (EXIT_HANG)
        if world > 1 and is_peer_error(e):  # say who is gone or cut off, not only that a recv timed out
            line = unreachable_peers(hosts)
            if line:
                print(f"vit-train: {line}", file=sys.stderr, flush=True)
        if rank == 0:
            _status(layout, "failed", max(start, clock.completed))
        raise
    finally:
        startup.done()
        logger.close()
        stop_workers()
        if samples is not None:
            samples.close()
    result.update(resumed_from=start, seconds=time.time() - t0, run_dir=str(run_dir), checkpoint_dir=str(ckpt_dir),
                  wandb_dir=logger.wandb_dir, world_size=world, checkpoint_async=cfg.checkpoint.async_save,
                  checkpoint_blocked_seconds=checkpointer.blocked_s, checkpoint_waited_seconds=checkpointer.waited_s)
    if rank == 0:
        try:
            write_json(layout.summary, result, indent=1)
        except OSError as e:  # the checkpoint is saved (maybe in checkpoint.dir): report, do not fail
            print(f"vit-train: warning: cannot write {layout.summary} ({e.strerror or e}); "
                  f"final step {result['step']}", file=sys.stderr, flush=True)
        _status(layout, "interrupted" if result["preempted"] else "completed", result["step"])
        print(_goodbye(result), file=sys.stderr, flush=True)  # before the barrier: a launcher may kill us after it
    dist.barrier()
    return result


def _prediction(cfg, world: int):
    """``pretrain.perf.perfmodel.run_record`` for this job's GPUs (none on CPU)."""
    if not torch.cuda.is_available():
        return None
    from pretrain.perf.perfmodel import run_record

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))
    return run_record(cfg, world, per_node, torch.cuda.get_device_name())


def _hosts() -> list[str]:
    """Every rank's host name, in rank order (one all-gather at start-up)."""
    import socket

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _status(layout: RunDir, state: str, step: int) -> None:
    """How this invocation ended, for schedulers and ``vit-launch`` (best effort on failure)."""
    code = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(state, 1)
    try:
        write_json(layout.status, {"state": state, "step": step, "exit_code": code, "time": time.time()})
    except OSError:
        pass


def _goodbye(result: dict) -> str:
    """The one line saying how the run ended."""
    ckpt = checkpoint.latest_complete(result["checkpoint_dir"])
    if result["preempted"]:
        return (f"vit-train: stopped ({result['stop_reason']}) at step {result['step']}: checkpoint {ckpt}; run the "
                f"same command to resume (exit {EXIT_INTERRUPTED})")
    return (f"vit-train: done at step {result['step']}: checkpoint {ckpt}; export with: python -m pretrain.export "
            f"{result['run_dir']} OUT.safetensors")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="vit-train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    from data_pipeline.loading.loader import DataError

    with cli_errors("vit-train", DataError, NonFiniteLoss, CheckpointWriteError):
        cfg = load_config(args.config, args.overrides)
        code = EXIT_INTERRUPTED if run(cfg)["preempted"] else EXIT_OK
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
