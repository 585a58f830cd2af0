"""Evaluation while pre-training: validation loss / top-1 / top-5, few-shot and kNN probes.

Every ``validation.every_steps`` steps (0: off) the loop calls ``evaluator(step)``:

* ``eval/loss``, ``eval/top1``, ``eval/top5`` (multi-label data: ``eval/prec@1``) over
  ``data.val_shards``: every validation sample exactly once across ranks (the loader's evaluation
  stream), reduced with sums after the pass; ``eval/data/<kind>``: what the pass's reading skipped
  and why, and its retried requests, summed over ranks (``data_pipeline/tally.py``'s kinds; only
  kinds that occurred), as ``train/data/*`` counts the training stream's.
* with ``train.ema_decay``, the same again on the weights' moving average: ``eval/ema/loss``,
  ``eval/ema/top1``, ``eval/ema/fewshot/<suite>/<n>shot``, ... (the average swapped into the module
  for the pass, ``WeightEma.swapped``, and the weights swapped back bit for bit).
* ``eval/fewshot/<suite>/<n>shot``: big_vision's closed-form ridge on the frozen features the
  model's own head sees (``forward_head(pre_logits=True)``: its pooling, [class] token, mean or
  MAP, and pre-logits layer; ``pretrain.transfer.protocols.fewshot``) for each suite in
  ``validation.fewshot_suites`` (``NAME`` or ``NAME:PATH`` with the names of ``vit-transfer --suite``)
  at ``validation.fewshot_shots``, each seed's examples drawn from the whole train split as vit-transfer
  draws them (the same on any number of ranks). The drawn few-shot
  images are decoded once per run (this rank's share, cached as float16) and their features are
  computed by all ranks (ZeRO-3 gathers parameters in every forward, so every rank runs the same
  number of forwards: ranks that run out pad with a dummy batch) and gathered on rank 0.
* ``eval/knn/<suite>/<k>nn``: DINOv2's weighted kNN vote (``pretrain.transfer.protocols.knn``) of the whole
  train split on the test split, for each suite in ``validation.knn_suites`` at
  ``validation.knn_k`` and ``validation.knn_temperature``, on the same features. These images are
  read again at each evaluation (all of a train split would not fit in memory as the few-shot
  pools do): a forward pass over train and test each time.
* The probes' images are prepared as vit-transfer prepares them (``pretrain.transfer.data.make_view``:
  the task's resize mode, ``data.augment.eval_crop_pct`` and ``data.augment.mean/std``).
* Training is not disturbed: its data stream is untouched (separate loaders), torch's RNG states
  are saved and restored, the model returns to train mode, and the time is logged as
  ``eval/seconds`` and left out of throughput and MFU.
"""
from __future__ import annotations

import sys
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from pretrain.distributed import rng
from pretrain.distributed.process import lockstep
from pretrain.models.losses import classification_loss
from pretrain.observability.clock import synced_now
from pretrain.observability.window import sum_counters
from pretrain.transfer.errors import TransferError


def parse_suite(spec: str) -> tuple[str, Optional[str]]:
    name, _, path = spec.partition(":")
    return name, (path or None)


def probe_tasks(val, data) -> dict[str, list[tuple[str, object]]]:
    """Each suite spec (``NAME`` or ``NAME:PATH``) of the ``validation`` section ``val``'s few-shot
    and kNN probes, read once however many probes name it, -> its ``(label, task)`` pairs, read by
    vit-transfer's builders (file lists, split files, labels; CIFAR-100's arrays). The label names
    the task in the metrics (``eval/fewshot/<label>/10shot``): the suite's name, with the task's
    (VTAB-1k's) or the folder's (two suites of one name: ``imagefolder/pets``) after it. A missing
    folder, file or task, or two suites of one probe that would log under one label, raises
    ``TransferError``, one line naming it."""
    from types import SimpleNamespace

    from pretrain.evaluation.config import FEWSHOT_DEFAULTS, names_tasks
    from pretrain.transfer.suites import SUITES

    out = {}
    for spec, own in names_tasks(list(dict.fromkeys(val.fewshot_suites + val.knn_suites))).items():
        name, path = parse_suite(spec)
        # the minival split a sweep of vit-transfer selects on: the probes fit the whole train split
        ev = SimpleNamespace(suite=name, data_root=path, minival_fraction=FEWSHOT_DEFAULTS["minival_fraction"],
                             seed=FEWSHOT_DEFAULTS["seed"], tasks=list(val.tasks))
        tasks, _ = SUITES[name].build(ev, data)
        out[spec] = [(f"{name}/{task.name}" if own else name, task) for task in tasks]
    for key in ("fewshot_suites", "knn_suites"):
        seen: dict[str, str] = {}
        for spec in dict.fromkeys(getattr(val, key)):
            for label, _ in out[spec]:
                if seen.setdefault(label, spec) != spec:
                    raise TransferError(f"validation.{key}: {seen[label]} and {spec} would both log as {label}; "
                                        "give their folders distinct names")
    return out


def probe_labels(read: dict[str, list[tuple[str, object]]]) -> dict[str, list[str]]:
    """Each probe spec's labels as its metrics name them (``vtab1k/dtd``), from ``probe_tasks``."""
    return {spec: [label for label, _ in pairs] for spec, pairs in read.items()}


def _say(line: str) -> None:
    print(f"vit-train: {line}", file=sys.stderr, flush=True)


class _Fewshot:
    """One few-shot suite: this rank's share of train / test images, decoded once, prepared as
    vit-transfer prepares them for a model pre-trained with ``aug`` (``data.augment``).

    A train split whose labels are known before its images are read (files, arrays) is drawn from
    once, whole, as vit-transfer draws it (``shot_draws``: every seed and shot count), and only the
    drawn examples are decoded: the pool, their union in split order. Rank ``r`` holds the pool's
    positions ``r::world``; ``order`` puts rows gathered in rank order back in pool order, and
    ``draws`` names each fit's examples as pool positions, so every fit sees the same examples on
    any number of ranks. Shards have no labels before they are read: the whole split is decoded,
    each rank a contiguous run in manifest order (the loader's evaluation plan) read in this process
    (no data workers, whose parts would interleave), so the rows joined in rank order are the split
    in manifest order, as vit-transfer's features are with any ``eval.workers``, and the draws come
    from their labels."""

    def __init__(self, name: str, task, img_size: int, aug, rank: int, world: int, batch: int, shots: list[int],
                 seeds: int):
        from pretrain.transfer.data import Subset, make_view
        from pretrain.transfer.protocols.fewshot import short_classes, shot_draws

        self.name, self.num_classes, self.said = name, task.num_classes, False
        self.draws: Optional[dict[tuple[int, int], np.ndarray]] = None
        self.order: Optional[torch.Tensor] = None
        self.short: Optional[dict] = None
        view = make_view(task, img_size, aug)
        train, train_rank, train_world = task.trainval, rank, world
        labels = getattr(train, "labels", None)
        if labels is not None:
            labels = np.asarray(labels)
            drawn = shot_draws(labels, self.num_classes, shots, seeds)
            pool = np.unique(np.concatenate(list(drawn.values())))
            self.draws = {key: np.searchsorted(pool, idx) for key, idx in drawn.items()}
            shares = [np.arange(r, len(pool), world) for r in range(world)]
            self.order = torch.from_numpy(np.concatenate(shares))
            self.short = short_classes(labels, self.num_classes, shots)
            train, train_rank, train_world = Subset(f"{train.name}[few-shot pool]", train, pool[shares[rank]]), 0, 1
        self.parts = {}
        for part, split, r, w in (("train", train, train_rank, train_world), ("test", task.test, rank, world)):
            xs, ys = [], []
            for x, y in split.batches(view, batch_size=batch, train=False, rank=r, world=w):
                xs.append(x.to(torch.float16))
                ys.append(y)
            self.parts[part] = (xs, ys)

    def in_pool_order(self, X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The train rows gathered in rank order, back in pool order (shards: as they are)."""
        if self.order is None:
            return X, y
        Xp, yp = torch.empty_like(X), torch.empty_like(y)
        Xp[self.order], yp[self.order] = X, y
        return Xp, yp


class _Knn:
    """One kNN suite: its train and test splits, this rank's share streamed at every evaluation,
    prepared as vit-transfer prepares them for a model pre-trained with ``aug`` (``data.augment``)."""

    def __init__(self, name: str, task, img_size: int, aug, rank: int, world: int, batch: int):
        from pretrain.transfer.data import make_view

        self.name, self.num_classes, self.said = name, task.num_classes, False
        self.view, self.rank, self.world, self.batch = make_view(task, img_size, aug), rank, world, batch
        self.splits = {"train": task.trainval, "test": task.test}

    def batches(self, part: str):
        return self.splits[part].batches(self.view, batch_size=self.batch, train=False, rank=self.rank,
                                         world=self.world)


def pass_counts(before: dict, after: dict) -> dict:
    """What one validation pass added to the loader's counters (they run on over the run's passes):
    the samples it skipped and why, its retried requests; not ``samples`` (``eval/samples`` is the
    pass's count over ranks)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if k != "samples" and v != before.get(k, 0)}


class InTrainingEval:
    """``val``: the ``validation`` section; ``data``: the ``data`` section (val shards, labels);
    ``batch``: images per forward; ``seed``: the validation loader's; ``device``: where its batches
    are normalised (the training device); ``loss``: ``optim.loss``; ``ema``: the weights' moving
    average (``pretrain.distributed.ema.WeightEma``), evaluated too; ``val_plan``: the val shards'
    plan when start-up has read it (``data_pipeline.loading.loader.plan_loader``)."""

    def __init__(self, val, data, *, batch: int, seed: int, rank: int, world: int, img_size: int,
                 num_classes: int, dtype: torch.dtype, device=None, loss: str = "ce", ema=None, val_plan=None):
        self.ev, self.data, self.rank, self.world = val, data, rank, world
        self.loss, self.ema = loss, ema
        self.img_size, self.num_classes, self.dtype = img_size, num_classes, dtype
        self.batch, self.seed = batch, seed
        self.fewshot: Optional[list[_Fewshot]] = None  # decoded at the first evaluation
        self.knn: list[_Knn] = []
        self.last_seconds = 0.0
        self.val = None
        # the probes' suites are read now: a wrong folder or task ends start-up, not the first evaluation
        read = probe_tasks(val, data) if self.enabled else {}
        self.tasks = tuple([task for spec in specs for task in read.get(spec, [])]
                           for specs in (val.fewshot_suites, val.knn_suites))
        self.labels = probe_labels(read)
        if self.enabled and data.val_shards:
            from data_pipeline.loading.loader import build_loader

            self.val = build_loader(data, rank=rank, world_size=world, batch_size=self.batch, seed=self.seed,
                                    img_size=img_size, train=False, device=device, plan=val_plan)

    @property
    def enabled(self) -> bool:
        return self.ev.every_steps > 0 and bool(self.data.val_shards or self.ev.fewshot_suites or self.ev.knn_suites)

    def due(self, step: int, last_step: int) -> bool:
        return self.enabled and (step % self.ev.every_steps == 0 or step == last_step)

    # ------------------------------------------------------------------------------------------ run
    def __call__(self, engine, step: int) -> dict:
        """Collective. Metrics on rank 0 (``{}`` elsewhere); training state left as it was."""
        t0 = synced_now(engine.device)  # training steps still queued on the GPU are not eval time
        engine.eval()
        try:
            with torch.no_grad(), rng.preserved():
                out = self._metrics(engine)
                if self.ema is not None:
                    with self.ema.swapped():
                        out.update({f"ema/{k}": v for k, v in self._metrics(engine).items()})
        finally:
            engine.train()
        out["seconds"] = self.last_seconds = synced_now(engine.device) - t0
        return {f"eval/{k}": v for k, v in out.items()} if self.rank == 0 else {}

    def _metrics(self, engine) -> dict:
        out = self._validation(engine) if self.val is not None else {}
        out.update(self._fewshot(engine))
        out.update(self._knn(engine))
        return out

    def _dummy(self, device) -> torch.Tensor:
        """The input a rank that ran out of batches feeds ZeRO-3's collective forward."""
        return torch.zeros(1, 3, self.img_size, self.img_size, device=device, dtype=self.dtype)

    def _validation(self, engine) -> dict:
        """Loss (``pretrain.models.losses``, the training definition, summed then divided by the image
        count), top-1 / top-5 (multi-label: precision@1), over every validation sample once."""
        device = engine.device
        sums = torch.zeros(4, device=device, dtype=torch.float64)  # loss, top1, top5 (or prec@1), count
        before = self.val.counters
        multi = self.data.multi_label
        for item in lockstep(self.val, device):
            if item is None:
                engine(self._dummy(device))
                continue
            x, y = item
            logits = engine(x.to(device, self.dtype)).float()
            y = y.to(device)
            loss = classification_loss(logits, y, multi_label=multi, reduction="sum", loss=self.loss)
            if multi:
                hit1 = hit5 = y.gather(1, logits.argmax(1, keepdim=True)).sum()
            else:
                topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
                hit1, hit5 = (topk[:, 0] == y).sum(), (topk == y[:, None]).any(1).sum()
            n = torch.tensor(len(x), device=device, dtype=torch.float64)
            sums += torch.stack([loss.double(), hit1.double(), hit5.double(), n])
        dist.all_reduce(sums)
        total, hit1, hit5, count = sums.tolist()  # the evaluation's one host read
        n = max(1.0, count)
        data = {f"data/{k}": v for k, v in sum_counters(pass_counts(before, self.val.counters)).items()}
        if multi:
            return {"loss": total / n, "prec@1": hit1 / n, "samples": int(count), **data}
        return {"loss": total / n, "top1": hit1 / n, "top5": hit5 / n, "samples": int(count), **data}

    def _suites(self) -> list[_Fewshot]:
        if self.fewshot is None:
            aug = self.data.augment
            self.fewshot = [_Fewshot(label, task, self.img_size, aug, self.rank, self.world, self.batch,
                                     list(self.ev.fewshot_shots), self.ev.fewshot_seeds)
                            for label, task in self.tasks[0]]
            self.knn = [_Knn(label, task, self.img_size, aug, self.rank, self.world, self.batch)
                        for label, task in self.tasks[1]]
        return self.fewshot

    def _features(self, engine, batches) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's pre-logits features (the head's input: ``forward_head(pre_logits=True)``,
        which follows the pooling), taken by a hook during the engine's own forward (so ZeRO-3
        gathers every parameter as in training), gathered on every rank."""
        device, model = engine.device, engine.module
        captured = []
        hook = model.head.register_forward_pre_hook(lambda mod, inp: captured.append(inp[0].float().cpu()))
        labels = []
        try:
            for item in lockstep(batches, device):
                captured.clear()
                engine(self._dummy(device) if item is None else item[0].to(device, self.dtype))
                if item is not None:
                    labels.append((captured[-1], item[1].cpu()))
        finally:
            hook.remove()
        dim = getattr(model, "num_features", 0)
        mine = (torch.cat([f for f, _ in labels]) if labels else torch.zeros(0, dim),
                torch.cat([y for _, y in labels]) if labels else torch.zeros(0, dtype=torch.int64))
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        return torch.cat([g[0] for g in gathered]), torch.cat([g[1] for g in gathered])

    def _fewshot_train(self, engine, s: _Fewshot) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: the features and labels of ``s``'s train rows, in pool order on rank 0."""
        return s.in_pool_order(*self._features(engine, zip(*s.parts["train"])))

    def _fewshot(self, engine) -> dict:
        from pretrain.transfer.protocols.fewshot import fewshot_accuracy, short_classes, short_note

        out = {}
        for s in self._suites():
            Xtr, ytr = self._fewshot_train(engine, s)
            Xte, yte = self._features(engine, zip(*s.parts["test"]))
            if self.rank != 0:
                continue
            if not s.said:  # what the numbers below are, once
                s.said = True
                short = s.short if s.short is not None else short_classes(ytr.numpy(), s.num_classes,
                                                                          list(self.ev.fewshot_shots))
                if short:
                    _say(f"in-training few-shot {s.name}: {short_note(short)}")
            acc = fewshot_accuracy(Xtr, ytr, Xte, yte, s.num_classes, list(self.ev.fewshot_shots),
                                   self.ev.fewshot_seeds, self.ev.fewshot_l2, s.draws)
            for k, per_seed in acc.items():
                out[f"fewshot/{s.name}/{k}shot"] = sum(per_seed) / len(per_seed)
        return out

    def _knn(self, engine) -> dict:
        from pretrain.transfer.protocols.knn import knn_scores, short_note, topk_accuracy

        self._suites()
        out = {}
        for s in self.knn:
            Xtr, ytr = self._features(engine, s.batches("train"))
            Xte, yte = self._features(engine, s.batches("test"))
            if self.rank != 0:
                continue
            if not s.said:
                s.said = True
                if short := short_note(list(self.ev.knn_k), len(ytr)):
                    _say(f"in-training kNN {s.name}: {short}")
            scores = knn_scores(Xtr, ytr, Xte, list(self.ev.knn_k), self.ev.knn_temperature, s.num_classes)
            for k, sc in scores.items():
                out[f"knn/{s.name}/{k}nn"] = topk_accuracy(sc, yte, 1)
        return out
