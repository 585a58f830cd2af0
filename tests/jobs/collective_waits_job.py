"""One rank of a 2-rank gloo job through DeepSpeed's communication backend: rank 1 works 0.6 s
(sleeps) before each collective, rank 0 goes straight in. Collectives are enclosed by
``ds_compat.time_collectives`` and timed by a real ``StepClock``: a synchronous all-reduce in
``backward``, an asynchronous all-gather waited on in ``step``. Prints the rank's window as JSON."""
import json
import os
import time

import deepspeed
import deepspeed.comm as dist
import torch

from pretrain.distributed import ds_compat
from pretrain.observability.clock import StepClock

deepspeed.init_distributed("gloo", verbose=False)
rank = dist.get_rank()
clock = StepClock("cpu")
names = ds_compat.time_collectives(clock.comm_begin, clock.comm_end)
work = 0.6 if rank == 1 else 0.0

clock.enter("forward")
time.sleep(work)
clock.enter("backward")
time.sleep(work)
dist.all_reduce(torch.ones(4))  # rank 0 waits here for rank 1's work
clock.enter("step")
out = torch.zeros(2 * 4)
time.sleep(work)
handle = dist.all_gather_into_tensor(out, torch.full((4,), float(rank)), async_op=True)
handle.wait()  # rank 0's call returns at once; it waits for rank 1 here
gathered = out.tolist()
clock.enter("data")
elapsed, phases = clock.close_window()
print(json.dumps({"rank": rank, "phases": phases, "wrapped": names, "gathered": gathered,
                  "again": ds_compat.time_collectives(clock.comm_begin, clock.comm_end)}), flush=True)
dist.destroy_process_group()
os._exit(0)
