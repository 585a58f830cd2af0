"""Run by the deepspeed runner from test_reduce_dtype: for each case (ZeRO stage x reduce dtype),
build a live bf16 engine from ``pretrain.distributed.engine.deepspeed_config`` on a one-weight model, take one
optimizer step of 16 accumulated micro-batches whose gradients are one large value then small ones,
and record what DeepSpeed built and the gradient norm it saw."""
import json
import sys

import deepspeed
import torch

from pretrain.config.schema import OptimConfig, TrainConfig, ZeroConfig
from pretrain.distributed.process import init_distributed
from pretrain.distributed.engine import deepspeed_config

GAS, SMALL = 16, 1e-3


class OneWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, c):  # d loss / d w = c, per element
        return (self.w * c).sum()


args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out = args[0]
rank, _, world = init_distributed()
results = {}
for stage in (1, 2, 3):
    for reduce in ("fp32", "bf16"):
        train = TrainConfig(steps=1, global_batch_size=GAS * world, micro_batch_size=1, precision="bf16",
                            reduce_dtype=reduce)
        cfg = deepspeed_config(OptimConfig(name="sgd", grad_clip=0.0, weight_decay=0.0), train,
                               ZeroConfig(stage=stage), world)
        model = OneWeight()
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        for i in range(GAS):  # one large gradient on rank 0's first micro-batch, small ones after
            c = torch.full((4,), 1.0 if (i == 0 and rank == 0) else SMALL, dtype=torch.bfloat16)
            engine.backward(engine(c))
            engine.step()
        norm = engine.get_global_grad_norm()
        results[f"z{stage}-{reduce}"] = {"comm": str(engine.communication_data_type),
                                         "optimizer": type(engine.optimizer).__name__,
                                         "grad_norm": float(norm)}
        del engine, model, opt
if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
torch.distributed.barrier()
