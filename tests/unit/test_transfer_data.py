"""Transfer data readers on files in the exact official layouts, and their errors."""
import io
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transfer_fixtures import colour_image, py2_pickle, save_png, write_cifar100, write_imagefolder, write_vtab_task

from pretrain.config import DataConfig
from pretrain.transfer import suites, vtab
from pretrain.transfer.data import Concat, FileImages, View
from pretrain.transfer.errors import TransferError


def _all(split, view, **kw):
    xs, ys = zip(*split.batches(view, batch_size=16, train=False, **kw))
    return torch.cat(xs), torch.cat(ys)


# ------------------------------------------------------------------------------------- CIFAR
def test_cifar100_official_layout_pixels_labels_and_minival(tmp_path):
    d = write_cifar100(tmp_path, n_train=50, n_test=20)
    task = suites.cifar100(str(tmp_path), minival_fraction=0.2, seed=0)  # the parent folder works too
    assert task.num_classes == 100 and len(task.trainval) == 50 and len(task.test) == 20
    assert len(task.val) == 10 and len(task.train) == 40
    assert set(task.train.indices) | set(task.val.indices) == set(range(50))
    assert not set(task.train.indices) & set(task.val.indices)
    raw = pickle.load(open(d / "test", "rb"), encoding="bytes")
    # image 3: channel-major row -> HWC, and the fine label
    assert np.array_equal(task.test.pixels[3], raw[b"data"][3].reshape(3, 32, 32).transpose(1, 2, 0))
    assert task.test.labels.tolist() == raw[b"fine_labels"]
    x, y = _all(task.test, View(img_size=32, resize="squash", mean=(0, 0, 0), std=(1, 1, 1)))
    assert x.shape == (20, 3, 32, 32) and y.tolist() == raw[b"fine_labels"]
    # squash at 32 px is the identity; mean 0, std 1 leaves pixels / 255
    assert torch.allclose(x[3] * 255, torch.from_numpy(task.test.pixels[3]).permute(2, 0, 1).float(), atol=1e-3)
    suites.cifar100(str(d), 0.2, 0)  # the cifar-100-python folder itself too


def test_restricted_unpickler_refuses_a_pickle_that_would_create_a_file(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    data = py2_pickle({b"data": Payload(), b"fine_labels": [0]})
    pickle.loads(data, encoding="bytes")  # the payload is live: a plain unpickler runs it
    assert marker.exists()
    marker.unlink()
    d = write_cifar100(tmp_path, n_train=8, n_test=8)
    (d / "train").write_bytes(data)
    with pytest.raises(TransferError, match=r"train: not a CIFAR-100 pickle.*refusing to unpickle (posix|os)\.system"):
        suites.cifar100(str(d), 0.25, 0)
    assert not marker.exists()


def test_cifar100_missing_file_is_named(tmp_path):
    d = write_cifar100(tmp_path, n_train=8, n_test=8)
    (d / "meta").unlink()
    with pytest.raises(TransferError, match="'meta' not found"):
        suites.cifar100(str(d), 0.25, 0)


# -------------------------------------------------------------------------------------- VTAB
def test_vtab_layout_splits_aliases_and_missing_tasks(tmp_path):
    write_vtab_task(tmp_path, "caltech101", counts=(8, 4), n_test=6)
    write_vtab_task(tmp_path, "dsprites_loc", counts=(8, 4), n_test=6, seed=1)  # the short folder name
    tasks, missing = suites.vtab1k(str(tmp_path), [])
    assert [t.name for t in tasks] == ["caltech101", "dsprites_location"]
    assert [t.group for t in tasks] == ["natural", "structured"]
    assert len(missing) == 17 and "caltech101" not in missing and "sun397" in missing
    t = tasks[0]
    assert t.num_classes == 102 and (len(t.train), len(t.val), len(t.trainval), len(t.test)) == (8, 4, 12, 6)
    assert isinstance(t.trainval, Concat)  # train800 + val200: their features are reused
    lines = (tmp_path / "caltech101" / "test.txt").read_text().split()
    assert t.test.paths[0] == str(tmp_path / "caltech101" / lines[0]) and t.test.labels[0] == int(lines[1])
    x, y = _all(t.test, View(img_size=32))
    assert x.shape == (6, 3, 32, 32) and y.tolist() == t.test.labels.tolist()
    assert t.augment is False  # no flips / crops for VTAB (structured labels)


def test_vtab_requested_subset_and_unknown_or_absent_task(tmp_path):
    write_vtab_task(tmp_path, "caltech101", counts=(4, 4), n_test=4)
    write_vtab_task(tmp_path, "eurosat", counts=(4, 4), n_test=4)
    tasks, missing = suites.vtab1k(str(tmp_path), ["eurosat"])
    assert [t.name for t in tasks] == ["eurosat"] and "caltech101" in missing
    with pytest.raises(TransferError, match="unknown VTAB-1k task 'imagenet'"):
        suites.vtab1k(str(tmp_path), ["imagenet"])
    with pytest.raises(TransferError, match="task 'svhn' not found"):
        suites.vtab1k(str(tmp_path), ["svhn"])
    with pytest.raises(TransferError, match="no VTAB-1k task folders"):
        suites.vtab1k(str(tmp_path / "caltech101" / "images"), [])


@pytest.mark.parametrize("line, message", [
    ("images/test_0000.png", r"test.txt:2: expected 'relative/path label'"),
    ("images/test_0000.png seven", r"test.txt:2: expected 'relative/path label'"),
    ("images/test_0000.png 102", r"test.txt:2: label 102 outside 0..101"),
    ("images/nope.png 1", r"test.txt:2: image .*nope.png not found"),
])
def test_vtab_malformed_lines_are_named(tmp_path, line, message):
    d = write_vtab_task(tmp_path, "caltech101", counts=(4, 4), n_test=3)
    rows = (d / "test.txt").read_text().splitlines()
    rows[1] = line
    (d / "test.txt").write_text("\n".join(rows) + "\n")
    with pytest.raises(TransferError, match=message):
        suites.vtab1k(str(tmp_path), [])


def test_vtab_missing_split_file_is_named(tmp_path):
    d = write_vtab_task(tmp_path, "caltech101", counts=(4, 4), n_test=3)
    (d / "val200.txt").unlink()
    with pytest.raises(TransferError, match=r"caltech101/val200.txt: split file not found"):
        suites.vtab1k(str(tmp_path), [])


def test_group_and_overall_means():
    acc = {"caltech101": 0.9, "cifar100": 0.7, "eurosat": 0.95, "clevr_count": 0.5, "dmlab": 0.4, "kitti_distance": 0.3}
    s = vtab.summarize(acc)
    assert s["groups"]["natural"] == {"mean": pytest.approx(0.8), "tasks": 2, "of": 7}
    assert s["groups"]["specialized"] == {"mean": pytest.approx(0.95), "tasks": 1, "of": 4}
    assert s["groups"]["structured"] == {"mean": pytest.approx(0.4), "tasks": 3, "of": 8}
    assert s["mean"] == pytest.approx(3.75 / 6)  # over tasks, not over the three group means
    assert s["tasks"] == 6 and len(s["missing"]) == 13 and "sun397" in s["missing"]
    full = vtab.summarize({t: (i + 1) / 100 for i, t in enumerate(vtab.TASKS)})
    assert full["missing"] == [] and full["mean"] == pytest.approx(sum(range(1, 20)) / 19 / 100)
    assert full["groups"]["natural"]["mean"] == pytest.approx(sum(range(1, 8)) / 7 / 100)
    assert sum(len(ts) for ts in vtab.GROUPS.values()) == 19 == len(set(vtab.TASKS))


# ------------------------------------------------------------------------ ImageFolder, shards
def test_training_augmentation_is_the_samples_own_whoever_reads_it(tmp_path):
    """Fine-tuning's random crops and flips come from each sample's seed (the run's seed, the epoch,
    the sample), not from torch's global RNG: every rank of a deepspeed fine-tune seeds that alike,
    so the ranks' augmentations went in lockstep, and with ``eval.workers=0`` they depended on
    whatever drew from it before. Eight copies of one image: samples differ by augmentation alone."""
    img = colour_image(0, np.random.default_rng(0), 32)
    paths = [tmp_path / f"{i}.png" for i in range(8)]
    for p in paths:
        save_png(img, p)
    split = FileImages("copies", [str(p) for p in paths], [0] * 8)
    view = View(img_size=16, train_augment=True)

    def batch(rank, world, global_seed=0, n=2):
        torch.manual_seed(global_seed)  # as every rank of a fine-tune seeds it (eval.seed)
        return next(split.batches(view, batch_size=n, train=True, seed=0, rank=rank, world=world))[0]

    assert not torch.equal(batch(0, 2), batch(1, 2))  # two ranks, two samples each: their own crops
    assert torch.equal(batch(0, 2), batch(0, 2, global_seed=123))
    whole = batch(0, 1, n=8)  # one rank reads the epoch's permutation whole; rank r of 2 its r-th half
    assert torch.equal(batch(0, 2), whole[:2]) and torch.equal(batch(1, 2), whole[4:6])


def test_imagefolder_with_and_without_val(tmp_path):
    root = write_imagefolder(tmp_path / "colours", n_train=5, n_test=3)
    t = suites.imagefolder(str(root), minival_fraction=0.2, seed=0)
    assert t.num_classes == 4 and len(t.trainval) == 20 and len(t.val) == 4 and len(t.test) == 12
    assert sorted(set(t.test.labels.tolist())) == [0, 1, 2, 3]
    root2 = write_imagefolder(tmp_path / "withval", n_train=5, n_test=3, with_val=True)
    t2 = suites.imagefolder(str(root2), 0.2, 0)
    assert len(t2.train) == 20 and len(t2.val) == 12 and len(t2.trainval) == 32
    (root2 / "test" / "purple").mkdir()
    (root2 / "test" / "purple" / "a.png").write_bytes((root2 / "test" / "red" / "000.png").read_bytes())
    with pytest.raises(TransferError, match="'purple' is not among the train classes"):
        suites.imagefolder(str(root2), 0.2, 0)


def test_corrupt_image_is_a_one_line_error_naming_it(tmp_path):
    d = write_vtab_task(tmp_path, "eurosat", counts=(4, 4), n_test=3)
    (d / "images" / "test_0001.png").write_bytes(b"not a png")
    t = suites.vtab1k(str(tmp_path), [])[0][0]
    with pytest.raises(TransferError, match=r"test.txt:2: .*test_0001.png"):
        _all(t.test, View(img_size=32), workers=1)  # raised in a worker, reported in one line


def _colour_shards(tmp_path, shard_kit):
    rng = np.random.default_rng(0)

    def samples(n, start):
        out = []
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(colour_image(i % 4, rng, 24)).save(buf, "PNG")
            out.append((f"{start + i:06d}", {"png": buf.getvalue(), "cls": str(i % 4).encode()}))
        return out

    classes = ["red", "green", "blue", "yellow"]
    shard_kit.make_shards(tmp_path / "colours" / "train", [samples(8, 0), samples(8, 8)], classes, prefix="train")
    shard_kit.make_shards(tmp_path / "colours" / "test", [samples(6, 100)], classes, prefix="test")


def test_shards_suite_reads_our_shards(tmp_path, shard_kit):
    _colour_shards(tmp_path, shard_kit)
    task = suites.shards(str(tmp_path / "colours"), DataConfig(workers=0))
    assert task.num_classes == 4 and len(task.trainval) == 16 and task.val is None
    x, y = _all(task.test, View(img_size=32))
    assert x.shape == (6, 3, 32, 32) and sorted(y.tolist()) == [0, 0, 1, 1, 2, 3]
    (tmp_path / "colours" / "test" / "manifest.json").unlink()
    with pytest.raises(TransferError, match="test/manifest.json: not found"):
        suites.shards(str(tmp_path / "colours"), DataConfig())


def test_a_fine_tune_on_shards_leaves_pre_trainings_augmentation_out(tmp_path, shard_kit):
    """A pre-training config's RandAugment and repeated augmentation stay out of a shard suite's
    training batches, as out of every other suite's (its crop and flip are the fine-tune's): with the
    crop set to the whole image, an epoch holds each of the 16 training images once, and another
    seed's epoch the very same pixels."""
    import itertools

    from data_pipeline.config import AugmentConfig

    _colour_shards(tmp_path, shard_kit)
    aug = AugmentConfig(crop_scale=[1.0, 1.0], crop_ratio=[1.0, 1.0], hflip=0.0, randaugment_ops=2,
                        randaugment_magnitude=30)
    task = suites.shards(str(tmp_path / "colours"), DataConfig(workers=0, augment=aug, repeat_augment=3))
    view = View(img_size=32, train_augment=True)

    def epoch(seed):
        batches = task.trainval.batches(view, batch_size=4, train=True, seed=seed)
        return sorted(x.numpy().tobytes() for xs, _ in itertools.islice(batches, 4) for x in xs)

    first = epoch(0)
    assert len(set(first)) == 16 and epoch(1) == first


@pytest.mark.gpu
def test_transfer_batches_arrive_on_the_gpu_they_are_computed_on(tmp_path, shard_kit):
    """Shard splits are finished on the consumer's GPU as training's loader does (the CPU finish's
    values); other splits arrive in pinned host memory, ready for a non-blocking copy."""
    _colour_shards(tmp_path, shard_kit)
    task = suites.shards(str(tmp_path / "colours"), DataConfig(workers=0))
    (x, y), (gx, gy) = _all(task.test, View(img_size=32)), _all(task.test, View(img_size=32), device="cuda")
    assert gx.is_cuda and torch.equal(x, gx.cpu()) and torch.equal(y, gy.cpu())
    d = write_cifar100(tmp_path / "cifar", n_train=10, n_test=10)
    xs = next(suites.cifar100(str(d), minival_fraction=0.0, seed=0).test.batches(
        View(img_size=32), batch_size=4, train=False, device=torch.device("cuda")))[0]
    assert xs.is_pinned()
