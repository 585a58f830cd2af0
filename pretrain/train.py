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
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_pipeline.files import write_json
from data_pipeline.sample_log import SampleLog
from data_pipeline.workers import stop_workers
from pretrain import checkpoint, faults, watchdog
from pretrain.config import (Config, ConfigError, cli_errors, check_world_size, image_size, load_config,
                             save_config, to_dict)
from pretrain.distributed import init_distributed, launched
from pretrain.engine import deepspeed_config, initialize
from pretrain.evaluator import InTrainingEval
from pretrain.flops import analytic_flops, peak_tflops, train_flops_per_image
from pretrain.lifecycle import EXIT_INTERRUPTED, EXIT_OK, StopRequest
from pretrain.metrics import MetricsLogger, StepTimer, peak_memory_gb, throughput
from pretrain.model import create_model
from pretrain.precision import check_precision, compute_dtype
from pretrain.rundir import RunDir
from pretrain.watchdog import Watchdog


class NonFiniteLoss(RuntimeError):
    pass


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (one line: the folder, why, the last good checkpoint)."""


class NonFiniteGuard:
    """Drops micro-batches whose loss is non-finite on any rank, with no host sync inside a step;
    K in a row stop the run, naming the steps.

    Each micro-batch's finite flag is all-reduced (MIN) on the device, so every rank drops the same
    micro-batches, and gates every parameter's gradient in a hook that runs before the gradient is
    accumulated: ``torch.where(ok, grad, 0)`` *selects*, so NaN / inf gradients become exact zeros
    (``grad * 0`` would stay NaN, and zeroing the loss is not enough: the backward through NaN
    activations is NaN whatever the upstream gradient). Every rank still runs the backward and
    the step, so ZeRO's collectives and DeepSpeed's accumulation counter stay in step; the dropped
    micro-batch adds nothing to its step's gradient and the step counts. The flags wait on the
    device and are read at the next sync point (``verdict``, one ``tolist``).

    Costs: one elementwise select per gradient per micro-batch (memory-bound, far below the
    step's matmuls). A step whose micro-batches were all dropped still steps the optimizer with
    zero gradients (AdamW's momentum and weight decay move the weights slightly: no NaN reaches
    them), and a streak of K stops the run at the next sync point, up to
    ``train.sync_every_steps`` steps later, before any checkpoint of those steps is written.
    """

    def __init__(self, limit: int, params=(), device="cpu"):
        self.limit, self.in_a_row, self.total, self.first_step = limit, 0, 0, None
        self.ok = torch.ones((), dtype=torch.bool, device=device)  # the current micro-batch's gate
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, flag) not yet read
        self._hooks = [p.register_hook(self._gate) for p in params if p.requires_grad]

    def _gate(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(self.ok, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

    def agree(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """This micro-batch's verdict on every rank, as a device bool (a collective, no sync)."""
        finite = torch.isfinite(loss.detach()).float()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        ok = finite.bool()
        self.ok.copy_(ok)
        self.pending.append((step, ok))
        return ok

    def verdict(self) -> None:
        """Read the pending flags (a sync point): count them; K in a row raise NonFiniteLoss."""
        if not self.pending:
            return
        flags = torch.stack([f for _, f in self.pending]).tolist()
        steps = [s for s, _ in self.pending]
        self.pending.clear()
        for finite, step in zip(flags, steps):
            self.check(finite, step)

    def check(self, finite: bool, step: int) -> bool:
        if finite:
            self.in_a_row, self.first_step = 0, None
            return True
        self.total += 1
        self.in_a_row += 1
        self.first_step = step if self.first_step is None else self.first_step
        if self.in_a_row >= self.limit:
            raise NonFiniteLoss(f"{self.in_a_row} non-finite losses in a row at steps "
                                f"{self.first_step}-{step}; lower optim.lr or check the data")
        return False

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


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
    check_precision(cfg.train.precision)
    return check_world_size(cfg.train, world_size)


def build_model(cfg: Config) -> torch.nn.Module:
    """The configured model. Under ZeRO-3 it is built inside ``deepspeed.zero.Init``: each layer's
    parameters are partitioned over the ranks as soon as that layer exists, so no rank ever holds
    the whole fp32 model (a rank's peak is one layer plus its 1/N share). The initialisation then
    runs module by module under ``GatheredParameters(modifier_rank=0)``: on partitioned
    parameters it would otherwise change nothing. Same seed, same weights as the plain build."""
    m = cfg.model
    kw = dict(num_classes=m.num_classes, img_size=m.img_size, drop_rate=m.drop_rate,
              drop_path_rate=m.drop_path_rate, representation_size=m.representation_size,
              global_pool=m.global_pool, qk_norm=m.qk_norm, init_values=m.init_values)
    if cfg.zero.stage != 3:
        return create_model(m.name, **kw)
    import deepspeed

    world = dist.get_world_size() if dist.is_initialized() else 1
    ds_cfg = deepspeed_config(cfg.optim, cfg.train, cfg.zero, world)  # its dtype (bf16 / fp32) for the shards
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = create_model(m.name, defer_init=True, **kw)
    # every rank draws the same numbers (same seed, same order); rank 0's are broadcast
    model.init_weights(gather=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0))
    return model


def num_params(model: torch.nn.Module) -> int:
    """Parameter count, also of a ZeRO-3 partitioned model (whose tensors are empty placeholders)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, multi_label: bool, smoothing: float) -> torch.Tensor:
    logits = logits.float()
    if multi_label:  # sigmoid cross-entropy over classes (ImageNet-21k / JFT)
        return F.binary_cross_entropy_with_logits(logits, targets.float(), reduction="sum") / logits.shape[0]
    return F.cross_entropy(logits, targets, label_smoothing=smoothing)  # soft targets (mixup) too


def set_cpu_threads(local_world: int, data_workers: int) -> None:
    """On CPU, ranks (and their data workers) share the cores: oversubscribed, a rank ran 7x
    slower here (13 vs 91 img/s, 2 cores). One core per node is left to the data workers."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        per_rank = (os.cpu_count() or 1) // max(1, local_world) - (1 if data_workers > 0 else 0)
        torch.set_num_threads(max(1, per_rank))


# ----------------------------------------------------------------------------------------- loop
def train_loop(cfg: Config, engine, loader, logger: MetricsLogger, *, start_step: int, rank: int,
               world: int, ckpt_dir: Path, run_info: dict, flops: tuple[float, float],
               stop: StopRequest, dog: Watchdog, samples: Optional[SampleLog],
               evaluator: Optional[InTrainingEval] = None, say: Callable[[str], None] = lambda msg: None) -> dict:
    t, device = cfg.train, engine.device
    dtype = compute_dtype(t.precision)
    guard, timer = NonFiniteGuard(t.max_nonfinite_steps, engine.module.parameters(), device), StepTimer()
    batches = iter(loader)
    loss_sum = torch.zeros(2, device=device)  # (sum of losses, count) since the last log
    peak, history, step, stopped = peak_tflops(), [], start_step, False
    nan_faults = faults.fault_steps("nan_loss")  # test hook, empty in real runs

    def save(at: int) -> None:
        dog.beat(at, "checkpoint", slow=True)
        if samples is not None:
            samples.flush()
        try:
            checkpoint.save(engine, ckpt_dir, at, rank_state={"loader": loader.state_dict()},
                            run_info={**run_info, "wandb_run_id": logger.run_id}, keep_last=cfg.checkpoint.keep_last)
        except OSError as e:  # folder made read-only, disk full: say what survives, not a traceback
            last = checkpoint.latest_complete(ckpt_dir)
            kept = f"the last complete checkpoint is {last}" if last else "no complete checkpoint yet"
            raise CheckpointWriteError(f"cannot save checkpoint {checkpoint.tag_for(at)} in {ckpt_dir} "
                                       f"({e.strerror or e}); {kept}; make the folder writable (or set "
                                       "checkpoint.dir) and run the same command to resume") from None

    def sync_due(at: int) -> bool:
        """The steps where the loop reads the device (a sync point): log and checkpoint steps, the
        last step, and every ``train.sync_every_steps``; between them the host runs ahead."""
        return (at % t.log_every_steps == 0 or at % cfg.checkpoint.every_steps == 0 or at == t.steps
                or at % t.sync_every_steps == 0)

    while step < t.steps:
        # --- one optimizer step: micro-batches until DeepSpeed reaches the accumulation boundary
        first = step == start_step  # start-up, first collectives and JIT builds get a longer allowance
        done = False
        while not done:
            dog.beat(step + 1, "data", slow=first)
            t0 = time.perf_counter()
            images, targets = next(batches)
            timer.add_data_wait(time.perf_counter() - t0)
            if samples is not None:  # data.record_samples
                samples.write(step + 1, loader.last_epoch, loader.last_keys)
            dog.beat(step + 1, "forward", slow=first)
            faults.hang_in_step(step + 1, rank)  # test hooks
            faults.crash_in_step(step + 1, rank, start_step)
            images = images.to(device, dtype, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = loss_fn(engine(images), targets, cfg.data.multi_label, cfg.optim.label_smoothing)
            if step + 1 in nan_faults:
                nan_faults.remove(step + 1)
                loss = loss * float("nan")
            # every rank drops a non-finite micro-batch (zero gradients, on the device; no sync)
            dog.beat(step + 1, "agree", slow=first)
            ok = guard.agree(loss, step + 1)
            dog.beat(step + 1, "backward", slow=first)
            done = engine.is_gradient_accumulation_boundary()
            engine.backward(loss)
            engine.step()
            loss_sum += torch.stack([torch.where(ok, loss.detach(), 0.0), ok.float()])
            timer.images += images.shape[0] * world
        step += 1
        sync = sync_due(step)
        if sync:  # before the log and any checkpoint of these steps
            guard.verdict()

        # --- log
        dog.beat(step, "log")
        if step % t.log_every_steps == 0 or step == t.steps:
            dist.all_reduce(loss_sum)
            elapsed, wait_share = timer.window()
            gn = engine.get_global_grad_norm()
            total, count = loss_sum.tolist()
            metrics = {"loss": total / count if count else None, "lr": engine.get_lr()[0],
                       "grad_norm": float(gn) if gn is not None else None,
                       "examples_seen": step * t.global_batch_size, "data_wait_share": wait_share,
                       "peak_memory_gb": peak_memory_gb(), "nonfinite_skipped": guard.total,
                       **throughput(timer.images, elapsed, world, *flops, peak),
                       **{f"data/{k}": v for k, v in _sum_counters(loader.counters).items()}}
            logger.log(step, metrics)
            logger.print(step, metrics)
            history.append(metrics["loss"])
            loss_sum.zero_()
            timer.reset()
        if step == start_step + 1:
            say(f"step {step} done; a line every {t.log_every_steps} steps")

        # --- evaluate (eval.every_steps): its own data and RNG; its time is left out of throughput
        if evaluator is not None and evaluator.due(step, t.steps):
            dog.beat(step, "eval", slow=True)
            results = evaluator(engine, step)
            logger.log(step, results)
            timer.exclude(evaluator.last_seconds)
            say(f"eval at step {step}: " + " ".join(f"{k[5:]}={v:.4g}" for k, v in results.items()))

        # --- checkpoint (periodic, final, or when asked to stop: SIGTERM, SIGINT, launcher gone)
        dog.beat(step, "stop")
        stopped = sync and stop.agreed(device)  # a signal stops every rank within train.sync_every_steps
        if step % cfg.checkpoint.every_steps == 0 or step == t.steps or stopped:
            save(step)
        if stopped:
            break
    dog.beat(step, "end", slow=True)
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
    from data_pipeline.loader import build_loader

    stop = StopRequest(watch_launcher=launched())  # first: a signal during start-up is kept, not fatal
    rank, local_rank, world = init_distributed(cfg.train.pg_timeout_s)
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), cfg.data.workers)
    check_machine(cfg, world)
    layout = RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir)
    run_dir, ckpt_dir = layout.root, layout.checkpoints
    # before any expensive work: an unwritable folder would otherwise fail at the first save
    checkpoint.check_writable(run_dir, "train.output_dir")
    if cfg.checkpoint.dir:
        checkpoint.check_writable(ckpt_dir, "checkpoint.dir")
    say = Progress(rank)
    watchdog.clear(layout.hang, rank)
    dog = Watchdog(layout.hang, rank, world, cfg.train.hang_timeout_s)
    img = image_size(cfg.model)

    torch.manual_seed(cfg.train.seed)  # same on every rank: identical initial weights (ZeRO-3 too)
    say(f"building {cfg.model.name} ({img} px) on {world} rank(s)")
    model = build_model(cfg)
    say(f"DeepSpeed init: ZeRO-{cfg.zero.stage}, {cfg.train.precision}, "
        f"{num_params(model) / 1e6:.1f}M parameters")
    engine, ds_cfg = initialize(model, cfg.optim, cfg.train, cfg.zero, world)
    loader = build_loader(cfg.data, rank=rank, world_size=world, batch_size=cfg.train.micro_batch_size,
                          seed=cfg.train.seed, img_size=img, train=True)
    if loader.num_classes != cfg.model.num_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the shards have "
                          f"{loader.num_classes} classes; set model.num_classes={loader.num_classes}")

    if cfg.checkpoint.resume and checkpoint.latest_complete(ckpt_dir) is not None:
        say(f"resuming: verifying and loading the newest checkpoint in {ckpt_dir}")
    resumed = checkpoint.resume(engine, ckpt_dir, config=to_dict(cfg)) if cfg.checkpoint.resume else None
    start, run_id = 0, None
    if resumed:
        info, states = resumed
        start, run_id = info["step"], info.get("wandb_run_id")
        loader.load_state_dicts([st["loader"] for st in states])  # same layout: this rank's, bit-exact
    else:
        torch.manual_seed(cfg.train.seed + 1000 * (rank + 1))  # per-rank dropout / drop-path streams

    fwd = analytic_flops(cfg.model.name, img, cfg.model.num_classes, cfg.model.global_pool,
                         cfg.model.representation_size, qk_norm=cfg.model.qk_norm, breakdown=True)
    flops = train_flops_per_image(fwd["total"], fwd["blocks"] if cfg.train.activation_checkpointing else 0)
    run_config = {**to_dict(cfg), "world_size": world, "zero_stage": cfg.zero.stage,
                  "global_batch_size": cfg.train.global_batch_size, "model_gflops_fwd": fwd["total"] / 1e9,
                  "train_flops_per_image": flops[0], "gradient_accumulation": ds_cfg["gradient_accumulation_steps"]}
    if cfg.logging.wandb.mode == "online":
        say(f"starting W&B online (offline after logging.wandb.init_timeout_s={cfg.logging.wandb.init_timeout_s:g})")
    logger = MetricsLogger(cfg.logging, run_dir, rank=rank, run_config=run_config, run_id=run_id)
    if rank == 0:
        save_config(cfg, layout.config)
        where = f"resuming from step {start}" if resumed else "starting from scratch"
        print(f"vit-train: {cfg.model.name} on {world} rank(s), ZeRO-{cfg.zero.stage}, {cfg.train.precision}, "
              f"{where}; run dir {run_dir}", file=sys.stderr, flush=True)
    samples = SampleLog(layout.samples, rank).open(start) if cfg.data.record_samples else None
    if samples is not None and rank == 0:  # after an elastic resume onto fewer ranks, the old ranks'
        for r in range(world, len(resumed[1]) if resumed else 0):  # logs are cut back to the step too
            SampleLog(layout.samples, r).open(start).close()
    evaluator = InTrainingEval(cfg, rank=rank, world=world, img_size=img, num_classes=cfg.model.num_classes,
                               dtype=compute_dtype(cfg.train.precision))
    evaluator = evaluator if evaluator.enabled else None
    say(f"waiting for the first batch (data.workers={cfg.data.workers})")
    t0 = time.time()
    try:
        result = train_loop(cfg, engine, loader, logger, start_step=start, rank=rank, world=world,
                            ckpt_dir=ckpt_dir, run_info={"config": to_dict(cfg)}, flops=flops, stop=stop, dog=dog,
                            samples=samples, evaluator=evaluator, say=say)
    except BaseException:
        dog.hold_if_fired()  # a hang report in progress decides the exit (EXIT_HANG)
        if rank == 0:
            _status(layout, "failed", start)
        raise
    finally:
        logger.close()
        stop_workers()
        if samples is not None:
            samples.close()
    result.update(resumed_from=start, seconds=time.time() - t0, run_dir=str(run_dir), checkpoint_dir=str(ckpt_dir),
                  wandb_dir=logger.wandb_dir, world_size=world)
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
    from data_pipeline.loader import DataError

    with cli_errors("vit-train", DataError, NonFiniteLoss, CheckpointWriteError):
        cfg = load_config(args.config, args.overrides)
        code = EXIT_INTERRUPTED if run(cfg)["preempted"] else EXIT_OK
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
