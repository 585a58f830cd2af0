"""Fine-tuning under the deepspeed runner: 2 CPU ranks (gloo), ZeRO-3, and a test set that leaves
one rank a batch short (ZeRO-3's per-forward gathers would hang without the dummy batch); both
recipes (deit: its EMA gathered at every step and written back into the partitioned weights)."""
import json

import pytest
from dist_utils import deepspeed_cmd, run_job
from transfer_fixtures import exported_metadata, save_safetensors, tiny_model, write_imagefolder

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe", ["paper", "deit"])
def test_zero3_finetune_on_two_ranks_counts_every_test_image_once(tmp_path, recipe):
    root = write_imagefolder(tmp_path / "colours", n_train=8, n_test=8)
    (root / "test" / "red" / "extra.png").write_bytes((root / "test" / "red" / "000.png").read_bytes())  # 33
    ckpt = save_safetensors(tiny_model(32), tmp_path / "t.safetensors", exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32}, step=9, grid=(2, 2)))
    out = tmp_path / "r.json"
    p = run_job(deepspeed_cmd("pretrain.transfer", "--checkpoint", str(ckpt), "--suite", "imagefolder",
                              "--protocol", "finetune", "--data-root", str(root), "--output", str(out),
                              "eval.workers=0", "eval.steps=12", "eval.warmup_steps=2", "eval.batch_size=16",
                              "train.precision=fp32", "zero.stage=3", "--recipe", recipe,
                              *(["eval.lr=0.001"] if recipe == "deit" else [])), timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    r = doc["tasks"]["colours"]
    assert r["num_test"] == 33 and r["details"]["batch_size"] == 16
    # what the fine-tune itself cost: both ranks' devices over its wall-clock
    assert doc["world_size"] == 2 and doc["device_hours"] == pytest.approx(doc["seconds"] * 2 / 3600), doc
    assert f"Evaluated in {doc['device_hours']:.3g} device-hours (2 devices x " in p.stdout, p.stdout[-2000:]
    # every image counted once over the two ranks: accuracy is a multiple of 1/33
    assert abs(r["accuracy"] * 33 - round(r["accuracy"] * 33)) < 1e-6
    assert r["accuracy"] >= 0.75, r  # chance 0.25
    if recipe == "deit":  # the EMA's weights were scored, the trained ones beside them
        assert r["details"]["recipe"]["ema_decay"] == 0.99996 and r["details"]["accuracy_no_ema"] >= 0.75, r
    assert p.stdout.count("| colours |") == 1  # rank 0 alone reports
