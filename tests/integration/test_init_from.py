"""``model.init_from``: pre-training starts from existing weights (a transformers ViT folder here,
the format most pre-trained ViTs come in), position embeddings resized, a new head for a new
number of classes; bad sources are one line naming the key."""
import pytest
import torch
from dist_utils import TINY_MODEL, train_single

from pretrain.models.tokens import resize_pos_embed
from pretrain.models.vit import create_model
from pretrain.weights import hf
from pretrain.weights.export import load_run_weights, write_safetensors

# lr 1e-30, no weight decay: the one step moves no loaded weight by as much as one float32 ulp
STILL = ["train.steps=1", "optim.lr=1e-30", "optim.min_lr=1e-30", "optim.weight_decay=0.0", "checkpoint.every_steps=1"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The tiny jobs' model at 32 px with 7 classes, written as a transformers folder."""
    root = tmp_path_factory.mktemp("hf")
    src = create_model(TINY_MODEL, img_size=32, num_classes=7, init_seed=5)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # no zero heads or unit norms left from the init
    model = {"name": TINY_MODEL, "img_size": 32, "num_classes": 7}
    hf.write_folder(root / "src", src.state_dict(), hf.hf_config(model, hf.labels_for(7, None)),
                    hf.preprocessor_config(32, (0.5,) * 3, (0.5,) * 3), "# card\n", write_safetensors)
    return root / "src", src.state_dict()


@pytest.mark.parametrize("precision, stage, ranks", [("fp32", 2, 1), ("bf16", 2, 1), ("bf16", 3, 2),
                                                     ("bf16-autocast", 2, 1)])
def test_pretraining_starts_from_a_transformers_folder(tiny_run, hf_folder, precision, stage, ranks):
    """The trained weights are the file's, bit for bit; in bf16 too, where DeepSpeed would make its
    fp32 masters from the bf16-rounded module (the file's fp32 values are set into them), also in
    ZeRO-3 partitions on 2 ranks; and under autocast, whose fp32 module the masters copy (one rank:
    what autocast changes is the module's dtype, not how ZeRO partitions it)."""
    folder, src = hf_folder
    small = (f"train.precision={precision}", f"zero.stage={stage}", f"train.micro_batch_size={4 // ranks}",
             "train.global_batch_size=4")
    job = tiny_run(f"model.init_from={folder}", *STILL, *small, via="python" if ranks == 1 else "deepspeed",
                   ranks=ranks)  # tiny_cpu: 64 px, 10 classes
    r = job.run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"initialised from {folder}" in r.stderr and "new head for 10 classes" in r.stderr
    got, _ = load_run_weights(job.run_dir)
    for k, v in src.items():
        if k.startswith("head."):
            assert got[k].shape[0] == 10  # a new head: 10 classes, not the source's 7
        elif k == "pos_embed":
            assert torch.equal(got[k], resize_pos_embed(v, (4, 4), (2, 2)))  # 2x2 -> 4x4 grid
        else:
            assert torch.equal(got[k], v), k
    # the same command, longer: the run resumes from its checkpoint, init_from is not read again
    if precision == "fp32":
        r = tiny_run(f"model.init_from={folder}", *STILL[1:], *small, "train.steps=2").run(300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resuming from step 1" in r.stderr and "initialised from" not in r.stderr


def test_a_head_of_named_classes_follows_the_shards_class_order(shards, tmp_path):
    """A file whose head names its classes (a transformers folder's id2label) and shards that name
    theirs: the same classes in another order load with the head's rows in the shards' order (row i
    is then the shards' label i); other classes of the same count get a new head, as another count
    does."""
    import json
    from pathlib import Path

    classes = json.loads(Path(shards).read_text())["classes"]
    src = create_model(TINY_MODEL, img_size=32, num_classes=10, init_seed=5)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = {"name": TINY_MODEL, "img_size": 32, "num_classes": 10}
    for name, labels in (("reversed", classes[::-1]), ("other", [f"x{i}" for i in range(10)])):
        hf.write_folder(tmp_path / name, src.state_dict(), hf.hf_config(model, hf.labels_for(10, labels)),
                        hf.preprocessor_config(32, (0.5,) * 3, (0.5,) * 3), "# card\n", write_safetensors)
    r = train_single(shards, tmp_path / "run", f"model.init_from={tmp_path / 'reversed'}", *STILL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(its head's rows put in the shards' class order)" in r.stderr and "new head" not in r.stderr
    got, _ = load_run_weights(tmp_path / "run")
    for k in ("head.weight", "head.bias"):
        assert torch.equal(got[k], src.state_dict()[k].flip(0)), k
    r = train_single(shards, tmp_path / "run2", f"model.init_from={tmp_path / 'other'}", *STILL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "new head for 10 classes (its classes are not the shards')" in r.stderr
    got, _ = load_run_weights(tmp_path / "run2")
    assert not torch.equal(got["head.weight"], src.state_dict()["head.weight"])


@pytest.mark.parametrize("source, words", [("missing.safetensors", "not found"), ("base", "does not fit")])
def test_bad_sources_are_one_line(shards, tmp_path, source, words):
    if source == "base":
        m = create_model("vit_base_patch16_224", img_size=32, num_classes=10)
        source = str(tmp_path / "b.safetensors")
        write_safetensors(m.state_dict(), tmp_path / "b.safetensors", {"model.name": "vit_base_patch16_224"})
    r = train_single(shards, tmp_path / "run", f"model.init_from={source}", *STILL)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "model.init_from" in last and words in last
