"""The in-training few-shot and kNN probes measure what vit-transfer measures on the same checkpoint:
images prepared by the same rule (the run's ``data.augment`` crop and normalisation)."""
import pytest
import torch
import torch.distributed as dist
from transfer_fixtures import tiny_model, write_imagefolder

from data_pipeline.config import AugmentConfig, DataConfig
from pretrain.evaluation.config import ValidationConfig
from pretrain.evaluation.in_training import InTrainingEval
from pretrain.transfer.data import make_view
from pretrain.transfer.protocols.features import FeatureCache

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
