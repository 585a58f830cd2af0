"""Few-shot: big_vision's closed-form L2-regularised least squares on frozen features.

For each seed, ``k`` examples per class are drawn from the training split (a per-class seeded
permutation, its first ``k``); features are standardised with those examples' mean and std, a
constant 100 is appended (a bias that is almost unregularised), targets are one-hot rescaled to
{-1, +1}, and the ridge system is solved on the smaller Gram matrix (X^T X when N >= D, else
X X^T: with 1 shot of 100 classes that is 100 x 100 instead of D x D). Test top-1 is averaged
over seeds. big_vision's defaults: shots 1/5/10/25, 3 seeds, l2 = 2^10. A few seconds on CPU --
cheap enough to run while pre-training goes on (``--watch``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pretrain.transfer.protocols.features import FeatureCache, FrozenFeatureProtocol

BIAS_CONSTANT = 100.0
HEADLINE_SHOTS = 10  # the number big_vision shows first; the largest shot count when 10 is absent


def ridge_fit(X: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float):
    """Closed-form ridge regression to +-1 one-hot targets; returns a predict(X) -> labels function."""
    X = X.double()
    mean, std = X.mean(0, keepdim=True), X.std(0, unbiased=False, keepdim=True) + 1e-5
    Xb = torch.nn.functional.pad((X - mean) / std, (0, 1), value=BIAS_CONSTANT)
    Y = 2.0 * torch.nn.functional.one_hot(y, num_classes).double() - 1.0
    n, d = Xb.shape
    eye = torch.eye(min(n, d), dtype=torch.float64)
    if n >= d:  # primal: (X^T X + l2 I)^-1 X^T Y
        W = torch.linalg.solve(Xb.T @ Xb + l2 * eye, Xb.T @ Y)
    else:  # dual: X^T (X X^T + l2 I)^-1 Y -- with 1 shot per class n is far below d
        W = Xb.T @ torch.linalg.solve(Xb @ Xb.T + l2 * eye, Y)

    def predict(Xt: torch.Tensor) -> torch.Tensor:
        Xt = torch.nn.functional.pad((Xt.double() - mean) / std, (0, 1), value=BIAS_CONSTANT)
        return (Xt @ W).argmax(1)

    return predict


def sample_shots(labels: np.ndarray, num_classes: int, shots: int, seed: int) -> np.ndarray:
    """Indices of ``shots`` examples per class (fewer where a class has fewer), big_vision's way
    (``fewshot_lsr``: per seed one permutation of each class's examples, its first ``shots``, the
    classes in order)."""
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    return np.concatenate([idx[:shots] for idx in per_class]).astype(np.int64)


def shot_draws(labels: np.ndarray, num_classes: int, shots: list[int], seeds: int) -> dict[tuple[int, int], np.ndarray]:
    """``{(seed, k): sample_shots(labels, num_classes, k, seed)}`` for every seed and shot count:
    the examples of the whole training split ``labels`` each fit sees."""
    return {(seed, k): sample_shots(labels, num_classes, k, seed) for seed in range(seeds) for k in shots}


def short_classes(labels: np.ndarray, num_classes: int, shots: list[int]) -> dict[int, tuple[int, int]]:
    """``{k: (fewest examples of a class, that class)}`` for each shot count ``k`` some class has
    fewer than: those counts draw every example such a class has (big_vision's sampling), so a
    "k-shot" number holds fewer examples of it than its name says."""
    counts = np.bincount(labels, minlength=num_classes)[:num_classes]
    c = int(counts.argmin())
    return {k: (int(counts[c]), c) for k in shots if k > counts[c]}


def short_note(short: dict[int, tuple[int, int]]) -> str:
    """One line for ``short_classes``' answer."""
    (n, c), ks = next(iter(short.values())), "/".join(str(k) for k in sorted(short))
    return (f"{ks}-shot asks for more examples than class {c} has ({n}): classes with fewer give all "
            f"they have, {n} at the least (big_vision's sampling)")


def fewshot_accuracy(Xtr, ytr, Xte, yte, num_classes: int, shots: list[int], seeds: int,
                     l2: float, draws: Optional[dict[tuple[int, int], np.ndarray]] = None) -> dict[int, list[float]]:
    """{shots: [test top-1 per seed]}. ``draws``: each ``(seed, k)``'s examples as rows of ``Xtr``,
    where ``Xtr`` holds only some of the training split (``shot_draws`` of the whole split's labels,
    mapped to those rows); None: ``Xtr`` is the whole split, drawn from ``ytr``."""
    out: dict[int, list[float]] = {}
    if draws is None:
        draws = shot_draws(ytr.numpy(), num_classes, shots, seeds)
    for seed in range(seeds):
        for k in shots:
            idx = torch.from_numpy(draws[(seed, k)])
            predict = ridge_fit(Xtr[idx], ytr[idx], num_classes, l2)
            out.setdefault(k, []).append(float((predict(Xte) == yte).double().mean()) if len(yte) else 0.0)
    return out


def headline(shots: list[int]) -> int:
    return HEADLINE_SHOTS if HEADLINE_SHOTS in shots else max(shots)


class FewShot(FrozenFeatureProtocol):
    name = "fewshot"

    def __init__(self, features: FeatureCache, view_of, shots: list[int], seeds: int, l2: float, grid: list[float]):
        super().__init__(features, view_of, l2, grid)
        self.shots, self.seeds = sorted(set(shots)), seeds

    def metric(self, setting: dict) -> str:
        """What the one accuracy of a task is, under any ``setting`` (an L2 penalty): the headline
        shot count's top-1, mean over seeds."""
        return f"{headline(self.shots)}-shot top-1 (mean of {self.seeds} seed(s))"

    def fit_score(self, task, fit, evaluate, setting: dict) -> tuple[float, dict]:
        Xf, yf, Xe, ye = self.splits(task, fit, evaluate)
        short = short_classes(yf.numpy(), task.num_classes, self.shots)
        if short:
            self.say_once(f"  {task.name} fewshot: {short_note(short)}")
        acc = fewshot_accuracy(Xf, yf, Xe, ye, task.num_classes, self.shots, self.seeds, setting["l2"])
        k = headline(self.shots)
        details = {"headline_shots": k, "seeds": self.seeds,
                   "shots": {str(s): {"mean": float(np.mean(v)), "per_seed": v,
                                      **({"fewest_of_a_class": short[s][0]} if s in short else {})}
                             for s, v in acc.items()}}
        return float(np.mean(acc[k])), details
