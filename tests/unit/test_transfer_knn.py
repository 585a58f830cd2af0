"""kNN on frozen features (``pretrain.transfer.protocols.knn``) equals DINOv2's ``KnnModule``
(``dinov2/eval/knn.py``) on the same features: the reference below is its code for one process
(no broadcast or gather: one rank holds every training feature), with DINOv2's feature
normalisation (``ModelWithNormalize``) and its accuracy (torchmetrics' ``MulticlassAccuracy``,
micro average: the share of test images whose label is in the top k; written out, torchmetrics
is not installed)."""
import pytest
import torch
from torch.nn.functional import normalize, one_hot, softmax

from pretrain.transfer.protocols.knn import headline, knn_scores, topk_accuracy


class DinoV2Knn(torch.nn.Module):
    """DINOv2's ``KnnModule`` with ``global_size`` 1, as written there."""

    def __init__(self, train_features, train_labels, nb_knn, T, num_classes):
        super().__init__()
        self.train_features_rank_T = train_features.T
        self.candidates = train_labels.view(1, -1)
        self.nb_knn, self.max_k, self.T, self.num_classes = nb_knn, max(nb_knn), T, num_classes

    def forward(self, features_rank):
        similarity = torch.mm(features_rank, self.train_features_rank_T)
        candidate_labels = self.candidates.expand(len(similarity), -1)
        topk_sims, indices = similarity.topk(self.max_k, largest=True, sorted=True)
        neighbors_labels = torch.gather(candidate_labels, 1, indices)
        batch_size = neighbors_labels.shape[0]
        topk_sims_transform = softmax(topk_sims / self.T, 1)
        matmul = torch.mul(one_hot(neighbors_labels, num_classes=self.num_classes),
                           topk_sims_transform.view(batch_size, -1, 1))
        return {k: torch.sum(matmul[:, :k, :], 1) for k in self.nb_knn}


def dinov2_accuracy(probas: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """torchmetrics' ``MulticlassAccuracy(top_k=k, average="micro")``, which DINOv2's
    ``MEAN_ACCURACY`` builds: correct images over all images, an image correct when its label is
    among its k highest scores."""
    correct = (probas.topk(k, dim=1).indices == labels.view(-1, 1)).any(1)
    return correct.sum().item() / len(labels)


def _features(n_train=300, n_test=120, classes=10, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    ytr, yte = torch.randint(0, classes, (n_train,), generator=g), torch.randint(0, classes, (n_test,), generator=g)
    noisy = lambda y: centres[y] + 1.5 * torch.randn(len(y), dim, generator=g)  # noqa: E731  overlapping classes
    return noisy(ytr) * 7.0, ytr, noisy(yte) * 0.3, yte  # unnormalised on purpose: the norm must not matter


@pytest.mark.parametrize("chunk", [256, 7])
def test_knn_equals_dinov2_knn_module(chunk):
    Xtr, ytr, Xte, yte = _features()
    ks, T, C = [10, 20, 100, 200], 0.07, 10
    ours = knn_scores(Xtr, ytr, Xte, ks, T, C, chunk=chunk)
    ref = DinoV2Knn(normalize(Xtr, dim=1), ytr, ks, T, C)(normalize(Xte, dim=1))
    for k in ks:
        assert torch.allclose(ours[k], ref[k], atol=1e-6), k
        assert torch.equal(ours[k].argmax(1), ref[k].argmax(1))
        for top in (1, 5):
            assert topk_accuracy(ours[k], yte, top) == pytest.approx(dinov2_accuracy(ref[k], yte, top), abs=1e-9)
    acc = {k: topk_accuracy(ours[k], yte, 1) for k in ks}
    assert 0.35 < acc[20] < 0.98, acc  # classes overlap: neither chance (0.1) nor trivial


def test_headline_k_and_fewer_training_images_than_k():
    assert headline([10, 20, 100, 200]) == 20 and headline([5, 50]) == 50
    Xtr, ytr, Xte, yte = _features(n_train=15)
    scores = knn_scores(Xtr, ytr, Xte, [10, 20], 0.07, 10)  # 20 neighbours asked, 15 exist: all of them
    assert torch.allclose(scores[20].sum(1), torch.ones(len(yte)), atol=1e-5)
    assert torch.allclose(scores[10].sum(1), scores[10].sum(1).clamp(max=1.0))


def test_a_sweep_over_k_names_each_k_it_scores(tmp_path):
    """With ``eval.sweep`` every val line and the test line name the k they score, not the headline k."""
    import numpy as np
    from transfer_fixtures import colour_image, tiny_model

    from pretrain.transfer.data import ArrayImages, View
    from pretrain.transfer.protocols.features import FeatureCache
    from pretrain.transfer.protocols.knn import KNN
    from pretrain.transfer.suites import Task
    from pretrain.transfer.sweep import run_task

    rng = np.random.default_rng(0)

    def split(name, n):
        labels = [i % 4 for i in range(n)]
        return ArrayImages(name, np.stack([colour_image(y, rng, 32) for y in labels]), labels)

    train, val, test = split("train", 16), split("val", 8), split("test", 8)
    task = Task("colours", 4, train, val, train, test)
    cache = FeatureCache(tiny_model(32).eval(), batch_size=8, pool="model", device=torch.device("cpu"))
    lines: list[str] = []
    result = run_task(KNN(cache, lambda t: View(img_size=32), [1, 3, 20], 0.07), task, sweep=True, log=lines.append)
    assert [line.split(": val ")[1].split(" top-1")[0] for line in lines[:3]] == ["1-NN", "3-NN", "20-NN"], lines
    chosen = result.setting["k"]
    assert f"k={chosen}: test {chosen}-NN top-1 (T=0.07) " in lines[3], lines


def test_each_scoring_line_names_the_split_it_scores():
    """A sweep scores val images, then test images: each line says which, with their number."""
    import numpy as np
    from transfer_fixtures import colour_image, tiny_model

    from pretrain.transfer.data import ArrayImages, View
    from pretrain.transfer.protocols.features import FeatureCache
    from pretrain.transfer.protocols.knn import KNN
    from pretrain.transfer.suites import Task
    from pretrain.transfer.sweep import run_task

    rng = np.random.default_rng(1)

    def split(name, n):
        labels = [i % 4 for i in range(n)]
        return ArrayImages(name, np.stack([colour_image(y, rng, 32) for y in labels]), labels)

    train, val, test = split("train", 16), split("val", 6), split("test", 10)
    lines: list[str] = []
    cache = FeatureCache(tiny_model(32).eval(), batch_size=8, pool="model", device=torch.device("cpu"),
                         log=lines.append)
    run_task(KNN(cache, lambda t: View(img_size=32), [1, 3], 0.07), Task("colours", 4, train, val, train, test),
             sweep=True, log=lines.append)
    scoring = [line for line in lines if " against " in line]
    assert scoring == ["  colours knn: 6 images of val against 16 of train ..."] * 2 + \
        ["  colours knn: 10 images of test against 16 of train ..."], lines
