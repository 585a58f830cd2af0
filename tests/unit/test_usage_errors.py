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


CHILD = r"""
import select, sys, time
from data_pipeline.errors import cli_errors

with cli_errors("prog", OSError):
    print("first", flush=True)
    if sys.argv[1] == "socket":  # a connection of its own broke: not the reader of stdout
        raise BrokenPipeError(32, "Broken pipe")
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    deadline = time.monotonic() + 30
    while not any(ev & select.POLLERR for _, ev in poll.poll(100)) and time.monotonic() < deadline:
        pass  # until the reader has closed its end
    for i in range(100):
        print("line", i)
"""


@pytest.mark.parametrize("case", ["reader", "socket"])
def test_a_reader_gone_early_ends_the_command_quietly(tmp_path, case):
    """`vit-launch plan ... | head -1`: the reader closes the pipe while the command still prints; no
    "error: [Errno 32] Broken pipe" (a user error it is not) and no traceback at exit. A broken
    pipe of another kind (a connection the command opened) is still the error it is."""
    import subprocess
    from pathlib import Path

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), case], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])
    if case == "reader":
        assert proc.stdout.readline() == b"first\n"
        proc.stdout.close()  # as head does after its lines
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
        assert (code, err) == (1, ""), (code, err)
    else:  # stdout read to its end
        out, err = proc.communicate(timeout=60)
        assert out == b"first\n" and proc.returncode == 2, (proc.returncode, err)
        assert err.decode().strip() == "prog: error: [Errno 32] Broken pipe", err
