"""Checks only a GPU can make (marker `gpu`, `make test-gpu`; CPU machines leave them out): bf16 fused attention
against the fp32 math path, and a DeepSpeed bf16 ZeRO-2 step over NCCL reporting MFU."""
import json

import pytest
import torch
from dist_utils import deepspeed_cmd, metrics, run_job

from pretrain.models.vit import create_model

pytestmark = pytest.mark.gpu


def test_bf16_flash_attention_matches_fp32():
    torch.manual_seed(0)
    m = create_model("vit_base_patch16_224", num_classes=10).cuda().eval()
    torch.nn.init.normal_(m.head.weight, std=0.02)
    x = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x)
    assert torch.allclose(out.float(), ref, atol=5e-2, rtol=5e-2), (out.float() - ref).abs().max()


def test_deepspeed_bf16_nccl_reports_mfu(tmp_path):
    from data_pipeline.shards.writer import write_demo_shards

    shards = tmp_path / "shards"
    write_demo_shards(shards, "train", n=2048, shard_size=128)
    run = tmp_path / "run"
    r = run_job(deepspeed_cmd("pretrain.train", "--config", "configs/tiny_cpu.yaml",
                              f"data.train_shards={shards / 'manifest.json'}", f"train.output_dir={run}",
                              "train.precision=bf16", "zero.stage=2", "train.steps=20", "train.log_every_steps=5",
                              ranks=min(2, torch.cuda.device_count())))
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(run)[20]
    assert m["tflops_per_device"] > 0 and "mfu" in m and 0 < m["mfu"] < 1
    assert json.loads((run / "summary.json").read_text())["step"] == 20
