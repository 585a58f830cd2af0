"""Pre-flight checks (`vit-launch check`, and `vit-launch` before it starts the runner): each
failure on real shards and folders, with the one line that says what to change."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
from dist_utils import REPO

from data_pipeline.shards.manifest import ShardSet
from launch import preflight
from launch.cli import main
from pretrain.config import load_config
from pretrain.models.arch import config_macs
from pretrain.observability.flops import train_flops_per_image
from pretrain.perf import levers, memory
from pretrain.perf.memory import checkpoint_bytes, model_shape

CONFIG = "configs/tiny_cpu.yaml"


@pytest.fixture()
def id_dir(tmp_path, shard_kit):
    """8 real shards of 12 samples with manifest.json (byte sizes recorded); labels 0-95 -> 96 classes."""
    return shard_kit.id_shards(tmp_path / "shards", [12] * 8)


def args(id_dir, tmp_path, *extra):
    return ["--config", CONFIG, f"data.train_shards={id_dir}/manifest.json", f"train.output_dir={tmp_path / 'run'}",
            "model.num_classes=96", "train.micro_batch_size=4", "train.global_batch_size=8", "data.workers=2", *extra]


def check(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["check", *argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err.strip().splitlines()


def the_error(capsys, argv, topic):
    code, out, err = check(capsys, argv)
    assert code == 2, (out, err)
    errors = [x for x in err if x.startswith("vit-launch: error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"vit-launch: error: {topic}: "), errors[0]
    return errors[0]


def test_all_checks_pass_without_touching_a_device(capsys, id_dir, tmp_path):
    code, out, err = check(capsys, args(id_dir, tmp_path, "--gpus-per-node", "2"))
    assert code == 0 and err == [], err
    topics = [line.split(":")[0].strip() for line in out.splitlines()[1:]]
    assert topics == ["ok  batch", "ok  manifest", "ok  shards", "ok  plan", "ok  run dir", "ok  memory"]
    assert ("96 samples in 8 shards on 2 rank(s) x 2 worker(s), batch 4: 12 batches per rank per epoch; "
            "96 samples used, 0 dropped (0.000%) per epoch") in out
    assert "global 8 = micro 4 x 2 rank(s) x 1 accumulation step(s)" in out
    assert "4 reader slot(s) = 2 rank(s) x 2 worker(s)" in out
    # pre-flight must not claim a GPU or start a process group (it runs on the launching node)
    assert not torch.cuda.is_initialized() and not torch.distributed.is_initialized()
    assert not (tmp_path / "run").exists()  # and leaves nothing behind


def test_missing_shard(capsys, id_dir, tmp_path):
    os.remove(id_dir / "train-000003.tar")
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "1"), "manifest")
    assert f"1 of 8 shard(s) do not match {id_dir}/manifest.json, first {id_dir}/train-000003.tar: missing" in line
    assert "re-copy them or re-write the shards" in line


def test_truncated_shard(capsys, id_dir, tmp_path):
    p = id_dir / "train-000005.tar"
    size = p.stat().st_size
    os.truncate(p, size - 1024)  # an interrupted copy
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "1"), "manifest")
    assert f"train-000005.tar: {size - 1024} bytes, the manifest says {size}" in line


def test_file_that_is_not_a_tar(capsys, id_dir, tmp_path):
    p = id_dir / "train-000001.tar"
    p.write_bytes(b"<html>403 Forbidden</html>".ljust(p.stat().st_size, b" "))  # same size, wrong content
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "1"), "manifest")
    assert "train-000001.tar: does not start with a tar header" in line


def test_reader_slots_share_shards_but_each_needs_a_batch(capsys, id_dir, tmp_path):
    # 8 shards feed 12 reader slots: slots take sample ranges, not whole shards
    code, out, err = check(capsys, args(id_dir, tmp_path, "--world-size", "2", "data.workers=6"))
    assert code == 0, err
    assert "on 2 rank(s) x 6 worker(s), batch 4: 12 batches per rank per epoch; 96 samples used, 0 dropped" in out
    # 96 samples cannot give 16 ranks x 2 workers a batch of 4 each
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "16", "train.global_batch_size=64"), "shards")
    assert "each of the 32 reader slots (16 rank(s) x 2 worker(s)) gets fewer than batch_size=4 samples" in line
    assert "use more data, a smaller batch or fewer workers" in line


def test_classes_must_match_the_model(capsys, id_dir, tmp_path):
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "1", "model.num_classes=10"), "shards")
    assert "model.num_classes=10 but" in line and "set model.num_classes=96" in line


def test_multi_label_shards_need_data_multi_label(capsys, tmp_path, shard_kit):
    """Multi-label shards (a filelist with several labels a line) keep each sample's first label in .cls
    too: read single-label, the run would train on it alone. Single-label shards read as multi-label are
    sigmoid targets of one class (big_vision's ImageNet-21k recipe): allowed."""
    samples = [(f"{i:06d}", {"jpg": shard_kit.image_bytes(), "cls": b"0", "json": b'{"labels": [0, 2]}'})
               for i in range(16)]
    multi = shard_kit.make_shards(tmp_path / "multi", [samples[:8], samples[8:]], ["a", "b", "c"], multi_label=True)
    argv = ["--config", CONFIG, f"data.train_shards={multi}/manifest.json", f"train.output_dir={tmp_path / 'run'}",
            "model.num_classes=3", "train.micro_batch_size=4", "train.global_batch_size=8", "data.workers=1",
            "--world-size", "2"]
    line = the_error(capsys, argv, "shards")
    assert line.endswith(f"shards: data.multi_label=false but {multi}/manifest.json holds multi-label samples, of "
                         "which it would train on each one's first label alone; set data.multi_label=true"), line
    code, out, err = check(capsys, argv + ["data.multi_label=true"])
    assert code == 0, (out, err)
    single = ShardSet((), ("a", "b"), False, ("t/manifest.json",))
    assert single.config_problem(2, multi_label=True) is None and single.config_problem(2, False) is None


def test_batch_arithmetic(capsys, id_dir, tmp_path):
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "3"), "batch")
    assert line == ("vit-launch: error: batch: train.global_batch_size=8 is not divisible by train.micro_batch_size "
                    "x world size = 4 x 3 = 12; e.g. train.global_batch_size=12")  # one suggestion, not two


@pytest.mark.parametrize("extra, needle", [
    (["train.precision=bf16", "zero.stage=0"], "zero.stage=0 with train.precision=bf16: "),
    (["train.reduce_dtype=bf16"], "train.reduce_dtype=bf16 with train.precision=fp32: "),
])
def test_a_pair_deepspeed_refuses_fails_before_the_gpus(capsys, id_dir, tmp_path, extra, needle):
    """What start-up would refuse when it builds the DeepSpeed config, after the GPUs are claimed."""
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "2", *extra), "deepspeed")
    assert line.startswith(f"vit-launch: error: deepspeed: {needle}"), line


def test_batch_advice_divides_every_schedule_phase(capsys, id_dir, tmp_path):
    """A phase's micro batch (8) x 3 ranks does not divide the global batch 16: the advice was
    train.global_batch_size=12, a multiple of train.micro_batch_size (4) x 3 alone, which 8 x 3
    does not divide either."""
    sched = "train.resolution_schedule=[[0.0, 32, 8], [0.5, 64]]"
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "3", "train.global_batch_size=16", sched), "batch")
    assert "micro batch 8 x world size 3 = 24 does not divide train.global_batch_size=16" in line
    assert line.endswith("; e.g. train.global_batch_size=24")


def test_validation_shards_must_carry_the_training_labels(capsys, id_dir, tmp_path, shard_kit):
    """data.val_shards is read with the training head's labels: the same class list, in the same order."""
    val = ["validation.every_steps=2"]
    same = shard_kit.id_shards(tmp_path / "same", [12] * 8)  # s0 ... s95, as the training shards
    code, out, err = check(capsys, args(id_dir, tmp_path, "--world-size", "2", *val,
                                        f"data.val_shards={same}/manifest.json"))
    assert code == 0 and not [x for x in err if "shards" in x], (out, err)
    classes = [f"s{i}" for i in range(96)]
    swapped = shard_kit.make_shards(tmp_path / "swapped", [[("000000", {"jpg": shard_kit.image_bytes(), "cls": b"0"})]],
                                    classes[1::-1] + classes[2:], prefix="val")
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "2", *val,
                                  f"data.val_shards={swapped}/manifest.json"), "shards")
    assert (f"data.val_shards: {swapped}/manifest.json lists the classes of {id_dir}/manifest.json in another "
            "order (label 0: 's1' here, 's0' there)") in line
    fewer = shard_kit.id_shards(tmp_path / "fewer", [12])
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "2", *val,
                                  f"data.val_shards={fewer}/manifest.json"), "shards")
    assert f"lists 12 classes against the 96 of {id_dir}/manifest.json (e.g. 's12' only in {id_dir}" in line
    # without validation while training the val shards are not read
    code, out, err = check(capsys, args(id_dir, tmp_path, "--world-size", "2",
                                        f"data.val_shards={fewer}/manifest.json"))
    assert code == 0, (out, err)


def test_validation_on_the_training_shards_is_a_warning(capsys, id_dir, tmp_path):
    """Validation shards that are training shards (named through another path too) score images the
    model trains on: said, naming one, and the launch goes on (other shards with the same labels say
    nothing: the test above)."""
    (tmp_path / "link").symlink_to(id_dir)
    code, out, err = check(capsys, args(id_dir, tmp_path, "--world-size", "2", "validation.every_steps=2",
                                        f"data.val_shards={tmp_path / 'link'}"))
    assert code == 0 and err == [
        f"vit-launch: warning: shards: data.val_shards: 8 of its 8 shard(s) are also training shards (e.g. "
        f"{tmp_path / 'link' / 'train-000000.tar'}): its loss and accuracy score images the model trains on, not "
        "held-out ones"], (out, err)


def test_a_synthetic_run_reads_no_shards(capsys, tmp_path):
    """data.synthetic trains on random batches made on the device: no training shards to find."""
    code, out, err = check(capsys, ["--config", CONFIG, "--world-size", "2", "data.synthetic=true",
                                    "data.train_shards=/nonexistent/manifest.json", f"train.output_dir={tmp_path}/run",
                                    "train.micro_batch_size=4", "train.global_batch_size=8"])
    assert code == 0 and "  ok  shards: none read: data.synthetic=true" in out, (out, err)


def test_labels_of_a_multi_label_set_are_not_a_single_label_set_s():
    train = ShardSet((), ("a", "b"), False, ("t/manifest.json",))
    assert train.labels_problem(train) is None
    multi = ShardSet((), ("a", "b"), True, ("v/manifest.json", "w/manifest.json"))
    assert multi.labels_problem(train) == ("data.val_shards: v/manifest.json (+1 more) is multi-label but "
                                           "t/manifest.json is single-label; write both from one kind of source")


def test_run_dir_not_writable(capsys, id_dir, tmp_path):
    (tmp_path / "afile").write_text("x")
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "1", f"train.output_dir={tmp_path}/afile/run"),
                     "run dir")
    assert f"train.output_dir={tmp_path}/afile/run: {tmp_path}/afile is a file, not a folder" in line


def test_disk_space_for_checkpoints(id_dir, tmp_path):
    cfg = load_config(CONFIG, args(id_dir, tmp_path)[1:][1:] + ["checkpoint.keep_last=3"])
    free = shutil.disk_usage(tmp_path).free
    # a model whose checkpoint cannot fit on this disk at all
    (f,) = preflight.check_run_dir(cfg, params=10 ** 14)
    assert f.level == "error" and "free but a checkpoint is about" in f.message and "set checkpoint.dir" in f.message
    # one checkpoint (half the free space) fits, keep_last=3 (+1 being written) does not: refused,
    # since the run would fail at its second save
    params = int(free / 2 / (checkpoint_bytes(1, "fp32")))
    (f,) = preflight.check_run_dir(cfg, params=params)
    assert f.level == "error" and "checkpoint.keep_last=3 (+1 while saving) holds 4: the 4 still to write" in f.message
    assert "lower checkpoint.keep_last" in f.message


def test_a_resume_needs_free_space_for_the_checkpoints_still_to_write(id_dir, tmp_path):
    """Resuming beside 2 complete checkpoints with keep_last=3: the 2 there hold their space already,
    so the free space is measured against the 2 still to write (keep_last + 1 while saving, less
    those), and the line says that figure is what is still needed, not what the folder will hold."""
    cfg = load_config(CONFIG, args(id_dir, tmp_path)[1:][1:] + ["checkpoint.keep_last=3"])
    for step in (4, 8):
        ckpt = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "COMPLETE").write_text("{}")
    free = shutil.disk_usage(tmp_path).free
    params = int(free / 1.5 / checkpoint_bytes(1, "fp32"))  # one fits, the 2 still to write do not
    need = checkpoint_bytes(params, "fp32")
    (f,) = preflight.check_run_dir(cfg, params=params)
    assert f.level == "error", f.message
    assert ("checkpoint.keep_last=3 (+1 while saving) holds 4, 2 there already: the 2 still to write need "
            f"{preflight._gb(2 * need)} more") in f.message, f.message


def test_a_resume_with_changed_shape_keys_is_refused_before_the_gpus(id_dir, tmp_path):
    """A run dir whose newest checkpoint has another model: vit-launch check and the start of
    pretrain.train say so in one line, before any model is built."""
    import json

    from pretrain.config import to_dict

    cfg = load_config(CONFIG, args(id_dir, tmp_path)[1:][1:])
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    saved = to_dict(cfg)
    saved["model"]["name"] = "vit_small_patch16_224"
    (ckpt / "run.json").write_text(json.dumps({"step": 4, "config": saved, "world_size": 1}))
    (ckpt / "COMPLETE").write_text("{}")
    cfg.train.output_dir = str(tmp_path / "run")
    (f,) = preflight.check_run_dir(cfg, params=10 ** 6)
    assert f.level == "error" and f.topic == "resume", f
    assert "model.name=vit_small_patch16_224->vit_tiny_patch16_224" in f.message
    cfg.checkpoint.resume = False  # a fresh start beside them: nothing to resume, they are kept
    (f,) = preflight.check_run_dir(cfg, params=10 ** 6)
    assert f.level == "ok" and "checkpoint.resume=false: the 1 checkpoint(s) there are kept in earlier-K/" in f.message
    r = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", CONFIG, f"data.train_shards={id_dir}",
                        f"train.output_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model.name=vit_small_patch16_224->vit_tiny_patch16_224" in r.stderr
    assert "building" not in r.stderr  # said before the model build


def test_memory_over_the_device_is_a_warning_with_fixes(capsys, id_dir, tmp_path):
    code, out, err = check(capsys, args(id_dir, tmp_path, "--world-size", "1", "--gpu-memory-gb", "1",
                                        "train.precision=bf16", "zero.reduce_bucket_size=10000000"))
    assert code == 0  # an estimate warns; it does not block the launch
    (line,) = [x for x in err if "memory" in x]
    assert line.startswith("vit-launch: warning: memory: estimated")
    assert "exceeds 0.95 GB, 95 % of 1 GB (--gpu-memory-gb; the rest is the allocator's margin)" in line
    cfg = load_config(CONFIG, ["model.name=vit_huge_patch14_224", "model.img_size=224", "train.micro_batch_size=256",
                               "train.global_batch_size=4096", "train.precision=bf16", "zero.stage=3",
                               "train.activation_checkpointing=false"])
    cfg = levers.resolve(cfg, 16)[0]  # its buckets, as training decides them
    (f,) = preflight.check_memory(cfg, 16, 80, model_shape(cfg.model))
    assert f.level == "warning"
    assert "train.activation_checkpointing=true" in f.message and "train.micro_batch_size=" in f.message
    # op by op fits too, and repeats no matmul: the first fix named
    op_level = memory.estimate(levers.with_checkpointing(cfg, "selective"), 16, model_shape(cfg.model)).total
    assert f"set train.activation_checkpointing=selective ({preflight._gb(op_level)}) or " \
           f"train.activation_checkpointing=true" in f.message
    assert memory.estimate(cfg, 16, model_shape(cfg.model)).total > 80 * memory.GB > op_level
    # the build's host memory: one layer under ZeRO-3 (zero.Init), the whole fp32 model otherwise
    est = memory.estimate(cfg, 16, model_shape(cfg.model))
    assert f"building the model takes {preflight._gb(est.host_build)} host memory per rank (one fp32 layer" in f.message
    (f2,) = preflight.check_memory(preflight._with(cfg, stage=2), 16, 80, model_shape(cfg.model))
    whole = memory.estimate(preflight._with(cfg, stage=2), 16, model_shape(cfg.model)).host_build
    assert f"takes {preflight._gb(whole)} host memory per rank (the whole fp32 model)" in f2.message
    assert whole > 50 * est.host_build


@pytest.mark.parametrize("gb", ["0", "-5", "nan", "eighty"])
def test_a_device_memory_of_none_is_refused_not_warned_against(capsys, tmp_path, gb):
    """``--gpu-memory-gb 0`` warned that 1 GB "exceeds 0.00 GB": every estimate checked against it is
    meaningless, so the option itself is the one line, before any check runs."""
    code, out, err = check(capsys, ["--config", CONFIG, "--gpu-memory-gb", gb, f"train.output_dir={tmp_path}"])
    assert (code, out, err) == (2, "", [f"vit-launch check: error: argument --gpu-memory-gb: must be a number "
                                        f"of GB above 0, got {gb!r}"])


def test_launch_stops_before_the_runner_when_a_check_fails(capsys, id_dir, tmp_path):
    os.remove(id_dir / "train-000000.tar")
    with pytest.raises(SystemExit) as e:
        main(args(id_dir, tmp_path, "--gpus-per-node", "1"))  # no --dry-run: would exec deepspeed
    assert e.value.code == 2
    assert "manifest: 1 of 8 shard(s)" in capsys.readouterr().err


def _rewrite_manifest(id_dir, **counts):
    """Change the sample counts a manifest claims (byte sizes untouched: the tars are intact)."""
    import json

    m = json.loads((id_dir / "manifest.json").read_text())
    for s in m["shards"]:
        s["samples"] = counts.get(s["name"].replace("-", "_").removesuffix(".tar"), s["samples"])
    m["total"] = sum(s["samples"] for s in m["shards"])
    (id_dir / "manifest.json").write_text(json.dumps(m))


def test_manifest_that_overclaims_its_tars_fails_before_the_run(capsys, id_dir, tmp_path):
    """Counts above the tars passed the check and the run failed on "bad samples"."""
    before = {p.name: p.read_bytes() for p in id_dir.glob("*.tar")}
    _rewrite_manifest(id_dir, train_000006=15)
    line = the_error(capsys, args(id_dir, tmp_path, "--world-size", "1", "model.num_classes=96"), "manifest")
    assert line == (f"vit-launch: error: manifest: 1 of 8 counted tar(s) disagree with their manifest, first: "
                    f"{id_dir}/manifest.json says train-000006.tar holds 15 samples but the tar has 12 (-3); "
                    "re-write the shards with vit-shards")
    assert {p.name: p.read_bytes() for p in id_dir.glob("*.tar")} == before  # read, never changed


def test_counting_reads_headers_only_and_samples_many_shards(capsys, shard_kit, tmp_path, monkeypatch):
    root = shard_kit.id_shards(tmp_path / "many", [2] * 100, size=8)
    read = []
    real_open = open

    def counting_open(path, mode="r", *a, **k):  # how many bytes of the tars are read
        f = real_open(path, mode, *a, **k)
        if str(path).endswith(".tar") and "b" in mode:
            r = f.read
            f.read = lambda n=-1: read.append(len(b := r(n))) or b  # noqa: E731
        return f

    monkeypatch.setattr("builtins.open", counting_open)
    monkeypatch.setattr("tarfile.bltn_open", counting_open)  # tarfile's own reference to open
    code, out, err = check(capsys, ["--config", CONFIG, f"data.train_shards={root}/manifest.json", "--world-size", "1",
                                    f"train.output_dir={tmp_path / 'run'}", "model.num_classes=200",
                                    "train.micro_batch_size=2", "train.global_batch_size=2", "data.workers=1"])
    assert code == 0, err
    assert f"samples counted in {preflight.COUNT_SAMPLE} of 100 (spread over the list; the rest not counted) " \
           "match the manifest" in out
    images = sum(p.stat().st_size for p in root.glob("*.tar"))
    # 64 tars counted (4 member headers each) + 100 first-block checks, 512 bytes a read; no image bytes
    assert len(read) > 100 and sum(read) < images / 4 and max(read) <= 512, (len(read), sum(read), images)
    assert (preflight.spread(100, 64)[0] == 0 and preflight.spread(100, 64)[-1] == 99
            and len(preflight.spread(100, 64)) == 64)


def recomputed_share(cfg, blocks: int, depth: int) -> float:
    """HFU / MFU - 1 as training counts them (``train_flops_per_image`` over the analytic MACs)."""
    macs = config_macs(cfg.model, cfg.model.img_size, breakdown=True)
    model, hardware = train_flops_per_image(macs["total"], macs["blocks"] * blocks / depth)
    return hardware / model - 1


def test_auto_checkpointing_is_decided_and_needless_checkpointing_is_a_warning():
    """`auto` (the default) checkpoints the fewest blocks that fit, and the check and the start-up
    line say how many and what they cost; an explicit `true` that memory does not need is a warning
    naming what `auto` would do."""
    big = ["model.name=vit_huge_patch14_224", "model.img_size=224", "train.micro_batch_size=256",
           "train.global_batch_size=4096", "train.precision=bf16", "zero.stage=3"]
    cfg = load_config(CONFIG, big)
    f, zero3 = preflight.check_memory(cfg, 16, 80, model_shape(cfg.model))
    n = int(f.message.split("checkpointing ")[1].split(" of 32 blocks (auto)")[0])
    assert f.level == "ok" and 0 < n < 32, f.message  # some blocks, not all: the estimate fits 80 GB
    # ZeRO-3 keeps 504M of H/14's 630M partitioned weights gathered from their forward to their
    # backward use (gathered_weights), so ZeRO-2 fits at as many blocks: the ZeRO-3 warning
    assert zero3.level == "warning" and "but ZeRO-2 fits 80 GB" in zero3.message, zero3.message
    # and what they cost: their forward again, the share of the step's FLOPs that HFU adds to MFU
    # (training's own count: observability.flops.train_flops_per_image over the analytic MACs)
    share = recomputed_share(cfg, n, 32)
    assert 0.01 < share < 1 / 3 and f", their forward again: +{share:.1%} FLOPs;" in f.message, f.message
    start = [ln for ln in levers.resolve(cfg, 16, memory_bytes=80 * memory.GB)[1].lines if "checkpointing" in ln]
    assert start == [f"train.activation_checkpointing=auto: {n} of 32 blocks checkpointed (80 GB): their forward "
                     f"runs again in the backward, +{share:.1%} of the step's FLOPs"], start
    # where ZeRO-2 fits too, ZeRO-3's gathers in every micro-step are a warning
    l16 = load_config(CONFIG, ["model.name=vit_large_patch16_224", "model.img_size=224", "train.micro_batch_size=64",
                               "train.global_batch_size=4096", "train.precision=bf16", "zero.stage=3"])
    ok, zero3 = preflight.check_memory(l16, 64, 80, model_shape(l16.model))
    assert ok.level == "ok" and zero3.level == "warning", (ok.message, zero3.message)
    # L/16 is far under DeepSpeed's stage3_max_reuse_distance: the performance model has its weights
    # gathered once per micro-step and kept for the backward, and the warning says so
    assert "zero.stage=3 gathers the weights (" in zero3.message
    assert "in every micro-step's forward and keeps them for its backward" in zero3.message
    assert "again in its backward" not in zero3.message
    assert "but ZeRO-2 fits 80 GB (" in zero3.message and "set zero.stage=2 unless" in zero3.message
    g14 = load_config(CONFIG, ["model.name=vit_gigantic_patch14_224", "model.img_size=224", "train.micro_batch_size=8",
                               "train.global_batch_size=64", "train.precision=bf16", "zero.stage=3"])
    (f,) = preflight.check_memory(g14, 8, 12, model_shape(g14.model))  # only ZeRO-3 fits 12 GB: no warning
    assert f.level == "ok", f.message
    cfg = load_config(CONFIG, ["model.name=vit_large_patch16_224", "model.img_size=224", "train.micro_batch_size=64",
                               "train.global_batch_size=4096", "train.precision=bf16", "zero.stage=2",
                               "train.activation_checkpointing=true"])
    ok, warn = preflight.check_memory(cfg, 64, 80, model_shape(cfg.model))
    every = recomputed_share(cfg, 24, 24)  # a third of the blocks' share of the step
    assert ok.level == "ok" and f"checkpointing 24 of 24 blocks, their forward again: +{every:.1%} FLOPs;" in ok.message
    assert 0.32 < every < 1 / 3, every
    assert warn.level == "warning" and "recomputes 24 of 24 blocks but 0 would fit 80 GB" in warn.message
    assert "train.activation_checkpointing=auto (0 here)" in warn.message
    ok, warn = preflight.check_memory(levers.with_checkpointing(cfg, "selective"), 64, 80, model_shape(cfg.model))
    assert ok.level == "ok" and "checkpointing every block op by op (selective)" in ok.message
    assert warn.level == "warning" and "selective recomputes every block's element-wise work but the run fits " \
                                       "80 GB without checkpointing" in warn.message


def test_the_zero3_warning_says_what_the_performance_model_gathers_in_the_backward():
    """Above DeepSpeed's stage3_max_reuse_distance (G/14: 1.8B elements) some weights are released
    after the forward and gathered again in the backward: the warning gives the performance
    model's count (``collectives.backward_gathers``), not a rule of its own."""
    from pretrain.perf import collectives, perfmodel

    g14 = load_config(CONFIG, ["model.name=vit_gigantic_patch14_224", "model.img_size=224",
                               "train.micro_batch_size=8", "train.global_batch_size=512", "train.precision=bf16",
                               "zero.stage=3"])
    ok, zero3 = preflight.check_memory(g14, 64, 80, model_shape(g14.model))
    assert ok.level == "ok" and zero3.level == "warning", (ok.message, zero3.message)
    resolved, _ = levers.resolve(g14, 64, memory_bytes=80 * memory.GB)
    again, part = collectives.backward_gathers(perfmodel.layout_from_config(resolved, nodes=8, gpus_per_node=8,
                                                                            gpu="h100-sxm"))
    assert 0 < again < part, (again, part)
    assert (f"zero.stage=3 gathers the weights ({part / 1e6:,.0f}M partitioned elements) in every micro-step's "
            f"forward and {again / 1e6:,.0f}M of them again in its backward, but ZeRO-2 fits 80 GB") \
        in zero3.message, zero3.message


def test_the_memory_line_names_zero3s_terms_as_the_plan_does():
    """At ZeRO-3 the estimate carries the weights kept gathered for the backward and hpZ's
    secondary partition; `check` prints them under the plan's names, with the plan's total."""
    from pretrain.perf import perfmodel

    l16 = load_config(CONFIG, ["model.name=vit_large_patch16_224", "model.img_size=224", "train.micro_batch_size=64",
                               "train.global_batch_size=4096", "train.precision=bf16", "zero.stage=3",
                               "zero.hpz_partition_size=8"])
    ok = preflight.check_memory(l16, 64, 80, model_shape(l16.model))[0]
    resolved, _ = levers.resolve(l16, 64, memory_bytes=80 * memory.GB)
    est = memory.estimate(resolved, 64, model_shape(l16.model))
    assert est.gathered_weights > 0 and est.hpz_secondary > 0
    assert ok.level == "ok" and ok.message.startswith(f"{preflight._gb(est.total)} per GPU (ZeRO-3"), ok.message
    gb = preflight._gb
    assert (f"runtime 1.00 GB, gathered_weights {gb(est.gathered_weights)}, hpz_secondary {gb(est.hpz_secondary)} "
            f"of 80 GB") in ok.message, ok.message
    plan = perfmodel.predict(perfmodel.layout_from_config(resolved, nodes=8, gpus_per_node=8, gpu="h100-sxm"))
    assert {"gathered_weights", "hpz_secondary"} <= plan.memory_gb_per_gpu.keys()
    assert plan.memory_gb_per_gpu["total"] == pytest.approx(est.total / memory.GB, rel=1e-9)
    z2 = preflight.check_memory(preflight._with(resolved, stage=2), 64, 80, model_shape(l16.model))[0]
    assert "gathered_weights" not in z2.message and "hpz_secondary" not in z2.message


def test_on_a_machine_without_a_gpu_check_prices_the_cpu_job_per_rank(capsys, monkeypatch, tmp_path):
    """No GPU here, no hostfile and no device named: the ranks would run on DeepSpeed's CPU
    accelerator (gloo), so the estimate is per rank in host memory, with no CUDA runtime and no
    device memory to fit. Naming a device, or GPUs on this machine, keeps the per-GPU estimate."""
    over = ["--world-size", "2", "data.synthetic=true", f"train.output_dir={tmp_path}/run"]

    def memory_line(*extra):
        code, out, err = check(capsys, ["--config", CONFIG, *over, *extra])
        assert code == 0, (out, err)
        (line,) = [ln for ln in out.splitlines() if ln.startswith("  ok  memory:")]
        return line

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine: no GPU
    cpu = memory_line()
    assert " GB per rank (ZeRO-" in cpu and "per GPU" not in cpu and "runtime" not in cpu, cpu
    assert "no GPU here: DeepSpeed's CPU accelerator, gloo" in cpu and " of 80 GB" not in cpu, cpu
    named = memory_line("--gpu-memory-gb", "80")
    assert " GB per GPU (ZeRO-" in named and "runtime 1.00 GB of 80 GB" in named, named
    # the same states and activations: the GPU's figure is the CPU's and the CUDA runtime
    per_rank, per_gpu = (float(x.split("memory: ")[1].split(" GB")[0]) for x in (cpu, named))
    assert per_gpu - per_rank == pytest.approx(1.0, abs=0.011), (cpu, named)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a machine with GPUs: a GPU job
    assert "per GPU" in memory_line() and "of 80 GB" in memory_line()


def test_run_prices_the_cpu_job_it_starts_per_rank(capsys, monkeypatch, tmp_path):
    """`vit-launch` on a machine without a GPU starts its ranks on DeepSpeed's CPU accelerator: its
    pre-flight prices them as `check` does, per rank (here it stops on the missing shards)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as e:
        main(["--config", CONFIG, "--gpus-per-node", "1", f"data.train_shards={tmp_path}/none/manifest.json",
              f"train.output_dir={tmp_path}/run"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "vit-launch: error: shards:" in err, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  ok  memory:")]
    assert " GB per rank (ZeRO-" in line and "runtime" not in line, line


def test_check_says_when_the_master_port_is_taken(capsys, id_dir, tmp_path):
    """`vit-launch check --master-port P` tests the port as `vit-launch run` does (rank 0 on this
    machine): held by a socket here, it is one error line naming it and exit 2; free, no line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = the_error(capsys, args(id_dir, tmp_path, "--gpus-per-node", "1", "--master-port", str(port)), "port")
    assert line == (f"vit-launch: error: port: --master-port {port} is in use on this machine (another job's "
                    "rendezvous?); choose a free one with --master-port")
    code, out, err = check(capsys, args(id_dir, tmp_path, "--gpus-per-node", "1", "--master-port", str(port)))
    assert code == 0 and err == [], err


def test_with_a_gpu_type_check_fits_the_memory_that_gpu_reports(capsys, tmp_path):
    """`vit-launch check --gpu h100-sxm` measures the estimate against the memory an H100 80GB
    reports (nvidia-smi: 81,559 MiB, 79.6 GiB: every estimate is in GiB), not the 80 of its name,
    and its plan line agrees; --gpu-memory-gb still decides where it is given."""
    over = ["data.synthetic=true", f"train.output_dir={tmp_path}/run", "model.qk_norm=true",
            "train.micro_batch_size=512", "train.activation_checkpointing=false"]
    code, out, err = check(capsys, ["--config", "configs/deit3_l16_in1k.yaml", "--world-size", "4", "--gpu",
                                    "h100-sxm", *over])
    usable = 81559 / 1024 * memory.MEMORY_HEADROOM
    assert f"exceeds {usable:.1f} GB, 95 % of 79.6 GB" in " ".join(err), err
    assert "(does NOT fit)" in out and "needed of 79.6 GB" in out, out
    code, out, err = check(capsys, ["--config", "configs/deit3_l16_in1k.yaml", "--world-size", "4", "--gpu",
                                    "h100-sxm", "--gpu-memory-gb", "96", *over])
    assert "of 96 GB" in out and "exceeds" not in " ".join(err) and "(does NOT fit)" not in out, (out, err)


def test_the_prediction_is_for_the_layout_checked(capsys, tmp_path):
    """`check --hostfile` of 2 nodes x 4 was predicted as 1 x 8 (no inter-node link priced); a
    `--world-size` that is not whole nodes was priced as one node of 12 GPUs, and one whose batch
    does not split ended in a traceback after the batch error."""
    over = ["data.synthetic=true", f"train.output_dir={tmp_path}/run"]
    hosts = tmp_path / "hosts"
    hosts.write_text("n0 slots=4\nn1 slots=4\n")
    code, out, err = check(capsys, ["--config", CONFIG, "--hostfile", str(hosts), "--gpu", "h100-sxm", *over,
                                    "train.micro_batch_size=8"])
    assert code == 0 and "predicted on 2 x 4 h100-sxm:" in out, (out, err)
    code, out, err = check(capsys, ["--config", CONFIG, "--world-size", "12", "--gpu", "h100-sxm", *over])
    assert code == 2 and "predicted" not in out, (out, err)
    assert [x.split(":")[2] for x in err] == [" batch"], err  # the batch's one line, nothing after it
    code, out, err = check(capsys, ["--config", CONFIG, "--world-size", "12", "--gpu", "h100-sxm", *over,
                                    "train.global_batch_size=384"])
    assert code == 0 and "predicted" not in out, (out, err)
    assert "vit-launch: warning: prediction: --world-size 12 is not whole nodes of 8 GPUs" in err[0], err
    code, out, err = check(capsys, ["--config", CONFIG, "--world-size", "12", "--gpus-per-node", "4", "--gpu",
                                    "h100-sxm", *over, "train.global_batch_size=384"])
    assert code == 0 and "predicted on 3 x 4 h100-sxm:" in out, (out, err)
