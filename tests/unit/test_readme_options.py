"""Every option of every command's ``--help`` is in the README or a guide (any ``*.md`` under
``pretrain/``, ``data_pipeline/``, ``launch/``), and every ``--option`` they show belongs to a command.

The parsers are the real ones: each command's ``main`` is called with ``parse_known_args``
replaced by a catch, so the parser it built is read back without running anything. Commands:
the console scripts of setup.py (``vit-launch`` once per subcommand) and the ``python -m``
modules the README names. The README's format: each option appears literally as ``--option``.
Options of other programs that the README shows (the deepspeed runner's, read from DeepSpeed's
own parser; the benchmark scripts' it runs, from theirs; sbatch's) are named below with where they
come from.
"""
import argparse
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
from dist_utils import console_scripts

REPO = Path(__file__).resolve().parents[2]
# the README and the guides beside the code: every *.md under the three packages
DOCS = [REPO / "README.md"] + sorted(p for d in ("pretrain", "data_pipeline", "launch")
                                     for p in (REPO / d).rglob("*.md"))
README = "\n".join(p.read_text() for p in DOCS)
OPTION = re.compile(r"(?<![\w-])--[a-zA-Z][a-zA-Z0-9]*(?:[-_][a-zA-Z0-9]+)*")
# sbatch's own flags, written into the generated script (README "SLURM"; launch/slurm.py)
SBATCH = {"--exclusive", "--gres", "--open-mode", "--signal", "--requeue", "--output", "--time", "--partition",
          "--account", "--job-name", "--nodes", "--gpus-per-node", "--ntasks-per-node", "--cpus-per-task",
          "--array", "--dependency", "--parsable"}  # the last three: submitting a shard-writing job array
PYTEST = {"--maxfail"}  # none shown today; pytest's flags would go here


class _Caught(Exception):
    def __init__(self, parser):
        self.parser = parser


def built_parser(main, name: str) -> argparse.ArgumentParser:
    """The parser ``main`` builds, caught when it parses, without running the command."""
    real = argparse.ArgumentParser.parse_known_args

    def catch(self, *a, **k):
        raise _Caught(self)

    argparse.ArgumentParser.parse_known_args = catch
    try:
        main([]) if inspect.signature(main).parameters else main()
    except _Caught as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_known_args = real
    raise AssertionError(f"{name} built no parser")


def parser_of(target: str) -> argparse.ArgumentParser:
    """The parser ``module:function`` builds (``main`` by default), without running the command."""
    module, _, fn = target.partition(":")
    fn = "main" if fn == "command" else fn  # a command runs main as its whole process: main's parser
    return built_parser(getattr(importlib.import_module(module), fn or "main"), target)


def benchmark_options() -> set[str]:
    """The options of the benchmark scripts the docs run (``python benchmarks/NAME.py``), from their parsers."""
    out = set()
    for name in sorted(set(re.findall(r"python benchmarks/(\w+)\.py", README))):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(module)
        out |= options(built_parser(module.main, f"benchmarks/{name}.py"))
    return out


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions if a.help != argparse.SUPPRESS
            for o in a.option_strings if o.startswith("--") and o != "--help"}


def commands() -> dict[str, set[str]]:
    """Command name -> its options, for every console script and every ``python -m`` module the README names."""
    from launch.cli import COMMANDS, parser

    out = {}
    for name, target in console_scripts().items():
        if name == "vit-launch":
            out.update({f"vit-launch {c}": options(parser(c)) for c in COMMANDS})
        else:
            out[name] = options(parser_of(target))
    for module in sorted(set(re.findall(r"python -m ((?:launch|pretrain|data_pipeline)[\w.]*)", README))):
        if module not in ("launch", "pretrain.transfer"):  # = vit-launch / vit-transfer, read above
            out[f"python -m {module}"] = options(parser_of(module))
    return out


def deepspeed_runner_options() -> set[str]:

    return options(parser_of("deepspeed.launcher.runner:parse_args"))


@pytest.fixture(scope="module")
def cmds():
    return commands()


# every command: the console scripts, each vit-launch subcommand, each ``python -m`` module the docs name
NAMED = ["vit-launch run", "vit-launch check", "vit-launch plan", "vit-launch slurm", "vit-launch sweep",
         "vit-transfer", "vit-shards", "vit-train", "vit-export", "vit-config", "vit-analyze", "vit-audit",
         "vit-flops", "python -m launch.demo", "python -m data_pipeline.loading.plan",
         "python -m data_pipeline.write_shards", "python -m launch.plot_scaling",
         "python -m pretrain.checkpointing.elastic", "python -m pretrain.export", "python -m pretrain.train",
         "python -m launch.supervise"]


@pytest.mark.parametrize("command", NAMED)
def test_every_option_of_the_command_is_in_the_readme(cmds, command):
    missing = sorted(o for o in cmds[command] if not re.search(re.escape(o) + r"(?![\w-])", README))
    assert not missing, f"{command}: options in --help but not in README.md or a guide: {missing}"


def test_every_command_is_checked(cmds):
    """A new console script, vit-launch command or documented module joins NAMED, so its options are
    checked too."""
    assert sorted(cmds) == sorted(NAMED), (sorted(set(cmds) - set(NAMED)), sorted(set(NAMED) - set(cmds)))


def test_every_option_in_the_readme_belongs_to_a_command(cmds):
    ours = set().union(*cmds.values(), {"--help"})
    foreign = deepspeed_runner_options() | benchmark_options() | SBATCH | PYTEST
    unknown = sorted(set(OPTION.findall(README)) - ours - foreign)
    assert not unknown, f"README.md or a guide shows options no command has: {unknown}"


def test_the_check_sees_a_made_up_option():
    assert "--frobnicate" in set(OPTION.findall("run `vit-launch --frobnicate` now")) - options(parser_of("launch.cli"))


def test_the_workflow_says_how_to_resume_and_where_throughput_and_mfu_go():
    """The README's workflow tells a new user that the same command resumes, and where throughput and
    MFU are logged, with the keys `throughput` writes; and that MFU is absent on the CPU, as it is."""
    from pretrain.observability.metrics import throughput

    text = (REPO / "README.md").read_text()
    flow = text[text.index("## Typical workflow"):text.index("## Configuration")]
    said = " ".join(ln.lstrip("# ").strip() for ln in flow.splitlines() if ln.startswith("#"))
    assert "the same command resumes" in said and "metrics.jsonl" in said and "W&B" in said, said
    assert "progress line on stderr" in said and "on the CPU" in said and "it is absent" in said, said
    keys = re.search(r"metrics\.jsonl \(([a-z_, ]+)\)", said).group(1).split(", ")
    on_gpu = throughput(640, 2.0, 8, 1e9, 1.2e9, peak=312e12)
    on_cpu = throughput(640, 2.0, 8, 1e9, 1.2e9, peak=None)
    assert keys == ["images_per_sec", "tflops_per_device", "mfu"] and set(keys) <= set(on_gpu), keys
    assert "mfu" not in on_cpu and {"images_per_sec", "tflops_per_device"} <= set(on_cpu)
