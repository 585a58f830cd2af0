"""Run by the deepspeed runner from test_zero_init: build a model through ``train.build_model``
under ZeRO-3 (``deepspeed.zero.Init``), record this rank's peak host memory during the build,
compare the gathered weights with the plain build from the same seed, set the fp32 masters from
whole tensors on rank 0 (padded partitions included), and take one training step.

    deepspeed --num_gpus 2 --module tests.jobs.zero_init_job OUT_DIR MODEL_NAME
"""
import gc
import json
import os
import sys
from pathlib import Path

import torch

from pretrain.config import Config
from pretrain.distributed.engine import initialize, param_groups
from pretrain.distributed.process import init_distributed
from pretrain.models.vit import create_model
from pretrain.perf.collector import after_imports
from pretrain.weights.init_from import build_model, num_params

after_imports()  # as vit-train: DeepSpeed's gc.collect calls walk only what is newer than the imports


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak resident set) to the current RSS."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def measured_build(fn):
    reset_peak()
    before = rss_kb("VmRSS")
    out = fn()
    return out, (rss_kb("VmHWM") - before) * 1024


args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank
out_dir, name = Path(args[0]), args[1]
rank, _, world = init_distributed()
torch.set_num_threads(1)
cfg = Config()
cfg.model.name, cfg.model.img_size, cfg.model.num_classes = name, 32, 7  # 7: the head's bias splits unevenly
cfg.model.qk_norm, cfg.model.init_values = True, 1e-4
cfg.train.precision, cfg.zero.stage = "fp32", 3
cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.steps = 2, 2 * world, 1
cfg.optim.warmup_steps = 0

# warm-up: DeepSpeed's one-time set-up (communication buffers, lazy imports) is not the model's
warm = Config()
warm.model.name, warm.model.img_size, warm.zero.stage, warm.train.precision = "vit_tiny_patch16_224", 32, 3, "fp32"
build_model(warm)
torch.manual_seed(cfg.train.seed)
model, zero_peak = measured_build(lambda: build_model(cfg))
params = num_params(model)
assert all(p.numel() == 0 for p in model.parameters()), "ZeRO-3 build left whole parameters on a rank"
record = {"rank": rank, "world": world, "params": params, "zero3_build_peak_bytes": zero_peak,
          "local_partition_bytes": 4 * sum(p.ds_tensor.numel() for p in model.parameters())}

# the same seed without ZeRO, on one rank: every gathered tensor equal (rank 0 compares; all gather)
import deepspeed  # noqa: E402

torch.manual_seed(12345)  # the global generator plays no part: the weights come from train.seed alone
plain, plain_peak = measured_build(lambda: create_model(
    name, num_classes=7, img_size=32, qk_norm=True, init_values=1e-4, init_seed=cfg.train.seed))
record["plain_build_peak_bytes"] = plain_peak
mismatch, stats = [], {}
for (n, p), (n2, q) in zip(model.named_parameters(), plain.named_parameters()):
    assert n == n2, (n, n2)
    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        if rank == 0 and not torch.equal(p.data.cpu(), q.data):  # ZeRO-3 puts p on the accelerator
            mismatch.append(n)
        if n in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.bias", "pos_embed", "blocks.0.ls1.gamma"):
            stats[n] = [p.data.float().mean().item(), p.data.float().std().item(),
                        q.data.float().mean().item(), q.data.float().std().item()]
record.update(mismatch=mismatch, stats=stats)

# weight-decay groups use the full shapes (ds_shape), as for the plain model
sizes = lambda groups: [sum(getattr(p, "ds_numel", p.numel()) for p in g["params"]) for g in groups]  # noqa: E731
record["groups_zero3"], record["groups_plain"] = sizes(param_groups(model, 0.1)), sizes(param_groups(plain, 0.1))
del plain
gc.collect()

engine, _ = initialize(model, cfg.optim, cfg.train, cfg.zero, world)

# fp32 masters set from whole tensors that rank 0 holds (model.init_from's path), padded partitions too
from pretrain.weights.init_from import set_masters  # noqa: E402

g = torch.Generator().manual_seed(7)  # the same values on every rank, to compare with
values = {n: torch.randn(tuple(p.ds_shape), generator=g) for n, p in engine.module.named_parameters()}
set_masters(engine, values if rank == 0 else {})
record["padded"] = [n for n, p in engine.module.named_parameters() if p.ds_numel % world]
record["masters_mismatch"] = [n for n, p in engine.module.named_parameters()
                              if not torch.equal(deepspeed.utils.safe_get_full_fp32_param(p).cpu(), values[n])]

# and it trains: one step through the DeepSpeed engine
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(rank))
loss = torch.nn.functional.cross_entropy(engine(x), torch.tensor([1, 2]))
engine.backward(loss)
engine.step()
record["loss"] = loss.item()
(out_dir / f"rank{rank}.json").write_text(json.dumps(record))
torch.distributed.barrier()
torch.distributed.destroy_process_group()

# End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
# one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
# after its results are written, which the runner reports as a failed job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
