"""Many machines, one shard set: ``vit-shards --part I/N`` writes part I of a job, ``merge_parts``
checks the N part manifests and writes the one ``manifest.json`` (the writer's docstring has the
whole scheme)."""
from __future__ import annotations

import json
import posixpath
from collections import Counter
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.shards.manifest import FORMAT, MANIFEST_NAME, SKIPPED_NAMES, VERSION, manifest_text, shard_problem
from data_pipeline.storage.places import open_place
from data_pipeline.storage.urls import is_remote

PART_FORMAT = "vitscale-shards-part"  # part-IIIIofNNNN.json of a --part I/N job


def part_range(n: int, shard_size: int, part: tuple[int, int]) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of the job's sample order that part ``I`` of ``N`` writes: the order's
    nominal shards (``shard_size`` samples each) split into ``N`` near-equal runs, so without skipped
    files or --max-shard-bytes a part's shards hold exactly what one process would put in them."""
    i, parts = part
    nominal = -(-n // shard_size)
    return min(n, (i - 1) * nominal // parts * shard_size), min(n, i * nominal // parts * shard_size)


def part_tag(part: tuple[int, int]) -> str:
    """``0003of0008``: in part I of N's shard names, progress file and part manifest."""
    return f"{part[0]:04d}of{part[1]:04d}"


def part_manifest_name(part: tuple[int, int]) -> str:
    return f"part-{part_tag(part)}.json"


def _part_files(out, part_paths) -> list[tuple[str, bytes | None]]:
    """(where, bytes or None when missing) of each part manifest: a local path, or a URL in the
    store (a shell pattern such as ``s3://b/p/part-*of0064.json`` is listed there)."""
    found = []
    for p in map(str, part_paths):
        if not is_remote(p):
            found.append((str(Path(p)), Path(p).read_bytes() if Path(p).is_file() else None))
            continue
        folder, name = posixpath.split(p)
        place = open_place(folder, "part manifest")
        names = place.names(name) if any(c in name for c in "*?[") else [name]
        if not names:
            found.append((p, None))
        found += [(place.url(n), place.read_bytes(n)) for n in names]
    return found


def _count(v, least: int = 0) -> bool:
    return type(v) is int and v >= least  # bool is an int to isinstance


def _part_problem(m: dict) -> str | None:
    """What in a part manifest (format and version already checked) is not as ``vit-shards --part``
    writes it, as ``key: expected ..., got ...``; None when nothing."""
    checks = [
        ("parts", _count(m.get("parts"), 1), "a number of parts >= 1"),
        ("part", _count(m.get("part"), 1) and _count(m.get("parts"), 1) and m["part"] <= m["parts"],
         "a part number in 1..parts"),
        ("job_samples", _count(m.get("job_samples")), "a sample count >= 0"),
        ("range", isinstance(m.get("range"), list) and len(m["range"]) == 2 and all(map(_count, m["range"])),
         "[first sample, end]"),
        ("shards", isinstance(m.get("shards"), list), "a list of shards"),
        ("skipped", isinstance(m.get("skipped", {}), dict) and all(map(_count, m.get("skipped", {}).values())),
         "{reason: count}"),
        ("skipped_files", isinstance(m.get("skipped_files") or {}, dict) and all(
            isinstance(v, list) for v in (m.get("skipped_files") or {}).values()), "{reason: [file, ...]}"),
    ]
    for key, ok, what in checks:
        if not ok:
            return f"{key}: expected {what}, got {m.get(key)!r}"
    for i, sh in enumerate(m["shards"]):
        if not (isinstance(sh, dict) and isinstance(sh.get("name"), str) and "/" not in sh["name"]
                and _count(sh.get("samples")) and _count(sh.get("bytes"))):
            return f"shards[{i}]: expected {{'name': file name, 'samples': int >= 0, 'bytes': int >= 0}}, got {sh!r}"
    return None


def merge_parts(out_dir, part_paths) -> dict:
    """Check the part manifests of one ``--part I/N`` job and write the one ``manifest.json`` the
    loader reads, into ``out_dir`` (the folder, or ``s3://bucket/prefix``, holding every part's
    shards; part manifests there may be given as URLs or patterns, see ``_part_files``). Checks: each is a part
    manifest; all have the same job (source, classes, options), split and N; parts 1..N each once,
    their sample ranges end to end over the whole job; every shard name once, its file present with
    the size its part recorded. The first problem is a ``DataError`` naming the file or the part.
    Shards are listed in part order, so keys increase through the manifest as in a one-process job."""
    out = open_place(out_dir, "OUT")
    if not part_paths:
        raise DataError(f"{out.root}: no part manifests given")
    parts: dict[int, tuple[str, dict]] = {}
    first = None
    for p, text in _part_files(out, part_paths):
        if text is None:
            raise DataError(f"{p}: part manifest not found (has that part finished?)")
        try:
            m = json.loads(text.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise DataError(f"{p}: not a part manifest (invalid JSON: {e})") from None
        if not isinstance(m, dict) or m.get("format") != PART_FORMAT or m.get("version") != VERSION:
            raise DataError(f"{p}: not a part manifest of vit-shards --part (format {PART_FORMAT!r} "
                            f"version {VERSION} expected)")
        problem = _part_problem(m)
        if problem:
            raise DataError(f"{p}: {problem}: not a part manifest as vit-shards --part writes it")
        if first is None:
            first = (p, m)
        for k in ("job", "parts", "split", "source", "classes", "multi_label", "options", "job_samples"):
            if m.get(k) != first[1].get(k):
                raise DataError(f"{p}: {k} differs from that of {first[0]} ({m.get(k)!r} vs {first[1].get(k)!r}): "
                                "parts of different vit-shards jobs")
        i = m.get("part")
        if i in parts:
            raise DataError(f"{p}: part {i} of {m['parts']} is also given as {parts[i][0]}")
        parts[i] = (p, m)
    n_parts, n = first[1]["parts"], first[1]["job_samples"]
    missing = [i for i in range(1, n_parts + 1) if i not in parts]
    if missing:
        raise DataError(f"{out.root}: part {missing[0]} of {n_parts} is missing "
                        f"({part_manifest_name((missing[0], n_parts))}; {len(missing)} missing in all)")
    shards, names, skipped, skipped_files, end = [], {}, Counter(), {}, 0
    for i in range(1, n_parts + 1):
        p, m = parts[i]
        lo, hi = m["range"]
        if lo != end:
            raise DataError(f"{p}: part {i} covers samples {lo}..{hi} but part {i - 1} ended at {end}")
        end = hi
        if m.get("total") != sum(s["samples"] for s in m["shards"]):
            raise DataError(f"{p}: total {m.get('total')} differs from the sum of its shards' samples")
        for s in m["shards"]:
            if s["name"] in names:
                raise DataError(f"{p}: shard {s['name']} is also listed by {names[s['name']]}")
            names[s["name"]] = p
            why = shard_problem(out, s)
            if why:
                raise DataError(f"{out.url(s['name'])}: shard of part {i} ({p}) is {why}")
            shards.append(s)
        skipped.update(m.get("skipped", {}))
        for reason, files in (m.get("skipped_files") or {}).items():
            kept = skipped_files.setdefault(reason, [])
            kept.extend(files[:SKIPPED_NAMES - len(kept)])
    if end != n:
        raise DataError(f"{parts[n_parts][0]}: the parts end at sample {end} of the job's {n}")
    if not shards:
        raise DataError(f"{first[1]['source']}: no readable images ({dict(skipped)})")
    m = first[1]
    manifest = {
        "format": FORMAT, "version": VERSION, "split": m["split"], "source": m["source"],
        "classes": m["classes"], "multi_label": m["multi_label"], "total": sum(s["samples"] for s in shards),
        "shards": shards, "options": m["options"], "skipped": dict(skipped), "skipped_files": skipped_files,
        "job": m["job"], "parts": n_parts,
    }
    out.write_text(MANIFEST_NAME, manifest_text(manifest))
    return manifest
