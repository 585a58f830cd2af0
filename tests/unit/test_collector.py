"""The garbage collector around vit-train's start-up (pretrain/perf/collector.py): off while the
program imports, on again, with the imports frozen, before the run starts."""
import json
import subprocess
import sys
import textwrap

from dist_utils import REPO

PROGRAM = textwrap.dedent("""
    import atexit, gc, json, runpy, sys
    passes = []  # (generation, frozen objects) of each collector pass
    gc.callbacks.append(lambda phase, info: phase == "start" and passes.append((info["generation"],
                                                                                 gc.get_freeze_count())))
    # the program ends its own process (pretrain.distributed.process.program), exit handlers run
    atexit.register(lambda: print(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                                              "passes": passes})))
    sys.argv = ["vit-train", "--config", sys.argv[1]]
    runpy.run_module("pretrain.train", run_name="__main__", alter_sys=True)
""")


def test_vit_train_imports_without_collector_passes_then_runs_with_the_collector_on(tmp_path):
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "missing.yaml")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 2 and "missing.yaml" in r.stderr  # the config is read after the imports
    assert out["enabled"] and out["frozen"] > 100_000  # torch and DeepSpeed's objects, frozen
    # no pass walked them while they were imported (with the collector on: about 900 passes, 6 of them
    # full); the young generation's few passes before the module's first line remain
    before = [gen for gen, frozen in out["passes"] if frozen == 0]
    assert len(before) < 10 and max(before, default=0) == 0, before
