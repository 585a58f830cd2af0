"""Time to accuracy: the first evaluation at which ``validation.target_metric`` reaches
``validation.target_value``, with what the run took to get there.

MLPerf Training scores a run by the time it takes to reach a quality target, evaluated on a
schedule; this records that point of a vit-train run in its own terms: the step, the device-hours
(``RunTotals``: devices x wall-clock of every invocation that led to it, start-up, evaluations and
saves included), the images and the model FLOPs. The record rides in each later checkpoint's
``run.json`` and in ``summary.json`` (``target_reached``), so a resumed run keeps the first time it
was reached; with ``validation.stop_at_target`` the run ends there with a checkpoint.
"""
from __future__ import annotations

from typing import Optional

from pretrain.evaluation.config import lower_is_better


def relation(metric: str) -> str:
    """``<=`` for a loss, ``>=`` for an accuracy: how ``metric`` reaches its target."""
    return "<=" if lower_is_better(metric) else ">="


class Target:
    """``val``: the ``validation`` section (its ``target_*`` keys set); ``reached``: the record a
    resumed checkpoint carries (kept only when it is of this metric and value)."""

    def __init__(self, val, reached: Optional[dict] = None):
        self.metric, self.value, self.stop = val.target_metric, val.target_value, val.stop_at_target
        same = reached is not None and (reached.get("metric"), reached.get("value")) == (self.metric, self.value)
        self.reached: Optional[dict] = reached if same else None

    @property
    def words(self) -> str:
        """``eval/top1 >= 0.75`` (a loss: ``<=``)."""
        return f"{self.metric} {relation(self.metric)} {self.value:g}"

    def meets(self, measured: float) -> bool:
        return measured <= self.value if lower_is_better(self.metric) else measured >= self.value

    def check(self, results: dict, step: int, totals: dict) -> Optional[dict]:
        """After the evaluation of ``step`` (``results``: its metrics, rank 0's; ``totals``:
        ``RunTotals.record()`` now): the record when it is the first to reach the target, else None."""
        measured = results.get(self.metric)
        if self.reached is not None or measured is None or not self.meets(measured):
            return None
        secs = totals.get("device_seconds")
        self.reached = {"metric": self.metric, "value": self.value, "measured": measured, "step": step,
                        "device_hours": None if secs is None else secs / 3600,
                        "images_seen": totals.get("images_seen"), "model_flops": totals.get("model_flops")}
        return self.reached


def reached_words(rec: dict) -> str:
    """``eval/top1 0.7612 >= 0.75 at step 4000 after 120 device-hours (2,048,000 images)``."""
    hours = f" after {rec['device_hours']:.3g} device-hours" if rec.get("device_hours") is not None else ""
    images = f" ({rec['images_seen']:,} images)" if rec.get("images_seen") is not None else ""
    reached = f"{rec['metric']} {rec['measured']:.4g} {relation(rec['metric'])} {rec['value']:g}"
    return f"{reached} at step {rec['step']}{hours}{images}"
