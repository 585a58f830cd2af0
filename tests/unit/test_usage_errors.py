"""Every command answers a usage mistake (an option it does not know, a required one missing) with
one line naming itself and exit 2, before any work: argparse's usage block is left to ``--help``
(``data_pipeline.errors.Parser``). The console scripts are read from setup.py, so a new one is
held to it too."""
import ast
import importlib.util
import runpy
import sys

import pytest
from dist_utils import console_scripts

# commands run as modules, beside the console scripts: {what each calls itself: its module}
MODULES = {"vit-elastic": "pretrain.checkpointing.elastic", "vit-demo": "launch.demo",
           "plot_scaling": "launch.plot_scaling", "python -m data_pipeline.loading.plan": "data_pipeline.loading.plan"}


@pytest.mark.parametrize("name,module,argv", [
    *[(n, target.partition(":")[0], ["--no-such-option"]) for n, target in console_scripts().items()],
    *[(n, m, ["--no-such-option"]) for n, m in MODULES.items()],
    ("vit-launch plan", "launch.cli", ["plan", "--no-such-option"]),
])
def test_a_usage_mistake_is_one_line(capsys, name, module, argv):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"{name}: error: "), err


# every module a command is run as with `python -m`: the console scripts' and the aliases the docs name
RUN_AS_MODULES = sorted({t.partition(":")[0] for t in console_scripts().values()} | set(MODULES.values())
                        | {"data_pipeline.write_shards", "pretrain.export", "pretrain.flops"})


@pytest.mark.parametrize("module", RUN_AS_MODULES)
def test_python_m_runs_the_command(module):
    """Without the `if __name__ == "__main__":` call, `python -m MODULE` imported it and exited 0,
    having done nothing. Read from the source: the guards of vit-train and vit-transfer end the
    process (``process.program``)."""
    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
    assert any(isinstance(n, ast.Expr) or isinstance(n, ast.Raise) for g in guards for n in g.body), module


def test_python_m_shards_cli_runs_vit_shards(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli.py", "--no-such-option"])
    monkeypatch.delitem(sys.modules, "data_pipeline.shards.cli", raising=False)  # runpy warns of a module imported
    with pytest.raises(SystemExit) as e:
        runpy.run_module("data_pipeline.shards.cli", run_name="__main__", alter_sys=False)
    assert e.value.code == 2 and capsys.readouterr().err.startswith("vit-shards: error: ")
