"""VTAB-1k protocol: the sweep selects on train800 -> val200 only and retrains on train800val200;
the whole suite end to end through the CLI with tasks missing."""
import json

import pytest
from transfer_fixtures import exported_metadata, save_safetensors, tiny_model, write_vtab_task

from pretrain.transfer import suites
from pretrain.transfer.cli import main
from pretrain.transfer.sweep import run_task


class Recording:
    """A protocol whose score is a table lookup by (setting, eval split): it records which splits
    each fit/score saw. The sweep is what is under test."""

    name = "toy"

    def __init__(self, scores: dict):
        self.scores, self.calls = scores, []

    def grid(self, sweep):
        return [{"c": 1}, {"c": 2}, {"c": 3}] if sweep else [{"c": 1}]

    def fit_score(self, task, fit, evaluate, setting):
        self.calls.append((fit.name, evaluate.name, setting["c"]))
        return self.scores[(setting["c"], evaluate.name.split("/")[1])], {}


@pytest.fixture(scope="module")
def vtab_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vtab-1k")
    write_vtab_task(root, "eurosat", n_classes=4, counts=(40, 20), n_test=40, seed=0)
    write_vtab_task(root, "clevr_count", n_classes=4, counts=(40, 20), n_test=40, seed=1)
    return root


def test_sweep_selects_on_val200_only_and_retrains_on_train800val200(vtab_root):
    task = suites.vtab1k(str(vtab_root), ["eurosat"])[0][0]
    # c=2 is best on val200; c=3 would be best on test -- the sweep must never see that
    scores = {(1, "val200"): 0.5, (2, "val200"): 0.8, (3, "val200"): 0.7,
              (1, "test"): 0.1, (2, "test"): 0.6, (3, "test"): 0.99}
    proto = Recording(scores)
    r = run_task(proto, task, sweep=True, log=lambda m: None)
    assert proto.calls == [("eurosat/train800", "eurosat/val200", 1), ("eurosat/train800", "eurosat/val200", 2),
                           ("eurosat/train800", "eurosat/val200", 3), ("eurosat/train800val200", "eurosat/test", 2)]
    assert r.setting == {"c": 2} and r.accuracy == 0.6 and r.num_train == 60 and r.num_test == 40
    assert [v["accuracy"] for v in r.val_accuracy] == [0.5, 0.8, 0.7]


def test_sweep_ties_take_the_first_setting_and_no_sweep_skips_val(vtab_root):
    task = suites.vtab1k(str(vtab_root), ["eurosat"])[0][0]
    tied = Recording({(1, "val200"): 0.7, (2, "val200"): 0.9, (3, "val200"): 0.9, (2, "test"): 0.5, (1, "test"): 0.4})
    assert run_task(tied, task, sweep=True, log=lambda m: None).setting == {"c": 2}
    single = Recording({(1, "test"): 0.4})
    r = run_task(single, task, sweep=False, log=lambda m: None)
    assert single.calls == [("eurosat/train800val200", "eurosat/test", 1)] and r.val_accuracy == []


def test_vtab_linear_suite_end_to_end_with_missing_tasks(vtab_root, tmp_path, capsys):
    ckpt = save_safetensors(tiny_model(32), tmp_path / "tiny.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=1234, grid=(2, 2)))
    out = tmp_path / "results.json"
    main(["--checkpoint", str(ckpt), "--suite", "vtab1k", "--protocol", "linear", "--data-root", str(vtab_root),
          "--output", str(out), "eval.workers=0", "eval.sweep_linear_l2=[0.0001,0.1]"])
    doc = json.loads(out.read_text())
    assert doc["step"] == 1234 and doc["sweep"] is True and doc["protocol"] == "linear"
    assert set(doc["tasks"]) == {"eurosat", "clevr_count"}
    for name, r in doc["tasks"].items():
        assert [v["setting"] for v in r["val_accuracy"]] == [{"l2": 0.0001}, {"l2": 0.1}]
        assert r["setting"] in ({"l2": 0.0001}, {"l2": 0.1}) and r["num_train"] == 60 and r["num_test"] == 40
        assert r["accuracy"] >= 0.75, (name, r)  # 4 colour classes: chance 0.25
    assert doc["groups"]["specialized"]["tasks"] == 1 and doc["groups"]["natural"]["mean"] is None
    assert doc["mean"] == pytest.approx(
        (doc["tasks"]["eurosat"]["accuracy"] + doc["tasks"]["clevr_count"]["accuracy"]) / 2)
    assert len(doc["missing"]) == 17 and "eurosat" not in doc["missing"]
    table = capsys.readouterr().out
    assert "| eurosat | specialized |" in table and "| **mean** (2/19) |" in table and "Missing (17)" in table


def test_a_grid_of_one_setting_is_not_said_to_be_swept(vtab_root, tmp_path, capsys):
    """VTAB-1k sweeps by default, but with one L2 penalty there is nothing to choose on val: the
    results and the table's header do not say 'swept on val', and no val fit ran."""
    ckpt = save_safetensors(tiny_model(32), tmp_path / "tiny.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=7, grid=(2, 2)))
    out = tmp_path / "results.json"
    main(["--checkpoint", str(ckpt), "--suite", "vtab1k", "--protocol", "linear", "--data-root", str(vtab_root),
          "--output", str(out), "eval.workers=0", "eval.sweep_linear_l2=[0.0001]", "eval.tasks=[eurosat]"])
    doc = json.loads(out.read_text())
    assert doc["sweep"] is False and doc["tasks"]["eurosat"]["val_accuracy"] == []
    header = capsys.readouterr().out.splitlines()[0]
    assert "vtab1k / linear at 32 px" in header and "swept" not in header, header
