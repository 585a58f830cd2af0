"""Linear probe: multinomial logistic regression on frozen, standardised features.

Full-batch L-BFGS on the feature matrix (as CLIP's and most linear-probe protocols do with
scikit-learn): deterministic, no learning rate or epochs to tune, and seconds even for CIFAR-100's
50k x 768 features. The one hyper-parameter is the L2 penalty on the weights, swept on
train -> val when sweeping.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pretrain.observability.progress import Progress
from pretrain.transfer.protocols.features import FrozenFeatureProtocol


@dataclass
class LinearClassifier:
    weight: torch.Tensor  # (D, C)
    bias: torch.Tensor  # (C,)
    mean: torch.Tensor  # (D,) feature standardisation of the fit set
    std: torch.Tensor

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        return ((X - self.mean) / self.std) @ self.weight + self.bias

    def accuracy(self, X: torch.Tensor, y: torch.Tensor) -> float:
        return float((self.logits(X).argmax(1) == y).float().mean()) if len(y) else 0.0


def fit_logistic(X: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float, max_iter: int = 500,
                 device: torch.device | None = None, desc: str = "") -> LinearClassifier:
    """Minimise mean cross-entropy + l2/2 * ||W||^2 (bias unpenalised) by L-BFGS, in float64 (the
    line search needs the precision at small l2) on ``device`` (a GPU makes CIFAR-100's
    50k x 768 x 100 problem take seconds instead of minutes)."""
    X, y = X.to(device or X.device, torch.float64), y.to(device or X.device)
    mean, std = X.mean(0), X.std(0, unbiased=False) + 1e-6  # standardised: one l2 grid fits all widths
    Xs = (X - mean) / std
    W = torch.zeros(X.shape[1], num_classes, dtype=torch.float64, device=X.device, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, device=X.device, requires_grad=True)
    max_eval = max_iter * 5 // 4  # LBFGS's own default: the most evaluations it may take
    opt = torch.optim.LBFGS([W, b], lr=1.0, max_iter=max_iter, max_eval=max_eval, history_size=20,
                            tolerance_grad=1e-7, tolerance_change=1e-10, line_search_fn="strong_wolfe")

    with Progress(max_eval, f"  L-BFGS {desc}".rstrip(), "evals", at_most=True) as bar:
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(Xs @ W + b, y) + 0.5 * l2 * (W * W).sum()
            loss.backward()
            bar.update(1, lambda: f"loss {loss.item():.4f}")  # .item() syncs a GPU: only when a line prints
            return loss

        with torch.enable_grad():
            opt.step(closure)
    return LinearClassifier(*(t.detach().float().cpu() for t in (W, b, mean, std)))


class LinearProbe(FrozenFeatureProtocol):
    name = "linear"

    def fit_score(self, task, fit, evaluate, setting: dict) -> tuple[float, dict]:
        Xf, yf, Xe, ye = self.splits(task, fit, evaluate)
        self.features.log(f"  {task.name} linear l2={setting['l2']:g}: logistic regression on {tuple(Xf.shape)} "
                          f"features of {fit.name} (L-BFGS) ...")
        clf = fit_logistic(Xf, yf, task.num_classes, setting["l2"], device=self.features.device,
                           desc=f"{task.name} l2={setting['l2']:g}")
        return clf.accuracy(Xe, ye), {"train_accuracy": clf.accuracy(Xf, yf)}
