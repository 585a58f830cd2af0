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
