"""Loading experiment files: YAML with ``base:`` inheritance, ``a.b=c`` overrides, and typed
building against the schema (``schema.py``). An unknown key, a value of the wrong type or an
impossible combination raises ``ConfigError`` naming the key and the file it came from."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from data_pipeline.errors import ConfigError
from pretrain.config.checks import check_config
from pretrain.config.schema import MOVED, NOT_KEYS, Config
from pretrain.evaluation.config import FEWSHOT_DEFAULTS


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1) reading floats as YAML 1.2 and every user writes them:
    ``1e-3``, ``1E5``, ``-2e-4`` are floats, not the strings YAML 1.1 makes of an exponent without
    a dot or a sign. Config files, ``base:`` files and ``a.b=c`` overrides all read through it."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _mapping_without_duplicates(loader: YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping whose keys are each written once: PyYAML keeps the last of two equal keys, so a
    second ``optim:`` section would silently replace the first one's settings."""
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: keys written after it override it
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping's own error names it
            break
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {first})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def yaml_scalars(text: str):
    """``text`` read as YAML with the config's float rule (``YamlLoader``)."""
    return yaml.load(text, Loader=YamlLoader)  # a SafeLoader: plain data only, no Python objects


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml_scalars(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _merge(base: dict, over: dict, origin: dict | None, src: str, prefix: str = "") -> dict:
    """Deep-merge ``over`` into a copy of ``base``; record in ``origin`` (if given) where keys came from."""
    out = dict(base)
    for k, v in over.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v, origin, src, key + ".")
        else:
            out[k] = v
            if origin is not None:
                _record(origin, key, v, src)
    return out


def _record(origin: dict, key: str, value: Any, src: str) -> None:
    origin[key] = src
    if isinstance(value, dict):
        for k, v in value.items():
            _record(origin, f"{key}.{k}", v, src)


def _load_tree(path: Path, origin: dict, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'base:' inheritance cycle through {' -> '.join(map(str, seen))}")
    raw = _read_yaml(path)
    base_ref = raw.pop("base", None)
    tree: dict = {}
    if base_ref is not None:
        refs = base_ref if isinstance(base_ref, list) else [base_ref]
        for ref in refs:
            if not isinstance(ref, str) or not ref.strip():
                raise ConfigError(f"{path}: 'base' must be a file name or a list of them, got {ref!r}")
            if not (path.parent / ref).is_file():  # named here: the file that asks for it
                raise ConfigError(f"{path}: base: {path.parent / ref}: config file not found")
            # keys from a base keep the base file as their origin
            tree = _merge(tree, _load_tree(path.parent / ref, origin, seen + (path,)), None, str(path))
    return _merge(tree, raw, origin, str(path))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``optim.lr=3e-4`` -> (["optim", "lr"], 0.0003). Values are YAML scalars (or flow lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    key, value = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        parsed = yaml_scalars(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(tree: dict, overrides, origin: dict) -> dict:
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
                # a section only the override names: a typo in it (``trian.steps=3``) is the command line's
                _record(origin, ".".join(parts[:i + 1]), None, "command line")
            node = nxt
        node[parts[-1]] = value
        _record(origin, ".".join(parts), value, "command line")
    return tree


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        names = " | ".join(_type_name(a) for a in args if a is not type(None))
        return names + (" or null" if type(None) in args else "")
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list of {_type_name(inner)}"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}: {key}: expected {_type_name(tp)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # YAML's .nan / .inf: no key of ours means them
        raise ConfigError(f"{where}: {key}: expected a finite number, got {value!r}")
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key, where)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(inner, v, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}: expected a mapping (section), got {value!r}")
        return _build(tp, value, key + ".", {}, where)
    if tp is dict:  # a free-form mapping (the ``deepspeed:`` pass-through), checked where it is used
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}: expected a mapping, got {value!r}")
        for k, v in value.items():
            if isinstance(v, (dict, float)):
                _coerce(dict if isinstance(v, dict) else float, v, f"{key}.{k}", where)
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad


# YAML keys that are Python keywords -> the dataclass field that holds them
ALIASES = {"checkpoint.async": "async_save"}


def _build(cls: type, tree: dict, prefix: str, origin: dict, default_where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        where = origin.get(key, default_where)
        if key in ALIASES:
            k = ALIASES[key]
            key = f"{prefix}{k}"
        if key in MOVED:
            raise ConfigError(f"{where}: '{key}' is now '{MOVED[key]}'")
        if key in NOT_KEYS:
            raise ConfigError(f"{where}: '{key}' is not a key: {NOT_KEYS[key]}")
        if k not in names:
            valid = [f"{prefix}{n}" for n in names]
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            raise ConfigError(f"{where}: unknown key '{key}'{hint}")
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: {key}: expected a section (mapping), got {v!r}")
            kwargs[k] = _build(tp, v, key + ".", origin, default_where)
        else:
            kwargs[k] = _coerce(tp, v, key, where)
    return cls(**kwargs)


def _resolve(path: str | Path | None, overrides) -> tuple[dict, dict[str, str]]:
    """(merged YAML tree, where each key came from): ``base:`` files, then overrides."""
    origin: dict[str, str] = {}
    tree = _load_tree(Path(path), origin) if path is not None else {}
    return apply_overrides(tree, list(overrides), origin), origin


def raw_tree(path: str | Path | None, overrides=()) -> dict:
    """The merged tree before defaults and validation: tells which keys a user actually set."""
    return _resolve(path, overrides)[0]


def load_config(path: str | Path | None, overrides=()) -> Config:
    """Load ``path`` (following ``base:``), apply ``a.b=c`` overrides, return a validated Config."""
    src = str(path) if path is not None else "defaults"
    tree, origin = _resolve(path, overrides)
    cfg = _build(Config, tree, "", origin, src)
    check_config(cfg, origin, src)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config (every key, defaults included) as YAML."""
    from data_pipeline.files import write_atomic

    return write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def from_dict(tree: dict) -> Config:
    """Rebuild a Config from ``to_dict`` output (e.g. the copy stored in a checkpoint)."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    old = tree.get("eval") or {}
    if "every_steps" in old or "fewshot" in old:  # saved before the validation section existed
        val = tree.setdefault("validation", {})
        val.setdefault("every_steps", old.pop("every_steps", 0))
        val.setdefault("fewshot_suites", (old.pop("fewshot", None) or {}).get("suites", []))
        for k in FEWSHOT_DEFAULTS:  # the settings the two sections share
            if k in old:
                val.setdefault(k, old[k])
    for key in NOT_KEYS:  # stored before they were dropped: they never changed what the run did
        section, _, name = key.partition(".")
        if isinstance(tree.get(section), dict):
            tree[section].pop(name, None)
    return _build(Config, tree, "", {}, "stored config")
