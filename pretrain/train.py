"""Pre-training entry point.

    deepspeed [runner options] --module pretrain.train --config FILE [a.b=c ...]
    python -m pretrain.train --config FILE [a.b=c ...]          # one process

``run`` starts the rank in its phases (``pretrain/startup.py``: connect, build the engine, restore,
assemble), ``train_loop`` is the loop. Every rank runs the same code; only rank 0 writes metrics; a
run resumes from the newest complete checkpoint.
"""
from __future__ import annotations

import gc

if __name__ == "__main__":  # the program (-m pretrain.train, the deepspeed runner's --module)
    gc.disable()  # while importing; main() turns it back on (pretrain/perf/collector.py)

import argparse
import time
from functools import partial
from typing import Optional

import torch.distributed as dist

from data_pipeline.errors import DataError, Parser, path_arg
from data_pipeline.loading.workers import stop_workers
from pretrain.checkpointing import checkpoint
from pretrain.checkpointing.checkpointer import CheckpointWriteError
from pretrain.checkpointing.rundir import RunDir, step_of
from pretrain.config import Config, cli_errors, load_config
from pretrain.config.phases import window_ends
from pretrain.distributed.precision import compute_dtype
from pretrain.distributed.process import any_rank, process_group_ends, program, set_collective_timeout
from pretrain.evaluation.target import reached_words
from pretrain.models.losses import classification_loss
from pretrain.observability.window import Window, window_metrics
from pretrain.perf.collector import after_imports
from pretrain.resilience.lifecycle import EXIT_INTERRUPTED, EXIT_OK, FailureRecord, resume_command, say_goodbye
from pretrain.resilience.nonfinite import NonFiniteGuard, NonFiniteLoss, scale_floor_as_error
from pretrain.resilience.straggler import gather_and_judge
from pretrain.startup import Connected, Job, Loop, assemble, build_engine, connect, restore
from pretrain.step import train_step

USER_ERRORS = (DataError, NonFiniteLoss, CheckpointWriteError)  # vit-train's one-line errors: exit 2


# ----------------------------------------------------------------------------------------- loop
def evaluate(lp: Loop, step: int) -> bool:
    """The evaluation of ``step`` when one is due: its own data and RNG, its time not in img/s.
    True, on every rank, when the run ends here: it reached its target (``validation.stop_at_target``)."""
    if lp.evaluator is None or not lp.evaluator.due(step, lp.cfg.train.steps):
        return False
    lp.clock.beat("eval", slow=True)
    results = lp.evaluator(lp.engine, step)
    totals = lp.totals.record()
    # with the cost so far in its own record: W&B draws eval/* against it even off the log steps
    hours = {} if totals["device_seconds"] is None else {"device_hours": totals["device_seconds"] / 3600}
    lp.logger.log(step, {**results, **hours})
    lp.clock.exclude(lp.evaluator.last_seconds)
    lp.say(f"eval at step {step}: " + " ".join(f"{k[5:]}={v:.4g}" for k, v in results.items()))
    if lp.target is None:
        return False
    reached = lp.target.check(results, step, totals)  # the metrics are rank 0's: it alone records
    if reached is not None:
        lp.totals.target_reached = reached
        lp.logger.summarize({f"target/{k}": v for k, v in reached.items()})  # a column of the W&B runs table
        lp.say(f"target reached: {reached_words(reached)}"
               + ("; the run ends here (validation.stop_at_target)" if lp.target.stop else ""))
    return lp.target.stop and any_rank(reached is not None, lp.engine.device)


def train_loop(lp: Loop) -> dict:
    """Steps until ``train.steps`` or an agreed stop. Between sync points (log and checkpoint steps,
    every ``train.sync_every_steps``) nothing is read on the host."""
    t, engine, clock, device = lp.cfg.train, lp.engine, lp.clock, lp.engine.device
    guard = NonFiniteGuard(t.max_nonfinite_steps, engine.module.parameters(), device)
    o = lp.cfg.optim
    loss_of = partial(classification_loss, multi_label=lp.cfg.data.multi_label, smoothing=o.label_smoothing,
                      loss=o.loss, target_threshold=o.bce_target_threshold)
    dtype, window = compute_dtype(t.precision), Window(device)
    history, step, stopped, at_target = [], lp.start_step, False, False
    prof, window_first = lp.profiler, step + 1
    while step < t.steps and not ended_at_target(lp):
        phase = lp.phases(step + 1)  # its first step: the engine takes its micro batch, the loader its size
        if prof is not None:  # logging.profile: its own seconds are not the window's
            clock.exclude(prof.before(step + 1))
        cold = step == lp.start_step or step + 1 == phase.first  # a start's or a new shape's first step
        clock.begin_step(step + 1, startup=cold)
        # this step's LR, the largest group's (optim.layer_decay scales the lower layers' down): read
        # before engine.step(), which moves the schedule on to the next step's
        lr = max(engine.get_lr())
        with scale_floor_as_error(step + 1):  # fp16's loss scaler at its floor: one line, not a traceback
            window.add(*train_step(engine, lp.batches, guard, clock, step + 1, loss_of, dtype, lp.ema),
                       lp.flops[phase.img_size], phase.img_size, lr=lr, cold=cold)
        lp.totals.add(t.global_batch_size, lp.flops[phase.img_size][0])
        clock.end_step()
        step += 1
        if prof is not None:
            clock.exclude(prof.after(step))
        if step == lp.start_step + 1:  # start-up is over: step-time bounds from here on
            lp.startup.done()
            set_collective_timeout(t.pg_timeout_s)
            lp.say(f"step {step} done; a line every {t.log_every_steps} steps")
            lp.forecast.start(step)
        elif step == phase.first:  # a new shape's first step (its loader restart, its compile): not its pace
            lp.forecast.start(step)
        ends = step == phase.last  # a window holds one resolution phase's steps
        sync = (step % t.log_every_steps == 0 or lp.checkpointer.due(step) or step % t.sync_every_steps == 0
                or (ends and step < t.steps))
        if sync:  # before the log and any checkpoint of these steps
            guard.verdict()

        clock.beat("log")
        if window_ends(step, phase, t.log_every_steps):
            history.append(log_window(lp, window, window_first, step, guard.total))
            window, window_first = Window(device), step + 1

        at_target = evaluate(lp, step)
        if at_target and not sync:  # the save below makes this step a sync point
            guard.verdict()
            sync = True
        clock.beat("stop")
        # a signal stops every rank within train.sync_every_steps
        stopped = at_target or (sync and lp.stop.agreed(device))
        if stopped and window.steps:  # the steps since the last log step: their window too, before the save
            clock.beat("log")
            history.append(log_window(lp, window, window_first, step, guard.total, ends=at_target))
        clock.beat("checkpoint", slow=True)
        # the seconds a save held this thread are not the next window's img/s (as an evaluation's; Megatron's too)
        clock.exclude(lp.checkpointer.maybe_save(step, stopping=stopped, sync=sync))
        if stopped:
            break
    clock.beat("end", slow=True)
    if prof is not None:  # stopped with logging.profile's steps still ahead: what was recorded
        prof.close(step)
    lp.checkpointer.close()
    lp.startup.done()  # a run resumed at its last step takes no step
    guard.close()
    # a stop seen at the last step's sync point ends a finished run: every step trained and saved
    preempted = stopped and not at_target and step < t.steps
    return {"step": step, "losses": history, "nonfinite_skipped": guard.total, "preempted": preempted,
            "stop_reason": lp.stop.reason, "target": lp.target.words if lp.target else None}


def log_window(lp: Loop, window: Window, first: int, step: int, nonfinite_skipped: int,
               ends: bool = False) -> Optional[float]:
    """Steps ``first..step`` (``window``) into the metrics, the progress line and status.json, with
    the straggler verdict; returns the window's loss. ``ends``: the run ends at ``step`` (it reached
    its target), so the line forecasts no time left. Collective: every rank calls it at the same
    step, a sync point."""
    prof = lp.profiler
    metrics, phases = window_metrics(lp.engine, window, lp.clock, world=lp.world, totals=lp.totals.record(),
                                     nonfinite_skipped=nonfinite_skipped, loader=lp.loader)
    profiled = prof.window_steps(first, step) if prof is not None else 0
    if profiled:  # slowed by the profiler (on the ranks that record): not evidence of a straggler
        metrics.update(profiled_steps=profiled, **prof.metrics())
    straggling, line = gather_and_judge(None if profiled else lp.detector, phases, lp.engine.device)
    lp.logger.log(step, {**metrics, **straggling})
    note = "" if ends else lp.forecast.note(step, metrics.get("device_hours"), lp.world)
    lp.logger.print(step, metrics, lp.cfg.train.steps, note)
    lp.logged(step)
    if line:
        lp.say(f"straggler: {line}")
    return metrics["loss"]


def ended_at_target(lp: Loop) -> bool:
    """The run reached its target and ends there (``validation.stop_at_target``): a checkpoint of
    it started again trains nothing."""
    return lp.target is not None and lp.target.stop and lp.target.reached is not None


# ----------------------------------------------------------------------------------------- main
def run(cfg: Config, record: Optional[FailureRecord] = None) -> dict:
    """One rank's whole run; a failure anywhere in it, start-up included, leaves the rank's record
    in ``<output_dir>/errors/`` (``FailureRecord``: what ``vit-launch run`` tells a failed rank from
    a dead node by, and which rank of a job says a mistake)."""
    record = record or FailureRecord(user_errors=USER_ERRORS)
    record.errors_dir = RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir).errors
    with record:
        return _run(cfg, record)


def _run(cfg: Config, record: FailureRecord) -> dict:
    c = connect(cfg, record)
    cfg = c.cfg  # its `auto` levers decided
    try:  # minutes on a large job (DeepSpeed's set-up, a checkpoint's load): a failure in them is spent too
        b = build_engine(cfg, c)
        job = assemble(cfg, c, b, restore(cfg, c, b))
    except BaseException as e:
        newest = checkpoint.latest_complete(c.layout.checkpoints) if cfg.checkpoint.resume else None
        _failed(c, record, e, step=step_of(newest) if newest else 0)
        raise
    result = _train(cfg, c, job, record)
    if c.rank == 0:  # before the barrier: a launcher may kill us after it
        say_goodbye(result, c.layout.summary, job.status, checkpoint.latest_complete(result["checkpoint_dir"]),
                    resume_command(cfg.checkpoint.resume))
    dist.barrier()
    return result


def _train(cfg: Config, c: Connected, job: Job, record: FailureRecord) -> dict:
    """The loop from its first step, then what the run did; a failure is recorded (status, the
    rank's record) and whatever the start-up opened is closed either way."""
    lp, start = job.loop, job.loop.start_step
    lp.clock.begin_step(start, startup=True)
    if start >= cfg.train.steps:  # a finished run started again, or train.steps lowered: no batch is read
        c.say(f"the checkpoint is at step {start}, train.steps={cfg.train.steps}: no step left to train")
    elif ended_at_target(lp):
        c.say(f"the run reached its target at step {lp.target.reached['step']} (validation.stop_at_target): "
              "no step left to train")
    else:
        c.say(f"waiting for the first batch (data.workers={cfg.data.workers})")
    c.startup.phase("first step (first batch, first collectives)")
    t0 = time.time()
    failed = False
    try:
        result = train_loop(lp)
    except BaseException as e:
        failed = True
        _failed(c, record, e, step=max(start, lp.clock.completed))
        raise
    finally:
        c.startup.done()
        lp.logger.close()
        stop_workers()
        if job.samples is not None:  # after a failure the lines since the last checkpoint are not history:
            job.samples.close(flush=not failed)  # a resume cuts them, and a rank cut off may end after it
    result.update(resumed_from=start, seconds=time.time() - t0, run_dir=str(c.layout.root),
                  checkpoint_dir=str(c.layout.checkpoints), wandb_dir=lp.logger.wandb_dir, world_size=c.world,
                  checkpoint_async=cfg.checkpoint.async_save, checkpoint_blocked_seconds=lp.checkpointer.blocked_s,
                  checkpoint_waited_seconds=lp.checkpointer.waited_s,
                  # what led to the newest checkpoint, as its run.json and an export of it say (an
                  # invocation that saved none trained no step: the checkpoint it resumed is the run's
                  # last); and what the run spent, what no checkpoint kept included
                  **(lp.checkpointer.saved_totals or lp.totals.record(own=result["step"] > start)),
                  device_seconds_spent=round(lp.totals.spent(), 3))
    return result


def _failed(c: Connected, record: FailureRecord, err: BaseException, step: int) -> None:
    """This rank fails with ``err`` at ``step`` (in start-up: the checkpoint's it would resume): its
    record now, while the others ask too; status.json says it, with the code the rank ends with and
    what the run spent; a peer's failure, or who is gone, ends the rank with its code, not gloo's
    words and a traceback."""
    c.dog.hold_if_fired()  # a hang report in progress decides the exit (EXIT_HANG)
    peers = record.report(err)
    c.status(step, "failed", record.code_of(err) if peers is None else peers)
    if peers is not None:
        raise SystemExit(peers) from None


def main(argv=None) -> None:
    ap = Parser(prog="vit-train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=path_arg, help="YAML experiment file")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    after_imports()
    record = FailureRecord(user_errors=USER_ERRORS)  # its folder once the config is read
    with process_group_ends(), cli_errors("vit-train", *USER_ERRORS, voice=record.voice):  # one line per job
        cfg = load_config(args.config, args.overrides)
        code = EXIT_INTERRUPTED if run(cfg, record)["preempted"] else EXIT_OK
    raise SystemExit(code)


def command() -> None:
    """``vit-train`` and ``-m pretrain.train``: ``main`` as the whole process, which ends with the
    run's code and without the interpreter's finalization (``process.program``)."""
    program(main)


if __name__ == "__main__":
    command()
