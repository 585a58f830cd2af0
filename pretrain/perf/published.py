"""Published ViT training runs the performance model is checked against
(``published_runs.json``, beside this file), and the calibration that solves a GPU type's
efficiency constant from one of them."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pretrain.perf.perfmodel import Layout, predict

PUBLISHED = Path(__file__).with_name("published_runs.json")


def published_table() -> list[dict]:
    """Each row of ``published_runs.json`` with the model's prediction and relative error."""
    out = []
    for row in json.loads(PUBLISHED.read_text())["rows"]:
        lay = Layout(**row["layout"])
        if row["metric"] == "scaling_efficiency":
            ref = replace(lay, nodes=row["reference_nodes"])
            pred = predict(lay).images_per_second_per_gpu / predict(ref).images_per_second_per_gpu
        else:
            pred = predict(lay).images_per_second
        out.append(dict(row, predicted=pred, error=pred / row["published"] - 1))
    return out


def calibrate(layout: Layout, published_images_per_second: float) -> float:
    """The efficiency constant at which :func:`predict` gives ``published_images_per_second``."""
    lo, hi = 0.01, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        got = predict(replace(layout, efficiency=mid)).images_per_second
        lo, hi = (mid, hi) if got < published_images_per_second else (lo, mid)
    return round((lo + hi) / 2, 3)
