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
