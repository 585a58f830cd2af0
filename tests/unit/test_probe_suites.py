"""The in-training probes' suites (``validation.fewshot_suites``, ``validation.knn_suites``) are read
when vit-train starts and by ``vit-launch check``: a wrong folder or VTAB-1k task is one line before
any step, not a failure at the first evaluation hours in."""
import pytest
import torch
from transfer_fixtures import write_imagefolder, write_vtab_task

from data_pipeline.config import DataConfig
from launch.cli import main
from pretrain.evaluation.config import ValidationConfig
from pretrain.evaluation.in_training import InTrainingEval
from pretrain.transfer.errors import TransferError

CONFIG = "configs/tiny_cpu.yaml"


def evaluator(**val):
    return InTrainingEval(ValidationConfig(**val), DataConfig(), batch=4, seed=0, rank=0, world=1, img_size=32,
                          num_classes=6, dtype=torch.float32)


def test_the_evaluator_reads_its_suites_when_built(tmp_path):
    folder = write_imagefolder(tmp_path / "folder", n_train=3, n_test=2)
    write_vtab_task(tmp_path / "vtab", "eurosat", counts=(4, 4), n_test=4)
    ev = evaluator(every_steps=10, fewshot_suites=[f"imagefolder:{folder}"], knn_suites=[f"vtab1k:{tmp_path}/vtab"])
    assert [(label, t.num_classes, len(t.test)) for label, t in ev.tasks[0]] == [("imagefolder", 4, 8)]
    assert [(label, t.num_classes) for label, t in ev.tasks[1]] == [("vtab1k/eurosat", 10)]  # a VTAB task, named
    with pytest.raises(TransferError, match=f"^{tmp_path}/gone: ImageFolder root not found$"):
        evaluator(every_steps=10, knn_suites=[f"imagefolder:{tmp_path}/gone"])
    # the demo suite's folder as a probe names it (demo:PATH): no word of vit-transfer's --data-root
    with pytest.raises(TransferError) as e:
        evaluator(every_steps=10, fewshot_suites=[f"demo:{tmp_path}/gone"])
    assert str(e.value).startswith(f"{tmp_path}/gone/transfer-train/manifest.json: not found (the demo suite given "
                                   "a folder reads") and "--data-root" not in str(e.value), e.value
    with pytest.raises(TransferError, match="VTAB-1k task 'svhn' not found"):
        evaluator(every_steps=10, fewshot_suites=[f"vtab1k:{tmp_path}/vtab"], tasks=["svhn"])
    # no evaluation, nothing read
    assert evaluator(every_steps=0, fewshot_suites=[f"imagefolder:{tmp_path}/gone"]).tasks == ([], [])


def test_vit_launch_check_reads_the_probe_suites(capsys, tmp_path, shard_kit):
    ids = shard_kit.id_shards(tmp_path / "shards", [12] * 4)
    folder = write_imagefolder(tmp_path / "folder", n_train=3, n_test=2)
    base = ["check", "--config", CONFIG, "--world-size", "1", f"data.train_shards={ids}/manifest.json",
            f"train.output_dir={tmp_path / 'run'}", "model.num_classes=48", "train.micro_batch_size=4",
            "train.global_batch_size=4", "validation.every_steps=5"]
    with pytest.raises(SystemExit) as e:
        main([*base, *(f"validation.{key}=[imagefolder:{folder}]" for key in ("fewshot_suites", "knn_suites"))])
    out, err = capsys.readouterr()
    assert e.value.code == 0, (out, err)
    assert f"  ok  probes: imagefolder:{folder}: 4 classes, 12 train and 8 test images\n" in out  # each suite once
    for task in ("eurosat", "dtd"):
        write_vtab_task(tmp_path / "vtab", task, counts=(4, 4), n_test=4)
    with pytest.raises(SystemExit) as e:
        main([*base, f"validation.knn_suites=[vtab1k:{tmp_path}/vtab]"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and f"  ok  probes: vtab1k:{tmp_path}/vtab: 2 tasks, 16 train and 8 test images\n" in out
    # a target on a task the folder does not hold: any task at load, refused once the suite is read
    with pytest.raises(SystemExit) as e:
        main([*base, f"validation.knn_suites=[vtab1k:{tmp_path}/vtab]", "validation.target_value=0.5",
              "validation.target_metric=eval/knn/vtab1k/svhn/20nn"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.strip().splitlines() == [
        "vit-launch: error: target: validation.target_metric: 'eval/knn/vtab1k/svhn/20nn' is not a metric these "
        "evaluations log; they log eval/knn/vtab1k/dtd/10nn, eval/knn/vtab1k/dtd/20nn, eval/knn/vtab1k/dtd/100nn, "
        "eval/knn/vtab1k/dtd/200nn, eval/knn/vtab1k/eurosat/10nn, eval/knn/vtab1k/eurosat/20nn, "
        "eval/knn/vtab1k/eurosat/100nn, eval/knn/vtab1k/eurosat/200nn"], (out, err)
    with pytest.raises(SystemExit) as e:
        main([*base, f"validation.knn_suites=[vtab1k:{tmp_path}/vtab]", "validation.target_value=0.5",
              "validation.target_metric=eval/knn/vtab1k/eurosat/20nn", "validation.stop_at_target=true"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and ("  ok  target: eval/knn/vtab1k/eurosat/20nn >= 0.5: the first evaluation that "
                                  "reaches it is recorded with its step, device-hours and images; the run ends "
                                  "there\n") in out, (out, err)
    with pytest.raises(SystemExit) as e:
        main([*base, f"validation.knn_suites=[imagefolder:{tmp_path}/gone]"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.strip().splitlines() == [
        f"vit-launch: error: probes: {tmp_path}/gone: ImageFolder root not found"], (out, err)


def test_two_suites_of_one_name_log_under_their_folders_names(tmp_path):
    """Two ImageFolder sets probed at once (pets and flowers) logged both as eval/fewshot/imagefolder/*:
    the second overwrote the first. Each now logs under its folder's name; folders of one name are
    one line naming both, before any step."""
    pets = write_imagefolder(tmp_path / "pets", n_train=3, n_test=2)
    flowers = write_imagefolder(tmp_path / "flowers", n_train=3, n_test=2)
    ev = evaluator(every_steps=10, fewshot_suites=[f"imagefolder:{pets}", f"imagefolder:{flowers}"],
                   knn_suites=[f"imagefolder:{pets}"])
    assert [label for label, _ in ev.tasks[0]] == ["imagefolder/pets", "imagefolder/flowers"]
    assert [label for label, _ in ev.tasks[1]] == ["imagefolder/pets"]
    twin = write_imagefolder(tmp_path / "other" / "pets", n_train=3, n_test=2)
    with pytest.raises(TransferError, match=f"^validation.fewshot_suites: imagefolder:{pets} and imagefolder:{twin} "
                                            "would both log as imagefolder/pets; give their folders distinct names$"):
        evaluator(every_steps=10, fewshot_suites=[f"imagefolder:{pets}", f"imagefolder:{twin}"])


DEMO = ["validation.every_steps=5", "validation.fewshot_suites=[demo]", "validation.target_value=0.5"]


@pytest.mark.parametrize("overrides, says", [
    (["validation.stop_at_target=true"], "validation.stop_at_target: stops at validation.target_metric: set it too"),
    (["validation.target_metric=eval/top1", "validation.target_value=0.5"],
     "validation.target_metric: is read at an evaluation: set validation.every_steps too, or clear this key"),
    (["validation.every_steps=5", "validation.target_metric=eval/top1", "validation.target_value=0.5"],
     "'eval/top1' is not a metric these evaluations log; they log nothing (no data.val_shards and no probe suites)"),
    ([*DEMO, "validation.target_metric=eval/fewshot/demo/3shot"], "'eval/fewshot/demo/3shot' is not a metric these "
     "evaluations log; they log eval/fewshot/demo/1shot, eval/fewshot/demo/5shot, eval/fewshot/demo/10shot, "
     "eval/fewshot/demo/25shot"),
    ([*DEMO, "validation.target_metric=eval/ema/fewshot/demo/5shot"], "'eval/ema/fewshot/demo/5shot' is not a"),
    ([*DEMO, "validation.target_metric=eval/fewshot/demo/5shot", "validation.target_value=75"],
     "validation.target_value: an accuracy to reach is a fraction in (0, 1] (e.g. 0.75), got 75"),
])
def test_a_target_the_evaluations_cannot_meet_is_one_line_at_load(overrides, says):
    from pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides)
    assert says in str(e.value) and "<folder>" not in str(e.value), e.value  # one demo suite: its name alone


def test_a_target_is_read_against_the_names_the_suites_log(tmp_path):
    """At load a VTAB-1k task is any task; once the suites are read (vit-train's start-up,
    vit-launch check) the target must be one the folder holds."""
    from pretrain.config import load_config
    from pretrain.evaluation.config import target_metrics, target_problem

    write_vtab_task(tmp_path / "vtab", "eurosat", counts=(4, 4), n_test=4)
    base = ["validation.every_steps=5", f"validation.knn_suites=[vtab1k:{tmp_path}/vtab]", "train.ema_decay=0.99",
            "validation.target_value=0.5"]
    for task, ok in (("eurosat", True), ("dtd", False)):
        cfg = load_config(CONFIG, [*base, f"validation.target_metric=eval/ema/knn/vtab1k/{task}/20nn"])  # both load
        v = cfg.validation
        ev = evaluator(every_steps=5, knn_suites=v.knn_suites)
        metrics = target_metrics(v, val_shards=False, multi_label=False, ema=True, labels=ev.labels)
        assert "eval/ema/knn/vtab1k/eurosat/20nn" in metrics and "eval/knn/vtab1k/eurosat/10nn" in metrics
        assert (target_problem(v, metrics) is None) == ok, target_problem(v, metrics)


def test_the_target_is_recorded_once_at_the_first_evaluation_that_reaches_it():
    """At least for an accuracy, at most for a loss; later evaluations change nothing; a resumed
    run keeps a record of its own target and drops one of another."""
    from pretrain.evaluation.target import Target, reached_words

    totals = {"device_seconds": 7200.0, "images_seen": 1024, "model_flops": 1e15}
    acc = Target(ValidationConfig(target_metric="eval/top1", target_value=0.5))
    assert acc.check({"eval/top1": 0.49}, 4, totals) is None and acc.check({"eval/loss": 0.1}, 5, totals) is None
    rec = acc.check({"eval/top1": 0.5}, 6, totals)
    assert rec == {"metric": "eval/top1", "value": 0.5, "measured": 0.5, "step": 6, "device_hours": 2.0,
                   "images_seen": 1024, "model_flops": 1e15}
    assert acc.check({"eval/top1": 0.9}, 8, totals) is None and acc.reached == rec  # the first time stays
    assert reached_words(rec) == "eval/top1 0.5 >= 0.5 at step 6 after 2 device-hours (1,024 images)"
    loss = Target(ValidationConfig(target_metric="eval/ema/loss", target_value=2.0))
    assert loss.words == "eval/ema/loss <= 2" and loss.check({"eval/ema/loss": 2.1}, 3, totals) is None
    assert loss.check({"eval/ema/loss": 1.9}, 6, totals)["step"] == 6
    assert Target(ValidationConfig(target_metric="eval/top1", target_value=0.5), rec).reached == rec
    assert Target(ValidationConfig(target_metric="eval/top1", target_value=0.6), rec).reached is None
