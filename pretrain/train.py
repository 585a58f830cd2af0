"""Pre-training entry point.

    deepspeed [runner options] --module pretrain.train --config FILE [a.b=c ...]
    python -m pretrain.train --config FILE [a.b=c ...]          # one process

``run`` assembles the parts (each from its own package), ``train_loop`` is the loop. Every rank runs
the same code; only rank 0 writes metrics; a run resumes from the newest complete checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from data_pipeline.errors import DataError, exit_code
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.sample_log import SampleLog, logged_batches
from data_pipeline.loading.workers import stop_workers
from pretrain.checkpointing import checkpoint
from pretrain.checkpointing.checkpointer import Checkpointer, CheckpointWriteError
from pretrain.checkpointing.rundir import RunDir
from pretrain.config import (
    Config,
    ConfigError,
    check_world_size,
    cli_errors,
    image_size,
    load_config,
    save_config,
    to_dict,
)
from pretrain.distributed import ds_compat
from pretrain.distributed.engine import check_with_deepspeed, deepspeed_config, initialize
from pretrain.distributed.precision import check_precision, compute_dtype
from pretrain.distributed.process import all_hosts, init_distributed, launched, set_collective_timeout, set_cpu_threads
from pretrain.evaluation.in_training import InTrainingEval
from pretrain.models.arch import analytic_flops
from pretrain.models.losses import classification_loss
from pretrain.observability.clock import StepClock
from pretrain.observability.flops import train_flops_per_image
from pretrain.observability.metrics import MetricsLogger
from pretrain.observability.progress import StartupLines
from pretrain.observability.window import Window, window_metrics
from pretrain.perf.perfmodel import run_record
from pretrain.resilience import faults, watchdog
from pretrain.resilience.lifecycle import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    FailureRecord,
    RunStatus,
    StopRequest,
    say_goodbye,
)
from pretrain.resilience.nonfinite import NonFiniteGuard, NonFiniteLoss, scale_floor_as_error
from pretrain.resilience.straggler import StragglerDetector, gather_and_judge
from pretrain.resilience.watchdog import StartupGuard, Watchdog
from pretrain.step import train_step
from pretrain.weights.init_from import build_model, load_init_weights, num_params, set_masters

USER_ERRORS = (DataError, NonFiniteLoss, CheckpointWriteError)  # vit-train's one-line errors: exit 2


# ------------------------------------------------------------------------------------- builders
def check_machine(cfg: Config, world_size: int) -> int:
    """Before any expensive work: the precision on this device, the batch on this world size, and
    the DeepSpeed config these sections make (a refused combination is one line here)."""
    check_precision(cfg.train.precision)
    check_with_deepspeed(deepspeed_config(cfg.optim, cfg.train, cfg.zero, world_size, cfg.deepspeed))
    if cfg.model.init_from and not Path(cfg.model.init_from).exists():
        raise ConfigError(f"model.init_from={cfg.model.init_from}: not found")
    return check_world_size(cfg.train, world_size)


@dataclass
class Loop:
    """Everything ``train_loop`` works with, assembled by ``run``."""
    cfg: Config
    engine: object
    batches: Iterator
    loader: object
    logger: MetricsLogger
    checkpointer: Checkpointer
    clock: StepClock
    stop: StopRequest
    startup: StartupGuard
    start_step: int
    world: int
    flops: tuple[float, float]  # (model, hardware) training FLOPs per image
    detector: Optional[StragglerDetector] = None
    evaluator: Optional[InTrainingEval] = None
    say: Callable[[str], None] = lambda msg: None
    logged: Callable[[int], None] = lambda step: None  # after each log step (status.json)


# ----------------------------------------------------------------------------------------- loop
def train_loop(lp: Loop) -> dict:
    """Steps until ``train.steps`` or an agreed stop. Between sync points (log and checkpoint steps,
    every ``train.sync_every_steps``) nothing is read on the host."""
    t, engine, clock, device = lp.cfg.train, lp.engine, lp.clock, lp.engine.device
    guard = NonFiniteGuard(t.max_nonfinite_steps, engine.module.parameters(), device)
    loss_of = partial(classification_loss, multi_label=lp.cfg.data.multi_label, smoothing=lp.cfg.optim.label_smoothing)
    dtype, window = compute_dtype(t.precision), Window(device)
    history, step, stopped = [], lp.start_step, False
    while step < t.steps:
        clock.begin_step(step + 1, startup=step == lp.start_step)
        with scale_floor_as_error(step + 1):  # fp16's loss scaler at its floor: one line, not a traceback
            window.add(*train_step(engine, lp.batches, guard, clock, step + 1, loss_of, dtype))
        clock.end_step()
        step += 1
        if step == lp.start_step + 1:  # start-up is over: step-time bounds from here on
            lp.startup.done()
            set_collective_timeout(t.pg_timeout_s)
            lp.say(f"step {step} done; a line every {t.log_every_steps} steps")
        sync = (step % t.log_every_steps == 0 or lp.checkpointer.due(step) or step % t.sync_every_steps == 0)
        if sync:  # before the log and any checkpoint of these steps
            guard.verdict()

        clock.beat("log")
        if step % t.log_every_steps == 0 or step == t.steps:
            metrics, phases = window_metrics(engine, window, clock, step=step, world=lp.world, flops=lp.flops,
                                             global_batch=t.global_batch_size, nonfinite_skipped=guard.total,
                                             loader=lp.loader)
            straggling, line = gather_and_judge(lp.detector, phases, device)
            lp.logger.log(step, {**metrics, **straggling})
            lp.logger.print(step, metrics)
            lp.logged(step)
            if line:
                lp.say(f"straggler: {line}")
            history.append(metrics["loss"])
            window = Window(device)

        if lp.evaluator is not None and lp.evaluator.due(step, t.steps):  # own data and RNG, not in img/s
            clock.beat("eval", slow=True)
            results = lp.evaluator(engine, step)
            lp.logger.log(step, results)
            clock.exclude(lp.evaluator.last_seconds)
            lp.say(f"eval at step {step}: " + " ".join(f"{k[5:]}={v:.4g}" for k, v in results.items()))

        clock.beat("stop")
        stopped = sync and lp.stop.agreed(device)  # a signal stops every rank within train.sync_every_steps
        clock.beat("checkpoint", slow=True)
        lp.checkpointer.maybe_save(step, stopping=stopped, sync=sync)
        if stopped:
            break
    clock.beat("end", slow=True)
    lp.checkpointer.close()
    lp.startup.done()  # a run resumed at its last step takes no step
    guard.close()
    return {"step": step, "losses": history, "nonfinite_skipped": guard.total, "preempted": stopped,
            "stop_reason": lp.stop.reason}


# ----------------------------------------------------------------------------------------- main
def run(cfg: Config) -> dict:
    """One rank's whole run; a failure anywhere in it, start-up included, leaves the rank's record
    in ``<output_dir>/errors/`` (``FailureRecord``: what ``vit-launch run`` tells a failed rank from
    a dead node by)."""
    with FailureRecord(RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir).errors) as record:
        return _run(cfg, record)


def _run(cfg: Config, record: FailureRecord) -> dict:
    stop = StopRequest(watch_launcher=launched())  # first: a signal during start-up is kept, not fatal
    t = cfg.train
    startup = StartupGuard(t.startup_timeout_s)  # until the first step is done
    startup.phase("process group and DeepSpeed's communication set-up")
    build_lock = ds_compat.report_build_lock_wait()  # DeepSpeed's CPU shm op may be JIT-built here
    rank, local_rank, world = init_distributed(max(t.pg_timeout_s, t.startup_timeout_s))
    build_lock.cancel()
    hosts = record.hosts = all_hosts()  # lines and records about ranks name their hosts
    if rank == 0:
        ds_compat.check_version()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), cfg.data.workers)
    check_machine(cfg, world)
    layout = RunDir.of(t.output_dir, cfg.checkpoint.dir)
    run_dir, ckpt_dir = layout.root, layout.checkpoints
    if rank == 0:  # vit-launch's way to stop a multi-node job without signalling its runner
        stop.watch_file(layout.stop_request)
    # before any expensive work: an unwritable folder would otherwise fail at the first save
    checkpoint.check_writable(run_dir, "train.output_dir")
    if cfg.checkpoint.dir:
        checkpoint.check_writable(ckpt_dir, "checkpoint.dir")
    if cfg.checkpoint.resume:  # a changed shape key, said before the model build and DeepSpeed init
        checkpoint.check_resumable(ckpt_dir, to_dict(cfg))
    say = StartupLines(rank)
    watchdog.clear(layout.hang, rank)
    dog = Watchdog(layout.hang, rank, world, t.hang_timeout_s, startup_s=t.startup_timeout_s)
    dog.hosts = hosts
    img = image_size(cfg.model)

    say(f"building {cfg.model.name} ({img} px) on {world} rank(s)")
    startup.phase("model build")
    torch.manual_seed(t.seed)  # anything drawn before the per-rank streams below is the same on every rank
    model = build_model(cfg)
    resuming = cfg.checkpoint.resume and checkpoint.latest_complete(ckpt_dir) is not None
    masters = load_init_weights(model, cfg, say) if cfg.model.init_from and not resuming else {}
    say(f"DeepSpeed init: ZeRO-{cfg.zero.stage}, {t.precision}, {num_params(model) / 1e6:.1f}M parameters")
    startup.phase("DeepSpeed initialize")
    engine, ds_cfg = initialize(model, cfg.optim, t, cfg.zero, world, cfg.deepspeed)
    set_masters(engine, masters)  # a 16-bit module: the init_from file's fp32 bits, not the rounded module's
    loader = build_loader(cfg.data, rank=rank, world_size=world, batch_size=t.micro_batch_size,
                          seed=t.seed, img_size=img, train=True, device=engine.device)
    say(f"data workers decode: {loader.worker_decoder}")
    if loader.num_classes != cfg.model.num_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the shards have "
                          f"{loader.num_classes} classes; set model.num_classes={loader.num_classes}")

    if resuming:
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
                               dtype=compute_dtype(t.precision), device=engine.device)
    status = RunStatus(layout.status if rank == 0 else None)
    status(start)
    clock = StepClock(engine.device, dog)
    if cfg.zero.stage == 3:  # the forward's waits for parameters are not the rank's own work
        ds_compat.around_zero3_fetch(engine.module, clock.gather_begin, clock.gather_end)
    if clock.times_waits:  # backward's and step's waits for peers are not the rank's own work either
        ds_compat.time_collectives(clock.comm_begin, clock.comm_end, engine)
    lp = Loop(cfg, engine, faults.wrap_batches(logged_batches(loader, samples, start, gas), rank=rank, start_step=start,
                                               accumulation=gas),
              loader, logger, Checkpointer(cfg, engine, loader, ckpt_dir, {"config": to_dict(cfg)}, logger, samples),
              clock, stop, startup, start_step=start, world=world, flops=flops,
              detector=StragglerDetector(hosts, t.straggler_factor, t.straggler_windows,
                                         record=layout.stragglers if rank == 0 else None,
                                         span_s=t.straggler_span_s, waits_timed=clock.times_waits)
              if world > 1 else None,
              evaluator=evaluator if evaluator.enabled else None, say=say, logged=status)
    lp.clock.begin_step(start, startup=True)
    say(f"waiting for the first batch (data.workers={cfg.data.workers})")
    startup.phase("first step (first batch, first collectives)")
    t0 = time.time()
    failed = False
    try:
        result = train_loop(lp)
    except BaseException as e:
        failed = True
        dog.hold_if_fired()  # a hang report in progress decides the exit (EXIT_HANG)
        lost = record.report(e)  # who is gone, not gloo's words; now, while the other ranks ask too
        status(max(start, lp.clock.completed), "failed", exit_code(e, *USER_ERRORS))  # 2 user, 69 store, 1
        if lost:
            raise SystemExit(1) from None
        raise
    finally:
        startup.done()
        logger.close()
        stop_workers()
        if samples is not None:  # after a failure the lines since the last checkpoint are not history: a
            samples.close(flush=not failed)  # resume cuts them, and a rank cut off may end after it
    result.update(resumed_from=start, seconds=time.time() - t0, run_dir=str(run_dir), checkpoint_dir=str(ckpt_dir),
                  wandb_dir=logger.wandb_dir, world_size=world, checkpoint_async=cfg.checkpoint.async_save,
                  checkpoint_blocked_seconds=lp.checkpointer.blocked_s,
                  checkpoint_waited_seconds=lp.checkpointer.waited_s)
    if rank == 0:  # before the barrier: a launcher may kill us after it
        say_goodbye(result, layout.summary, status, checkpoint.latest_complete(result["checkpoint_dir"]))
    dist.barrier()
    return result


def _prediction(cfg, world: int):
    """The performance model's record for this job's GPUs (none on CPU)."""
    if not torch.cuda.is_available():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))
    return run_record(cfg, world, per_node, torch.cuda.get_device_name())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="vit-train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    with cli_errors("vit-train", *USER_ERRORS):
        cfg = load_config(args.config, args.overrides)
        code = EXIT_INTERRUPTED if run(cfg)["preempted"] else EXIT_OK
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
