"""One checkpoint x one suite x one protocol -> one results document.

    pre = load_pretrained("run.safetensors")
    tasks, missing = build_tasks(cfg.eval, cfg.data)
    doc = evaluate_checkpoint(cfg, pre, tasks, missing)

Each part receives its own settings: the protocol gets the ``eval`` section (the fine-tune its
resolved recipe), views get ``data.augment`` (normalisation, crop), fine-tuning under DeepSpeed
gets ``zero``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from pretrain.config import Config
from pretrain.models.arch import model_defaults
from pretrain.transfer.data import View, make_view
from pretrain.transfer.errors import TransferError
from pretrain.transfer.protocols.features import FeatureCache
from pretrain.transfer.protocols.fewshot import FewShot
from pretrain.transfer.protocols.finetune import Dist, Finetune
from pretrain.transfer.protocols.head import OwnHead
from pretrain.transfer.protocols.knn import KNN
from pretrain.transfer.protocols.linear import LinearProbe
from pretrain.transfer.protocols.recipes import resolve
from pretrain.transfer.results import assemble
from pretrain.transfer.sweep import log_stderr, run_task
from pretrain.weights.pretrained import Pretrained, build_backbone, build_classifier


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_protocol(cfg: Config, pre: Pretrained, img_size: int, device: torch.device, dist: Dist,
                  log: Callable[[str], None]):
    ev = cfg.eval

    def view_of(task) -> View:
        return make_view(task, img_size, cfg.data.augment, ev.train_augment)

    if ev.protocol == "finetune":
        # bf16 only where it is native; CPU fine-tuning stays fp32
        precision = cfg.train.precision if torch.cuda.is_available() else "fp32"
        # a fine-tune's batches are small: `auto` (pre-training's memory rule) checkpoints nothing here
        ckpt = cfg.train.activation_checkpointing if cfg.train.activation_checkpointing != "auto" else False
        recipe = resolve(ev, depth=model_defaults(pre.arch["name"])["depth"], model_drop_path=cfg.model.drop_path_rate)
        return Finetune(pre, img_size=img_size, ev=ev, recipe=recipe, view_of=view_of, device=device,
                        precision=precision, zero=cfg.zero, grad_checkpointing=ckpt, dist_info=dist, log=log)
    if dist.world > 1:
        raise TransferError(f"--protocol {ev.protocol} runs in one process; start it without the deepspeed runner")
    if ev.pool == "token" and not pre.arch.get("class_token", True):
        raise TransferError(f"eval.pool=token: {pre.source} holds a model without the [class] token; "
                            "use eval.pool=model (its own pooling) or avg")
    if ev.protocol == "head":
        return OwnHead(build_classifier(pre, img_size=img_size), view_of, batch_size=ev.batch_size, device=device,
                       workers=ev.workers, real_labels=ev.real_labels, log=log, head_classes=pre.classes,
                       source=pre.source)
    model = build_backbone(pre, img_size=img_size)
    cache = FeatureCache(model, batch_size=ev.batch_size, pool=ev.pool, device=device, workers=ev.workers, log=log)
    if ev.protocol == "linear":
        return LinearProbe(cache, view_of, ev.linear_l2, list(ev.sweep_linear_l2))
    if ev.protocol == "knn":
        return KNN(cache, view_of, list(ev.knn_k), ev.knn_temperature)
    return FewShot(cache, view_of, list(ev.fewshot_shots), ev.fewshot_seeds, ev.fewshot_l2, list(ev.sweep_fewshot_l2))


def evaluate_checkpoint(cfg: Config, pre: Pretrained, tasks: list, missing: list[str], *, dist: Dist = Dist(),
                        device: Optional[torch.device] = None, log: Callable[[str], None] = log_stderr) -> dict:
    ev = cfg.eval
    t0 = time.time()
    if dist.rank != 0:  # every rank runs the same code; one of them speaks
        log = lambda msg: None  # noqa: E731
    img_size = ev.img_size or pre.img_size
    device = device or default_device()
    protocol = make_protocol(cfg, pre, img_size, device, dist, log)
    sweep = ev.sweep if ev.sweep is not None else ev.suite == "vtab1k"
    # what the results say: a grid of one setting (head, a single k or l2) has nothing to choose on val
    swept = sweep and len(protocol.grid(True)) > 1
    step = f"step {pre.step}" if pre.step is not None else "unknown step"
    log(f"vit-transfer: {pre.arch['name']} ({step}) {ev.suite}/{ev.protocol} at {img_size} px on "
        f"{len(tasks)} task(s)" + (f"; missing: {', '.join(missing)}" if missing else ""))
    results = [run_task(protocol, t, sweep, log) for t in tasks]
    return assemble(results, missing=missing, suite=ev.suite, protocol=ev.protocol, pre=pre, img_size=img_size,
                    sweep=swept, settings=dataclasses.asdict(ev), seconds=time.time() - t0, world=dist.world)
