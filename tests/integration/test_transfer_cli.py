"""vit-transfer from every checkpoint format, its one-line errors, --watch and W&B logging."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transfer_fixtures import (
    exported_metadata,
    save_safetensors,
    tiny_model,
    write_cifar100,
    write_imagefolder,
    write_run_dir,
    write_vtab_task,
)

from pretrain.transfer.cli import main
from pretrain.weights.pretrained import build_backbone, load_pretrained

REPO = Path(__file__).resolve().parents[2]
FAST = ["eval.workers=0", "eval.batch_size=16", "eval.fewshot_shots=[1,5]", "eval.fewshot_seeds=2"]


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("if") / "colours", n_train=8, n_test=6)


# ----------------------------------------------------------------------------- checkpoint formats
def _timm_pth(path: Path):
    import timm

    torch.manual_seed(3)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=7)
    torch.save(m.state_dict(), path)
    return m


@pytest.mark.parametrize("fmt", ["exported", "bare_safetensors", "timm_pth", "run_dir"])
def test_every_checkpoint_format_loads_the_same_backbone(tmp_path, fmt):
    model = tiny_model(32, seed=1)
    if fmt == "exported":
        src = save_safetensors(model, tmp_path / "m.safetensors", exported_metadata(
            {"name": "vit_tiny_patch16_224", "img_size": 32}, step=300, grid=(2, 2), run_id="abc"))
    elif fmt == "bare_safetensors":  # no metadata: the architecture is read from the tensors
        src = save_safetensors(model, tmp_path / "m.safetensors")
    elif fmt == "timm_pth":
        model = _timm_pth(tmp_path / "m.pth")
        src = tmp_path / "m.pth"
    else:
        src = write_run_dir(tmp_path / "run", model, {100: True, 200: True}, final=200)
    pre = load_pretrained(src)
    assert pre.arch["name"] == "vit_tiny_patch16_224" and pre.img_size == 32
    assert pre.step == {"exported": 300, "run_dir": 200}.get(fmt)
    assert pre.wandb_run_id == {"exported": "abc", "run_dir": "run123abc"}.get(fmt)
    ours = build_backbone(pre, img_size=32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # the same pre-logits features as the model the weights came from
        ref = model.forward_head(model.forward_features(x), pre_logits=True)
        assert torch.allclose(ours.forward_head(ours.forward_features(x), pre_logits=True), ref, atol=1e-5)


def test_cli_fewshot_from_a_timm_state_dict_with_model_override(tmp_path, colours, capsys):
    _timm_pth(tmp_path / "timm.pth")
    out = tmp_path / "r.json"
    main(["--checkpoint", str(tmp_path / "timm.pth"), "--suite", "imagefolder", "--protocol", "fewshot",
          "--data-root", str(colours), "--output", str(out), "model.name=vit_tiny_patch16_224", *FAST])
    doc = json.loads(out.read_text())
    assert doc["checkpoint_kind"] == "state_dict" and doc["step"] is None and doc["img_size"] == 32
    assert doc["tasks"]["colours"]["accuracy"] >= 0.75  # chance 0.25
    assert "| colours |" in capsys.readouterr().out


def test_cli_cifar100_linear_sweeps_on_the_minival_cut_from_train(tmp_path):
    write_cifar100(tmp_path / "data", n_train=80, n_test=40)
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    out = tmp_path / "r.json"
    main(["--checkpoint", str(ckpt), "--suite", "cifar100", "--protocol", "linear", "--data-root",
          str(tmp_path / "data" / "cifar-100-python"), "--output", str(out), "eval.sweep=true",
          "eval.sweep_linear_l2=[0.0001,1.0]", "eval.minival_fraction=0.25", *FAST])
    r = json.loads(out.read_text())["tasks"]["cifar100"]
    assert len(r["val_accuracy"]) == 2 and r["num_train"] == 80 and r["num_test"] == 40
    assert r["accuracy"] >= 0.75  # 4 of the 100 fine labels in use: chance is 0.25 at best


# --------------------------------------------------------------------------- kNN, own head, deit
def test_cli_knn_from_an_export(tmp_path, colours, capsys):
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=11, grid=(2, 2)))
    out = tmp_path / "knn.json"
    main(["--checkpoint", str(ckpt), "--suite", "imagefolder", "--protocol", "knn", "--data-root", str(colours),
          "--output", str(out), "eval.knn_k=[3,10]", *FAST])
    r = json.loads(out.read_text())["tasks"]["colours"]
    assert r["accuracy"] >= 0.75 and r["details"]["headline_k"] == 10 and set(r["details"]["k"]) == {"3", "10"}
    table, err = capsys.readouterr()
    assert "| Task | Group | 10-NN top-1 (%) |" in table and "3-NN" in table and "| Train | Test |" in table
    # FAST's few-shot keys are no error under knn (one config serves every protocol), but said once
    notes = [x for x in err.splitlines() if x.startswith("vit-transfer: note:")]
    assert notes == ["vit-transfer: note: eval.protocol=knn ignores eval.fewshot_shots, eval.fewshot_seeds "
                     "(read by fewshot)"], err


def test_cli_own_head_of_a_run_directory_on_a_folder(tmp_path, colours):
    """``--protocol head`` with --data-root the evaluated folder itself: every test image scored by
    the run's own 10-class head, nothing trained."""
    run = write_run_dir(tmp_path / "run", tiny_model(32, seed=2), {4: True}, final=4)
    out = tmp_path / "head.json"
    main(["--checkpoint", str(run), "--suite", "imagefolder", "--protocol", "head", "--data-root",
          str(colours / "test"), "--output", str(out), *FAST])
    doc = json.loads(out.read_text())
    r = doc["tasks"]["test"]
    assert doc["step"] == 4 and r["num_train"] == 0 and r["num_test"] == 24 and r["details"]["head_classes"] == 10
    assert 0.0 <= r["details"]["top1"] == r["accuracy"] <= r["details"]["top5"] <= 1.0


def test_cli_deit_finetune_from_a_timm_state_dict(tmp_path, colours):
    """``--recipe deit`` end to end (AdamW, layer decay, mixing, smoothing, drop path, EMA): learns
    the task; the EMA's accuracy is the result, the trained weights' beside it."""
    _timm_pth(tmp_path / "timm.pth")
    out = tmp_path / "deit.json"
    main(["--checkpoint", str(tmp_path / "timm.pth"), "--suite", "imagefolder", "--protocol", "finetune",
          "--recipe", "deit", "--data-root", str(colours), "--output", str(out), "model.name=vit_tiny_patch16_224",
          "eval.steps=40", "eval.warmup_steps=5", "eval.lr=0.001", *FAST])
    r = json.loads(out.read_text())["tasks"]["colours"]
    recipe = r["details"]["recipe"]
    assert recipe["optimizer"] == "adamw" and recipe["layer_decay"] == 0.65 and recipe["mixup_alpha"] == 0.8
    assert r["accuracy"] >= 0.75 and "accuracy_no_ema" in r["details"], r


# ----------------------------------------------------------------------------------------- errors
def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vit-transfer: error:"), err
    return err[0]


def test_user_mistakes_are_one_line_errors(tmp_path, colours, capsys, shard_kit):
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    vt = tmp_path / "vtab"
    d = write_vtab_task(vt, "eurosat", counts=(4, 4), n_test=4)
    base = ["--output", str(tmp_path / "r.json"), "eval.workers=0"]
    assert "nope.pth: checkpoint not found" in _error(
        capsys, ["--checkpoint", str(tmp_path / "nope.pth"), "--suite", "demo", *base])
    assert "junk.safetensors: not a readable checkpoint" in _error(
        capsys, ["--checkpoint", str(tmp_path / "junk.safetensors"), "--suite", "demo", *base])
    vtab = ["--checkpoint", str(ckpt), "--suite", "vtab1k", "--data-root", str(vt), *base]
    assert "VTAB-1k task 'svhn' not found" in _error(capsys, [*vtab, "eval.tasks=[svhn]"])
    assert "needs --data-root" in _error(capsys, ["--checkpoint", str(ckpt), "--suite", "cifar100", *base])
    assert "unknown key 'eval.stepz'" in _error(capsys, [*vtab, "eval.stepz=3"])
    assert "eval.warmup_steps" in _error(
        capsys, [*vtab, "--protocol", "finetune", "eval.steps=10", "eval.warmup_steps=10"])
    (d / "test.txt").write_text("images/test_0000.png 1\nimages/test_0001.png\n")
    assert "eurosat/test.txt:2: expected 'relative/path label'" in _error(capsys, vtab)
    (d / "test.txt").unlink()
    assert "eurosat/test.txt: split file not found" in _error(capsys, vtab)
    assert "--suite: invalid choice" in _error(capsys, ["--checkpoint", str(ckpt), "--suite", "imagenet"])
    one = [[("000000", {"jpg": shard_kit.image_bytes(), "cls": b"0"})]]
    shard_kit.make_shards(tmp_path / "own" / "train", one, ["a", "b", "c"])
    shard_kit.make_shards(tmp_path / "own" / "test", one, ["a", "c", "b"], prefix="test")
    own = tmp_path / "own"
    assert (f"--suite shards: {own}/test/manifest.json lists the classes of {own}/train/manifest.json "
            "in another order (label 1: 'c' here, 'b' there)") in _error(
        capsys, ["--checkpoint", str(ckpt), "--suite", "shards", "--data-root", str(tmp_path / "own"), *base])
    bigger = save_safetensors(tiny_model(32), tmp_path / "b.safetensors")
    assert "shape mismatch" in _error(capsys, ["--checkpoint", str(bigger), "--suite", "imagefolder", "--data-root",
                                               str(colours), "model.name=vit_small_patch16_224", *base])


def test_module_entry_point_prints_one_line_and_no_traceback(tmp_path):
    (tmp_path / "bad.pth").write_bytes(b"not a torch file")
    p = subprocess.run([sys.executable, "-m", "pretrain.transfer", "--checkpoint", str(tmp_path / "bad.pth"),
                        "--suite", "demo", "--output", str(tmp_path / "r.json")], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "bad.pth" in p.stderr


# ------------------------------------------------------------------------------------------ watch
def test_watch_evaluates_each_complete_checkpoint_once_and_stops_at_the_last(tmp_path, colours):
    run = write_run_dir(tmp_path / "run", tiny_model(32), {10: True, 20: False}, final=20)
    out = tmp_path / "watch.json"
    seen_first: list = []

    def trainer():  # the "training job": finishes checkpoint 20 after the watcher reported 10
        deadline = time.time() + 60
        while time.time() < deadline and not out.exists():
            time.sleep(0.05)
        seen_first.extend(d["step"] for d in json.loads(out.read_text())["evaluations"])
        (run / "checkpoints" / "step_00000020" / "COMPLETE").write_text("{}")
        (run / "checkpoints" / "latest").write_text("step_00000020")

    t = threading.Thread(target=trainer)
    t.start()
    argv = ["--watch", str(run), "--suite", "imagefolder", "--protocol", "fewshot", "--data-root", str(colours),
            "--output", str(out), "eval.watch_poll_s=0.1", "eval.watch_idle_timeout_s=60", *FAST]
    main(argv)
    t.join()
    assert seen_first == [10]  # the half-written step 20 was skipped until marked complete
    docs = json.loads(out.read_text())["evaluations"]
    assert [d["step"] for d in docs] == [10, 20] and all(d["wandb_run_id"] == "run123abc" for d in docs)
    assert all(d["tasks"]["colours"]["accuracy"] >= 0.75 for d in docs)
    main(argv)  # a restarted watcher finds nothing new and stops: the final step is done
    assert [d["step"] for d in json.loads(out.read_text())["evaluations"]] == [10, 20]


def test_watch_refuses_finetune(tmp_path, capsys):
    run = write_run_dir(tmp_path / "run", tiny_model(32), {10: True}, final=10)
    assert "--watch runs fewshot, linear, knn or head" in _error(
        capsys, ["--watch", str(run), "--suite", "demo", "--protocol", "finetune",
                 "--output", str(tmp_path / "w.json")])


# -------------------------------------------------------------------------------------------- W&B
def test_wandb_logs_into_the_pretraining_run_at_its_step(tmp_path, colours, monkeypatch):
    from dist_utils import wandb_history

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=4242, grid=(2, 2), run_id="pre0train1",
        totals={"device_seconds": 9000.0, "images_seen": 4242 * 16, "model_flops": 3.5e15}))
    main(["--checkpoint", str(ckpt), "--suite", "imagefolder", "--protocol", "fewshot", "--data-root", str(colours),
          "--output", str(tmp_path / "r.json"), "eval.wandb=true", "logging.wandb.mode=offline", *FAST])
    runs = list((tmp_path / "wandb").glob("offline-run-*-pre0train1"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    logged = wandb_history(runs[0], "train/step")
    assert logged.get("train/step") == 4242, logged
    assert logged.get("train/device_hours") == 2.5, logged  # in the same row: accuracy against GPU-hours
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["pretraining"] == {"device_hours": 2.5, "images_seen": 4242 * 16, "model_flops": 3.5e15}
    acc = doc["tasks"]["colours"]["accuracy"]
    assert logged["transfer/imagefolder/fewshot/colours"] == pytest.approx(acc)
    assert "transfer/imagefolder/fewshot/colours_5shot" in logged


# --------------------------------------------------------------------- output, progress, headline
@pytest.fixture()
def lockable(tmp_path):
    """A folder and a function that makes it unwritable the way a user trial found it: ``chattr +i``
    as root (root ignores permission bits), ``chmod 0555`` otherwise. Always undone at teardown."""
    d = tmp_path / "locked"
    d.mkdir()
    root = os.geteuid() == 0

    def lock():
        if root:
            subprocess.run(["chattr", "+i", str(d)], check=True)
        else:
            d.chmod(0o555)

    yield d, lock
    if root:
        subprocess.run(["chattr", "-i", str(d)], check=False)
    d.chmod(0o755)


def test_unwritable_output_is_one_line_before_any_work(tmp_path, colours, capsys, lockable, monkeypatch):
    import pretrain.transfer.cli as cli

    d, lock = lockable
    lock()
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    started = []
    monkeypatch.setattr(cli, "load_pretrained", lambda *a, **k: started.append(1))  # the work would start here
    for argv in (["--checkpoint", str(ckpt)], ["--watch", str(tmp_path)]):
        line = _error(capsys, [*argv, "--suite", "imagefolder", "--protocol", "fewshot", "--data-root", str(colours),
                               "--output", str(d / "sub" / "x.json"), *FAST])
        assert f"--output {d}/sub/x.json: cannot write in {d} (" in line and "choose a writable --output" in line
    assert started == [] and list(d.iterdir()) == []  # nothing computed, nothing left behind
    assert "is a folder" in _error(capsys, ["--checkpoint", str(ckpt), "--suite", "demo", "--output", str(tmp_path)])


def test_output_naming_a_file_not_results_leaves_it_and_does_no_work(tmp_path, colours, capsys, monkeypatch):
    """``--output`` naming the checkpoint itself (or any file that is not results of ours) replaced
    it with the results JSON; now one line before any work, the file as it was. A results file is
    replaced as before, and --watch keeps to files of its own kind."""
    import pretrain.transfer.cli as cli

    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    before = ckpt.read_bytes()
    started = []
    monkeypatch.setattr(cli, "load_pretrained", lambda *a, **k: started.append(1))
    for argv in (["--checkpoint", str(ckpt)], ["--watch", str(tmp_path)]):
        line = _error(capsys, [*argv, "--suite", "demo", "--output", str(ckpt)])
        assert line.startswith(f"vit-transfer: error: --output {ckpt}: exists and is not ") and \
            line.endswith("it is left as it is: choose another --output"), line
    single = tmp_path / "r.json"
    single.write_text(json.dumps({"suite": "demo", "protocol": "knn", "tasks": {}}))
    assert "is not --watch results" in _error(capsys, ["--watch", str(tmp_path), "--suite", "demo",
                                                       "--output", str(single)])
    assert ckpt.read_bytes() == before and started == []


def test_output_that_fails_at_the_end_is_saved_in_tmpdir(tmp_path, colours, capsys, lockable, monkeypatch):
    """The folder becomes unwritable while the evaluation runs: the results go to $TMPDIR and the
    one line says where; the table is still printed."""
    import pretrain.transfer.cli as cli

    d, lock = lockable
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    real = cli.evaluate_checkpoint

    def evaluate_then_lock(*a, **k):
        doc = real(*a, **k)
        lock()
        return doc

    monkeypatch.setattr(cli, "evaluate_checkpoint", evaluate_then_lock)
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(ckpt), "--suite", "imagefolder", "--protocol", "fewshot", "--data-root",
              str(colours), "--output", str(d / "x.json"), *FAST])
    out, err = capsys.readouterr()
    assert e.value.code == 2
    errors = [x for x in err.splitlines() if x.startswith("vit-transfer: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    (saved,) = tmpdir.glob("vit-transfer-x-*.json")
    assert errors[0].startswith(f"vit-transfer: error: --output {d}/x.json: cannot write (")
    assert errors[0].endswith(f"); the results are saved in {saved}")
    doc = json.loads(saved.read_text())
    assert doc["tasks"]["colours"]["accuracy"] >= 0.75  # nothing lost
    assert "| colours |" in out


def test_linear_probe_says_what_it_does_while_it_works(tmp_path, colours, capsys):
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    main(["--checkpoint", str(ckpt), "--suite", "imagefolder", "--protocol", "linear", "--data-root", str(colours),
          "--output", str(tmp_path / "r.json"), "eval.sweep=true", "eval.sweep_linear_l2=[0.001,1.0]", *FAST])
    err = capsys.readouterr().err
    # every forward pass over a split and every L-BFGS fit of the sweep is announced (a tqdm bar is
    # added on a terminal); not a silent minute
    assert err.count("  features of ") >= 2 * 2 and "img/s)" in err
    assert "colours linear l2=0.001: logistic regression on" in err and "colours linear l2=1: logistic" in err
    assert err.index("features of") < err.index("logistic regression")


def test_fewshot_headline_names_its_shot_count(tmp_path, colours, capsys):
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    main(["--checkpoint", str(ckpt), "--suite", "imagefolder", "--protocol", "fewshot", "--data-root", str(colours),
          "--output", str(tmp_path / "r.json"), *FAST])  # shots 1 and 5: no 10, so the headline is 5-shot
    out, err = capsys.readouterr()
    assert "top-1 is 5-shot, mean of 2 seeds" in out and "| Task | Group | 5-shot top-1 (%) |" in out
    # the 5-shot fits 5 images of each of the 4 classes, drawn from the 32 of the training split
    assert "| Train (shots x classes of pool) | Test |" in out and "| 5 x 4 of 32 | 24 |" in out, out
    assert "test 5-shot top-1 (mean of 2 seed(s))" in err and "note:" not in err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["tasks"]["colours"]["details"]["headline_shots"] == 5


def test_progress_lines_in_a_log_file(tmp_path, colours, capsys, monkeypatch):
    """stderr is not a terminal (no tqdm bar): with VITSCALE_PROGRESS_S=0 every batch of the
    feature pass and every L-BFGS evaluation prints a progress line."""
    import re

    monkeypatch.setenv("VITSCALE_PROGRESS_S", "0")
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors")
    main(["--checkpoint", str(ckpt), "--suite", "imagefolder", "--protocol", "linear", "--data-root", str(colours),
          "--output", str(tmp_path / "r.json"), *FAST])  # batch 16: 32 train images, 24 test
    out, err = capsys.readouterr()
    feats = [x for x in err.splitlines() if re.fullmatch(r"  features \S+: \d+/\d+ img \(\d+%\), [\d.]+ img/s", x)]
    assert [x.split(":")[1].split()[0] for x in feats] == ["16/32", "32/32", "16/24", "24/24"], err
    fits = [x for x in err.splitlines() if x.startswith("  L-BFGS colours l2=")]
    assert fits and all(re.search(r": \d+ evals \(at most 625\), [\d.]+ evals/s, loss \d+\.\d{4}$", x) for x in fits)
    assert [int(x.split(": ")[1].split()[0]) for x in fits] == list(range(1, len(fits) + 1))
    assert "img/s" not in out and "evals" not in out  # stdout keeps the results table alone


def test_progress_throttle_and_interval(monkeypatch):
    import io

    from data_pipeline.errors import ConfigError
    from pretrain.observability.progress import Progress, Throttle, interval_from_env

    now = [0.0]
    t = Throttle(10.0, clock=lambda: now[0])
    due = []
    for now[0] in (1, 9.9, 10, 12, 19.9, 20.5, 50):
        due.append(t.due())
    assert due == [False, False, True, False, False, True, True]
    buf, now[0] = io.StringIO(), 0.0
    with Progress(1000, "features x", "img", interval_s=10, file=buf, clock=lambda: now[0]) as p:
        for now[0] in range(1, 26):
            p.update(40)
    assert buf.getvalue().splitlines() == ["features x: 400/1000 img (40%), 40 img/s",
                                           "features x: 800/1000 img (80%), 40 img/s"]
    monkeypatch.setenv("VITSCALE_PROGRESS_S", "2.5")
    assert interval_from_env() == 2.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("VITSCALE_PROGRESS_S", bad)
        with pytest.raises(ConfigError, match="VITSCALE_PROGRESS_S"):
            interval_from_env()
