"""Reading shards back in tests with the standard library alone (tarfile, json): what a stock
reader sees, independent of our loader."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path


def samples_of(out: Path) -> dict:
    """key -> (image extension, image bytes, label) over the shards manifest.json lists, read with tarfile."""
    found = {}
    for s in json.loads((out / "manifest.json").read_text())["shards"]:
        with tarfile.open(out / s["name"]) as t:
            members = {m.name: t.extractfile(m).read() for m in t if m.isfile()}
        keys = {n.split(".")[0] for n in members}
        assert len(keys) == s["samples"], s
        for k in keys:
            ext = next(e for e in ("jpg", "png") if f"{k}.{e}" in members)
            assert k not in found, f"key {k} twice"
            found[k] = (ext, members[f"{k}.{ext}"], members[f"{k}.cls"])
    return found


def remote_data_cfg(shards: str, **kw):
    """The data section the remote-shard tests read with: no workers, a small shuffle buffer, an
    outage retried well inside a test's time (``kw`` overrides)."""
    from data_pipeline.config import DataConfig

    base = dict(train_shards=shards, allow_remote=True, workers=0, shuffle_buffer=16, remote_retry_s=20.0,
                remote_timeout_s=5.0)
    return DataConfig(**{**base, **kw})


def one_epoch(cfg):
    """One epoch of the training loader on ``cfg``: (keys, targets, images) per batch, and the
    loader's counters."""
    from data_pipeline.loading.loader import build_loader

    loader = build_loader(cfg, batch_size=8, seed=3, img_size=16)
    out = []
    for x, y in loader:
        out.append((list(loader.last_keys), y.clone(), x.clone()))
        if loader.epoch == 1:
            break
    return out, loader.counters


class InterruptOnce:
    """A source item that interrupts the writer (as Ctrl-C would) the first time it is loaded,
    then loads normally: a rerun of the same job reads it."""

    def __init__(self, inner):
        self.inner, self.labels, self.armed = inner, inner.labels, True

    def load(self):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.inner.load()
