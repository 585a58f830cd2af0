"""Run by the deepspeed runner from test_distributed: load a run's newest checkpoint into a live
ZeRO-3 engine (parameters sharded over the ranks) and save its logits on a fixed input."""
import os
import sys
from pathlib import Path

import torch

from pretrain.checkpointing import checkpoint
from pretrain.config import from_dict
from pretrain.distributed.engine import initialize
from pretrain.distributed.process import init_distributed
from pretrain.perf.collector import after_imports
from pretrain.weights.init_from import build_model

after_imports()  # as vit-train: DeepSpeed's gc.collect calls walk only what is newer than the imports

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank
run_dir, out = Path(args[0]), Path(args[1])
rank, _, world = init_distributed()
info = __import__("json").loads((checkpoint.latest_complete(run_dir / "checkpoints") / "run.json").read_text())
cfg = from_dict(info["config"])
cfg.train.precision = "fp32"  # compare in fp32; the checkpoint's fp32 master weights are loaded
engine, _ = initialize(build_model(cfg), cfg.optim, cfg.train, cfg.zero, world)
assert checkpoint.resume(engine, run_dir / "checkpoints") is not None
engine.eval()
x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits = engine(x)
if rank == 0:
    torch.save({"x": x, "logits": logits.float()}, out)
torch.distributed.barrier()
torch.distributed.destroy_process_group()

# End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
# one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
# after its results are written, which the runner reports as a failed job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
