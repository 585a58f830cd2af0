"""Hugging Face round trip: our ViT <-> transformers' ViTForImageClassification, and timm's
pretrained_cfg on the timm export. Real transformers and timm, real files, no mocks.

Run directories are built by hand in the layout training writes (a ZeRO-0 checkpoint with its
COMPLETE marker, config.yaml, metrics.jsonl, summary.json, a vit-transfer results file): training
itself takes ~40 s to start, and the export reads nothing else. Images are real JPEGs decoded
and normalised by the project's own evaluation transform.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import timm
import torch
import transformers  # the test extra (setup.py): a missing install fails here rather than skipping
import yaml
from PIL import Image

from data_pipeline.loading.transforms import SampleTransform
from pretrain.checkpointing import rundir
from pretrain.config import load_config, save_config, to_dict
from pretrain.models.arch import analytic_flops
from pretrain.models.vit import create_model
from pretrain.weights import hf
from pretrain.weights.export import main as export_main
from pretrain.weights.load import load_weights, read_state_dict

CLASSES = ["abyssinian", "beagle", "bengal", "boxer", "pug", "sphynx"]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # not the defaults: proves they travel


def jpeg_batch(img: int, mean=MEAN, std=STD) -> torch.Tensor:
    """Two real JPEGs (gradient + noise, and its mirror), decoded, resized and centre-cropped by
    our evaluation transform, normalised."""
    yy, xx = np.mgrid[0:96, 0:128]
    rng = np.random.default_rng(0)
    arr = np.stack([xx * 2, yy * 2, xx + yy], -1) % 256 + rng.integers(0, 60, (96, 128, 3))
    out = []
    for a in (arr, arr[:, ::-1]):
        buf = io.BytesIO()
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        aug = load_config(None).data.augment
        out.append(SampleTransform(aug, img, train=False)(Image.open(io.BytesIO(buf.getvalue())), seed=0))
    x = torch.stack(out).float() / 255
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial weights everywhere (the head starts at zero, LayerNorms at 1/0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("head") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def hf_logits(folder, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    m, info = transformers.ViTForImageClassification.from_pretrained(str(folder), output_loading_info=True)
    with torch.no_grad():
        return m.eval()(pixel_values=x).logits, info


def assert_clean(info: dict) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


# ------------------------------------------------------------------------------- run directory
@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    (d / "train-000000.tar").write_bytes(b"")
    (d / "manifest.json").write_text(json.dumps({
        "format": "vitscale-shards", "version": 1, "split": "train", "source": "imagefolder:/data/pets",
        "classes": CLASSES, "multi_label": False, "total": 8, "shards": [{"name": "train-000000.tar", "samples": 8}]}))
    return d / "manifest.json"


@pytest.mark.parametrize("folder, name", [("/data/pets", "pets"), ("/data/imagenet21k/train", "imagenet21k"),
                                          ("/data/imagenet21k/train/", "imagenet21k"), ("train", "train")])
def test_the_card_names_the_data_set_of_an_imagefolder(tmp_path, folder, name):
    """The model card's data set is the ImageFolder's name; a split folder (train/, val/) is one split
    of the set its parent names."""
    from data_pipeline.config import DataConfig
    from pretrain.weights.hf import shard_source

    (tmp_path / "train-000000.tar").write_bytes(b"")
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "vitscale-shards", "version": 1, "split": "train", "source": f"imagefolder:{folder}",
        "classes": CLASSES, "multi_label": False, "total": 8, "shards": [{"name": "train-000000.tar", "samples": 8}]}))
    assert shard_source(DataConfig(train_shards=str(tmp_path / "manifest.json"))) == (CLASSES, name)


def make_run(root, manifest, step: int = 5, weights: bool = True, totals: dict | None = None, **model):
    """A run directory as training leaves it, with random weights; returns (root, our model).
    ``totals``: what run.json says the run cost (None: a checkpoint of a release without them)."""
    model = {"name": "vit_tiny_patch16_224", "img_size": 32, "num_classes": len(CLASSES), **model}
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + [
        f"data.train_shards={manifest}", f"train.output_dir={root}", "zero.stage=0", "train.global_batch_size=16",
        "train.micro_batch_size=8", f"data.augment.mean={MEAN}", f"data.augment.std={STD}",
        "data.augment.eval_crop_pct=0.9", "train.precision=fp32"])
    ckpt = root / "checkpoints" / rundir.tag_for(step)
    ckpt.mkdir(parents=True)
    m = cfg.model
    ours = randomized(create_model(m.name, img_size=m.img_size, num_classes=m.num_classes, global_pool=m.global_pool,
                                   qk_norm=m.qk_norm, init_values=m.init_values, reg_tokens=m.reg_tokens,
                                   class_token=m.class_token, pos_embed=m.pos_embed,
                                   representation_size=m.representation_size, init_seed=1))
    if weights:
        torch.save({"module": ours.state_dict()}, ckpt / "mp_rank_00_model_states.pt")
    (ckpt / "run.json").write_text(json.dumps({"config": to_dict(cfg), "wandb_run_id": "r1", "step": step,
                                               "world_size": 2, **(totals or {})}))
    (ckpt / rundir.COMPLETE).write_text(rundir.marker(step, ckpt))
    save_config(cfg, root / "config.yaml")
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.5 - 0.1 * s}) + "\n"
                                                for s in range(1, step + 2)))  # step+1: logged after the checkpoint
    (root / "summary.json").write_text(json.dumps({"step": step, "seconds": 7200.0, "world_size": 2,
                                                   "resumed_from": 0}))
    (root / "results.json").write_text(json.dumps({
        "suite": "cifar100", "protocol": "linear", "step": step, "img_size": 32, "mean": 0.4321,
        "tasks": {"cifar100": {"accuracy": 0.4321}}}))
    return root, ours


def export(capsys, *args) -> tuple[int, str, str]:
    try:
        export_main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------- tests
def test_run_to_hf_folder_logits_labels_card(tmp_path, manifest, capsys):
    run, ours = make_run(tmp_path / "run", manifest)
    code, out, err = export(capsys, run, tmp_path / "hf", "--format", "hf")
    assert code == 0, err
    assert "from_pretrained(" in out and "vit_tiny_patch16_224 step 5" in err
    x = jpeg_batch(32)
    logits, info = hf_logits(tmp_path / "hf", x)
    assert_clean(info)
    with torch.no_grad():
        torch.testing.assert_close(logits, ours(x), rtol=0, atol=1e-4)
    assert logits.abs().max() > 1e-2  # a real comparison, not of zeros

    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["layer_norm_eps"] == 1e-6 and cfg["image_size"] == 32 and cfg["intermediate_size"] == 768
    assert [cfg["id2label"][str(i)] for i in range(len(CLASSES))] == CLASSES and cfg["label2id"]["pug"] == 4
    proc = transformers.AutoImageProcessor.from_pretrained(str(tmp_path / "hf"))
    assert list(proc.image_mean) == MEAN and list(proc.image_std) == STD
    assert (proc.size["height"], proc.size["width"]) == (32, 32)
    pil = Image.fromarray(np.full((40, 40, 3), 128, np.uint8))  # the processor's own pixels: same logits
    px = proc(images=pil, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "hf", px)[0], ours(px), rtol=0, atol=1e-4)

    card = (tmp_path / "hf" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and "vision" in front["tags"]
    assert front["datasets"] == ["pets"] and front["metrics"] == ["accuracy"]
    eflops = 6 * analytic_flops("vit_tiny_patch16_224", 32, len(CLASSES)) * 5 * 16 / 1e18
    for needle in ("| Steps | 5 |", "| Images seen | 80 (5 x global batch 16) |", f"{eflops:.3g} exaFLOPs",
                   "| Final training loss | 2.0000 (step 5, metrics.jsonl) |", "| Device-hours | 4 (2 device(s) x 2 h",
                   "## Transfer results", "| 5 | cifar100 | linear | 32 | cifar100 | 43.21 |"):
        assert needle in card, (needle, card)


def test_card_compute_counts_each_step_at_its_resolution_and_kept_tokens():
    """A run on fewer tokens (a resolution schedule, patch dropout) is credited the compute its steps
    did, as training's logged FLOPs count it, and the card says what every token at full size would
    have cost. Steps 1-5 train at 16 px, 6-10 at 32; the checkpoint is step 8."""
    tokens = load_config(None, ["model.name=vit_tiny_patch16_224", "model.img_size=32", "model.num_classes=3",
                                "model.patch_drop_rate=0.5", "train.steps=10", "train.micro_batch_size=16",
                                "train.global_batch_size=16", "train.resolution_schedule=[[0.0,16],[0.5,32]]"])
    cfg = to_dict(tokens)
    prep = {"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 0.875}
    card = hf.model_card(cfg, 8, ["a", "b", "c"], None, None, 10 ** 6, prep)
    gmacs = lambda px, rate: analytic_flops("vit_tiny_patch16_224", px, 3, patch_drop_rate=rate)  # noqa: E731
    done = 6 * 16 * (5 * gmacs(16, 0.5) + 3 * gmacs(32, 0.5)) / 1e18
    full = 6 * 16 * 8 * gmacs(32, 0.0) / 1e18
    assert done < full / 2
    assert (f"| Compute | {done:.3g} exaFLOPs (6 x the forward of each image seen, at its step's resolution "
            f"(16 px, 32 px) and on the patches dropout kept (model.patch_drop_rate 0.5); analytic); {full:.3g} at "
            f"32 px with every token |") in card, card


def test_card_compute_of_a_schedule_whose_steps_changed_on_a_resume():
    """A run of 20 steps on [[0.0, 16], [0.5, 32]] trains steps 1-10 at 16 px and 11-20 at 32; resumed
    with train.steps=40, its config's phases are 1-20 and 21-40, so the config alone would price
    steps 11-20 at 16 px. The card gives the checkpoint's own count, of every step as it ran."""
    cfg = to_dict(load_config(None, ["model.name=vit_tiny_patch16_224", "model.img_size=32", "model.num_classes=3",
                                     "train.steps=40", "train.micro_batch_size=16", "train.global_batch_size=16",
                                     "train.resolution_schedule=[[0.0,16],[0.5,32]]"]))
    gmacs = lambda px: analytic_flops("vit_tiny_patch16_224", px, 3)  # noqa: E731
    ran = 6 * 16 * (10 * gmacs(16) + 30 * gmacs(32))  # steps 1-10 at 16 px, then 11-40 at 32
    prep = {"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 0.875}
    card = hf.model_card(cfg, 40, ["a", "b", "c"], None, None, 10 ** 6, prep,
                         totals={"device_seconds": None, "images_seen": 640, "model_flops": ran})
    assert f"| Compute | {ran / 1e18:.3g} exaFLOPs (the model FLOPs of every step" in card, card


def test_ours_hf_ours_bit_identical_base_shapes(tmp_path):
    """ViT-B/16 shapes at 32 px, without a checkpoint: the conversion and folder writer alone."""
    from pretrain.weights.export import write_safetensors

    model = {"name": "vit_base_patch16_224", "img_size": 32, "num_classes": 7}
    ours = randomized(create_model("vit_base_patch16_224", img_size=32, num_classes=7, init_seed=2))
    sd = ours.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in hf.from_hf(hf.to_hf(sd)).items())
    labels = hf.labels_for(7, None)
    hf.write_folder(tmp_path / "b", sd, hf.hf_config(model, labels), hf.preprocessor_config(32, MEAN, STD),
                    "# card\n", write_safetensors)
    back, meta = read_state_dict(tmp_path / "b")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    assert meta["grid_size"] == "2x2"
    x = jpeg_batch(32)
    logits, info = hf_logits(tmp_path / "b", x)
    assert_clean(info)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["id2label"]["6"] == "LABEL_6"
    with torch.no_grad():
        torch.testing.assert_close(logits, ours(x), rtol=0, atol=1e-4)


def test_hf_to_ours_to_hf(tmp_path, capsys):
    """A transformers model loads into ours through pretrain.weights.load, into vit-transfer's backbone
    at another resolution (position embeddings resized, head replaced), and exports back to a
    folder transformers loads with the same logits and labels. Its LayerNorm eps is ours (1e-6):
    with transformers' default 1e-12 the logits differ by the eps alone (~5e-5 here)."""
    from pretrain.weights.pretrained import build_backbone, load_pretrained

    torch.manual_seed(3)
    conf = transformers.ViTConfig(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                                  image_size=32, patch_size=16, layer_norm_eps=1e-6,
                                  id2label=dict(enumerate(CLASSES[:5])),
                                  label2id={c: i for i, c in enumerate(CLASSES[:5])})
    src = transformers.ViTForImageClassification(conf).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    src.save_pretrained(str(tmp_path / "src"))
    x = jpeg_batch(32)
    with torch.no_grad():
        ref = src(pixel_values=x).logits

    ours = create_model("vit_tiny_patch16_224", img_size=32, num_classes=5).eval()
    assert load_weights(ours, tmp_path / "src").clean
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref, rtol=0, atol=1e-4)

    # transformers 5's in-memory names (q_proj, mlp.fc1, vit.layers) in a pytorch_model.bin load too
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    torch.save(src.state_dict(), tmp_path / "mem" / "pytorch_model.bin")
    again = create_model("vit_tiny_patch16_224", img_size=32, num_classes=5).eval()
    assert load_weights(again, tmp_path / "mem").clean
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))

    pre = load_pretrained(tmp_path / "src")
    assert pre.arch["name"] == "vit_tiny_patch16_224" and pre.img_size == 32 and pre.grid == (2, 2)
    bb = build_backbone(pre, img_size=48, num_classes=3, finetune=True)
    assert bb.pos_embed.shape == (1, 1 + 9, 192) and torch.equal(bb.pos_embed[:, 0], ours.pos_embed[:, 0])
    assert torch.equal(bb.head.weight, torch.zeros(3, 192))

    # written into the folder it converts, the export would replace the config and weights it reads
    files = {f.name: f.read_bytes() for f in (tmp_path / "src").iterdir()}
    capsys.readouterr()  # transformers' own save lines
    for out, fmt in ((tmp_path / "src", "hf"), (tmp_path / "src" / "model.safetensors", "timm")):
        code, _, err = export(capsys, tmp_path / "src", out, "--format", fmt)
        assert code == 2 and err == (f"vit-export: error: {out}: inside {tmp_path / 'src'}, which this export reads; "
                                     "choose an output outside it\n"), err
    assert {f.name: f.read_bytes() for f in (tmp_path / "src").iterdir()} == files
    code, _, err = export(capsys, tmp_path / "src", tmp_path / "back", "--format", "hf")
    assert code == 0, err
    logits, info = hf_logits(tmp_path / "back", x)
    assert_clean(info)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["id2label"]["4"] == "pug"


@pytest.mark.parametrize("key, value", [("qk_norm", "true"), ("init_values", "1e-5"), ("global_pool", "avg"),
                                        ("global_pool", "map"), ("reg_tokens", "4"), ("class_token", "false"),
                                        ("representation_size", "192"), ("name", "vit_base_r50_s16_224")])
def test_unsupported_variant_is_one_line_naming_the_key(tmp_path, manifest, capsys, key, value):
    """Refused from run.json alone: the checkpoint here holds no weights at all."""
    extra = {"img_size": 64} if key == "name" else {"global_pool": "avg"} if key == "class_token" else {}
    run, _ = make_run(tmp_path / "run", manifest, weights=False, **{key: value, **extra})
    code, out, err = export(capsys, run, tmp_path / "hf", "--format", "hf")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("vit-export: error: config key model.") and f"key model.{key}=" in lines[0], err
    assert "--format timm" in lines[0] and not (tmp_path / "hf").exists()


def test_timm_export_carries_pretrained_cfg(tmp_path, manifest, capsys):
    run, ours = make_run(tmp_path / "run", manifest)
    for inside in (run / "checkpoints" / "w.safetensors", run / "checkpoints" / rundir.tag_for(5) / "w.safetensors"):
        code, _, err = export(capsys, run, inside)  # among the checkpoints it reads: refused
        assert code == 2 and "which this export reads; choose an output outside it" in err, err
    out = run / "w.safetensors"  # beside them, in the run directory: where a user keeps it
    code, stdout, err = export(capsys, run, out)
    assert code == 0, err
    call = stdout.strip().splitlines()[-1]
    assert call.startswith("import timm; m = timm.create_model('vit_tiny_patch16_224', pretrained=True, img_size=32, "
                           "num_classes=6, pretrained_cfg_overlay=dict("), call
    scope: dict = {}
    exec(call, scope)  # the printed line, as a user would paste it
    m = scope["m"].eval()
    cfg = timm.data.resolve_data_config({}, model=m)
    assert cfg["input_size"] == (3, 32, 32) and tuple(cfg["mean"]) == tuple(MEAN) and tuple(cfg["std"]) == tuple(STD)
    assert cfg["crop_pct"] == 0.9 and cfg["interpolation"] == "bilinear" and cfg["crop_mode"] == "center"
    x = jpeg_batch(32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ours(x), rtol=0, atol=1e-5)
    _, meta = read_state_dict(out)
    pcfg = json.loads(meta["pretrained_cfg"])
    assert pcfg["label_names"] == CLASSES and pcfg["num_classes"] == 6 and pcfg["input_size"] == [3, 32, 32]


def test_the_cost_of_pretraining_travels_with_the_export_into_transfer_results(tmp_path, manifest, capsys):
    """run.json's device-seconds, images and model FLOPs of the exported step go into the timm
    file's metadata; vit-transfer reads them from either and its results say them (the table's header too);
    a checkpoint that never recorded them says nothing, not zero."""
    from pretrain.transfer.results import markdown, pretraining
    from pretrain.weights.pretrained import load_pretrained

    totals = {"device_seconds": 5400.0, "images_seen": 80, "model_flops": 1.25e12}
    run, _ = make_run(tmp_path / "run", manifest, totals=totals)
    old, _ = make_run(tmp_path / "old", manifest)
    for src, want in ((run, totals), (old, dict.fromkeys(totals))):
        assert export(capsys, src, src / "w.safetensors")[0] == 0
        _, meta = read_state_dict(src / "w.safetensors")
        assert {k: meta[k] for k in totals} == {k: "" if v is None else str(v) for k, v in want.items()}
        for ckpt in (src, src / "w.safetensors"):
            assert load_pretrained(ckpt).totals == want, ckpt
    assert pretraining(load_pretrained(run / "w.safetensors").totals) == {
        "device_hours": 1.5, "images_seen": 80, "model_flops": 1.25e12}
    doc = {"model": {"name": "vit_tiny_patch16_224"}, "step": 5, "checkpoint": "w.safetensors", "suite": "demo",
           "protocol": "linear", "img_size": 32, "tasks": {}, "pretraining": pretraining(totals)}
    assert markdown(doc).startswith("**vit_tiny_patch16_224** (step 5, w.safetensors; pre-training 1.5 "
                                    "device-hours, 80 images, 1.25e+12 model FLOPs) -- demo / linear at 32 px")
    doc["pretraining"] = pretraining(load_pretrained(old).totals)
    assert markdown(doc).startswith("**vit_tiny_patch16_224** (step 5, w.safetensors) -- demo")


@pytest.mark.parametrize("model", [dict(reg_tokens=4, global_pool="map"),
                                   dict(class_token=False, global_pool="avg", pos_embed="sincos2d"),
                                   dict(class_token=False, reg_tokens=2, global_pool="map", pos_embed="sincos2d")],
                         ids=["reg4-map", "nocls-avg-sincos", "nocls-reg2-map-sincos"])
def test_timm_export_of_registers_map_and_sincos_gives_equal_logits(tmp_path, manifest, capsys, model):
    """The printed timm call names reg_tokens / class_token / global_pool; timm loads the file
    (strict) and its logits equal ours in fp32 on the same preprocessed images; the sin-cos
    embedding arrives as timm's learned ``pos_embed`` holding the formula's values."""
    run, ours = make_run(tmp_path / "run", manifest, **{k: str(v).lower() for k, v in model.items()})
    out = tmp_path / "w.safetensors"
    code, stdout, err = export(capsys, run, out)
    assert code == 0, err
    call = stdout.strip().splitlines()[-1]
    for k, v in model.items():
        if k != "pos_embed":
            assert f"{k}={v!r}" in call, call
    scope: dict = {}
    exec(call, scope)
    x = jpeg_batch(32)
    with torch.no_grad():
        diff = (scope["m"].eval()(x) - ours(x)).abs().max()
    assert diff < 1e-5 and ours(x).abs().max() > 1e-2, diff
    if model.get("pos_embed"):
        assert torch.equal(read_state_dict(out)[0]["pos_embed"], ours.pos_embed)


def test_hf_export_holds_the_sincos_embedding(tmp_path, manifest, capsys):
    """transformers' ViT holds a fixed sin-cos embedding as its learned one, with equal logits."""
    run, ours = make_run(tmp_path / "run", manifest, pos_embed="sincos2d")
    code, _, err = export(capsys, run, tmp_path / "hf", "--format", "hf")
    assert code == 0, err
    x = jpeg_batch(32)
    logits, info = hf_logits(tmp_path / "hf", x)
    assert_clean(info)
    with torch.no_grad():
        torch.testing.assert_close(logits, ours(x), rtol=0, atol=1e-4)


def test_card_mean_of_a_partial_suite_says_over_how_many_tasks():
    """A VTAB-1k evaluation of 2 of the 19 tasks: the card's mean row says 2/19, as vit-transfer's
    table does, so it is not read as the VTAB score; a complete evaluation's mean row is plain."""
    task = {"accuracy": 0.5}
    part = {"step": 5, "suite": "vtab1k", "protocol": "linear", "img_size": 32, "mean": 0.6,
            "tasks": {"dtd": task, "eurosat": {"accuracy": 0.7}}, "missing": [f"t{i}" for i in range(17)]}
    whole = {**part, "suite": "cifar100", "missing": []}
    assert "| 5 | vtab1k | linear | 32 | **mean** (2/19) | 60.00 |" in hf.transfer_table([part])
    assert "| 5 | cifar100 | linear | 32 | **mean** | 60.00 |" in hf.transfer_table([whole])


def test_the_export_line_counts_the_tensors_written(tmp_path, manifest, capsys):
    """'(N tensors)' is what the written file holds: a transformers folder has each fused qkv as
    query, key and value, so more tensors than the run's state dict; a timm file as many."""
    import re

    from safetensors import safe_open

    run, _ = make_run(tmp_path / "run", manifest)
    for args, weights in ((("--format", "hf"), tmp_path / "hf" / "model.safetensors"),
                          ((), tmp_path / "w.safetensors")):
        out = weights.parent if args else weights
        code, _, err = export(capsys, run, out, *args)
        assert code == 0, err
        with safe_open(str(weights), "pt") as f:
            written = len(list(f.keys()))
        assert re.search(r"\((\d+) tensors\)", err).group(1) == str(written), (err, written)
