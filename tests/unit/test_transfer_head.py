"""``--protocol head``: the checkpoint's own classifier. Its predictions equal timm's model with the
exported file loaded, on the same preprocessed images, from a run directory, the export and a
transformers folder; ReaL scores equal timm's ``RealLabelsImagenet`` on the same outputs; folders
named by integers are class indices (ImageNet-V2); a flat folder is scored by ReaL alone."""
import json

import numpy as np
import pytest
import timm
import torch
from transfer_fixtures import colour_image, save_png, tiny_model, write_run_dir

from data_pipeline.errors import ConfigError
from pretrain.config import load_config
from pretrain.transfer.data import make_view
from pretrain.transfer.evaluate import evaluate_checkpoint
from pretrain.transfer.protocols.head import predict
from pretrain.transfer.results import markdown
from pretrain.transfer.suites import labelled_folder
from pretrain.weights.hf import transfer_table
from pretrain.weights.pretrained import CheckpointError, build_classifier, load_pretrained

CLASSES = ["0", "2", "5", "9"]  # ImageNet-V2's layout: the folder names are the head's indices


def _real_name(i: int) -> str:
    return f"ILSVRC2012_val_{i + 1:08d}.JPEG"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One classifier (a random 10-class head) as a run directory, its timm export and its
    transformers folder."""
    from pretrain.weights.export import export, export_to

    tmp = tmp_path_factory.mktemp("head")
    model = tiny_model(32, seed=4)
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    run = write_run_dir(tmp / "run", model, {7: True}, final=7)
    export(run, tmp / "m.safetensors")
    export_to(run, tmp / "hf", fmt="hf")
    return {"run": run, "export": tmp / "m.safetensors", "hf": tmp / "hf"}


@pytest.fixture(scope="module")
def v2_folder(tmp_path_factory):
    """Class folders named by indices; file names ImageNet val's, spread over the folders so the
    sorted-name order differs from the folder order."""
    root = tmp_path_factory.mktemp("v2") / "val"
    rng = np.random.default_rng(0)
    order = rng.permutation(24)
    for i, n in enumerate(order):
        save_png(colour_image(i % 4, rng, 32), root / CLASSES[i % 4] / _real_name(int(n)))
    return root


def _timm_model(export_path):
    from safetensors.torch import load_file

    m = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    m.load_state_dict(load_file(str(export_path)))
    return m.eval()


def _cfg(*overrides):
    return load_config(None, ["eval.protocol=head", "eval.suite=imagefolder", "eval.workers=0", "eval.batch_size=8",
                              *overrides])


@pytest.mark.parametrize("kind", ["run", "export", "hf"])
def test_predictions_equal_timm_with_the_export(checkpoints, v2_folder, kind):
    task = labelled_folder(str(v2_folder))
    assert task.num_classes == 10 and sorted(set(task.test.labels.tolist())) == [0, 2, 5, 9]
    cfg = _cfg()
    view = make_view(task, 32, cfg.data.augment, cfg.eval.train_augment)
    ours = build_classifier(load_pretrained(checkpoints[kind]), img_size=32).eval()
    ref = _timm_model(checkpoints["export"])
    top, labels = predict(ours, task.test, view, batch_size=8, device=torch.device("cpu"))
    xs = torch.cat([x for x, _ in task.test.batches(view, batch_size=8, train=False)])
    with torch.no_grad():
        want = ref(xs)
        assert torch.allclose(ours(xs), want, atol=1e-5)
    assert torch.equal(top, want.topk(5, dim=1).indices) and torch.equal(labels, torch.from_numpy(task.test.labels))
    assert len(set(top[:, 0].tolist())) > 1  # the head really discriminates: not a constant answer


def test_protocol_scores_top1_top5_and_real_as_timm(checkpoints, v2_folder, tmp_path):
    """The task's accuracy is top-1 against the folders; ReaL from a real.json (in sorted file-name
    order, one empty list left out) equals timm's RealLabelsImagenet fed timm's outputs."""
    from timm.data import RealLabelsImagenet

    rng = np.random.default_rng(3)
    real = [sorted({int(c) for c in rng.choice(10, size=int(rng.integers(1, 4)))}) for _ in range(24)]
    real[5] = []
    (tmp_path / "real.json").write_text(json.dumps(real))
    task = labelled_folder(str(v2_folder))
    cfg = _cfg(f"eval.real_labels={tmp_path / 'real.json'}")
    doc = evaluate_checkpoint(cfg, load_pretrained(checkpoints["export"]), [task], [], log=lambda m: None)
    r = doc["tasks"]["val"]
    assert r["num_train"] == 0 and r["num_test"] == 24 and r["setting"] == {}
    d = r["details"]

    cfg = _cfg()
    view = make_view(task, 32, cfg.data.augment, cfg.eval.train_augment)
    xs = torch.cat([x for x, _ in task.test.batches(view, batch_size=8, train=False)])
    with torch.no_grad():
        logits = _timm_model(checkpoints["export"])(xs)
    y = torch.from_numpy(task.test.labels)
    assert d["top1"] == pytest.approx(float((logits.argmax(1) == y).double().mean()))
    assert d["top5"] == pytest.approx(float((logits.topk(5, 1).indices == y[:, None]).any(1).double().mean()))
    assert r["accuracy"] == d["top1"]
    acc = f"{100 * d['top1']:.2f}"  # top-1 against the folders, with ReaL under Details
    assert "| Task | Group | Top-1 (%) |" in markdown(doc) and f"| val | {acc} |" in transfer_table([doc])
    real_eval = RealLabelsImagenet(task.test.paths, real_json=str(tmp_path / "real.json"), topk=(1, 5))
    real_eval.add_result(logits)
    assert d["real_scored"] == 23
    assert 100 * d["real_top1"] == pytest.approx(real_eval.get_accuracy(1))
    assert 100 * d["real_top5"] == pytest.approx(real_eval.get_accuracy(5))


def test_a_flat_folder_is_scored_by_real_alone(checkpoints, v2_folder, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in sorted(v2_folder.rglob("*.JPEG")):
        (flat / p.name).write_bytes(p.read_bytes())
    (tmp_path / "real.json").write_text(json.dumps([[i % 10] for i in range(24)]))
    task = labelled_folder(str(flat))
    assert task.num_classes == 0 and set(task.test.labels.tolist()) == {-1}
    doc = evaluate_checkpoint(_cfg(f"eval.real_labels={tmp_path / 'real.json'}"), load_pretrained(checkpoints["hf"]),
                              [task], [], log=lambda m: None)
    d = doc["tasks"]["flat"]["details"]
    assert "top1" not in d and d["real_scored"] == 24 and doc["tasks"]["flat"]["accuracy"] == d["real_top1"]
    # the figure is ReaL top-1, and the table and the model card say so
    acc = f"{100 * d['real_top1']:.2f}"
    assert "| Task | Group | ReaL top-1 (%) |" in markdown(doc) and f"| flat |  | {acc} |" in markdown(doc)
    assert f"| flat | {acc} (ReaL) |" in transfer_table([doc])
    with pytest.raises(ConfigError, match="no labelled images"):
        evaluate_checkpoint(_cfg(), load_pretrained(checkpoints["export"]), [task], [], log=lambda m: None)
    (tmp_path / "short.json").write_text(json.dumps([[1]] * 3))
    with pytest.raises(ConfigError, match="3 entries for 24 images"):
        evaluate_checkpoint(_cfg(f"eval.real_labels={tmp_path / 'short.json'}"), load_pretrained(checkpoints["hf"]),
                            [task], [], log=lambda m: None)


def test_a_set_of_other_classes_than_the_head_s_is_one_line(tmp_path, shard_kit):
    """The head's class names come with the weights (the run's shard manifest, the export's
    pretrained_cfg, a transformers folder's id2label): a folder whose sorted class folders are not
    those, in that order (here three of the ten), would score label i against another class's output."""
    from pretrain.transfer.errors import TransferError
    from pretrain.weights.export import export, export_to

    names = [f"n{i:02d}" for i in range(10)]
    shards = shard_kit.make_shards(tmp_path / "shards", [[("000000", {"jpg": shard_kit.image_bytes(), "cls": b"0"})]],
                                   names)
    run = write_run_dir(tmp_path / "run", tiny_model(32, seed=4), {7: True}, final=7,
                        overrides=[f"data.train_shards={shards / 'manifest.json'}"])
    export(run, tmp_path / "m.safetensors")
    export_to(run, tmp_path / "hf", fmt="hf")
    rng = np.random.default_rng(0)
    for i, n in enumerate(names):
        save_png(colour_image(i % 4, rng, 32), tmp_path / "whole" / n / f"{i}.png")
    for i, n in enumerate(["n00", "n02", "n05"]):
        save_png(colour_image(i, rng, 32), tmp_path / "part" / n / f"{i}.png")
    for source in (run, tmp_path / "m.safetensors", tmp_path / "hf"):
        pre = load_pretrained(source)
        assert pre.classes == tuple(names), source
        doc = evaluate_checkpoint(_cfg(), pre, [labelled_folder(str(tmp_path / "whole"))], [], log=lambda m: None)
        assert doc["tasks"]["whole"]["details"]["labelled"] == 10
        with pytest.raises(TransferError, match=r"^part: label 1 is 'n02' here, output 1 of .*'s head is 'n01'; "):
            evaluate_checkpoint(_cfg(), pre, [labelled_folder(str(tmp_path / "part"))], [], log=lambda m: None)
    # a head whose names nobody recorded is scored as before: by index
    assert load_pretrained(write_run_dir(tmp_path / "bare", tiny_model(32), {7: True}, final=7)).classes is None


def test_a_checkpoint_without_a_head_is_one_line(tmp_path):
    from transfer_fixtures import save_safetensors

    from pretrain.models.vit import create_model

    path = save_safetensors(create_model("vit_tiny_patch16_224", img_size=32, num_classes=0),
                            tmp_path / "nohead.safetensors")
    with pytest.raises(CheckpointError, match="has no classifier head"):
        build_classifier(load_pretrained(path), img_size=32)


def test_chance_is_one_over_the_head_s_outputs(checkpoints, v2_folder, tmp_path):
    """The head picks among its 10 outputs whatever the set holds: a folder of 4 named classes and a
    flat folder scored by ReaL alone both read against 10% chance (not 25%, not 0%)."""
    named, flat = tmp_path / "named", tmp_path / "flat"
    for i, p in enumerate(sorted(v2_folder.rglob("*.JPEG"))):
        for d in (named / "abcd"[i % 4], flat):
            d.mkdir(parents=True, exist_ok=True)
            (d / p.name).write_bytes(p.read_bytes())
    (tmp_path / "real.json").write_text(json.dumps([[i % 10] for i in range(24)]))
    pre = load_pretrained(checkpoints["export"])
    for task, cfg in ((labelled_folder(str(named)), _cfg()),
                      (labelled_folder(str(flat)), _cfg(f"eval.real_labels={tmp_path / 'real.json'}"))):
        r = evaluate_checkpoint(cfg, pre, [task], [], log=lambda m: None)["tasks"][task.name]
        assert r["details"]["head_classes"] == 10 and r["chance"] == pytest.approx(0.1), (task.name, r["chance"])
