"""k-nearest-neighbour classification on frozen features, as DINO and DINOv2 report it
(``dinov2/eval/knn.py``, ``KnnModule``; a test holds the two equal on the same features).

Features are L2-normalised (DINOv2's ``ModelWithNormalize``); each test image takes its ``max(k)``
most cosine-similar training images, weighs them by ``softmax(similarity / T)`` over those
neighbours (T = 0.07), and for each ``k`` sums the weights of the first ``k`` per class: the
class scores whose top-1 / top-5 are reported (DINOv2: k in 10, 20, 100, 200; 20 is the number
DINO shows). Softmax over the ``max(k)`` neighbours is DINO's ``exp(sim / T)`` vote divided by one
constant per image, so the ranking of classes is the same.

Cost: one (chunk x N_train) similarity matrix at a time; ImageNet's 1.28M x 768 training
features (3.9 GB in fp32) against 50k test images in chunks of 256 rows is about a minute on one
GPU. The training features move to the device once when ``device`` is a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.transfer.protocols.features import FrozenFeatureProtocol

HEADLINE_K = 20  # DINO's; the largest k when 20 is not asked for


def headline(ks: list[int]) -> int:
    return HEADLINE_K if HEADLINE_K in ks else max(ks)


def short_note(ks: list[int], n_train: int) -> str | None:
    """The line for the ``ks`` above the ``n_train`` training images (DINOv2's topk would refuse;
    every training image is a neighbour instead), or None where there are none."""
    over = [k for k in ks if k > n_train]
    if not over:
        return None
    return (f"k={'/'.join(map(str, over))} asks for more neighbours than the {n_train} training images: "
            "those k use all of them")


@torch.no_grad()
def knn_scores(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, ks: list[int], temperature: float,
               num_classes: int, *, chunk: int = 256, device: torch.device | None = None) -> dict[int, torch.Tensor]:
    """``{k: class scores (N_test, num_classes)}`` on the CPU, float32."""
    device = device or train_x.device
    ks = sorted(set(ks))
    max_k = min(max(ks), len(train_y))
    bank = F.normalize(train_x.float(), dim=1).to(device).T  # (D, N_train)
    labels = train_y.to(device).view(1, -1)
    out: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    for start in range(0, len(test_x), chunk):
        q = F.normalize(test_x[start:start + chunk].float(), dim=1).to(device)
        sims, idx = (q @ bank).topk(max_k, dim=1, largest=True, sorted=True)
        neighbours = torch.gather(labels.expand(len(q), -1), 1, idx)
        weights = torch.softmax(sims / temperature, dim=1)
        for k in ks:  # DINOv2 sums one-hot rows (n x max_k x C); a scatter needs only n x C (21k classes)
            scores = torch.zeros(len(q), num_classes, device=device)
            out[k].append(scores.scatter_add_(1, neighbours[:, :k], weights[:, :k]).cpu())
    return {k: torch.cat(v) if v else torch.zeros(0, num_classes) for k, v in out.items()}


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Share of rows whose label is among the ``k`` highest scores."""
    if not len(labels):
        return 0.0
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return float((top == labels.view(-1, 1)).any(1).double().mean())


class KNN(FrozenFeatureProtocol):
    """kNN on the shared feature cache. Without a sweep the task's number is the headline k's
    top-1; with one, the k of ``eval.knn_k`` best on val."""

    name = "knn"

    def __init__(self, features, view_of, ks: list[int], temperature: float):
        super().__init__(features, view_of, 0.0, [])
        self.ks, self.temperature = sorted(set(ks)), temperature

    def metric(self, setting: dict) -> str:
        """What the accuracy under ``setting`` is: its k's top-1."""
        return f"{setting['k']}-NN top-1 (T={self.temperature:g})"

    def grid(self, sweep: bool) -> list[dict]:
        return [{"k": k} for k in self.ks] if sweep else [{"k": headline(self.ks)}]

    def fit_score(self, task, fit, evaluate, setting: dict) -> tuple[float, dict]:
        Xf, yf, Xe, ye = self.splits(task, fit, evaluate)
        self.features.log(f"  {task.name} knn: {len(ye)} images of {evaluate.name} against {len(yf)} of {fit.name} ...")
        if short := short_note(self.ks, len(yf)):
            self.say_once(f"  {task.name} knn: {short}")
        scores = knn_scores(Xf, yf, Xe, self.ks, self.temperature, task.num_classes, device=self.features.device)
        per_k = {str(k): {"top1": topk_accuracy(s, ye, 1), "top5": topk_accuracy(s, ye, 5),
                          **({"neighbours": len(yf)} if k > len(yf) else {})} for k, s in scores.items()}
        k = setting["k"]
        return per_k[str(k)]["top1"], {"k": per_k, "headline_k": k, "temperature": self.temperature}
