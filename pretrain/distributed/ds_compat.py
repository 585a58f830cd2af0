"""Every place vitscale reaches into DeepSpeed's private internals, here and in ``ds_masters.py``.

Each function here depends on DeepSpeed code that is not public API: a private attribute of the
engine, a file DeepSpeed's CPU accelerator creates, or a loader defect we undo. They were written
against, and are tested with, the releases in ``TESTED``; ``setup.py`` pins the same range.
``check_version`` says in one line at start-up when the installed release is outside it, so a
user who upgrades knows which assumptions to re-check (the tests in ``tests/integration/test_elastic_ckpt.py``
and ``tests/integration/test_distributed.py`` exercise each of them).

What lives here and why:

- ``universal_loading``: DeepSpeed reads ``engine._config.load_universal_checkpoint`` only inside
  ``load_checkpoint``; switching it on the live engine around one load lets a job built normally
  load a universal checkpoint (elastic resume) and save normally afterwards.
- ``fix_zero3_universal_load``: ZeRO-3's universal loader gives every param group the first
  group's hyperparameters (our no-decay group would decay) and stores one shared ``step`` tensor
  in every sub-group's state (torch's AdamW increments it once per sub-group, so bias correction
  runs ahead). Each group gets its own saved hyperparameters back, each state its own step.
- ``shm_buffer_path`` / ``release_shm_buffers``: DeepSpeed's CPU accelerator creates a 66 MB
  ``/dev/shm`` file per rank for its shared-memory all-reduce and never unlinks it.
- ``around_zero3_fetch``: ZeRO-3 fetches a module's parameters in a forward pre-hook that it
  registers on every module outside its leaf modules when the engine is built; hooks of ours before
  and after it time the wait (the straggler clock's ``gather`` phase).
- ``set_micro_batch``: DeepSpeed's public setters change the micro batch and the accumulation, but
  its accumulation boundary is ``engine.micro_steps`` (a private counter) modulo the accumulation,
  which must be realigned when the accumulation changes between steps (``train.resolution_schedule``).
- ``launcher_node``: the per-node launcher (``deepspeed.launcher.launch``) knows which hostfile
  entry its node is (``--world_info``, ``--node_rank``) but tells its ranks only the node's index
  (``CROSS_RANK``); the name is read from the launcher's own arguments.
- ``import_muon_uncompiled``: DeepSpeed's ZeRO optimizer check and its ZeRO-1/2/3 and bf16 optimizers
  import its Muon module, which wraps its functions in ``torch.compile`` at import and so loads
  inductor's compiler: about 0.9 CPU-seconds of each rank's start-up, for an optimizer vitscale
  does not offer. Imported first with dynamo off for that one import (vit-train's and
  vit-transfer's engines), its functions stay eager.
- The fp32 master weights inside DeepSpeed's optimizers (EMA, LAMB) are read in the sibling
  ``pretrain/distributed/ds_masters.py``, written for the same releases.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

# the DeepSpeed releases this module was written for and tested with: [low, high)
TESTED = ((0, 19, 0), (0, 20, 0))


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def tested_range() -> str:
    lo, hi = (".".join(map(str, v)) for v in TESTED)
    return f">={lo},<{hi}"


def version_ok(version: str) -> bool:
    return TESTED[0] <= _release(version) < TESTED[1]


def check_version(prog: str = "vit-train") -> bool:
    """One line on stderr when the installed DeepSpeed is outside ``TESTED``; returns whether it is in."""
    import deepspeed

    if version_ok(deepspeed.__version__):
        return True
    print(f"{prog}: warning: DeepSpeed {deepspeed.__version__} is outside the tested range {tested_range()}; "
          "universal-checkpoint loading, the CPU shm clean-up and the master-partition maps (EMA, LAMB) rely on "
          "its internals (pretrain/distributed/ds_compat.py, ds_masters.py)", file=sys.stderr, flush=True)
    return False


@contextlib.contextmanager
def universal_loading(engine, on: bool = True) -> Iterator[None]:
    """``"checkpoint": {"load_universal": true}`` for the duration of one load, on a live engine;
    restored afterwards so later loads and saves take the normal path."""
    before = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = bool(on) or before
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = before


def fix_zero3_universal_load(engine, saved_param_groups: list[dict]) -> None:
    """Undo ZeRO-3's universal-load defects (module docstring): each param group gets its own saved
    hyperparameters, each parameter state its own ``step`` tensor."""
    import torch

    base = engine.optimizer.optimizer
    if len(saved_param_groups) != len(base.param_groups):
        raise ValueError(f"{len(saved_param_groups)} saved param groups, the optimizer has {len(base.param_groups)}")
    for mine, theirs in zip(base.param_groups, saved_param_groups):
        for k, v in theirs.items():
            if k != "params":
                mine[k] = v
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def shm_buffer_path(rank: int) -> Path:
    """The /dev/shm file DeepSpeed's CPU accelerator creates for ``rank`` of this job (its shm
    all-reduce: named by uid, MASTER_ADDR, MASTER_PORT and rank)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffers() -> bool:
    """Unlink this rank's DeepSpeed shm buffer once every rank has mapped every peer's.

    On CPU, when all ranks are on one machine (the launcher's LOCAL_SIZE == WORLD_SIZE), each rank
    creates a 66 MB /dev/shm file and maps its peers' files while the process group starts; left
    there, every job filled RAM-backed /dev/shm by 66 MB per rank. After a barrier every mapping
    exists, so the names can go: the memory stays mapped while the ranks live and the kernel frees
    it when the last one exits, by kill -9 too. Returns whether a file was removed. A no-op on GPUs
    and across several machines (no such files)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):  # a world of one under the runner makes one too
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    dist.barrier()  # every rank has returned from DeepSpeed's shm set-up (it opens all peers' files)
    try:
        shm_buffer_path(dist.get_rank()).unlink()
        return True
    except FileNotFoundError:  # the shm op was not built (an older DeepSpeed, no compiler)
        return False


def fp32_state_dict(ckpt: Path) -> dict:
    """The fp32 master weights of one ZeRO checkpoint directory (stages 1-3), whole, on the CPU.

    DeepSpeed's ``zero_to_fp32`` reads the files of its ZeRO optimizers, but not those of its
    ``BF16_Optimizer``, which it builds for ZeRO-1 with bf16 weights and fp32 gradient accumulation
    (the default here): its ``bf16_zero_pp_rank_R_*optim_states.pt`` hold each rank's flat fp32
    partition per parameter group and no ``zero_stage`` key. Those are concatenated in rank order
    and cut by the parameter shapes the model-states file lists, group by group (the groups are
    padded only at their end)."""
    import contextlib
    import io
    import math

    import torch

    ckpt = Path(ckpt)
    files = sorted(ckpt.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda p: int(p.name.split("_")[4]))
    parts = [torch.load(f, map_location="cpu", weights_only=False, mmap=True)["optimizer_state_dict"] for f in files]
    if not parts or "zero_stage" in parts[0]:  # a ZeRO optimizer's files (bf16 ones carry the prefix too)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        del parts
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    model = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    if len(parts) != parts[0]["partition_count"][0]:
        raise ValueError(f"{ckpt}: {len(parts)} BF16_Optimizer partition files, saved on "
                         f"{parts[0]['partition_count'][0]} ranks")
    out: dict = {}
    for g, shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([p["single_partition_of_fp32_groups"][g].float() for p in parts])
        offset = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            out[name] = flat[offset:offset + n].view(shape).clone()
            offset += n
        if offset + sum(p["group_paddings"][g] for p in parts) != flat.numel():
            raise ValueError(f"{ckpt}: parameter group {g} holds {flat.numel()} values, its shapes {offset}")
    for alias, name in (model.get("shared_params") or {}).items():
        out[alias] = out[name]
    return out


def report_build_lock_wait(after_s: float = 10.0, prog: str = "vit-train"):
    """Start a timer that, ``after_s`` seconds from now, says in one line if this process's main
    thread is waiting for the lock of a JIT build of a compiled op. DeepSpeed's CPU shm op is built
    by torch's ``cpp_extension.load`` on first use, under a lock on the build folder; a second
    process waits on it silently while the first builds (about 20 s on two cores): torch 2.14 holds an
    OS file lock (``filelock``, released if the builder dies), older torch a lock file
    (``FileBaton``: a build killed mid-way leaves it, and every later run waits forever).
    Returns the timer; ``cancel()`` it once the wait is over."""
    import threading

    main = threading.main_thread().ident

    def look() -> None:
        frame = sys._current_frames().get(main)
        while frame is not None:
            lock = frame.f_locals.get("self")
            path = getattr(lock, "lock_file_path", None) or getattr(lock, "lock_file", None)
            if frame.f_code.co_name in ("wait", "acquire", "_poll_until_acquired") and isinstance(path, str):
                print(f"{prog}: waiting {after_s:g}+ s for the lock {path} of a compiled op's build: normal on "
                      "a first start, another process is building DeepSpeed's op (under a minute, once per "
                      "TORCH_EXTENSIONS_DIR). Only if no build runs for long (torch < 2.14 leaves the file "
                      "after a killed build): remove it", file=sys.stderr, flush=True)
                return
            frame = frame.f_back

    timer = threading.Timer(after_s, look)
    timer.daemon = True
    timer.start()
    return timer


MUON = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon module (``MUON``) with ``torch.compile`` a no-op while it runs: the
    one environment switch that ``torch._dynamo.optimize`` reads when called, set for the import
    and put back. Nothing else compiles meanwhile; ``train.compile`` is unaffected."""
    if MUON in sys.modules:
        return
    import importlib

    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(MUON)
    except ImportError:  # a release without it
        pass
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def set_micro_batch(engine, micro_batch: int) -> int:
    """The engine's micro batch set to ``micro_batch`` with its global batch kept, between optimizer
    steps: the accumulation becomes ``global / (micro x data-parallel ranks)``, which also scales each
    micro-batch's loss in ``engine.backward``. DeepSpeed's boundary test is ``(micro_steps + 1) %
    accumulation == 0`` on a counter that only that test reads (a resumed engine restarts it at 0), so
    the counter moves up to the next multiple of the new accumulation and the next boundary falls on
    the step's last micro-batch. Returns the accumulation."""
    if micro_batch != engine.train_micro_batch_size_per_gpu():
        global_batch = engine.train_batch_size()
        engine.set_train_micro_batch_size(micro_batch)
        engine.set_train_batch_size(global_batch)
    gas = engine.gradient_accumulation_steps()
    engine.micro_steps = -(-engine.micro_steps // gas) * gas
    return gas


def around_zero3_fetch(module, before: Callable[[], None], after: Callable[[], None]) -> int:
    """Call ``before`` and ``after`` around ZeRO-3's parameter fetch as each hooked module's forward
    begins. DeepSpeed (``DeepSpeedZeRoOffload._register_deepspeed_module``) registers that fetch as a
    forward pre-hook of every module while the engine is built, except inside a ZeRO-3 leaf module
    (``zero.leaf_blocks``, compiled blocks), which fetches its whole subtree's parameters itself; the
    same modules are wrapped here, so none inside a leaf (a compiled block keeps no hook of ours in
    its traced code). ``before`` is prepended to each module's pre-hooks and ``after`` appended, so
    together they enclose the fetch. Call once, after ``deepspeed.initialize``. Cost: two Python calls
    per hooked module per forward. Returns how many modules were wrapped."""
    from deepspeed.utils import z3_leaf_module

    n, todo = 0, [module]
    while todo:
        m = todo.pop()
        m.register_forward_pre_hook(lambda *_: before(), prepend=True)
        m.register_forward_pre_hook(lambda *_: after())
        n += 1
        if not z3_leaf_module(m):
            todo.extend(m.children())
    return n


# DeepSpeed's collectives, as methods of its communication backend (``deepspeed.comm.comm.cdb``, a
# ``TorchBackend``): ZeRO's reductions, gathers and norms all go through these.
COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_base",
               "all_gather_coalesced", "broadcast", "all_to_all_single", "all_to_all", "gather", "scatter",
               "barrier")


class _TimedWork:
    """An asynchronous collective's handle whose ``wait`` is enclosed too (the rest passes through)."""

    def __init__(self, work, begin: Callable[[], None], end: Callable[[], None]):
        self._work, self._begin, self._end = work, begin, end

    def wait(self, *args, **kwargs):
        self._begin()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._end()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _enclose(obj, name: str, begin: Callable[[], None], end: Callable[[], None]) -> bool:
    """Replace ``obj.name`` (a bound method) on the instance by one that calls ``begin`` and ``end``
    around it, and around its handle's ``wait`` when it returns one (``async_op=True``); False when
    there is no such method or it is already enclosed."""
    fn = getattr(obj, name, None)
    if fn is None or getattr(fn, "_vitscale_timed", False):
        return False

    def timed(*args, **kwargs):
        begin()
        try:
            out = fn(*args, **kwargs)
        finally:
            end()
        return _TimedWork(out, begin, end) if kwargs.get("async_op") and hasattr(out, "wait") else out
    timed._vitscale_timed = True
    setattr(obj, name, timed)
    return True


def time_collectives(begin: Callable[[], None], end: Callable[[], None], engine=None) -> list[str]:
    """Call ``begin`` and ``end`` around every collective DeepSpeed issues through its communication
    backend, so that a clock can tell the time a rank waited for its peers from its own work. The
    backend's bound methods are replaced on the one backend instance (module functions such as
    ``deepspeed.comm.all_reduce`` look it up at each call); a method that calls another counts once
    when ``begin``/``end`` nest. An asynchronous call (``async_op=True``) is timed until it returns and
    again in its handle's ``wait``. ZeRO-3's coordinator (``fetch_sub_module``: the forward's and
    backward's parameter fetch, which waits for the all-gathers it started earlier) is enclosed too
    when ``engine`` runs ZeRO-3. Call once, after ``deepspeed.initialize``. Returns the enclosed names."""
    from deepspeed.comm import comm as ds_comm

    wrapped = []
    if ds_comm.cdb is not None:
        wrapped += [n for n in COLLECTIVES if _enclose(ds_comm.cdb, n, begin, end)]
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is not None and _enclose(offload.get_param_coordinator(), "fetch_sub_module", begin, end):
        wrapped.append("fetch_sub_module")
    return wrapped


def launcher_node(environ: Optional[dict] = None, ppid: Optional[int] = None) -> Optional[str]:
    """The name the deepspeed runner gave this rank's node: its hostfile entry (``worker-3``,
    ``10.0.0.4``), the name ``vit-launch run`` leaves out or keeps. DeepSpeed's per-node launcher
    (the rank's parent) is started as ``python -m deepspeed.launcher.launch --world_info=B64
    --node_rank=N ...``, where ``B64`` is the base64 JSON of the job's hosts (in the runner's order)
    and their slots, and it sets ``CROSS_RANK=N`` in the rank's environment. None when the rank was
    not started by that launcher (Linux ``/proc`` is read) or by a runner without a hostfile (the
    one node called ``localhost``)."""
    import base64
    import json

    environ = os.environ if environ is None else environ
    ppid = os.getppid() if ppid is None else ppid
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        if "deepspeed.launcher.launch" not in argv:
            return None
        info = next(a.split("=", 1)[1] for a in argv if a.startswith("--world_info="))
        names = list(json.loads(base64.urlsafe_b64decode(info)))
        name = names[int(environ.get("CROSS_RANK", "0"))]
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return None if name == "localhost" else name
