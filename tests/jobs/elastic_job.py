"""Run by the deepspeed runner from test_elastic_ckpt: save / elastic-resume cases on CPU.

    deepspeed --num_gpus W --module tests.jobs.elastic_job ROOT save:z2-bf16 resume:z3-fp32 ...

A case is ``z<stage>-<precision>[-lamb][-ld]`` (``lamb``: optim.name=lamb, else AdamW; ``ld``:
optim.layer_decay=0.7, a group and a base LR per layer); its files live in ROOT/<case>/. Every case
keeps an EMA of the weights (train.ema_decay, with warmup). ``save`` (on the case's first world
size) trains STEPS steps, saves ``ckpt/step_00000004`` with our run.json and each rank's EMA pieces,
records the full fp32 weights, the moments, step, param-group hyperparameters, LR and the whole EMA
at the save, then trains on to TOTAL steps as the uninterrupted reference curve. ``resume`` (on
another world size) builds a fresh engine, loads through
``pretrain.checkpointing.elastic.load_checkpoint`` and ``WeightEma.load``, records the same
quantities, trains to TOTAL on the same data, and saves again. Every case runs in one process one
after another (a launch costs ~15 s here); each writes ROOT/<case>/<phase>.pt, or <phase>.error with
the traceback. The checks are made by the test, which reads those files.
"""
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed import ema as weight_ema
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import initialize
from pretrain.models.vit import VisionTransformer
from pretrain.perf.collector import after_imports

SAVE_AT, TOTAL, GLOBAL_BATCH, CLASSES = 4, 8, 8, 7
EMA_DECAY, LAYER_DECAY = 0.8, 0.7


def build(stage: int, precision: str, world: int, lamb: bool = False, layer_decay: bool = False):
    torch.manual_seed(0)  # identical initial weights on every rank and every world size
    # 7 classes: odd-sized head bias, so ZeRO's partition padding is exercised
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=CLASSES)
    # LAMB moves each tensor by lr x its norm: a larger LR, so the loss falls as fast as AdamW's
    optim = OptimConfig(name="lamb" if lamb else "adamw", lr=3e-2 if lamb else 3e-3, weight_decay=0.05, warmup_steps=3,
                        schedule="cosine", grad_clip=1.0, layer_decay=LAYER_DECAY if layer_decay else 1.0)
    train = TrainConfig(steps=10, global_batch_size=GLOBAL_BATCH, micro_batch_size=4, precision=precision)
    zero = ZeroConfig(stage=stage, stage3_param_persistence_threshold=0)  # ZeRO-3: partition everything
    engine, _ = initialize(model, optim, train, zero, world)
    return engine, weight_ema.WeightEma(engine, EMA_DECAY, warmup=True)


def batch(step: int, rank: int, world: int, gas: int, micro: int, dtype):
    """Micro-batch ``micro`` of this rank at ``step``: the global batch (two fixed batches taking
    turns, so the loss falls fast) cut the same way whatever the world size."""
    g = torch.Generator().manual_seed(step % 2)
    x = torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
    per = GLOBAL_BATCH // (world * gas)
    lo = (micro * world + rank) * per
    return x[lo:lo + per].to(dtype), y[lo:lo + per]


def train_to(engine, ema, start: int, end: int, rank: int, world: int) -> list[float]:
    """Steps start+1..end, each followed by the EMA's update; the global mean loss of each."""
    import torch.distributed as dist

    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, end):
        total = torch.zeros(())
        for m in range(gas):
            x, y = batch(step, rank, world, gas, m, dtype)
            loss = F.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        ema.update(step + 1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def snapshot(engine) -> dict:
    """Collective: full fp32 master weights, Adam moments, step, group hyperparameters, LR."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 links the moments to the parameters once, after the first group's first step,
        # when the other groups have no state yet (stage_1_and_2.py:2987); link them all now
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    fp32, avg, avg_sq = {}, {}, {}
    base = _client_optimizer(engine)
    for name, p in engine.module.named_parameters():
        if safe_get_full_fp32_param(p) is None:
            # ZeRO-0 (no wrapper, also in bf16: DeepSpeed steps AdamW on the bf16 weights):
            # the module holds the weights and AdamW its own per-parameter state
            fp32[name], avg[name], avg_sq[name] = (p.detach().clone(), base.state[p]["exp_avg"].clone(),
                                                   base.state[p]["exp_avg_sq"].clone())
            continue
        fp32[name] = safe_get_full_fp32_param(p).detach().cpu().clone()
        avg[name] = safe_get_full_optimizer_state(p, "exp_avg").detach().cpu().clone()
        avg_sq[name] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().cpu().clone()
    steps = _adam_steps(engine)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    return {"fp32": fp32, "exp_avg": avg, "exp_avg_sq": avg_sq, "adam_steps": steps, "groups": groups,
            "lr": engine.get_lr()[0], "sched_last_epoch": engine.lr_scheduler.last_epoch,
            "global_steps": engine.global_steps}


def _client_optimizer(engine):
    """The client torch AdamW, inside DeepSpeed's ZeRO / bf16 wrapper when there is one."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _adam_steps(engine) -> list[float]:
    """The distinct Adam step counts held by the client optimizer (one per flat group)."""
    return sorted({float(s["step"]) for s in _client_optimizer(engine).state.values() if "step" in s})


def module_weights(engine) -> dict:
    """Collective: the live module's weights (gathered under ZeRO-3), in their training dtype."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().cpu().clone() for n, p in params}


def write_ema(ema, folder: Path, rank: int) -> dict:
    """Collective: each rank's EMA pieces written into ``folder`` as a checkpoint holds them; the
    whole EMA read back from the files (on every rank)."""
    import torch.distributed as dist

    if ema.owns_pieces():
        tensors, meta = ema.pieces()
        weight_ema.write_pieces(folder / weight_ema.FILE.format(rank), tensors, meta)
    dist.barrier()
    return weight_ema.read_full(folder)


def save_phase(engine, ema, case_dir: Path, rank: int, world: int) -> dict:
    import torch.distributed as dist

    losses = train_to(engine, ema, 0, SAVE_AT, rank, world)
    ckpt_dir = case_dir / "ckpt"
    tag = f"step_{SAVE_AT:08d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    saved_ema = write_ema(ema, ckpt_dir / tag, rank)
    if rank == 0:
        (ckpt_dir / tag / "run.json").write_text(json.dumps({"world_size": world, "step": SAVE_AT}))
        (ckpt_dir / tag / "COMPLETE").write_text(json.dumps({"step": SAVE_AT}))
    dist.barrier()
    snap = snapshot(engine)
    losses += train_to(engine, ema, SAVE_AT, TOTAL, rank, world)
    return {**snap, "ema": saved_ema, "losses": losses, "world": world, "adam_steps_end": _adam_steps(engine)}


def resume_phase(engine, ema, case_dir: Path, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from pretrain.checkpointing import elastic

    ckpt = case_dir / "ckpt" / f"step_{SAVE_AT:08d}"
    raw = {}
    fix = elastic._fix_zero3_universal_load

    def observed(engine, universal):  # what DeepSpeed's ZeRO-3 loader left, before our fix
        base = engine.optimizer.optimizer
        raw["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        raw["distinct_step_tensors"] = len({id(s["step"]) for s in base.state.values()})
        raw["states"] = len(base.state)
        fix(engine, universal)

    elastic._fix_zero3_universal_load = observed
    try:
        elastic.load_checkpoint(engine, ckpt)
    finally:
        elastic._fix_zero3_universal_load = fix
    flag_after = engine._config.load_universal_checkpoint
    loaded = ema.load(ckpt)
    (case_dir / "ema_after_load").mkdir(exist_ok=True)
    ema_after = write_ema(ema, case_dir / "ema_after_load", rank)
    snap = snapshot(engine)
    weights = module_weights(engine)
    losses = train_to(engine, ema, SAVE_AT, TOTAL, rank, world)
    steps_end = _adam_steps(engine)
    # a save after an elastic resume: every rank's files must be there (deepspeedai/DeepSpeed#7546)
    engine.save_checkpoint(str(case_dir / "ckpt2"), tag="again", save_latest=False)
    dist.barrier()
    files = sorted(p.name for p in (case_dir / "ckpt2" / "again").iterdir())
    return {**snap, "module": weights, "ema": ema_after, "ema_loaded": loaded, "losses": losses, "world": world,
            "flag_after_load": flag_after,
            "files_after_resave": files, "deepspeed_zero3_raw": raw,
            "adam_steps_end": steps_end}


def fail_phase(engine, ema, case_dir: Path, rank: int, world: int) -> dict:
    """A checkpoint that cannot be converted: every rank gets the same one-line error, none hangs."""
    from pretrain.checkpointing import elastic

    try:
        elastic.load_checkpoint(engine, case_dir / "ckpt" / f"step_{SAVE_AT:08d}")
    except elastic.ElasticError as e:
        return {"error": str(e)}
    return {"error": None}


def main():
    import torch.distributed as dist

    after_imports()  # as vit-train: each case's gc.collect walks only what is newer than the imports
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    root, jobs = Path(args[0]), args[1:]
    from pretrain.distributed.process import init_distributed

    rank, _, world = init_distributed()  # the runner set RANK / WORLD_SIZE / MASTER_*
    torch.set_num_threads(1)
    for job in jobs:
        phase, case = job.split(":")
        parts = case.split("-")
        stage, precision = int(parts[0][1:]), parts[1]
        case_dir = root / case
        case_dir.mkdir(parents=True, exist_ok=True)
        try:
            engine, ema = build(stage, precision, world, lamb="lamb" in parts, layer_decay="ld" in parts)
            run = {"save": save_phase, "resume": resume_phase, "fail": fail_phase}[phase]
            out = run(engine, ema, case_dir, rank, world)
            if phase == "fail":
                (case_dir / f"fail.{rank}.json").write_text(json.dumps(out))
            elif rank == 0:
                torch.save(out, case_dir / f"{phase}.pt")
        except Exception:
            (case_dir / f"{phase}.error.{rank}").write_text(traceback.format_exc())
            raise  # a collective may be half done: this launch cannot go on safely
        finally:
            engine = ema = None
            gc.collect()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
    # one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
    # after its results are written, which the runner reports as a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
