"""``vit-transfer``: transfer evaluation of a pre-trained ViT (also ``python -m pretrain.transfer``).

    vit-transfer --checkpoint PATH --suite cifar100|vtab1k|demo|imagefolder|shards \\
                 --protocol finetune|linear|fewshot|knn|head [--recipe paper|deit] \\
                 --data-root DIR --output results.json [--config FILE] [a.b=c ...]
    vit-transfer --watch RUN_DIR --protocol fewshot --suite demo --output watch.json
    deepspeed --num_gpus 8 --module pretrain.transfer --checkpoint ... --protocol finetune ...

PATH: a run directory (any ZeRO stage), an exported .safetensors file, a timm state dict or a
transformers folder. ``--recipe`` picks the fine-tune's (the paper's SGD, or DeiT / MAE's AdamW
with layer decay, mixing and EMA); ``head`` scores the checkpoint's own classifier on the set
(``--data-root``: for imagefolder / shards the evaluated set itself).
Flags set the ``eval`` keys of the same name; everything else is ``eval.*`` / ``model.*`` /
``zero.*`` keys in the config or as overrides (``eval.img_size=384 eval.steps=2500``).
Results: ``--output`` (JSON), a Markdown table on stdout, W&B with ``eval.wandb=true``.
A user mistake prints one line on stderr and exits 2; an ``eval`` key set away from its default
that only other protocols read (``pretrain.evaluation.config.PROTOCOL_KEYS``) is one note line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional, TextIO

from data_pipeline.errors import ConfigError, Parser, cli_errors, path_arg
from pretrain.config import load_config
from pretrain.evaluation.config import unread_keys_note
from pretrain.perf.collector import after_imports
from pretrain.transfer.errors import TransferError
from pretrain.transfer.evaluate import evaluate_checkpoint
from pretrain.transfer.protocols.finetune import Dist
from pretrain.transfer.results import check_output, log_wandb, markdown, save_json
from pretrain.transfer.suites import SUITES, build_tasks
from pretrain.weights.pretrained import ARCH_KEYS, load_pretrained

PROG = "vit-transfer"


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog=PROG, description=__doc__.splitlines()[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=path_arg,
                     help="run directory, .safetensors file, .pth/.bin state dict, or a transformers ViT "
                     "folder (config.json + weights, e.g. from vit-export --format hf)")
    src.add_argument("--watch", type=path_arg, metavar="RUN_DIR",
                     help="evaluate each new checkpoint of a running pre-training job")
    ap.add_argument("--suite", choices=list(SUITES),
                    help="eval.suite: " + "; ".join(f"{k}: {v.help}" for k, v in SUITES.items()))
    ap.add_argument("--protocol", choices=["finetune", "linear", "fewshot", "knn", "head"],
                    help="eval.protocol (default: linear)")
    ap.add_argument("--recipe", choices=["paper", "deit"], help="eval.recipe: the fine-tune's recipe (default: paper)")
    ap.add_argument("--data-root", type=path_arg, help="dataset folder (eval.data_root)")
    ap.add_argument("--output", default="results.json", type=path_arg, help="results JSON (default: results.json)")
    ap.add_argument("--config", type=path_arg,
                    help="YAML config: its eval section, and the model, zero, data, train.precision, "
                         "train.activation_checkpointing and logging.wandb settings it evaluates with")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.img_size=384")
    return ap


def explicit_model_keys(config_path: Optional[str], overrides: list[str], model_cfg) -> dict:
    """Architecture keys the user set (config file or override): they override what the
    checkpoint says. Values come from the validated ``model_cfg``."""
    from pretrain.config import raw_tree

    tree = raw_tree(config_path, overrides)
    given = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    return {k: getattr(model_cfg, k) for k in ARCH_KEYS if k in given}


def setup_distributed(protocol: str) -> Dist:
    """Under the deepspeed runner (WORLD_SIZE > 1) start the process group for fine-tuning."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    if protocol != "finetune":
        raise TransferError(f"--protocol {protocol} runs in one process; start it without the deepspeed runner")
    from pretrain.distributed.process import init_distributed

    rank, _, world = init_distributed()  # binds the rank to its own GPU
    return Dist(rank=rank, world=world, deepspeed=True)


def _report(doc: dict, cfg, table: TextIO, output: Optional[str] = None) -> None:
    print(markdown(doc), file=table, flush=True)
    if output:
        print(f"{PROG}: results in {output}", file=sys.stderr)
    if cfg.eval.wandb:
        log_wandb(doc, cfg.logging.wandb, run_dir=doc.get("run_dir"))


def run_once(args, cfg, user_arch: dict, dist: Dist, table: TextIO) -> dict:
    pre = load_pretrained(args.checkpoint, user_arch, PROG)
    tasks, missing = build_tasks(cfg.eval, cfg.data)
    doc = evaluate_checkpoint(cfg, pre, tasks, missing, dist=dist)
    doc["run_dir"] = pre.run_dir
    if dist.rank == 0:
        saved, problem = save_json(args.output, doc)
        _report(doc, cfg, table, None if problem else saved)
        if problem:  # the table is printed and W&B logged; the file is in $TMPDIR and the line says where
            raise TransferError(problem)
    return doc


def run_watch(args, cfg, user_arch: dict, table: TextIO) -> list[dict]:
    from pretrain.transfer.watch import watch

    if cfg.eval.protocol == "finetune":
        raise TransferError("--watch runs fewshot, linear, knn or head "
                            "(fine-tuning would compete with the training job)")
    tasks, missing = build_tasks(cfg.eval, cfg.data)  # read once, reused for every checkpoint
    out = Path(args.output)
    docs: list[dict] = []
    if out.is_file():  # a restarted watcher continues its file and skips the steps in it
        try:
            prev = json.loads(out.read_text())
        except ValueError:
            raise TransferError(f"{out}: exists but is not JSON; choose another --output") from None
        if not isinstance(prev, dict) or prev.get("watch") != str(args.watch):
            raise TransferError(f"{out}: exists and is not a --watch file of {args.watch}; choose another --output")
        docs = prev["evaluations"]

    def evaluate(step: int, path: Path) -> None:
        pre = load_pretrained(path, user_arch, PROG)
        doc = evaluate_checkpoint(cfg, pre, tasks, missing)
        doc["run_dir"] = pre.run_dir or str(args.watch)
        docs.append(doc)
        docs.sort(key=lambda d: d.get("step") or 0)
        _, problem = save_json(out, {"watch": str(args.watch), "evaluations": docs})
        _report(doc, cfg, table)
        if problem:
            raise TransferError(problem)

    watch(args.watch, evaluate, poll_s=cfg.eval.watch_poll_s, idle_timeout_s=cfg.eval.watch_idle_timeout_s,
          done=[d["step"] for d in docs if d.get("step") is not None])
    return docs


def main(argv=None) -> None:
    args = parser().parse_intermixed_args(argv)  # overrides may sit between flags
    after_imports()
    from data_pipeline.errors import DataError
    from pretrain.distributed.process import process_group_ends

    table = sys.stdout  # the results table's alone: the rest goes to stderr, DeepSpeed's log lines included
    with (process_group_ends(), cli_errors(PROG, TransferError, DataError, ConfigError),
          contextlib.redirect_stdout(sys.stderr)):
        # the flags are overrides of the eval section: validated once, with the rest, by the schema
        flags = [f"eval.{k}={json.dumps(v)}" for k, v in (("suite", args.suite), ("protocol", args.protocol),
                                               ("recipe", args.recipe), ("data_root", args.data_root))
                 if v is not None]
        cfg = load_config(args.config, [*args.overrides, *flags])
        if (note := unread_keys_note(cfg.eval)) and os.environ.get("RANK", "0") == "0":  # once under deepspeed
            print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)
        user_arch = explicit_model_keys(args.config, args.overrides, cfg.model)
        # before the evaluation: an unwritable --output costs a second, not the run
        check_output(args.output, watch=bool(args.watch))
        if args.watch:
            run_watch(args, cfg, user_arch, table)
        else:
            run_once(args, cfg, user_arch, setup_distributed(cfg.eval.protocol), table)


def command() -> None:
    """``vit-transfer`` and ``-m pretrain.transfer``: ``main`` as the whole process, which ends with
    its code and without the interpreter's finalization (``pretrain.distributed.process.program``)."""
    from pretrain.distributed.process import program

    program(main)


if __name__ == "__main__":
    command()
