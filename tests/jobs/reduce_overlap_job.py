"""One rank of a 2-rank ZeRO-2 job (fp32, gloo): when does the gradient reduction start against the
end of the backward? For each reduction bucket size given, one engine of the tiny ViT takes one
step; every collective DeepSpeed issues is timed through its communication backend
(``ds_compat.time_collectives``), and the backward's last gradient (the input image's, which
autograd computes after every weight's) stamps the end of the autograd pass. Prints, per bucket
size, the collectives' start times relative to that end, as JSON (rank 0)."""
import json
import os
import sys
import time

import torch

from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed import ds_compat
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import initialize
from pretrain.distributed.process import init_distributed
from pretrain.models.vit import create_model

rank, _, world = init_distributed()
torch.set_num_threads(1)
out, starts = {}, []
for bucket in json.loads([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    train = TrainConfig(steps=1, global_batch_size=4 * world, micro_batch_size=4, precision="fp32",
                        activation_checkpointing=False)
    zero = ZeroConfig(stage=2, reduce_bucket_size=bucket, overlap_comm=True)
    engine, ds_cfg = initialize(model, OptimConfig(name="sgd", lr=0.1), train, zero, world)
    if not out:  # the backend's methods are enclosed once, after the first engine made the backend
        ds_compat.time_collectives(lambda: starts.append(time.perf_counter()), lambda: None)
    ended = []
    x = torch.randn(4, 3, 32, 32, requires_grad=True)  # its gradient is the backward's last
    x.register_hook(lambda g: ended.append(time.perf_counter()))
    loss = engine(x).float().logsumexp(-1).mean()
    starts.clear()
    engine.backward(loss)
    done = time.perf_counter()
    engine.step()
    out[str(bucket)] = {"bucket": ds_cfg["zero_optimization"]["reduce_bucket_size"],
                        "params": sum(p.numel() for p in model.parameters()),
                        "starts_before_end": [s - ended[0] for s in starts if s <= done],
                        "backward_call_s": done - ended[0]}
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
