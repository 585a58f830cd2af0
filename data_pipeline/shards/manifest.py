"""``manifest.json`` beside the shards, and turning ``data.train_shards`` into a checked shard list.

The manifest is what makes the loader's promises possible *before* reading any tar: the per-shard
sample counts give every rank the same number of batches, let a missing or truncated shard be
measured in lost samples, and the class list gives ``num_classes``. Layout (``version`` 1)::

    {"format": "vitscale-shards", "version": 1, "split": "train", "source": "imagefolder:/data",
     "classes": ["n01440764", ...], "multi_label": false, "total": 1281167,
     "shards": [{"name": "train-000000.tar", "samples": 1000, "bytes": 114000000}, ...],
     "options": {"shard_size": 1000, "resize_shorter": 256, ...}, "skipped": {"unreadable": 0}}

Shard names are relative to the manifest's folder. A shard's position in the manifest is its
stable identity: the loader seeds each sample's augmentation from (shard position, index in shard),
which does not depend on how shards are split over ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import braceexpand

from data_pipeline.errors import DataError
from data_pipeline.files import write_atomic
from data_pipeline.storage.http import HTTPShard
from data_pipeline.storage.retry import RemotePolicy, StoreUnreachable
from data_pipeline.storage.s3 import S3Object
from data_pipeline.storage.urls import is_http, is_remote, is_s3, local_path
from data_pipeline.tally import Tally

MANIFEST_NAME = "manifest.json"
FORMAT = "vitscale-shards"
VERSION = 1
SKIPPED_NAMES = 1000  # names kept per reason in the manifest's "skipped_files"; "skipped" counts all


@dataclass(frozen=True)
class Shard:
    index: int  # position in the manifest(s): the stable identity used for per-sample seeds
    name: str
    url: str
    samples: int


@dataclass(frozen=True)
class ShardSet:
    shards: tuple[Shard, ...]  # selected shards in manifest order
    classes: tuple[str, ...]
    multi_label: bool
    manifests: tuple[str, ...]
    # retries this process's manifest reads took (remote manifests): counted by the training
    # loader as remote_retries, since no loader counter existed yet when they happened
    read_retries: int = field(default=0, compare=False)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def total(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def where(self) -> str:
        """The manifest(s) it was read from, for a line: the first, and how many more."""
        more = len(self.manifests) - 1
        return self.manifests[0] + (f" (+{more} more)" if more else "")

    def config_problem(self, num_classes: int, multi_label: bool) -> Optional[str]:
        """The line for a model of ``num_classes`` (``model.num_classes``) trained on these shards with
        ``data.multi_label=multi_label``, or None where they agree. Single-label shards read as
        multi-label are sigmoid targets of one class (big_vision's ImageNet-21k); multi-label ones
        read as single-label would train on each sample's first label alone."""
        if num_classes != self.num_classes:
            return (f"model.num_classes={num_classes} but {self.where} lists {self.num_classes} classes; "
                    f"set model.num_classes={self.num_classes}")
        if self.multi_label and not multi_label:
            return (f"data.multi_label=false but {self.where} holds multi-label samples, of which it would "
                    "train on each one's first label alone; set data.multi_label=true")
        return None

    def labels_problem(self, train: "ShardSet", key: str = "data.val_shards") -> Optional[str]:
        """The line for shards read with ``train``'s labels (validation shards, whose labels index the
        training head; a transfer suite's test split) whose class list is not ``train``'s, or None
        where it is: another list, or the same classes in another order, would score samples against
        other classes."""
        if self.classes == train.classes and self.multi_label == train.multi_label:
            return None
        if self.multi_label != train.multi_label:
            kind = {True: "multi-label", False: "single-label"}
            return (f"{key}: {self.where} is {kind[self.multi_label]} but {train.where} is "
                    f"{kind[train.multi_label]}; write both from one kind of source")
        if sorted(self.classes) == sorted(train.classes):
            i = next(i for i, (a, b) in enumerate(zip(self.classes, train.classes)) if a != b)
            what = (f"lists the classes of {train.where} in another order (label {i}: {self.classes[i]!r} "
                    f"here, {train.classes[i]!r} there)")
        else:
            only = sorted(set(self.classes) ^ set(train.classes))[0]
            side = self.where if only in self.classes else train.where
            what = (f"lists {self.num_classes} classes against the {train.num_classes} of {train.where} "
                    f"(e.g. {only!r} only in {side})")
        return (f"{key}: {self.where} {what}; write both from sources with the same class folders "
                "(vit-shards --allow-empty-classes keeps a folder without images)")

    def fingerprint(self) -> str:
        """Short hash of names and counts: a stored data position only applies to the same data."""
        text = "|".join(f"{s.index}:{s.name}:{s.samples}" for s in self.shards)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def manifest_text(manifest: dict) -> str:
    """A manifest as its file holds it."""
    return json.dumps(manifest, indent=1) + "\n"


def write_manifest(out_dir: Union[str, Path], manifest: dict) -> Path:
    """Atomically write ``manifest.json`` (temp name + rename): it is the last file a job writes,
    so its presence means every shard it lists is complete."""
    return write_atomic(Path(out_dir) / MANIFEST_NAME, manifest_text(manifest))


def shard_problem(out, shard: dict) -> Optional[str]:
    """What is wrong with a shard a manifest lists, in ``out`` (a place of ``open_place``): "missing",
    or "N bytes, written as M" when its size is not the one recorded; None when it is whole."""
    st = out.stat(shard["name"])
    if st is None:
        return "missing"
    return None if st["bytes"] == shard["bytes"] else f"{st['bytes']} bytes, written as {shard['bytes']}"


MANIFEST_POLICY = RemotePolicy(retry_s=10.0)  # a manifest read without a data section's data.remote_* keys


def _read_bytes(url: str, allow_remote: bool, key: str, policy: Optional[RemotePolicy] = None,
                tally: Optional[Tally] = None) -> bytes:
    """The manifest's bytes (decoded, with the other checks, by :func:`parse_manifest`); an
    ``http(s)://`` or ``s3://`` one retried under ``policy`` (the run's ``data.remote_*``)."""
    if is_remote(url):
        _check_remote(url, allow_remote, key)
        from webdataset.gopen import gopen

        if is_http(url) or is_s3(url):  # retried like the shards (storage.http, storage.s3)
            reader = HTTPShard if is_http(url) else S3Object
            try:
                with reader(url, MANIFEST_NAME, policy or MANIFEST_POLICY, tally, kind="manifest") as f:
                    return f.read()
            except (DataError, StoreUnreachable) as e:
                raise (StoreUnreachable if isinstance(e, StoreUnreachable) else DataError)(f"{e} ({key})") from None

        try:
            with gopen(url, "rb") as f:
                return f.read()
        except Exception as e:  # any transport failure is the same user-facing problem
            raise DataError(f"{url}: cannot read manifest ({e})") from None
    path = Path(local_path(url))
    if not path.is_file():
        raise DataError(f"{path}: manifest not found ({key}); write shards with vit-shards, "
                        f"which puts {MANIFEST_NAME} beside them")
    return path.read_bytes()


def parse_manifest(text: Union[str, bytes], where: str) -> dict:
    """Validate a manifest (its text, or its bytes: UTF-8); every error names the file and the key."""
    try:
        m = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
                        "not a manifest that vit-shards wrote") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON at line {e.lineno}: {e.msg}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise DataError(f"{where}: JSON nested too deeply: not a manifest that vit-shards wrote") from None
    if not isinstance(m, dict):
        raise DataError(f"{where}: top level must be an object")
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DataError(f"{where}: format/version: expected {FORMAT!r} version {VERSION}, "
                        f"got {m.get('format')!r} version {m.get('version')!r}")
    classes = m.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise DataError(f"{where}: classes: expected a non-empty list of class names")
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise DataError(f"{where}: shards: expected a list")
    names = set()
    for i, s in enumerate(shards):
        if not (isinstance(s, dict) and isinstance(s.get("name"), str) and "/" not in s["name"]
                and type(s.get("samples")) is int and s["samples"] >= 0):  # bool is an int to isinstance
            raise DataError(f"{where}: shards[{i}]: expected {{'name': file name, 'samples': int >= 0}}, got {s!r}")
        if s["name"] in names:
            raise DataError(f"{where}: shards[{i}]: duplicate shard name {s['name']!r}")
        names.add(s["name"])
    total = sum(s["samples"] for s in shards)
    if type(m.get("total")) is not int or m["total"] != total:
        raise DataError(f"{where}: total: {m.get('total')!r} differs from the sum of shard samples {total}")
    if not isinstance(m.get("multi_label", False), bool):
        raise DataError(f"{where}: multi_label: expected true or false")
    return m


def read_manifest(url: str, *, allow_remote: bool = False, key: str = "data.train_shards",
                  policy: Optional[RemotePolicy] = None, tally: Optional[Tally] = None) -> dict:
    """The checked manifest at a path or URL (read as ``resolve_shards`` reads it; ``key`` names what
    gave it, in errors; a remote one retried under ``policy``, by default ``MANIFEST_POLICY``, its
    retries counted in ``tally``)."""
    return parse_manifest(_read_bytes(url, allow_remote, key, policy, tally), url)


def _check_remote(url: str, allow_remote: bool, key: str) -> None:
    if not allow_remote:
        raise DataError(f"{key}: remote URL {url!r} needs data.allow_remote=true "
                        f"(pipe: and object-store URLs run commands or reach the network)")


def _file_name(url: str) -> str:
    """The file a URL names; for ``pipe:`` commands, the token that names a .tar or .json file."""
    if url.startswith("pipe:"):
        tokens = [t for t in url[5:].split() if ".tar" in t or t.endswith(".json")] or url[5:].split()[-1:]
        return posixpath.basename(tokens[-1]) if tokens else url
    return posixpath.basename(local_path(url).rstrip("/"))


def _sibling(url: str, name: str, new_name: str) -> str:
    """``url`` with its file name ``name`` replaced: the manifest beside a shard and back. For
    ``pipe:`` URLs this keeps the command, so the manifest is read the way the shards are."""
    i = url.rindex(name)
    return url[:i] + new_name + url[i + len(name):]


def _expand(spec: Union[str, list, tuple], key: str) -> list[str]:
    items = [spec] if isinstance(spec, str) else list(spec)
    urls: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise DataError(f"{key}: expected shard URLs (strings), got {item!r}")
        urls.extend(braceexpand.braceexpand(item))
    return urls


def resolve_shards(spec: Union[str, list, tuple, None], *, allow_remote: bool = False,
                   key: str = "data.train_shards", policy: Optional[RemotePolicy] = None) -> ShardSet:
    """``spec`` is a manifest path/URL, a folder (or ``s3://bucket/prefix``) holding ``manifest.json``, a brace pattern
    (``/data/train-{000000..000127}.tar``) or a list of those. Shard URLs must be listed in the
    manifest beside them. Local files that are missing are *not* an error here (the loader skips
    and counts them) unless none of the selected shards exists. Remote manifests are retried under
    ``policy``: a run passes its ``RemotePolicy.of(data)``, so an outage at start-up is ridden out as
    long as one mid-epoch."""
    if spec is None or (isinstance(spec, (list, tuple)) and not spec):
        raise DataError(f"{key} is not set: give a manifest.json, a folder of shards or a brace pattern")
    manifests: dict[str, Optional[set]] = {}  # manifest URL -> selected names (None: all)
    same: dict[str, str] = {}  # a manifest's key for comparison (a local path normalised) -> its URL here

    def twice(what: str) -> DataError:  # read once an epoch however often named: a list cannot weight a set
        return DataError(f"{key}: {what}; each shard is read once an epoch, so naming shards again does not "
                         "weight them: name each once")

    for url in _expand(spec, key):
        if is_remote(url):
            _check_remote(url, allow_remote, key)
        is_manifest = url.endswith(".json")
        if not is_manifest and not is_remote(url) and Path(local_path(url)).is_dir():
            url, is_manifest = str(Path(local_path(url)) / MANIFEST_NAME), True
        elif not is_manifest and is_s3(url) and not url.endswith(".tar"):  # s3://bucket/prefix: a "folder"
            url, is_manifest = f"{url.rstrip('/')}/{MANIFEST_NAME}", True
        if not is_manifest and not is_remote(url) and ".tar" not in _file_name(url):
            # a shard's manifest is looked for beside it: for a file that is no shard, that would
            # name a manifest.json the user never gave
            what = "not found" if not Path(local_path(url)).exists() else "not a shard set"
            raise DataError(f"{key}: {url}: {what}; expected vit-shards' {MANIFEST_NAME}, the folder holding it "
                            "or .tar shards listed in it")
        if not is_manifest:
            url, name = _sibling(url, _file_name(url), MANIFEST_NAME), _file_name(url)
        url = same.setdefault(url if is_remote(url) else os.path.normpath(local_path(url)), url)
        chosen = manifests.get(url, set())
        if is_manifest:
            if url in manifests:  # whole twice, or whole and some of its shards
                raise twice(f"{url} is named twice" if chosen is None
                            else f"{url} is named whole, and its shard {sorted(chosen)[0]} on its own too")
            manifests[url] = None
        elif chosen is None or name in chosen:
            shard = _sibling(url, _file_name(url), name)
            raise twice(f"{shard} is named twice" if chosen is not None
                        else f"{shard} is named on its own, and within {url} whole too")
        else:
            manifests[url] = chosen | {name}

    shards: list[Shard] = []
    classes = None
    multi = False
    offset, reads = 0, Tally()
    for murl, chosen in manifests.items():
        m = read_manifest(murl, allow_remote=allow_remote, key=key, policy=policy, tally=reads)
        if classes is None:
            classes = tuple(m["classes"])
        elif tuple(m["classes"]) != classes:
            raise DataError(f"{murl}: classes differ from those of {next(iter(manifests))}; "
                            "shards of one stream must share one label space")
        multi = multi or bool(m.get("multi_label", False))
        listed = {s["name"] for s in m["shards"]}
        missing = sorted((chosen or set()) - listed)
        if missing:
            raise DataError(f"{murl}: shard {missing[0]!r} is not listed in this manifest")
        for i, s in enumerate(m["shards"]):
            if chosen is None or s["name"] in chosen:
                url = _sibling(murl, _file_name(murl), s["name"])
                shards.append(Shard(index=offset + i, name=s["name"], url=url, samples=s["samples"]))
        offset += len(m["shards"])
    if not shards:
        raise DataError(f"{key}: no shards match {spec!r}")
    local = [s for s in shards if not is_remote(s.url)]
    if local and len(local) == len(shards) and not any(os.path.exists(local_path(s.url)) for s in local):
        raise DataError(f"{key}: no shards match {spec!r} (none of the {len(shards)} files exists, "
                        f"e.g. {shards[0].url})")
    return ShardSet(shards=tuple(shards), classes=classes, multi_label=multi,
                    manifests=tuple(manifests), read_retries=reads.counts["remote_retries"])
