"""Hugging Face ``transformers`` ViT (``ViTForImageClassification``) <-> our ViT.

Names: transformers' checkpoint names (``vit.encoder.layer.N.attention.attention.query...``, the
names ``save_pretrained`` writes and the Hub holds, read by transformers 4.x and 5.x alike) <->
ours (timm's). Our fused ``qkv`` projection is split into query / key / value rows and fused back
by concatenation, so ours -> transformers -> ours is bit-identical. Reading also takes the names
transformers 5 uses in memory (``vit.layers.N.attention.q_proj``, ``mlp.fc1``), a ``ViTModel``'s
unprefixed names, and its tanh pooler as our ``pre_logits`` layer (the same computation).
Exported folders say ``layer_norm_eps`` 1e-6 (ours, the JAX original's). A transformers model made
with its default 1e-12 (Google's converted checkpoints) loads into ours unchanged; its outputs
then differ slightly, most where a token's variance is small (the eps is added to it).

transformers' ViT is the plain pre-norm ViT with [class]-token pooling: a model with ``qk_norm``,
LayerScale (``init_values``), register tokens, no [class] token, average or MAP pooling, a
pre-logits layer or a ResNet stem (hybrid) has no equivalent there, and :func:`check_expressible`
names the config key. A fixed sin-cos position embedding travels as the learned
``position_embeddings`` holding its values (transformers then trains it, if asked to). Neither transformers nor
timm is imported here: export and import need only torch and safetensors.

Writing a folder (config.json, model.safetensors, preprocessor_config.json, README.md) and the
model card built from a run directory live here too; ``pretrain.weights.export`` is the command line.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Mapping, Optional

import torch

from pretrain.models.arch import list_models, model_defaults

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_L = r"^(?:encoder\.layer|layers)\.(\d+)\."  # legacy names, then transformers 5's in-memory names
_FROM_HF = [  # (pattern on an unprefixed name, our name); first match wins
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.(weight|bias)$", r"patch_embed.proj.\1"),
    (_L + r"layernorm_before\.(weight|bias)$", r"blocks.\1.norm1.\2"),
    (_L + r"layernorm_after\.(weight|bias)$", r"blocks.\1.norm2.\2"),
    (_L + r"attention\.(?:attention\.query|q_proj)\.(weight|bias)$", r"blocks.\1.attn.q.\2"),
    (_L + r"attention\.(?:attention\.key|k_proj)\.(weight|bias)$", r"blocks.\1.attn.k.\2"),
    (_L + r"attention\.(?:attention\.value|v_proj)\.(weight|bias)$", r"blocks.\1.attn.v.\2"),
    (_L + r"attention\.(?:output\.dense|o_proj)\.(weight|bias)$", r"blocks.\1.attn.proj.\2"),
    (_L + r"(?:intermediate\.dense|mlp\.fc1)\.(weight|bias)$", r"blocks.\1.mlp.fc1.\2"),
    (_L + r"(?:output\.dense|mlp\.fc2)\.(weight|bias)$", r"blocks.\1.mlp.fc2.\2"),
    (r"^layernorm\.(weight|bias)$", r"norm.\1"),
    (r"^pooler\.dense\.(weight|bias)$", r"pre_logits.fc.\1"),
    (r"^classifier\.(weight|bias)$", r"head.\1"),
]
_TO_HF = [
    (r"^cls_token$", "vit.embeddings.cls_token"),
    (r"^pos_embed$", "vit.embeddings.position_embeddings"),
    (r"^patch_embed\.proj\.(weight|bias)$", r"vit.embeddings.patch_embeddings.projection.\1"),
    (r"^blocks\.(\d+)\.norm1\.(weight|bias)$", r"vit.encoder.layer.\1.layernorm_before.\2"),
    (r"^blocks\.(\d+)\.norm2\.(weight|bias)$", r"vit.encoder.layer.\1.layernorm_after.\2"),
    (r"^blocks\.(\d+)\.attn\.proj\.(weight|bias)$", r"vit.encoder.layer.\1.attention.output.dense.\2"),
    (r"^blocks\.(\d+)\.mlp\.fc1\.(weight|bias)$", r"vit.encoder.layer.\1.intermediate.dense.\2"),
    (r"^blocks\.(\d+)\.mlp\.fc2\.(weight|bias)$", r"vit.encoder.layer.\1.output.dense.\2"),
    (r"^norm\.(weight|bias)$", r"vit.layernorm.\1"),
    (r"^head\.(weight|bias)$", r"classifier.\1"),
]
_QKV = re.compile(r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_DROPPED = ("embeddings.mask_token",)  # masked-image-modelling only: no part of the classifier


class HFUnsupported(ValueError):
    """A model transformers' ViT cannot express; the message names the config key."""


# --------------------------------------------------------------------------------- checks
def check_expressible(model: Mapping) -> None:
    """Raise :class:`HFUnsupported` naming the first ``model.*`` key (of a model config section)
    that ``ViTForImageClassification`` has no equivalent for."""
    name = model.get("name", "")
    why = "; export with --format timm instead"
    if name in list_models() and model_defaults(name)["stem_layers"]:
        raise HFUnsupported(f"config key model.name={name}: a hybrid (ResNet stem) has no equivalent in "
                            f"transformers' ViTForImageClassification{why}")
    for key, bad, what in (
            ("qk_norm", bool(model.get("qk_norm")), "LayerNorm over queries and keys"),
            ("init_values", bool(model.get("init_values")), "LayerScale on the residual branches"),
            ("reg_tokens", bool(model.get("reg_tokens")), "register tokens"),
            ("class_token", model.get("class_token") is False, "a ViT without the [class] token"),
            ("global_pool", model.get("global_pool", "token") != "token", "pooling other than the [class] token"),
            ("representation_size", bool(model.get("representation_size")), "a tanh pre-logits layer before the head")):
        if bad:
            raise HFUnsupported(f"config key model.{key}={model.get(key)}: {what} has no equivalent in "
                                f"transformers' ViTForImageClassification{why}")


# ------------------------------------------------------------------------------- state dicts
def to_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' ``ViTForImageClassification`` names; ``qkv`` split in three.
    Every tensor is a fresh contiguous copy (safetensors refuses views of one storage)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = _QKV.match(k)
        if m:
            layer, kind = m.groups()
            for part, t in zip(("query", "key", "value"), v.chunk(3, dim=0)):
                out[f"vit.encoder.layer.{layer}.attention.attention.{part}.{kind}"] = t.clone().contiguous()
            continue
        for pat, new in _TO_HF:
            if re.match(pat, k):
                out[re.sub(pat, new, k)] = v.clone().contiguous()
                break
        else:
            raise HFUnsupported(f"tensor {k!r} has no place in transformers' ViT (check model.* keys)")
    return out


def hf_tensor_count(sd: Mapping[str, torch.Tensor]) -> int:
    """How many tensors ``to_hf(sd)`` holds (each ``qkv`` becomes three), without copying any."""
    return sum(3 if _QKV.match(k) else 1 for k in sd)


def from_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers ViT names -> ours; query / key / value fused into ``qkv`` (zero biases when the
    checkpoint has none: ``qkv_bias=false``). Names not recognised pass through unchanged, so the
    loader reports them as unexpected."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        bare = k[len("vit."):] if k.startswith("vit.") else k
        if bare in _DROPPED:
            continue
        for pat, new in _FROM_HF:
            if re.match(pat, bare):
                out[re.sub(pat, new, bare)] = v
                break
        else:
            out[k] = v
    for w in [k for k in out if re.match(r"^blocks\.\d+\.attn\.q\.weight$", k)]:
        base = w[:-len("q.weight")]
        parts = [out.get(f"{base}{p}.weight") for p in "qkv"]
        if any(p is None for p in parts):
            continue  # incomplete: left under their own names for the report
        out[f"{base}qkv.weight"] = torch.cat(parts, dim=0)
        biases = [out.pop(f"{base}{p}.bias", None) for p in "qkv"]
        out[f"{base}qkv.bias"] = torch.cat([b if b is not None else parts[0].new_zeros(parts[0].shape[0])
                                            for b in biases])
        for p in "qkv":
            del out[f"{base}{p}.weight"]
    return out


_VIT_NAME = re.compile(r"^(?:cls_token|reg_token|pos_embed|patch_embed\.|blocks\.\d+\.|norm\.|fc_norm\.|head\."
                       r"|pre_logits\.|attn_pool\.)")


def is_vit_name(name: str) -> bool:
    """A tensor name of our ViT (timm's), as :func:`from_hf` maps a transformers ViT's names."""
    return bool(_VIT_NAME.match(name))


# ------------------------------------------------------------------------------------ folders
def _looks_like_hf(p: Path) -> bool:
    return p.is_dir() and (p / CONFIG).is_file() and any((p / f).is_file() for f in WEIGHT_FILES)


def is_hf_folder(path: str | Path) -> bool:
    """A folder holding a transformers ViT: config.json with ``model_type`` "vit" and weights."""
    p = Path(path)
    return _looks_like_hf(p) and folder_problem(p) is None


def folder_problem(path: str | Path) -> Optional[str]:
    """Why a folder that looks like a transformers one (config.json beside a weight file) is not a
    transformers ViT folder: one line naming its config.json and what is wrong with it. None when
    it is one, or when it does not look like one."""
    p = Path(path)
    if not _looks_like_hf(p):
        return None
    cfg = p / CONFIG
    expected = "a transformers ViT folder's config.json is a JSON object with model_type 'vit'"
    try:
        config = json.loads(cfg.read_bytes().decode("utf-8"))
    except OSError as e:
        return f"{cfg}: unreadable ({e.strerror or e}); {expected}"
    except UnicodeDecodeError as e:
        return f"{cfg}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); {expected}"
    except json.JSONDecodeError as e:
        return f"{cfg}: invalid JSON at line {e.lineno}: {e.msg}; {expected}"
    if not isinstance(config, dict):
        return f"{cfg}: a JSON {type(config).__name__}; {expected}"
    if config.get("model_type") != "vit":
        got = f"model_type {config['model_type']!r}" if "model_type" in config else "no model_type"
        return f"{cfg}: {got}; {expected}"
    return None


def weight_files(path: Path) -> list[Path]:
    """The weight files of a transformers folder: one file, or the shards its index names."""
    for name in WEIGHT_FILES:
        f = path / name
        if not f.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(f.read_text())["weight_map"].values()))
            return [path / s for s in shards]
        return [f]
    raise FileNotFoundError(f"{path}: no {' / '.join(WEIGHT_FILES)}")


def _side(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, float)) else (int(v[0]), int(v[1]))


def folder_meta(config: dict) -> dict[str, str]:
    """Metadata for the loader (``pretrain.weights.load``) from a transformers config: the patch grid."""
    (h, w), (ph, pw) = _side(config.get("image_size", 224)), _side(config.get("patch_size", 16))
    return {"grid_size": f"{h // ph}x{w // pw}", "format": "transformers"}


def check_config(config: dict, where: str) -> None:
    """What our ViT cannot take from a transformers config (the shapes are checked on loading),
    and values of the keys read here that are no size or label map (a traceback later)."""
    def positive(v) -> bool:
        return type(v) is int and v > 0  # bool is an int to isinstance

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key in config and not positive(config[key]):
            raise ValueError(f"{where}: {key}={config[key]!r}; expected a positive integer")
    for key in ("patch_size", "image_size"):
        v = config.get(key, 1)
        if not (positive(v) or (isinstance(v, list) and len(v) == 2 and all(map(positive, v)))):
            raise ValueError(f"{where}: {key}={v!r}; expected a positive integer or [height, width]")
    if not isinstance(config.get("id2label", {}), dict):
        raise ValueError(f"{where}: id2label={config['id2label']!r}; expected an object {{\"0\": \"name\", ...}}")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{where}: hidden_act={config['hidden_act']!r}; our ViT uses exact GELU ('gelu')")
    if config.get("num_channels", 3) != 3:
        raise ValueError(f"{where}: num_channels={config['num_channels']}; our ViT takes RGB (3)")


def arch_from_config(config: dict, sd: Mapping[str, torch.Tensor], where: str) -> dict:
    """Our model config section for a transformers ViT: the registered name of its shape, its
    resolution, classes, and the pooler as ``representation_size``."""
    d, depth, heads = (config.get("hidden_size", 768), config.get("num_hidden_layers", 12),
                       config.get("num_attention_heads", 12))
    hidden, patch = config.get("intermediate_size", 3072), _side(config.get("patch_size", 16))[0]
    names = [n for n in list_models() if not model_defaults(n)["stem_layers"] and
             (model_defaults(n)["patch_size"], model_defaults(n)["embed_dim"], model_defaults(n)["depth"],
              model_defaults(n)["num_heads"], model_defaults(n)["mlp_hidden"]) == (patch, d, depth, heads, hidden)]
    if not names:
        raise ValueError(f"{where}: no registered model has patch {patch}, width {d}, depth {depth}, {heads} heads, "
                         f"MLP {hidden}; known: {', '.join(list_models())}")
    img = _side(config.get("image_size", 224))[0]
    name = next((n for n in names if model_defaults(n)["img_size"] == img), names[0])
    head = sd.get("head.weight")
    rep = sd.get("pre_logits.fc.weight")
    return {"name": name, "img_size": img, "num_classes": int(head.shape[0]) if head is not None else 0,
            "global_pool": "token", "representation_size": int(rep.shape[0]) if rep is not None else None}


def hf_config(model: Mapping, labels: list[str], layer_norm_eps: float = 1e-6) -> dict:
    """config.json of ``ViTForImageClassification`` for our model section. ``layer_norm_eps``: our
    LayerNorms' (the JAX original's 1e-6, not transformers' default 1e-12)."""
    a = model_defaults(model["name"])
    img = model.get("img_size") or a["img_size"]
    return {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": a["embed_dim"], "num_hidden_layers": a["depth"], "num_attention_heads": a["num_heads"],
        "intermediate_size": a["mlp_hidden"], "hidden_act": "gelu",
        "hidden_dropout_prob": float(model.get("drop_rate") or 0.0), "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02, "layer_norm_eps": layer_norm_eps, "image_size": img,
        "patch_size": a["patch_size"], "num_channels": 3, "qkv_bias": True, "encoder_stride": a["patch_size"],
        "id2label": {str(i): n for i, n in enumerate(labels)}, "label2id": {n: i for i, n in enumerate(labels)},
    }


def preprocessor_config(img_size: int, mean, std) -> dict:
    """ViTImageProcessor: resize to img_size x img_size (bilinear, as our evaluation), scale to
    [0, 1], normalise with the run's mean / std. It has no centre crop: our evaluation's
    resize-shorter-side-then-crop is described in the model card."""
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
            "size": {"height": img_size, "width": img_size}, "resample": 2, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}


def labels_for(num_classes: int, classes: Optional[list[str]]) -> list[str]:
    """The class names when there is one per output, else transformers' ``LABEL_i``."""
    if classes and len(classes) == num_classes and len(set(classes)) == num_classes:
        return list(classes)
    return [f"LABEL_{i}" for i in range(num_classes)]


# an ImageFolder so named is one split of the data set its parent folder names
SPLIT_FOLDERS = ("train", "training", "val", "validation", "test")


def shard_source(data) -> tuple[Optional[list[str]], Optional[str]]:
    """(class names, data set name) from the manifest of ``data.train_shards`` (a data config
    section); (None, None) when it cannot be read here (remote, moved, deleted)."""
    from data_pipeline.shards.manifest import parse_manifest, resolve_shards

    try:
        shards = resolve_shards(data.train_shards, allow_remote=False)
        first = shards.manifests[0]
        source = parse_manifest(Path(first).read_text(), first).get("source", "")
    except Exception:  # best effort: the card says LABEL_i and names no data set
        return None, None
    kind, _, where = str(source).partition(":")
    folder = Path(where)
    if kind == "imagefolder" and folder.name.lower() in SPLIT_FOLDERS and folder.parent.name:  # imagenet21k/train
        folder = folder.parent
    name = folder.name if kind in ("imagefolder", "filelist") and where else kind
    return list(shards.classes), name or None



def write_folder(out: Path, sd: Mapping[str, torch.Tensor], config: dict, preproc: dict, card: str,
                 write_safetensors) -> Path:
    """config.json, model.safetensors (transformers names), preprocessor_config.json and
    README.md into ``out``; each file written atomically by ``write_safetensors`` /
    ``write_atomic``."""
    from data_pipeline.files import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(to_hf(sd), out / "model.safetensors", {"format": "pt"})
    write_atomic(out / CONFIG, json.dumps(config, indent=2) + "\n")
    write_atomic(out / "preprocessor_config.json", json.dumps(preproc, indent=2) + "\n")
    write_atomic(out / "README.md", card)
    return out


# ------------------------------------------------------------------------------- model card
def _metrics(root: Path) -> list[dict]:
    try:
        lines = (root / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        if isinstance(r, dict) and "loss" in r and "step" in r:
            out.append(r)
    return out


def final_loss(root: Path, step: int) -> Optional[tuple[int, float]]:
    """(step, loss) of the last training record of metrics.jsonl at or before ``step``."""
    done = [r for r in _metrics(root) if r["step"] <= step and isinstance(r.get("loss"), (int, float))]
    return (done[-1]["step"], float(done[-1]["loss"])) if done else None


def device_hours(root: Optional[Path], step: Optional[int] = None,
                 device_seconds: Optional[float] = None) -> Optional[str]:
    """Devices x wall-clock: the checkpoint's own count up to its step (run.json's ``device_seconds``,
    every invocation that led to it), else the training loop of summary.json's last invocation,
    saying when that is all it covers."""
    if device_seconds:
        return (f"{device_seconds / 3600:.3g} (devices x wall-clock of every invocation up to step {step}, "
                "start-up, evaluations and saves included)")
    if root is None:
        return None
    try:
        s = json.loads((root / "summary.json").read_text())
        hours = float(s["seconds"]) * int(s["world_size"]) / 3600
    except (OSError, ValueError, KeyError, TypeError):
        return None
    text = f"{hours:.3g} ({s['world_size']} device(s) x {float(s['seconds']) / 3600:.3g} h in the training loop)"
    if s.get("resumed_from"):
        text += f"; last invocation only (resumed from step {s['resumed_from']})"
    return text


def transfer_docs(root: Path) -> list[dict]:
    """vit-transfer result documents (``pretrain.transfer.results``) saved in the run directory or
    one folder below it (``--watch`` files contribute each evaluation), oldest step first."""
    docs = []
    for f in sorted(list(root.glob("*.json")) + list(root.glob("*/*.json"))):
        if f.parent.name == "checkpoints" or f.stat().st_size > 16 << 20:
            continue
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for doc in (d.get("evaluations") or [] if isinstance(d, dict) and "watch" in d else [d]):
            if isinstance(doc, dict) and {"suite", "protocol", "tasks"} <= set(doc) and isinstance(doc["tasks"], dict):
                docs.append(doc)
    return sorted(docs, key=lambda d: d.get("step") or 0)


def transfer_table(docs: list[dict]) -> str:
    """One row per task (and a mean row per evaluation of several tasks; with the share of the
    suite's tasks it is over where some were missing, as vit-transfer's own table says it); a ReaL
    top-1 (a set scored by ReaL labels alone) is marked in its cell."""
    def real_only(r: dict) -> bool:  # as pretrain.transfer.results.real_only says it (a floor above)
        d = r.get("details") or {}
        return "real_top1" in d and "top1" not in d

    pct = lambda x: "-" if x is None else f"{100 * x:.2f}"  # noqa: E731
    rows = ["| Step | Suite | Protocol | Resolution | Task | Top-1 (%) |", "|---:|---|---|---:|---|---:|"]
    for d in docs:
        lead = f"| {d.get('step', '?')} | {d['suite']} | {d['protocol']} | {d.get('img_size', '')} "
        for task, r in d["tasks"].items():
            rows.append(lead + f"| {task} | {pct(r.get('accuracy'))}{' (ReaL)' if real_only(r) else ''} |")
        if len(d["tasks"]) > 1 and d.get("mean") is not None:
            n, missing = len(d["tasks"]), len(d.get("missing") or [])
            rows.append(lead + f"| **mean**{f' ({n}/{n + missing})' if missing else ''} | {pct(d['mean'])} |")
    return "\n".join(rows)


def flops_seen(tree: dict, step: int) -> float:
    """The model FLOPs of steps 1..``step`` of a run of this config (``tree``, as run.json holds it):
    6 x the analytic forward of each image at its step's resolution and on the tokens patch dropout
    kept, as training counts them; a run whose global batch or phases changed on a resume counted
    others (its checkpoint's ``model_flops``)."""
    from pretrain.config import from_dict, image_size
    from pretrain.config.phases import resolution_phases, steps_by_phase
    from pretrain.models.arch import config_macs

    cfg = from_dict(tree)
    m, batch = cfg.model, cfg.train.global_batch_size
    phases = resolution_phases(cfg.train, image_size(m))
    return sum(6 * config_macs(m, p.img_size) * batch * n for p, n in steps_by_phase(phases, 0, step))


def compute_seen(tree: dict, step: int) -> str:
    """The card's compute cell for a run's config (``tree``, as run.json holds it): 6 x the forward
    of each image seen, at its step's resolution (``train.resolution_schedule``) and on the tokens
    patch dropout kept (``arch.config_macs``, as training's logged FLOPs count them); beside it,
    when that differs, the same steps at the model's size with every token."""
    from dataclasses import replace

    from pretrain.config import from_dict, image_size
    from pretrain.config.phases import resolution_phases
    from pretrain.models.arch import config_macs

    cfg = from_dict(tree)
    m, batch, img = cfg.model, cfg.train.global_batch_size, image_size(cfg.model)
    phases = resolution_phases(cfg.train, img)
    done = flops_seen(tree, step)
    per_image = config_macs(replace(m, patch_drop_rate=0.0), img)
    full = 6 * per_image * batch * step
    fewer = []
    if len(phases) > 1 or phases[0].img_size != img:
        fewer.append(f"at its step's resolution ({', '.join(f'{p.img_size} px' for p in phases)})")
    if m.patch_drop_rate:
        fewer.append(f"on the patches dropout kept (model.patch_drop_rate {m.patch_drop_rate:g})")
    if not fewer:
        return f"{full / 1e18:.3g} exaFLOPs (6 x {per_image / 1e9:.3g} GMACs forward per image x images seen; analytic)"
    return (f"{done / 1e18:.3g} exaFLOPs (6 x the forward of each image seen, {' and '.join(fewer)}; analytic); "
            f"{full / 1e18:.3g} at {img} px with every token")


def model_card(cfg: dict, step: Optional[int], labels: list[str], dataset: Optional[str],
               run_root: Optional[Path], params: int, prep: dict, totals: Optional[dict] = None) -> str:
    """README.md in the Hub's format: YAML front matter, how to load, the training summary read
    from the run directory (steps, images seen, final loss, compute, device-hours) and the
    run's transfer results when it holds any. ``cfg``: the run's whole config (a dict; only
    ``model`` for a converted folder); ``prep``: mean, std, crop_pct; ``totals``: the checkpoint's
    own ``device_seconds``, ``images_seen`` and ``model_flops`` (run.json): what exactly the
    exported step cost, also where the global batch changed on a resume."""
    totals = totals or {}
    m, t, o = cfg["model"], cfg.get("train", {}), cfg.get("optim", {})
    img = m.get("img_size") or model_defaults(m["name"])["img_size"]
    front = ["---", "library_name: transformers", "pipeline_tag: image-classification",
             "tags:", "- vision", "- image-classification", "- vit", "- vitscale",
             "datasets:", f"- {json.dumps(dataset or 'unknown')}", "metrics:", "- accuracy", "---", ""]
    body = [f"# {m['name']} ({img} px)" + (f", step {step}" if step is not None else ""), "",
            f"A Vision Transformer (Dosovitskiy et al., 2020) pre-trained with vitscale: {params / 1e6:.1f}M "
            f"parameters, patch {model_defaults(m['name'])['patch_size']}, {len(labels)} classes"
            + (f" from `{dataset}`" if dataset else "") + ".", "",
            "```python", "from transformers import ViTForImageClassification, ViTImageProcessor",
            'model = ViTForImageClassification.from_pretrained("THIS_FOLDER")',
            'processor = ViTImageProcessor.from_pretrained("THIS_FOLDER")',
            'logits = model(**processor(images=image, return_tensors="pt")).logits', "```", "",
            f"The processor resizes to {img}x{img} and normalises with mean {list(prep['mean'])} and std "
            f"{list(prep['std'])}; our evaluation resizes the shorter side to {img}/{prep['crop_pct']} "
            "and takes the centre crop.", ""]
    rows = [("Model", f"{m['name']} at {img} px, {params / 1e6:.1f}M parameters")]
    if step is not None and t.get("global_batch_size"):
        images, batch = step * int(t["global_batch_size"]), t["global_batch_size"]
        seen = f"{images:,} ({step} x global batch {batch})"
        if totals.get("images_seen") not in (None, images):  # the global batch changed on a resume
            seen = f"{totals['images_seen']:,} (over {step} steps; the global batch, now {batch}, changed on a resume)"
        compute = compute_seen(cfg, step)
        # the config's phases are today's: a resume that changed the global batch, or train.steps under
        # a resolution schedule (which moves the phases' boundaries), trained steps the config no
        # longer describes; the checkpoint's own count is of every step as it ran
        flops = totals.get("model_flops")
        if flops is not None and not math.isclose(flops, flops_seen(cfg, step), rel_tol=1e-6):
            compute = (f"{flops / 1e18:.3g} exaFLOPs (the model FLOPs of every step, at its resolution "
                       "and kept tokens, as logged)")
        rows += [("Steps", f"{step}"), ("Images seen", seen), ("Compute", compute)]
    loss = final_loss(run_root, step) if run_root is not None and step is not None else None
    if loss:
        rows.append(("Final training loss", f"{loss[1]:.4f} (step {loss[0]}, metrics.jsonl)"))
    hours = device_hours(run_root, step, totals.get("device_seconds"))
    if hours:
        rows.append(("Device-hours", hours))
    if o:
        rows.append(("Optimizer", f"{o.get('name')}, lr {o.get('lr')}, weight decay {o.get('weight_decay')}, "
                                  f"{o.get('schedule')} schedule, {o.get('warmup_steps')} warm-up steps"))
    if t.get("precision"):
        rows.append(("Precision", t["precision"]))
    body += ["## Training", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
    docs = transfer_docs(run_root) if run_root is not None else []
    if docs:
        body += ["## Transfer results", "", "From vit-transfer result files in the run directory.", "",
                 transfer_table(docs), ""]
    return "\n".join(front + body)
