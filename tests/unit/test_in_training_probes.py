"""The in-training few-shot and kNN probes measure what vit-transfer measures on the same checkpoint:
images prepared by the same rule (the run's ``data.augment`` crop and normalisation), and the
few-shot fits drawn from the whole train split as vit-transfer (and big_vision) draw them, on one
rank or two."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transfer_fixtures import save_png, tiny_model, write_imagefolder

from data_pipeline.config import AugmentConfig, DataConfig
from pretrain.evaluation.config import ValidationConfig
from pretrain.evaluation.in_training import InTrainingEval
from pretrain.transfer.data import make_view
from pretrain.transfer.protocols.features import FeatureCache
from pretrain.transfer.protocols.fewshot import fewshot_accuracy, sample_shots

IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


class Engine:
    """What the evaluator calls: the engine's forward, its module and device."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self, x):
        return self.module(x)


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_probes_prepare_images_with_the_runs_crop_and_normalisation(tmp_path, group):
    """A run trained with ImageNet's mean / std and a 0.8 evaluation crop: the few-shot probe's
    cached images and the kNN probe's features are vit-transfer's (``make_view``, ``FeatureCache``)."""
    folder = write_imagefolder(tmp_path / "folder", n_train=3, n_test=2)
    aug = AugmentConfig(**IMAGENET, eval_crop_pct=0.8)
    spec = f"imagefolder:{folder}"
    ev = InTrainingEval(ValidationConfig(every_steps=1, fewshot_suites=[spec], knn_suites=[spec], fewshot_shots=[2],
                                         fewshot_seeds=1), DataConfig(augment=aug), batch=5, seed=0, rank=0, world=1,
                        img_size=32, num_classes=10, dtype=torch.float32)
    (_, task), = ev.tasks[0]
    view = make_view(task, 32, aug)
    assert (view.mean, view.std, view.crop_pct, view.resize) == (tuple(aug.mean), tuple(aug.std), 0.8, "crop")
    fewshot, = ev._suites()
    cached = torch.cat(fewshot.parts["test"][0]).float()
    want = torch.cat([x for x, _ in task.test.batches(view, batch_size=5, train=False)])
    torch.testing.assert_close(cached, want, atol=4e-3, rtol=1e-3)  # the cache holds float16

    model = tiny_model(img_size=32).eval()
    with torch.no_grad():
        feats, labels = ev._features(Engine(model), ev.knn[0].batches("test"))
    cache = FeatureCache(model, batch_size=5, pool="model", device=torch.device("cpu"))
    X, y = cache.get(task.test, view)
    assert torch.equal(labels, y)
    torch.testing.assert_close(feats, X)


SHOTS, SEEDS = [1, 3, 5], 3


def evaluator(spec: str, rank: int = 0, world: int = 1) -> InTrainingEval:
    """Few-shot probes of ``spec`` for a run trained with ImageNet's mean / std."""
    return InTrainingEval(ValidationConfig(every_steps=1, fewshot_suites=[spec], fewshot_shots=SHOTS,
                                           fewshot_seeds=SEEDS),
                          DataConfig(augment=AugmentConfig(**IMAGENET)), batch=4, seed=0, rank=rank,
                          world=world, img_size=32, num_classes=10, dtype=torch.float32)


def _fewshot_at(rank: int, world: int, spec: str, init: str, out: str) -> None:
    """Rank ``rank`` of ``world`` (gloo): the in-training few-shot metrics of ``tiny_model`` on
    ``spec``, its draws and its train features in pool order, saved to ``out`` by rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        ev = evaluator(spec, rank, world)
        engine = Engine(tiny_model(img_size=32).eval())
        with torch.no_grad():
            metrics = ev._fewshot(engine)
            s, = ev._suites()
            X, y = ev._fewshot_train(engine, s)
        if rank == 0:
            torch.save({"metrics": metrics, "X": X, "y": y, "draws": s.draws}, out)
    finally:
        dist.destroy_process_group()


def noise_folder(root, n_train: int, n_test: int, classes: int = 4):
    """An ImageFolder of noise: which examples a fit draws decides what it predicts."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        for c in range(classes):
            for i in range(n):
                save_png(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8), root / split / f"c{c}" / f"{i:03d}.png")
    return root


@pytest.mark.parametrize("suite", ["imagefolder", "demo"])
def test_fewshot_draws_are_vit_transfers_on_one_rank_or_two(tmp_path, suite):
    """Each seed's k-shot examples are vit-transfer's draw from the whole train split (rows of its
    features at ``sample_shots`` of its labels), at world size 1 and 2, and the accuracies are
    vit-transfer's ``fewshot_accuracy`` on its own features, read by two data workers: for files
    (labels known up front: the drawn examples alone are decoded) and for shards (the whole split,
    in manifest order, however many workers read it)."""
    if suite == "imagefolder":
        spec = f"imagefolder:{noise_folder(tmp_path / 'folder', n_train=12, n_test=10)}"
    else:
        from data_pipeline.shards.writer import write_demo_shards

        for split, n in (("transfer-train", 45), ("transfer-test", 30)):  # 45: uneven over ranks and shards
            write_demo_shards(tmp_path / split, split, n=n, shard_size=16)
        spec = f"demo:{tmp_path}"
    got = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}.pt"
        if world == 1:
            _fewshot_at(0, 1, spec, str(tmp_path / "pg1"), str(out))
        else:
            mp.spawn(_fewshot_at, args=(world, spec, str(tmp_path / "pg2"), str(out)), nprocs=world)
        got[world] = torch.load(out, weights_only=False)

    ev = evaluator(spec)  # vit-transfer's side: the same task, read by eval.workers' default 2, its own features
    (label, task), = ev.tasks[0]
    cache = FeatureCache(tiny_model(img_size=32).eval(), batch_size=8, pool="model", device=torch.device("cpu"),
                         workers=2)
    view = make_view(task, 32, ev.data.augment)
    Xtr, ytr = cache.get(task.trainval, view)
    Xte, yte = cache.get(task.test, view)
    want = fewshot_accuracy(Xtr, ytr, Xte, yte, task.num_classes, SHOTS, SEEDS, 1024.0)
    assert got[1]["metrics"] == got[2]["metrics"]
    assert got[1]["metrics"] == {f"fewshot/{label}/{k}shot": pytest.approx(np.mean(v)) for k, v in want.items()}
    assert (got[1]["draws"] is None) == (suite == "demo")
    for world, g in got.items():
        for seed in range(SEEDS):
            for k in SHOTS:
                idx = torch.from_numpy(sample_shots(ytr.numpy(), task.num_classes, k, seed))
                rows = idx if g["draws"] is None else torch.from_numpy(g["draws"][(seed, k)])
                assert torch.equal(g["y"][rows], ytr[idx]), (world, seed, k)
                torch.testing.assert_close(g["X"][rows], Xtr[idx], atol=2e-2, rtol=2e-2,
                                           msg=f"world {world}, seed {seed}, {k}-shot")
