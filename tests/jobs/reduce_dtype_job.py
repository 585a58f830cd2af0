"""Run by the deepspeed runner from test_reduce_dtype: for each case (precision x ZeRO stage x reduce
dtype), build a live engine from ``pretrain.distributed.engine.deepspeed_config`` on a one-weight
model (a bias-free Linear, the class DeepSpeed's autocast reduces in bf16 when asked), take one
optimizer step of 16 accumulated micro-batches whose gradients are one large value then small ones,
and record what DeepSpeed built and the update (SGD at lr 1 from zero: minus the averaged gradient)."""
import json
import os
import sys

import deepspeed
import torch

from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import deepspeed_config
from pretrain.distributed.precision import compute_dtype
from pretrain.distributed.process import init_distributed

GAS, SMALL = 16, 2.0 ** -10  # exact in bf16: any rounding seen is the accumulation's or the reduction's
STAGES = {"bf16": (1, 2, 3), "bf16-autocast": (0, 1, 2, 3)}


class OneWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(self.lin.weight)

    def forward(self, c):  # d loss / d w = c, per element
        return self.lin(c).sum()


args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out = args[0]
rank, _, world = init_distributed()
results = {}
for precision, stages in STAGES.items():
    for stage in stages:
        for reduce in ("fp32", "bf16"):
            train = TrainConfig(steps=1, global_batch_size=GAS * world, micro_batch_size=1, precision=precision,
                                reduce_dtype=reduce)
            cfg = deepspeed_config(OptimConfig(name="sgd", grad_clip=0.0, weight_decay=0.0), train,
                                   ZeroConfig(stage=stage, reduce_bucket_size=500_000_000,
                                   stage3_prefetch_bucket_size=50_000_000), world)
            model = OneWeight()
            opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            for i in range(GAS):  # one large gradient on rank 0's first micro-batch, small ones after
                c = torch.full((4,), 1.0 if (i == 0 and rank == 0) else SMALL, dtype=compute_dtype(precision))
                engine.backward(engine(c))
                engine.step()
            p = model.lin.weight
            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                master = deepspeed.utils.safe_get_full_fp32_param(p)
                norm = float((master if master is not None else p).detach().float().norm())
            results[f"{precision}-z{stage}-{reduce}"] = {
                "comm": str(engine.communication_data_type), "optimizer": type(engine.optimizer).__name__,
                "grad_norm": norm, "module_dtype": str(model.lin.weight.dtype),
                "weight_comm": str(getattr(model.lin.weight, "comm_dtype", None))}
            del engine, model, opt
if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()

# End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
# one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
# after its results are written, which the runner reports as a failed job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
