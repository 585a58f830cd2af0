"""Run by the deepspeed runner from tests/integration/test_reference_step.py: one SGD step of our
engine (``pretrain.distributed.engine.initialize``: ZeRO-3, activation checkpointing, 2 ranks, fp32)
against plain PyTorch on the same global batch, for each ``optim.grad_clip`` given; writes the
relative error of the update and the reference gradient norm per case (rank 0)."""
import copy
import json
import sys

import deepspeed
import torch
import torch.nn.functional as F

from pretrain.config.schema import OptimConfig, TrainConfig, ZeroConfig
from pretrain.distributed.engine import initialize
from pretrain.distributed.process import init_distributed
from pretrain.models.vit import create_model

MICRO, IMG, CLASSES, LR = 4, 32, 10, 0.1

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out, clips = args[0], [float(c) for c in args[1:]]
rank, _, world = init_distributed()
torch.manual_seed(0)
images = torch.randn(MICRO * world, 3, IMG, IMG) * 3  # the global batch, the same on every rank
labels = torch.randint(0, CLASSES, (MICRO * world,))
results = {}
for clip in clips:
    base = create_model("vit_tiny_patch16_224", img_size=IMG, num_classes=CLASSES, init_seed=0)
    with torch.no_grad():  # a head that is not zero, so every layer has a gradient at the first step
        base.head.weight.copy_(torch.randn(base.head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    ref = copy.deepcopy(base)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}

    # the reference: autograd on the whole batch, clip_grad_norm_ (when asked), one SGD step
    loss = F.cross_entropy(ref(images), labels)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf"))
    torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.0).step()

    # ours: each rank its micro-batch, DeepSpeed averages over ranks and clips as configured
    optim = OptimConfig(name="sgd", lr=LR, momentum=0.0, weight_decay=0.0, grad_clip=clip, warmup_steps=0,
                        schedule="constant")
    train = TrainConfig(steps=1, global_batch_size=MICRO * world, micro_batch_size=MICRO, precision="fp32",
                        activation_checkpointing=True)
    engine, _ = initialize(base, optim, train, ZeroConfig(stage=3), world)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    engine.backward(F.cross_entropy(engine(images[mine]), labels[mine]))
    engine.step()
    num = den = 0.0
    for (name, p), (_, q) in zip(engine.module.named_parameters(), ref.named_parameters()):
        with deepspeed.zero.GatheredParameters([p]):
            num += float(((p.detach() - before[name]) - (q.detach() - before[name])).pow(2).sum())
            den += float((q.detach() - before[name]).pow(2).sum())
    results[str(clip)] = {"relative_error": (num / den) ** 0.5, "reference_grad_norm": float(norm)}
    del engine
if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
torch.distributed.barrier()
