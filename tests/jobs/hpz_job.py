"""Run by the deepspeed runner (4 ranks) from test_perfmodel: ZeRO-3 with and without ZeRO++'s
hpZ (a secondary weight partition in groups of 2 ranks) from the same weights and data, three
optimizer steps each; rank 0 writes both loss curves. hpZ has no kernel of its own, so DeepSpeed
runs it on gloo."""
import json
import os
import sys

import torch

from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import initialize
from pretrain.distributed.process import init_distributed
from pretrain.models.vit import create_model
from pretrain.perf.collector import after_imports

after_imports()  # as vit-train: DeepSpeed's gc.collect calls walk only what is newer than the imports

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
rank, _, world = init_distributed()
out = {}
for hpz in (1, 2):
    train = TrainConfig(steps=10, global_batch_size=2 * world, micro_batch_size=2, precision="bf16")
    model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, init_seed=0, depth=2)
    engine, ds_cfg = initialize(model, OptimConfig(name="adamw", lr=1e-3), train,
                                ZeroConfig(stage=3, hpz_partition_size=hpz), world)
    gen, losses = torch.Generator().manual_seed(rank), []
    for _ in range(3):
        x = torch.randn(2, 3, 32, 32, generator=gen).bfloat16()
        y = torch.randint(0, 10, (2,), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    secondary = {getattr(p, "ds_secondary_tensor_group_size", None) or 0 for p in model.parameters()}
    out[hpz] = {"losses": losses, "hpz_in_config": ds_cfg["zero_optimization"]["zero_hpz_partition_size"],
                "secondary": sorted(secondary)}
    del engine, model
if rank == 0:
    with open(args[0], "w") as f:
        json.dump(out, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()

# End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
# one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
# after its results are written, which the runner reports as a failed job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
