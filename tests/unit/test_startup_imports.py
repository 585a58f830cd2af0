"""A rank's start-up loads no compiler it does not use. DeepSpeed's ZeRO optimizers import its Muon
module, which wraps its functions in ``torch.compile`` when imported and so loads inductor's
compiler; ``ds_compat.import_muon_uncompiled`` imports it first with dynamo off for that import."""
import json
import subprocess
import sys

from dist_utils import REPO, job_env

RANK = r"""
import json, os, sys
import torch
from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import initialize
from pretrain.distributed.process import init_distributed
from pretrain.models.vit import create_model

init_distributed()
model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, depth=2)
train = TrainConfig(steps=1, global_batch_size=2, micro_batch_size=2, precision="fp32")
engine, _ = initialize(model, OptimConfig(name="sgd", lr=0.1), train, ZeroConfig(stage=2), 1)
engine.backward(engine(torch.randn(2, 3, 32, 32)).sum())
engine.step()
from deepspeed.runtime.zero.muon import original_muon
print("RESULT " + json.dumps({
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "switch": os.environ.get("TORCHDYNAMO_DISABLE"),
    "muon_wrapped": hasattr(original_muon.muon_update, "_torchdynamo_orig_callable")}))
"""


def test_a_zero_engine_loads_no_inductor_and_leaves_dynamo_on():
    r = subprocess.run([sys.executable, "-c", RANK], cwd=REPO, env=job_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")).split(" ", 1)[1])
    # DeepSpeed's Muon functions plain, inductor never imported, the switch put back (train.compile works)
    assert got == {"inductor": False, "switch": None, "muon_wrapped": False}, got
