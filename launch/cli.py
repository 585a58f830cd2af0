"""``vit-launch``: start pre-training through the deepspeed runner, on one node or many.

    vit-launch [run] --config FILE [--hostfile H] [--num-nodes N] [--gpus-per-node G]
               [--master-addr A] [--master-port P] [--include S | --exclude S]
               [--gpu-memory-gb 80] [--skip-checks] [--dry-run] [a.b=c ...]
    vit-launch check --config FILE [same resource options] [--world-size W] [a.b=c ...]
    vit-launch plan --model NAME --gpu GPU --nodes N --gpus-per-node G --micro-batch B [--search] [--json]
    vit-launch plan --config FILE --world-size W --gpu GPU [a.b=c ...]
    vit-launch slurm --config FILE --nodes N --gpus-per-node G [--partition P] [--time T]
               [--launcher pdsh|srun] --output job.sbatch [a.b=c ...]
    vit-launch slurm --shards --parts N --output shards.sbatch [...] -- VIT-SHARDS OPTIONS
    vit-launch sweep --config FILE --world-sizes 1,2,4,8 [--steps 50] [--scaling weak|strong]
               [--dry-run] [a.b=c ...]

Each command is a module of ``launch/commands/`` (its summary, description, options, argument
checks and function); ``COMMANDS`` lists them, in the order ``vit-launch --help`` shows them.
``main`` parses, checks the arguments before any work, and runs the command inside ``cli_errors``:
every user mistake is raised and becomes one line on stderr and exit code 2, here alone.
"""
from __future__ import annotations

import argparse
import sys
import textwrap

from data_pipeline.errors import DataError, Parser, cli_errors
from launch.commands import check, plan, run, slurm, sweep
from launch.commands.options import PROG
from launch.plot_scaling import PlotError
from launch.slurm_shards import shards_main

COMMANDS = {"run": run, "check": check, "plan": plan, "slurm": slurm, "sweep": sweep}
DEFAULT = "run"  # what `vit-launch` without a command runs


def parser(name: str) -> argparse.ArgumentParser:
    """The parser of command ``name``; the default command's is also ``vit-launch --help``, which
    lists the commands, one line each."""
    command = COMMANDS[name]
    if name == DEFAULT:
        width = max(map(len, COMMANDS))
        listing = "\n".join(f"  {c:<{width}}  {m.SUMMARY}" for c, m in COMMANDS.items())
        epilog = (f"commands:\n{listing}\n\n`{PROG} COMMAND --help` shows a command's options; "
                  "without a command, run.")
        ap = Parser(prog=PROG, usage=f"{PROG} [{'|'.join(COMMANDS)}] --config FILE [options] [a.b=c ...]",
                    description=textwrap.fill(command.DESCRIPTION, 88), epilog=epilog,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        ap = Parser(prog=f"{PROG} {name}", description=command.DESCRIPTION)
    command.add_arguments(ap)
    return ap


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in COMMANDS else DEFAULT
    if name == "slurm" and slurm.shards_asked(argv):
        shards_main(argv)  # a vit-shards job array: its own options, no training config; it exits
    args = parser(name).parse_intermixed_args(argv)
    command = COMMANDS[name]
    with cli_errors(PROG, DataError, PlotError, OSError):  # OSError: an unwritable --output, say
        command.check_arguments(args)
        code = command.command(args)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
