"""A training rank's start-up, in its phases: ``connect`` (process group, checks, run directory,
watchdog), ``build_engine`` (model, DeepSpeed, loader), ``restore`` (the newest checkpoint, or the
per-rank seeds of a fresh run) and ``assemble`` (the :class:`Loop` that ``pretrain.train.train_loop``
runs). Each returns what the next needs.

The order is part of the contract: the stop request exists before anything can be interrupted;
every expensive phase is named to the start-up guard before it begins; ``train.seed`` seeds the
model build and the per-rank seed follows only a fresh start (a resume restores the saved RNG
state instead); the loader is built after DeepSpeed's init, on the engine's device.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from data_pipeline.loading.loader import build_loader, plan_loader
from data_pipeline.loading.plan import Plan
from data_pipeline.loading.sample_log import SampleLog, logged_batches
from data_pipeline.loading.step_batches import regrouped, sized_batches
from data_pipeline.loading.synthetic import SyntheticLoader
from pretrain.checkpointing import checkpoint
from pretrain.checkpointing.checkpointer import Checkpointer
from pretrain.checkpointing.rundir import RunDir, set_aside_earlier, step_of
from pretrain.config import (
    Config,
    ConfigError,
    check_world_size,
    checkpoint_count,
    compile_mode,
    image_size,
    save_config,
    target_check,
    to_dict,
)
from pretrain.config.phases import Phase, phase_at, resolution_phases
from pretrain.config.schema import TrainConfig
from pretrain.distributed import ds_compat
from pretrain.distributed.ema import WeightEma
from pretrain.distributed.engine import check_with_deepspeed, deepspeed_config, initialize
from pretrain.distributed.phases import PhaseSwitch
from pretrain.distributed.precision import check_precision, compute_dtype
from pretrain.distributed.process import all_hosts, init_distributed, launched, set_cpu_threads
from pretrain.distributed.rng import rank_seed
from pretrain.evaluation.in_training import InTrainingEval
from pretrain.evaluation.target import Target
from pretrain.models.arch import config_macs, patch_keep
from pretrain.observability.clock import StepClock
from pretrain.observability.flops import train_flops_per_image
from pretrain.observability.metrics import MetricsLogger
from pretrain.observability.profile import StepProfiler
from pretrain.observability.progress import StartupLines
from pretrain.observability.window import Forecast, RunTotals
from pretrain.perf import levers
from pretrain.perf.hardware import gpu_key
from pretrain.perf.perfmodel import run_record
from pretrain.resilience import faults, watchdog
from pretrain.resilience.lifecycle import FailureRecord, RunStatus, StopRequest, process_started, spent_before
from pretrain.resilience.straggler import StragglerDetector
from pretrain.resilience.watchdog import StartupGuard, Watchdog
from pretrain.weights.init_from import build_model, load_init_weights, num_params, set_masters


@dataclass
class Loop:
    """Everything ``train_loop`` works with, assembled by :func:`assemble`."""
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
    flops: dict[int, tuple[float, float]]  # resolution -> (model, hardware) training FLOPs per image
    phases: Callable[[int], Phase]  # a step's resolution phase (PhaseSwitch: switches the engine's micro batch)
    forecast: Forecast  # the time the steps left will take, for the progress line
    detector: Optional[StragglerDetector] = None
    evaluator: Optional[InTrainingEval] = None
    ema: Optional[WeightEma] = None  # train.ema_decay: updated after every optimizer step
    profiler: Optional[StepProfiler] = None  # logging.profile: the steps recorded with torch.profiler
    say: Callable[[str], None] = lambda msg: None
    totals: RunTotals = field(default_factory=RunTotals)  # what the run did and cost up to its step
    logged: Callable[[int], None] = lambda step: None  # after each log step (status.json)
    target: Optional[Target] = None  # validation.target_metric: when the run reaches it


@dataclass
class Connected:
    """A rank in its process group, its run directory checked, its watchdog set."""
    rank: int
    world: int
    hosts: list[str]
    layout: RunDir
    stop: StopRequest
    startup: StartupGuard
    dog: Watchdog
    say: StartupLines
    tree: dict  # the config as written (``to_dict``): checked against the checkpoint, stored in it, sent to W&B
    cfg: Config  # with its ``auto`` levers decided for this job and device (``decide_levers``)
    written: Config  # as written: config.yaml in the run directory
    levers: tuple[str, ...] = ()  # what ``auto`` chose, in words
    # what the run did and cost: this invocation's device time counted from its start, the earlier
    # invocations' carried on (status.json's spent; a resumed checkpoint's totals, from ``restore``)
    totals: RunTotals = field(default_factory=RunTotals)
    status: RunStatus = field(default_factory=lambda: RunStatus(None))  # rank 0's status.json


@dataclass
class Built:
    """The model inside its DeepSpeed engine, and this rank's loader."""
    engine: object
    loader: object
    accumulation: int  # micro-batches per optimizer step on this world size
    img: int
    resuming: bool  # a complete checkpoint waits to be loaded
    ema: Optional[WeightEma] = None  # the weights' moving average (train.ema_decay), on the masters' partitions
    val_plan: Optional[Plan] = None  # data.val_shards' plan, read with the training shards' (None: no validation)


@dataclass
class Restored:
    """Where the run starts: step 0, or the step of the checkpoint it resumed from."""
    step: int = 0
    run_id: Optional[str] = None  # the W&B run a resumed job continues
    resumed: bool = False
    saved_ranks: int = 0  # ranks that wrote the resumed checkpoint (another world size: elastic)


@dataclass
class Job:
    """The assembled loop and what ends with it: the rank's status file and its sample log."""
    loop: Loop
    status: RunStatus
    samples: Optional[SampleLog]


def check_machine(cfg: Config, world_size: int) -> int:
    """Before any expensive work: the precision on this device, the batch on this world size, and
    the DeepSpeed config these sections make (a refused combination is one line here)."""
    check_precision(cfg.train.precision)
    check_with_deepspeed(deepspeed_config(cfg.optim, cfg.train, cfg.zero, world_size, cfg.deepspeed))
    if cfg.model.init_from and not Path(cfg.model.init_from).exists():
        raise ConfigError(f"model.init_from={cfg.model.init_from}: not found")
    return check_world_size(cfg.train, world_size)


def decide_levers(cfg: Config, world_size: int) -> tuple[Config, tuple[str, ...]]:
    """``cfg`` with its ``auto`` speed levers decided for this job and device
    (``pretrain.perf.levers.resolve``: checkpointing from the device's memory, buckets from the
    parameters and the link), and the start-up lines that say what was chosen."""
    gpu = memory_bytes = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu, memory_bytes = gpu_key(props.name), props.total_memory
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cfg, choices = levers.resolve(cfg, world_size, gpus_per_node=per_node, gpu=gpu, memory_bytes=memory_bytes)
    return cfg, choices.lines


def connect(cfg: Config, record: FailureRecord) -> Connected:
    """Join the process group and check, before anything expensive, the machine, the config and the
    run directory (writable; a checkpoint this config may resume). ``Connected.cfg`` is ``cfg`` with
    its ``auto`` levers decided: the later phases take that one."""
    started = process_started()  # its device time and start-up lines count from it: the imports are start-up
    stop = StopRequest(watch_launcher=launched())  # first: a signal during start-up is kept, not fatal
    t = cfg.train
    startup = StartupGuard(t.startup_timeout_s)  # until the first step is done
    startup.phase("process group and DeepSpeed's communication set-up")
    build_lock = ds_compat.report_build_lock_wait()  # DeepSpeed's CPU shm op may be JIT-built here
    rank, _, world = init_distributed(max(t.pg_timeout_s, t.startup_timeout_s))
    build_lock.cancel()
    hosts = record.hosts = all_hosts()  # lines and records about ranks name their hosts
    if rank == 0:
        ds_compat.check_version()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), cfg.data.workers)
    written, tree = cfg, to_dict(cfg)
    cfg, lever_lines = decide_levers(cfg, world)
    check_machine(cfg, world)
    layout = RunDir.of(t.output_dir, cfg.checkpoint.dir)
    if rank == 0:  # vit-launch's way to stop a multi-node job without signalling its runner
        stop.watch_file(layout.stop_request)
    # before any expensive work: an unwritable folder would otherwise fail at the first save
    checkpoint.check_writable(layout.root, "train.output_dir")
    if cfg.checkpoint.dir:
        checkpoint.check_writable(layout.checkpoints, "checkpoint.dir")
    if cfg.checkpoint.resume:  # a changed shape key, said before the model build and DeepSpeed init
        checkpoint.check_resumable(layout.checkpoints, tree)
    say = StartupLines(rank, started)
    watchdog.clear(layout.hang, rank)
    dog = Watchdog(layout.hang, rank, world, t.hang_timeout_s, startup_s=t.startup_timeout_s)
    dog.hosts = hosts
    totals = RunTotals()  # what earlier invocations spent, read before this one's first status replaces it
    totals.begin(started, world, spent_before(layout.status) if rank == 0 and cfg.checkpoint.resume else 0.0)
    status = RunStatus(layout.status if rank == 0 else None, spent=totals.spent)
    return Connected(rank, world, hosts, layout, stop, startup, dog, say, tree, cfg, written, lever_lines, totals,
                     status)


def build_engine(cfg: Config, c: Connected) -> Built:
    """The shards' plan first (their manifests only: a data mistake is said before anything is
    built), the model (seeded by ``train.seed`` alike on every rank; ``model.init_from``'s weights
    on a fresh start), DeepSpeed around it, then the loader on the engine's device."""
    t, say = cfg.train, c.say
    img = image_size(cfg.model)
    plan, val_plan = shard_plans(cfg, c)
    say(f"building {cfg.model.name} ({img} px) on {c.world} rank(s)")
    for line in c.levers:
        say(line)
    c.startup.phase("model build")
    torch.manual_seed(t.seed)  # anything drawn before the per-rank streams below is the same on every rank
    model = build_model(cfg)
    resuming = cfg.checkpoint.resume and checkpoint.latest_complete(c.layout.checkpoints) is not None
    masters = (load_init_weights(model, cfg, say, plan.shardset.classes if plan else None)
               if cfg.model.init_from and not resuming else {})
    if cfg.model.patch_drop_rate:
        grid = model.grid_size[0] * model.grid_size[1]
        say(f"model.patch_drop_rate={cfg.model.patch_drop_rate:g}: in training each image keeps "
            f"{patch_keep(grid, cfg.model.patch_drop_rate)} of its {grid} patch tokens at {img} px")
    say(f"DeepSpeed init: ZeRO-{cfg.zero.stage}, {t.precision}, {num_params(model) / 1e6:.1f}M parameters")
    if compile_mode(t.compile):
        what = "the whole model" if compile_mode(t.compile, cfg.zero.stage) == "model" else "each block"
        say(f"train.compile={t.compile}: torch.compile of {what}, traced in the first step")
    c.startup.phase("DeepSpeed initialize")
    engine, ds_cfg = initialize(model, cfg.optim, t, cfg.zero, c.world, cfg.deepspeed)
    set_masters(engine, masters)  # a 16-bit module: the init_from file's fp32 bits, not the rounded module's
    ema = WeightEma(engine, t.ema_decay, t.ema_warmup) if t.ema_decay else None  # from the masters as set
    if cfg.data.synthetic:
        loader = SyntheticLoader(cfg.data, batch_size=t.micro_batch_size, img_size=img, seed=t.seed, rank=c.rank,
                                 num_classes=cfg.model.num_classes, device=engine.device)
    else:
        loader = build_loader(cfg.data, rank=c.rank, world_size=c.world, batch_size=t.micro_batch_size,
                              seed=t.seed, img_size=img, train=True, device=engine.device, plan=plan)
    say(loader.decode_path)  # who decodes the JPEGs, and with what
    return Built(engine, loader, ds_cfg["gradient_accumulation_steps"], img, resuming, ema, val_plan)


def shard_plans(cfg: Config, c: Connected) -> tuple[Optional[Plan], Optional[Plan]]:
    """The training shards' plan (None: ``data.synthetic``) and the validation shards' (None: no
    in-training validation on shards), from their manifests alone, with their classes checked against
    the model's and each other's: a data mistake said before anything is built."""
    t, plan, val_plan = cfg.train, None, None
    c.startup.phase("the shards' manifests (data.train_shards, data.val_shards)")
    if not cfg.data.synthetic:
        plan = plan_loader(cfg.data, world_size=c.world, batch_size=t.micro_batch_size, seed=t.seed)
        if problem := plan.shardset.config_problem(cfg.model.num_classes, cfg.data.multi_label):
            raise ConfigError(problem)
    if cfg.validation.every_steps > 0 and cfg.data.val_shards:
        val_plan = plan_loader(cfg.data, world_size=c.world, batch_size=validation_batch(cfg), seed=t.seed,
                               train=False)
        problem = (val_plan.shardset.labels_problem(plan.shardset) if plan else
                   val_plan.shardset.config_problem(cfg.model.num_classes, cfg.data.multi_label))
        if problem:
            raise ConfigError(problem)
    return plan, val_plan


def validation_batch(cfg: Config) -> int:
    """Images per forward of the in-training evaluation."""
    return cfg.validation.batch_size or cfg.train.micro_batch_size


def restore(cfg: Config, c: Connected, b: Built) -> Restored:
    """Load the newest complete checkpoint into the engine and the loader; without one, seed this
    rank's own dropout / drop-path streams. A fresh start (``checkpoint.resume: false``) first sets
    the checkpoints already in the folder aside (``rundir.set_aside_earlier``)."""
    ckpt_dir = c.layout.checkpoints
    if b.resuming:
        c.say(f"resuming: verifying and loading the newest checkpoint in {ckpt_dir}")
    c.startup.phase("checkpoint resume (a universal-checkpoint conversion on another world size)")
    resumed = checkpoint.resume(b.engine, ckpt_dir, config=c.tree, ema=b.ema) if cfg.checkpoint.resume else None
    if not cfg.checkpoint.resume and c.rank == 0:
        kept = set_aside_earlier(ckpt_dir)
        if kept is not None:
            c.say(f"checkpoint.resume=false: the checkpoints already in {ckpt_dir} are kept in {kept}; this run "
                  "starts from scratch and saves beside them")
    if not resumed:
        torch.manual_seed(rank_seed(cfg.train.seed, c.rank))  # per-rank dropout / drop-path streams
        return Restored()
    info, states = resumed
    # same layout: this rank's, bit-exact; the state type is the loader's own (shards or synthetic)
    b.loader.resume(Checkpointer.loader_states(states, type(b.loader.state())))
    c.totals.carry(info)
    if c.totals.device_seconds is None:  # said once, where it begins: the figures are silent from here on
        c.say(f"the checkpoint of step {info['step']} holds no device-seconds (the run went through a checkpoint "
              "of an older release, which counted none): its device-hours stay unknown in the metrics, the "
              "checkpoints and the last line")
    return Restored(info["step"], info.get("wandb_run_id"), resumed=True, saved_ranks=len(states))


def assemble(cfg: Config, c: Connected, b: Built, r: Restored) -> Job:
    """The metrics sinks, the sample log, the evaluator, the clock and the checkpointer around the
    engine, and the batch stream (the batches and the engine's save wrapped by ``faults`` only
    under ``VITSCALE_FAULT``)."""
    t, start = cfg.train, r.step
    flops, run_config = _run_config(cfg, c, b)
    if cfg.logging.wandb.mode == "online":
        c.say(f"starting W&B online (offline after logging.wandb.init_timeout_s={cfg.logging.wandb.init_timeout_s:g})")
    logger = MetricsLogger(cfg.logging, c.layout.root, rank=c.rank, run_config=run_config, run_id=r.run_id,
                           resume_step=start if r.resumed else None)
    if c.rank == 0:
        save_config(c.written, c.layout.config)
        where = f"resuming from step {start}" if r.resumed else "starting from scratch"
        print(f"vit-train: {cfg.model.name} on {c.world} rank(s), ZeRO-{cfg.zero.stage}, {t.precision}, "
              f"{where}; run dir {c.layout.root}", file=sys.stderr, flush=True)
    samples = SampleLog(c.layout.samples, c.rank).open(start) if cfg.data.record_samples else None
    if samples is not None and c.rank == 0:  # after an elastic resume onto fewer ranks, the old ranks'
        for old in range(c.world, r.saved_ranks):  # logs are cut back to the step too
            SampleLog(c.layout.samples, old).open(start).close()
    if cfg.validation.fewshot_suites or cfg.validation.knn_suites:  # their folders are read now (NFS: minutes)
        c.startup.phase("the probes' suites (validation.fewshot_suites, validation.knn_suites)")
    evaluator = InTrainingEval(cfg.validation, cfg.data, batch=validation_batch(cfg), val_plan=b.val_plan,
                               seed=t.seed, rank=c.rank, world=c.world, img_size=b.img,
                               num_classes=cfg.model.num_classes, dtype=compute_dtype(t.precision),
                               device=b.engine.device, loss=cfg.optim.loss, ema=b.ema)
    target = _target(cfg, evaluator, c.totals)
    c.status(start)
    clock = StepClock(b.engine.device, c.dog)
    if cfg.zero.stage == 3:  # the forward's waits for parameters are not the rank's own work
        ds_compat.around_zero3_fetch(b.engine.module, clock.gather_begin, clock.gather_end)
    if clock.times_waits:  # backward's and step's waits for peers are not the rank's own work either
        ds_compat.time_collectives(clock.comm_begin, clock.comm_end, b.engine)
    phases = resolution_phases(t, b.img)
    sized = None  # without a schedule: the loader's own iteration
    if t.resolution_schedule:  # the loader restarted at each phase's size where it changes
        sized = sized_batches(b.loader, lambda step: phase_at(phases, step).img_size, start, b.accumulation)
    batches = faults.wrap_batches(logged_batches(b.loader, samples, start, b.accumulation, sized),
                                  rank=c.rank, start_step=start, accumulation=b.accumulation)
    if any(p.micro_batch != t.micro_batch_size for p in phases):  # the loader's batches cut to each phase's
        batches = regrouped(batches, lambda step: phase_at(phases, step).micro_batch, start,
                            t.global_batch_size // c.world)
    checkpointer = Checkpointer(cfg, b.engine, b.loader, c.layout.checkpoints, {"config": c.tree}, logger, samples,
                                ema=b.ema, totals=c.totals.record)
    saver = checkpointer.saver  # an asynchronous save's faults run on its writer, behind the files
    faults.wrap_save(b.engine, rank=c.rank, step_of=step_of, defer=saver.writer.submit if saver else None)
    loop = Loop(cfg, b.engine, batches, b.loader, logger, checkpointer, clock, c.stop, c.startup, start_step=start,
                world=c.world, flops=flops, phases=PhaseSwitch(phases, b.engine, c.say), totals=c.totals,
                detector=_straggler_detector(t, c, clock),
                evaluator=evaluator if evaluator.enabled else None, ema=b.ema,
                profiler=StepProfiler.of(cfg.logging.profile, rank=c.rank, world=c.world, start_step=start,
                                         steps=t.steps, root=c.layout.root, device=b.engine.device, say=c.say,
                                         beat=lambda: clock.beat("profile", slow=True)),
                say=c.say, logged=c.status, forecast=Forecast(phases, flops, t.steps), target=target)
    return Job(loop, c.status, samples)


def _target(cfg: Config, evaluator: InTrainingEval, totals: RunTotals) -> Optional[Target]:
    """``validation.target_metric`` against the metrics the evaluator's suites, now read, will log
    (a VTAB-1k task or a folder's name the config alone could not tell: a ConfigError now, not a
    target never met), with the record a resumed checkpoint carries of reaching it."""
    v = cfg.validation
    if not v.target_metric:
        totals.target_reached = None  # a record of a target this run no longer has
        return None
    if problem := target_check(cfg, evaluator.labels):
        raise ConfigError(": ".join(problem))
    target = Target(v, totals.target_reached)
    totals.target_reached = target.reached
    return target


def _run_config(cfg: Config, c: Connected, b: Built) -> tuple[dict[int, tuple[float, float]], dict]:
    """(training FLOPs per image, model and hardware, at each resolution the run trains at) and what
    W&B records of the run: the resolved config, the layout, the FLOPs and, on GPUs, the performance
    model's prediction, said in a line. The FLOPs count the tokens patch dropout keeps."""
    m, t = cfg.model, cfg.train
    depth = len(b.engine.module.blocks)
    # blocks whose matmuls the backward repeats (decided by levers.resolve; selective repeats none)
    recomputed = checkpoint_count(t.activation_checkpointing, depth)
    flops, fwd = {}, {}
    for img in {b.img} | {p.img_size for p in resolution_phases(t, b.img)}:
        fwd[img] = config_macs(m, img, breakdown=True)
        flops[img] = train_flops_per_image(fwd[img]["total"], fwd[img]["blocks"] * recomputed / depth)
    run_config = {**c.tree, "world_size": c.world, "zero_stage": cfg.zero.stage,
                  "checkpointed_blocks": t.activation_checkpointing, "reduce_bucket_size": cfg.zero.reduce_bucket_size,
                  "global_batch_size": t.global_batch_size, "model_gflops_fwd": fwd[b.img]["total"] / 1e9,
                  "train_flops_per_image": flops[b.img][0], "gradient_accumulation": b.accumulation}
    predicted = _prediction(cfg, c.world)
    if predicted:
        run_config["predicted"] = predicted
        c.say(f"performance model for this layout on {predicted['gpu']}: {predicted['images_per_second']:,.0f} "
              f"img/s, MFU {predicted['mfu']:.1%} (measured img/s and MFU follow in the log lines)")
    return flops, run_config


def _prediction(cfg: Config, world: int) -> Optional[dict]:
    """The performance model's record for this job's GPUs (none on CPU)."""
    if not torch.cuda.is_available():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))
    return run_record(cfg, world, per_node, torch.cuda.get_device_name())


def _straggler_detector(t: TrainConfig, c: Connected, clock: StepClock) -> Optional[StragglerDetector]:
    """The judge of slow ranks (rank 0 keeps the record); none in a world of one."""
    if c.world <= 1:
        return None
    return StragglerDetector(c.hosts, t.straggler_factor, t.straggler_windows,
                             record=c.layout.stragglers if c.rank == 0 else None,
                             span_s=t.straggler_span_s, waits_timed=clock.times_waits)
