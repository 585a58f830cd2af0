"""vit-analyze: attention weights recorded beside the fused kernel, the figures' numbers on inputs
with known answers, and the command from every checkpoint kind and both image sources."""
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from transfer_fixtures import exported_metadata, save_safetensors, tiny_model, write_imagefolder

from pretrain.evaluation.analyze import (
    attention_maps,
    attention_modules,
    attention_rollout,
    embedding_components,
    main,
    mean_attention_distance,
    position_similarity,
    record_attention,
    rollout_map,
    similarity_by_distance,
)
from pretrain.models.vit import create_model


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """12 images in nested folders (any depth is read)."""
    root = write_imagefolder(tmp_path_factory.mktemp("img") / "photos", n_train=2, n_test=1)
    return root


@pytest.fixture(scope="module")
def val_shards(tmp_path_factory):
    from data_pipeline.shards.writer import write_demo_shards

    out = tmp_path_factory.mktemp("shards")
    write_demo_shards(out, split="val", n=10, shard_size=4)
    return out / "manifest.json"


# ------------------------------------------------------------------------ attention weights
def test_recorded_attention_is_what_the_fused_kernel_computes():
    torch.manual_seed(0)
    model = tiny_model(32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        maps = attention_maps(model, x)
        # the block's output recomputed from the recorded probabilities: probs @ v, then proj
        blk = model.blocks[0]
        h = blk.norm1(model.pos_drop(torch.cat([model.cls_token.expand(2, -1, -1), model.patch_embed(x)], 1)
                                      + model.pos_embed))
        attn = blk.attn
        B, N, C = h.shape
        v = attn.qkv(h).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)[2]
        ours = attn.proj((maps[0] @ v).transpose(1, 2).reshape(B, N, C))
        assert torch.allclose(ours, attn(h), atol=1e-5), (ours - attn(h)).abs().max()
        after = model(x)
    assert len(maps) == 12 and maps[0].shape == (2, 3, 5, 5)
    assert torch.allclose(maps[5].sum(-1), torch.ones(2, 3, 5))
    # nothing is left hooked, and the model's output never changed
    assert all(not m._forward_hooks for m in attention_modules(model))
    assert torch.equal(before, after)


def test_recorded_attention_applies_the_qk_norm_the_model_applies():
    """With ``model.qk_norm``, every layer's recorded probabilities times its values, through its
    output projection, are the attention module's own output."""
    torch.manual_seed(0)
    model = tiny_model(32, qk_norm=True).eval()
    with torch.no_grad():
        for m in attention_modules(model):  # LayerNorms away from their identity-like initialisation
            for p in (*m.q_norm.parameters(), *m.k_norm.parameters()):
                p.normal_()
    inputs, outputs = {}, {}

    def keep(i):
        def hook(module, inp, out):
            inputs[i], outputs[i] = inp[0], out
        return hook

    hooks = [m.register_forward_hook(keep(i)) for i, m in enumerate(attention_modules(model))]
    try:
        with torch.no_grad():
            maps = attention_maps(model, torch.randn(2, 3, 32, 32))
    finally:
        for h in hooks:
            h.remove()
    assert len(maps) == len(inputs) == 12
    for i, attn in enumerate(attention_modules(model)):
        h = inputs[i]
        B, N, C = h.shape
        v = attn.qkv(h).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)[2]
        with torch.no_grad():
            ours = attn.proj((maps[i] @ v).transpose(1, 2).reshape(B, N, C))
        torch.testing.assert_close(ours, outputs[i], atol=1e-5, rtol=1e-5, msg=f"layer {i}")


def test_hooks_are_removed_when_the_forward_fails():
    model = tiny_model(32)
    with pytest.raises(RuntimeError, match="to have 3 channels, but got 4"):
        with record_attention(model, lambda layer, p: None):
            model(torch.randn(1, 4, 32, 32))  # four channels: the patch embedding's convolution refuses them
    assert all(not m._forward_hooks for m in attention_modules(model))


# ------------------------------------------------------------------------- known answers
def _pairwise_mean_distance(h: int, w: int, px: float) -> float:
    """Mean distance of all ordered pairs of patch centres (self-pairs included), by loops."""
    centres = [((r + 0.5) * px, (c + 0.5) * px) for r in range(h) for c in range(w)]
    total = sum(math.dist(a, b) for a, b in itertools.product(centres, centres))
    return total / len(centres) ** 2


@pytest.mark.parametrize("grid,px", [((4, 4), 16.0), ((3, 5), 14.0), ((14, 14), 16.0)])
def test_uniform_attention_gives_the_mean_pairwise_patch_distance(grid, px):
    n = 1 + grid[0] * grid[1]
    uniform = torch.full((2, 3, n, n), 1.0 / n)  # the [class] token's share is renormalised away
    d = mean_attention_distance(uniform, grid, px)
    assert d.shape == (2, 3)
    assert torch.allclose(d, torch.full((2, 3), _pairwise_mean_distance(*grid, px), dtype=d.dtype), rtol=1e-9)


def test_identity_attention_has_distance_zero_and_neighbour_attention_one_patch():
    grid = (5, 5)
    n = 26
    eye = torch.eye(n).expand(1, 2, n, n)
    assert torch.equal(mean_attention_distance(eye, grid, 16.0), torch.zeros(1, 2, dtype=torch.float64))
    # every patch attends only to the patch right of it (the last column to the left): 16 px
    shift = torch.zeros(1, 1, n, n)
    shift[0, 0, 0, 0] = 1
    for r, c in itertools.product(range(5), range(5)):
        shift[0, 0, 1 + r * 5 + c, 1 + r * 5 + (c + 1 if c < 4 else c - 1)] = 1
    assert mean_attention_distance(shift, grid, 16.0).item() == pytest.approx(16.0)


def test_rollout_of_identity_attention_is_the_identity():
    n = 17
    layers = [torch.eye(n).expand(2, 3, n, n) for _ in range(4)]
    assert torch.allclose(attention_rollout(layers), torch.eye(n, dtype=torch.float64).expand(2, n, n))
    assert torch.allclose(attention_rollout(layers, residual=False), torch.eye(n, dtype=torch.float64))


def test_rollout_multiplies_layers_in_order_and_rows_stay_distributions():
    torch.manual_seed(0)
    n = 6
    layers = [torch.softmax(torch.randn(1, 2, n, n), -1) for _ in range(3)]
    steps = [0.5 * a.double().mean(1) + 0.5 * torch.eye(n, dtype=torch.float64) for a in layers]
    want = steps[2] @ steps[1] @ steps[0]
    got = attention_rollout(layers)
    assert torch.allclose(got, want)
    assert torch.allclose(got.sum(-1), torch.ones(1, n, dtype=torch.float64))
    # the [class] token's row over the patches, on the grid
    assert torch.equal(rollout_map(got, (1, 5)), got[:, 0, 1:].reshape(1, 1, 5))


def sincos_2d(grid: tuple[int, int], dim: int) -> torch.Tensor:
    """MAE's fixed 2-D sin-cos table: half of the channels encode the row, half the column."""
    q = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(q, dtype=torch.float64) / q)
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    parts = []
    for pos in (rows.flatten(), cols.flatten()):
        a = pos[:, None].double() * omega[None]
        parts += [a.sin(), a.cos()]
    return torch.cat(parts, 1).float()


def test_sincos_position_embeddings_are_less_similar_further_apart():
    model = tiny_model(128)  # 8x8 patch grid
    with torch.no_grad():
        model.pos_embed[0, 1:] = sincos_2d((8, 8), model.embed_dim)
    sim = position_similarity(model.pos_embed, (8, 8))
    assert sim.shape == (8, 8, 8, 8)
    assert torch.allclose(sim[3, 4, 3, 4], torch.tensor(1.0))
    by_dist = similarity_by_distance(sim)
    means = [by_dist[d] for d in sorted(by_dist)]
    assert means[0] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(means, means[1:])), by_dist
    # and so does each patch's own map: its row neighbour beats the patch two columns away
    assert all(sim[r, c, r, c + 1] > sim[r, c, r, c + 2] for r in range(8) for c in range(6))
    # a random (untrained) table shows no such order
    noise = position_similarity(torch.randn(1, 65, 192), (8, 8))
    assert abs(similarity_by_distance(noise)[1]) < 0.1


def test_embedding_components_are_orthonormal_and_ordered():
    torch.manual_seed(0)
    w = torch.randn(192, 3, 16, 16) * torch.linspace(2, 0.1, 768).view(1, 3, 16, 16)
    comps, ratios = embedding_components(w)
    assert comps.shape == (28, 3, 16, 16)
    flat = comps.reshape(28, -1).double()
    assert torch.allclose(flat @ flat.T, torch.eye(28, dtype=torch.float64), atol=1e-5)
    assert all(a >= b for a, b in zip(ratios, ratios[1:])) and 0 < ratios.sum() <= 1
    # fewer filters than 28: as many components as there are
    assert embedding_components(torch.randn(8, 3, 4, 4))[0].shape[0] == 8


# --------------------------------------------------------------------------- the command
FIGURES = ["embedding_filters.png", "position_similarity.png", "attention_distance.png", "rollout.png"]


def _check_output(out: Path, *, layers: int, heads: int, images: int, rollout: int, grid, step=None) -> dict:
    for f in FIGURES:
        assert (out / f).stat().st_size > 1000, f
    assert sorted(p.name for p in (out / "rollout").iterdir()) == [f"rollout_{i:03d}.png" for i in range(rollout)]
    numbers = json.loads((out / "attention_distance.json").read_text())
    assert numbers["num_images"] == images and numbers["grid"] == list(grid)
    assert [layer["layer"] for layer in numbers["layers"]] == list(range(1, layers + 1))
    assert all(len(layer["heads"]) == heads for layer in numbers["layers"])
    most = numbers["pixels_per_patch"] * math.hypot(grid[0] - 1, grid[1] - 1)
    assert all(0 <= d <= most for layer in numbers["layers"] for d in layer["heads"])
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["step"] == step
    return doc


def test_timm_state_dict_and_an_image_folder(tmp_path, photos):
    import timm

    torch.manual_seed(3)
    # a state dict saved by timm's own model: the names our model shares with it
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=5)
    torch.save(m.state_dict(), tmp_path / "timm.pth")
    main(["--checkpoint", str(tmp_path / "timm.pth"), "--images", str(photos), "--output", str(tmp_path / "out"),
          "--rollout-images", "3", "--batch-size", "5"])
    _check_output(tmp_path / "out", layers=12, heads=3, images=12, rollout=3, grid=(2, 2))


def test_our_state_dict_at_a_higher_resolution_with_shards(tmp_path, val_shards):
    """A timm-format .pth saved from our model, analysed at twice its resolution (the position
    embeddings resized, as for 224 -> 384 fine-tuning), images from shards."""
    model = tiny_model(32, seed=2)
    torch.save(model.state_dict(), tmp_path / "ours.pth")
    main(["--checkpoint", str(tmp_path / "ours.pth"), "--images", str(val_shards), "--output", str(tmp_path / "out"),
          "--img-size", "64", "--num-images", "7", "--rollout-images", "2", "--batch-size", "4"])
    doc = _check_output(tmp_path / "out", layers=12, heads=3, images=7, rollout=2, grid=(4, 4))
    assert doc["img_size"] == 64 and doc["model"]["img_size"] == 32


def test_export_with_metadata_and_shards_folder(tmp_path, val_shards):
    model = tiny_model(32, seed=4)
    ckpt = save_safetensors(model, tmp_path / "e.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=1234, grid=(2, 2), run_id="abc"))
    main(["--checkpoint", str(ckpt), "--images", str(val_shards.parent), "--output", str(tmp_path / "out"),
          "--rollout-images", "1"])
    doc = _check_output(tmp_path / "out", layers=12, heads=3, images=10, rollout=1, grid=(2, 2), step=1234)
    assert doc["wandb_run_id"] == "abc" and doc["checkpoint_kind"] == "safetensors"


def test_run_directory(tmp_path, photos):
    from transfer_fixtures import write_run_dir

    run = write_run_dir(tmp_path / "run", tiny_model(32, seed=5), {10: True, 20: True}, final=20)
    main(["--checkpoint", str(run), "--images", str(photos / "test"), "--output", str(tmp_path / "out"),
          "--rollout-images", "2"])
    doc = _check_output(tmp_path / "out", layers=12, heads=3, images=4, rollout=2, grid=(2, 2), step=20)
    assert doc["checkpoint_kind"] == "run"


def test_transformers_folder_is_named_so_and_its_unknown_step_is_a_question_mark(tmp_path, photos, capsys):
    """A transformers ViT folder (no step recorded): analysis.json calls it a transformers folder, not
    a run directory, and the closing line says ``step ?`` as the figures' titles do."""
    import transformers

    torch.manual_seed(6)
    conf = transformers.ViTConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=2, intermediate_size=192,
                                  image_size=32, patch_size=16, layer_norm_eps=1e-6, num_labels=4)
    transformers.ViTForImageClassification(conf).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    main(["--checkpoint", str(tmp_path / "hf"), "--images", str(photos / "test"), "--output", str(tmp_path / "out"),
          "--rollout-images", "1"])
    doc = _check_output(tmp_path / "out", layers=6, heads=2, images=4, rollout=1, grid=(2, 2), step=None)
    assert doc["checkpoint_kind"] == "transformers"
    err = capsys.readouterr().err
    assert "step ? at 32 px, 4 images ->" in err and "None" not in err, err


def test_hybrid_skips_the_embedding_filters(tmp_path, photos, monkeypatch):
    from pretrain.models import arch

    # a small hybrid (one ResNet stage, stride 8) registered for this test only
    monkeypatch.setitem(arch.REGISTRY, "vit_test_r1_s8_32", arch.Variant(
        patch_size=1, embed_dim=64, depth=2, num_heads=2, img_size=32, stem_layers=(1, 1)))
    torch.manual_seed(0)
    torch.save(create_model("vit_test_r1_s8_32", num_classes=0).state_dict(), tmp_path / "h.pth")
    main(["--checkpoint", str(tmp_path / "h.pth"), "--images", str(photos / "train" / "red"), "--output",
          str(tmp_path / "out"), "--rollout-images", "1"])
    doc = json.loads((tmp_path / "out" / "analysis.json").read_text())
    assert "not defined for hybrids" in doc["embedding_filters"]
    assert not (tmp_path / "out" / "embedding_filters.png").exists()
    assert doc["grid"] == [4, 4] and doc["pixels_per_patch"] == 8 and doc["num_images"] == 2
    assert len(doc["attention_distance_mean_per_layer"]) == 2


# ---------------------------------------------------------------------------- user errors
def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_one_line_errors(tmp_path, capsys, photos):
    ckpt = tmp_path / "m.pth"
    torch.save(tiny_model(32).state_dict(), ckpt)
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "out")
    assert "checkpoint not found" in _error(capsys, ["--checkpoint", str(tmp_path / "nope.pth"), "--images",
                                                     str(photos), "--output", out])
    assert "no image files" in _error(capsys, ["--checkpoint", str(ckpt), "--images", str(tmp_path / "empty"),
                                               "--output", out])
    assert "no such folder" in _error(capsys, ["--checkpoint", str(ckpt), "--images", str(tmp_path / "gone"),
                                               "--output", out])
    assert "--img-size 40: must be a positive multiple of" in _error(
        capsys, ["--checkpoint", str(ckpt), "--images", str(photos), "--output", out, "--img-size", "40"])
    assert "--images" in _error(capsys, ["--checkpoint", str(ckpt), "--output", out])
    assert "--device 'gpu0': not a device (cpu, cuda, cuda:N)" in _error(
        capsys, ["--checkpoint", str(ckpt), "--images", str(photos), "--output", out, "--device", "gpu0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine lacks")
def test_a_gpu_asked_for_on_a_machine_without_one_is_one_line(tmp_path, capsys, photos):
    """`--device cuda` without a GPU was torch's traceback from deep inside the model's move."""
    ckpt = tmp_path / "m.pth"
    torch.save(tiny_model(32).state_dict(), ckpt)
    err = _error(capsys, ["--checkpoint", str(ckpt), "--images", str(photos), "--output", str(tmp_path / "out"),
                          "--device", "cuda"])
    assert err == "vit-analyze: error: --device cuda: no CUDA GPU on this machine; use --device cpu (or leave it out)"


def test_module_entry_point_reports_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pretrain.evaluation.analyze", "--checkpoint",
                        str(tmp_path / "x.safetensors"), "--images", str(tmp_path), "--output", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == f"vit-analyze: error: {tmp_path / 'x.safetensors'}: checkpoint not found"


# ------------------------------------------------------------------------------------ W&B
def test_wandb_images_land_in_the_pretraining_run_at_its_step(tmp_path, monkeypatch, photos):
    from dist_utils import wandb_history

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=777, grid=(2, 2), run_id="pre0analyze1"))
    main(["--checkpoint", str(ckpt), "--images", str(photos / "test"), "--output", str(tmp_path / "out"),
          "--rollout-images", "2", "--wandb", "logging.wandb.mode=offline"])
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*-pre0analyze1"))
    assert len(runs) == 1, list((tmp_path / "out").iterdir())
    logged = wandb_history(runs[0], "analysis/rollout_grid/path")
    assert logged.get("train/step") == 777, logged
    for key in ("embedding_filters", "position_similarity", "attention_distance", "rollout_grid"):
        # an image is logged as nested keys: {_type, path, sha256, ...}; the PNG sits in the run
        assert logged[f"analysis/{key}/_type"] == "image-file", logged
        assert (runs[0] / "files" / logged[f"analysis/{key}/path"]).stat().st_size > 1000
    means = json.loads((tmp_path / "out" / "analysis.json").read_text())["attention_distance_mean_per_layer"]
    assert logged["analysis/mean_attention_distance/layer_01"] == pytest.approx(means[0])


# ------------------------------------------------------------- output, skipped files, figure layout
def test_unwritable_output_is_one_line_before_any_work(tmp_path, capsys, photos, monkeypatch):
    import pretrain.weights.pretrained as checkpoints

    ckpt = tmp_path / "m.pth"
    torch.save(tiny_model(32).state_dict(), ckpt)
    started = []
    monkeypatch.setattr(checkpoints, "load_pretrained", lambda *a, **k: started.append(1))  # the work starts here
    (tmp_path / "a_file").write_text("not a folder")
    for out in (tmp_path / "a_file" / "out", tmp_path / "a_file"):  # under a file; the file itself
        err = _error(capsys, ["--checkpoint", str(ckpt), "--images", str(photos), "--output", str(out)])
        assert err.startswith(f"vit-analyze: error: --output {out}: {tmp_path / 'a_file'} is a file"), err
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "rollout").write_text("")  # where the per-image figures would go
    assert "rollout is a file" in _error(capsys, ["--checkpoint", str(ckpt), "--images", str(photos), "--output",
                                                  str(tmp_path / "o")])
    assert started == []


def _longest_white_band(png: Path) -> int:
    """Rows of the longest run of blank rows between the first and the last drawn row."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(png).convert("L"))
    blank = (a > 250).all(1)
    drawn = np.flatnonzero(~blank)
    run = best = 0
    for b in blank[drawn[0]:drawn[-1]]:
        run = run + 1 if b else 0
        best = max(best, run)
    return best


def test_folder_with_other_files_and_classes(tmp_path, capsys, monkeypatch):
    """A .txt and a broken .png are skipped and counted; the rollout rows come from both class
    folders (not the first folder's first images), are named, under named columns, with no empty
    band: one row of three panels per image drawn."""
    from matplotlib.figure import Figure

    root = write_imagefolder(tmp_path / "pets", n_train=3, n_test=0)
    for name in ("red", "green", "blue"):  # two classes, as a user's folder of cats and dogs
        if name != "red":
            for f in (root / "train" / name).iterdir():
                f.unlink()
            (root / "train" / name).rmdir()
    (root / "train" / "yellow").rename(root / "train" / "z_yellow")
    (root / "README.txt").write_text("where these came from")
    (root / "train" / "red" / "broken.png").write_bytes(b"not a png")
    ckpt = tmp_path / "m.pth"
    torch.save(tiny_model(32).state_dict(), ckpt)
    saved = {}
    real = Figure.savefig

    def record(fig, path, *a, **k):
        saved[Path(path).name] = (len(fig.axes), [ax.get_title() for ax in fig.axes[:3]], fig.axes[0].get_ylabel())
        return real(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", record)
    monkeypatch.setenv("VITSCALE_PROGRESS_S", "0")  # a progress line after every batch
    out = tmp_path / "out"
    main(["--checkpoint", str(ckpt), "--images", str(root), "--output", str(out), "--rollout-images", "4",
          "--batch-size", "2"])
    err = capsys.readouterr().err
    assert "skipped 2 files (not_image: 1, unreadable: 1): README.txt, train/red/broken.png" in err, err
    progress = [line for line in err.splitlines() if line.startswith("vit-analyze attention: ")]
    # 7 image files found, the broken one skipped when read
    assert len(progress) == 3 and progress[-1].startswith("vit-analyze attention: 6/7 img (86%), ")
    assert progress[-1].endswith(" img/s")
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["num_images"] == 6 and doc["skipped"] == {"not_image": 1, "unreadable": 1}
    assert doc["rollout_images"] == ["train/red/000.png", "train/z_yellow/000.png", "train/red/001.png",
                                     "train/z_yellow/001.png"]
    axes, titles, row_label = saved["rollout.png"]
    assert axes == 3 * 4 and titles == ["input", "attention rollout", "masked by rollout"]
    assert row_label == "train/red/000.png"
    assert saved["rollout_000.png"][1] == titles
    assert _longest_white_band(out / "rollout.png") < 25  # ~10 between rows; the old layout left 77 under the title
