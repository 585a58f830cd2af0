"""Pre-flight checks: everything that can be known to fail before a GPU is claimed.

Run by ``vit-launch`` before it starts the deepspeed runner, by the generated sbatch script on the
first node, and on its own as ``vit-launch check``. Only files, manifests and arithmetic: no CUDA
call, no process group, no image bytes read (tars are read header by header). Each finding is one
line; a failure says what to change.

    batch     global = micro x ranks x accumulation steps
    deepspeed the DeepSpeed config training builds from the config (a pair it refuses: a 16-bit
              precision at ZeRO-0, train.reduce_dtype=bf16 outside the bf16 modes, ...)
    shards    manifest readable, its classes = model.num_classes, every reader slot (ranks x
              workers, each reading a range of samples) gets a full micro batch
    manifest  every local tar exists, has the byte size the manifest recorded, starts with a tar header;
              its samples (members grouped by key, headers only) are counted against the manifest,
              for every local tar up to COUNT_SAMPLE of them, else for COUNT_SAMPLE spread over the list;
              s3:// tars: listed (existence, byte size), S3_HEADERS of them read for the tar header
    run dir   output and checkpoint folders writable, free space for the checkpoints still to be written
              (memory.checkpoint_bytes each; checkpoint.keep_last + 1 less those a resume finds)
    memory    per-GPU estimate (memory.estimate) against --gpu-memory-gb, over it a warning; for a job on
              DeepSpeed's CPU accelerator (gpu_memory_gb None) the estimate per rank, no device to fit
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.files import unwritable
from pretrain.config import Config, ConfigError, check_world_size, image_size, selective_checkpointing, target_check
from pretrain.perf import memory

OK, WARN, FAIL = "ok", "warning", "error"


@dataclass(frozen=True)
class Finding:
    level: str
    topic: str
    message: str

    def line(self) -> str:
        return f"{self.topic}: {self.message}"


def _gb(x: float) -> str:
    return f"{x / memory.GB:.2f} GB" if x < 10 * memory.GB else f"{x / memory.GB:.1f} GB"


# ---------------------------------------------------------------------------------------- batch
def check_batch(cfg: Config, world: int) -> list[Finding]:
    t = cfg.train
    try:
        gas = check_world_size(t, world)
    except ConfigError as e:  # its message names the keys and the settings that work
        return [Finding(FAIL, "batch", str(e))]
    found = [Finding(OK, "batch", f"global {t.global_batch_size} = micro {t.micro_batch_size} x {world} rank(s) "
                                  f"x {gas} accumulation step(s)")]
    if t.resolution_schedule:
        from pretrain.config.phases import resolution_phases

        found.append(Finding(OK, "batch", "train.resolution_schedule: " + "; ".join(
            f"steps {p.first:,}-{p.last:,} at {p.img_size} px, micro {p.micro_batch} x {world} x "
            f"{t.global_batch_size // (p.micro_batch * world)}" for p in resolution_phases(t, image_size(cfg.model)))))
    return found


def check_deepspeed(cfg: Config, world: int) -> list[Finding]:
    """The DeepSpeed config of the run, made as start-up makes it (``auto`` levers decided first):
    a combination it refuses (``train.precision`` bf16 or fp16 at ``zero.stage=0``,
    ``train.reduce_dtype=bf16`` outside the bf16 modes, a ``zero.offload_*`` at the wrong stage, a
    ``deepspeed:`` key contradicting a section) fails here, not after the GPUs are claimed. Nothing
    is said where it is made; a batch that does not divide is ``check_batch``'s."""
    from pretrain.distributed.engine import deepspeed_config
    from pretrain.perf import levers

    try:
        check_world_size(cfg.train, world)
    except ConfigError:
        return []
    resolved, _ = levers.resolve(cfg, world)
    try:
        deepspeed_config(resolved.optim, resolved.train, resolved.zero, world, resolved.deepspeed)
    except ConfigError as e:
        return [Finding(FAIL, "deepspeed", str(e))]
    return []


# --------------------------------------------------------------------------------------- shards
_TAR_MAGIC = (b"ustar\x0000", b"ustar  \x00")  # POSIX ustar / old GNU tar, at offset 257


COUNT_SAMPLE = 64  # tars whose samples are counted; beyond that many, a sample spread over the list


def _manifest_bytes(manifests, policy) -> dict[str, tuple[Optional[int], str]]:
    """Local shard path or ``s3://`` URL -> (byte size recorded in its manifest or None, that
    manifest's path). ``policy``: the retries of an S3 manifest's read; other remote manifests are
    skipped."""
    from data_pipeline.shards.manifest import parse_manifest
    from data_pipeline.storage.s3 import S3Prefix
    from data_pipeline.storage.urls import is_remote, is_s3, local_path

    sizes: dict[str, tuple[Optional[int], str]] = {}
    for murl in manifests:
        if is_s3(murl):
            parent, name = murl.rsplit("/", 1)
            folder = S3Prefix(parent, policy)
            shards, where = parse_manifest(folder.read_bytes(name) or b"", murl)["shards"], murl
            keys = [folder.url(sh["name"]) for sh in shards]
        elif is_remote(murl):
            continue
        else:
            path = Path(local_path(murl))
            shards, where = parse_manifest(path.read_bytes(), str(path))["shards"], str(path)
            keys = [str(path.parent / sh["name"]) for sh in shards]
        for key, sh in zip(keys, shards):
            b = sh.get("bytes")
            sizes[key] = (b if isinstance(b, int) else None, where)
    return sizes


def _is_tar_header(head: bytes) -> bool:
    """The first 512 bytes of a file start a POSIX ustar or old GNU tar archive."""
    return len(head) >= 512 and head[257:265] in _TAR_MAGIC


def count_samples(path: str) -> int:
    """Samples in a tar as the loader groups them (consecutive members sharing a key), read from
    the member headers alone: ``tarfile`` seeks over each member's bytes, so a 1 GB shard of 10k
    images costs about 20k 512-byte reads, not 1 GB. Raises ``tarfile.TarError`` / ``OSError``."""
    import tarfile

    from webdataset.tariterators import base_plus_ext

    n, last = 0, None
    with tarfile.open(path, mode="r:") as tar:
        for info in tar:
            tar.members = []  # do not keep every TarInfo of a big shard
            if not info.isreg():
                continue
            key, _ = base_plus_ext(info.name)
            if key is not None and key != last:
                n, last = n + 1, key
    return n


def spread(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _count_problems(local, sizes) -> tuple[list[tuple], int]:
    """[(shard, manifest, counted or None, error)] for the counted tars that disagree, and how many were counted."""
    import tarfile

    picked = [local[i] for i in spread(len(local), COUNT_SAMPLE)]
    bad = []
    for s in picked:
        try:
            n = count_samples(s.url)
        except (tarfile.TarError, OSError, EOFError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            bad.append((s, sizes.get(s.url, (None, "?"))[1], None, why))
            continue
        if n != s.samples:
            bad.append((s, sizes.get(s.url, (None, "?"))[1], n, None))
    return bad, len(picked)


def _tar_problem(path: str, expected: Optional[int]) -> Optional[str]:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if expected is not None and size != expected:
        return f"{size} bytes, the manifest says {expected}"
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None if _is_tar_header(head) else "does not start with a tar header"


S3_HEADERS = 8  # tars in the store whose first 512 bytes are read (ranged GETs), spread over the list


def _s3_problems(remote, sizes, policy) -> tuple[list[tuple[str, str]], int]:
    """[(shard URL, what is wrong)] for ``s3://`` shards, and how many tar headers were read. One
    LIST per folder gives every object's size (a request per 1,000 shards), compared with the size
    its manifest recorded (``sizes``: :func:`_manifest_bytes`); a spread of S3_HEADERS tars has its
    first 512 bytes read for the tar header. Samples are not counted in the store: that reads every
    member's header, a request each. Raises ``DataError`` (one line: credentials, bucket) when the
    store refuses."""
    from data_pipeline.storage.s3 import S3Prefix

    listed: dict[str, int] = {}
    for parent in sorted({s.url.rsplit("/", 1)[0] for s in remote}):
        folder = S3Prefix(parent, policy)
        listed.update({folder.url(n): b for n, b in folder.sizes().items()})
    problems = []
    for s in remote:
        recorded = sizes.get(s.url, (None, ""))[0]
        if s.url not in listed:
            problems.append((s.url, "missing"))
        elif recorded is not None and listed[s.url] != recorded:
            problems.append((s.url, f"{listed[s.url]} bytes, the manifest says {recorded}"))
    if problems:
        return problems, 0
    picked = spread(len(remote), S3_HEADERS)
    for i in picked:
        parent, name = remote[i].url.rsplit("/", 1)
        if not _is_tar_header(S3Prefix(parent, policy).head_bytes(name, 512)):
            problems.append((remote[i].url, "does not start with a tar header"))
    return problems, len(picked)


def check_shards(cfg: Config, world: int) -> list[Finding]:
    from data_pipeline.errors import DataError
    from data_pipeline.loading.plan import Plan, plan_line
    from data_pipeline.shards.manifest import resolve_shards
    from data_pipeline.storage.retry import RemotePolicy
    from data_pipeline.storage.urls import is_remote, is_s3

    d = cfg.data
    if d.synthetic:  # vit-train reads no training shards
        return [Finding(OK, "shards", "none read: data.synthetic=true trains on random batches made on the "
                                      "training device")] + check_val_shards(cfg, None)
    try:
        shardset = resolve_shards(d.train_shards, allow_remote=d.allow_remote, key="data.train_shards",
                                  policy=RemotePolicy.of(d))
        sizes = _manifest_bytes(shardset.manifests, RemotePolicy.of(d))
    except (DataError, OSError) as e:
        return [Finding(FAIL, "shards", str(e).splitlines()[0])]
    where = shardset.where
    out: list[Finding] = []
    if problem := shardset.config_problem(cfg.model.num_classes, d.multi_label):  # vit-train stops on it too
        out.append(Finding(FAIL, "shards", problem))
    out += check_val_shards(cfg, shardset)

    # -- manifest against the tars: existence, byte size, header (never the whole file)
    local = [s for s in shardset.shards if not is_remote(s.url)]
    problems = [(s.url, p) for s in local if (p := _tar_problem(s.url, sizes.get(s.url, (None, ""))[0])) is not None]
    if problems:
        url, why = problems[0]
        out.append(Finding(FAIL, "manifest", f"{len(problems)} of {len(local)} shard(s) do not match {where}, "
                                             f"first {url}: {why}; re-copy them or re-write the shards with "
                                             "vit-shards"))
    elif local:
        # -- sample counts: an overclaiming manifest would otherwise surface as "bad samples" mid-run
        bad, counted = _count_problems(local, sizes)
        which = (f"all {counted}" if counted == len(local) else
                 f"{counted} of {len(local)} (spread over the list; the rest not counted)")
        if bad:
            s, murl, n, err = bad[0]
            what = (f"{s.url}: unreadable as a tar ({err})" if n is None else
                    f"{murl} says {s.name} holds {s.samples} samples but the tar has {n} ({n - s.samples:+d})")
            out.append(Finding(FAIL, "manifest", f"{len(bad)} of {counted} counted tar(s) disagree with their "
                                                 f"manifest, first: {what}; re-write the shards with vit-shards"))
        else:
            out.append(Finding(OK, "manifest", f"{len(local)} local tar(s) present with the recorded sizes; samples "
                                               f"counted in {which} match the manifest"))
    # -- the same in an S3 store, by listing: existence, byte size, a spread of headers
    in_s3 = [s for s in shardset.shards if is_s3(s.url)]
    if in_s3:
        try:
            bad, heads = _s3_problems(in_s3, sizes, RemotePolicy.of(d))
        except DataError as e:
            bad, heads = [], -1
            out.append(Finding(FAIL, "manifest", str(e).splitlines()[0]))
        if bad:
            url, why = bad[0]
            out.append(Finding(FAIL, "manifest", f"{len(bad)} of {len(in_s3)} shard(s) in the store do not match "
                                                 f"{where}, first {url}: {why}; re-write them with vit-shards"))
        elif heads >= 0:
            out.append(Finding(OK, "manifest", f"{len(in_s3)} shard(s) in the store with the recorded sizes; tar "
                                               f"headers read in {heads}; samples not counted in the store"))
    unchecked = len(shardset.shards) - len(local) - len(in_s3)
    if unchecked:
        out.append(Finding(WARN, "manifest", f"{unchecked} remote shard(s) not checked (only the loader reads them)"))

    # -- the data plan for this layout: equal batches per rank, what an epoch uses and drops
    workers = max(1, d.workers)
    try:
        line = plan_line(shardset, world_size=world, workers=d.workers, batch_size=cfg.train.micro_batch_size,
                         seed=cfg.train.seed)
    except DataError as e:
        out.append(Finding(FAIL, "shards", f"{e}".splitlines()[0]))
        return out
    plan = Plan(shardset, world, workers, cfg.train.micro_batch_size, cfg.train.seed, True)
    steps = plan.epoch_batches() * cfg.train.micro_batch_size * world // cfg.train.global_batch_size
    out.append(Finding(OK, "shards", f"{len(shardset.shards)} shards, {shardset.total} samples ({where}); "
                                     f"{world * workers} reader slot(s) = {world} rank(s) x {workers} worker(s); "
                                     f"about {steps} step(s) per epoch"))
    out.append(Finding(OK, "plan", line))
    return out


def check_val_shards(cfg: Config, train) -> list[Finding]:
    """``data.val_shards`` of the in-training validation: readable, with the labels of ``train``
    (the training shards' ShardSet; None: ``data.synthetic``, against ``model.num_classes``)."""
    from data_pipeline.errors import DataError
    from data_pipeline.shards.manifest import resolve_shards
    from data_pipeline.storage.retry import RemotePolicy

    d = cfg.data
    if not (d.val_shards and cfg.validation.every_steps > 0):
        return []
    try:
        val = resolve_shards(d.val_shards, allow_remote=d.allow_remote, key="data.val_shards",
                             policy=RemotePolicy.of(d))
    except (DataError, OSError) as e:
        return [Finding(FAIL, "shards", str(e).splitlines()[0])]
    problem = (val.labels_problem(train) if train is not None
               else val.config_problem(cfg.model.num_classes, d.multi_label))
    if problem:
        return [Finding(FAIL, "shards", problem)]
    shared = _same_files(val, train) if train is not None else []
    if shared:  # allowed (a check that the model fits its data), but never by mistake
        return [Finding(WARN, "shards", f"data.val_shards: {len(shared)} of its {len(val.shards)} shard(s) are "
                        f"also training shards (e.g. {shared[0]}): its loss and accuracy score images the model "
                        "trains on, not held-out ones")]
    return []


def check_probe_suites(cfg: Config) -> list[Finding]:
    """The suites of the in-training few-shot and kNN probes (``validation.fewshot_suites``,
    ``validation.knn_suites``), read as vit-train reads them at start-up: each folder, split file and
    VTAB-1k task there, before any GPU waits on them."""
    from pretrain.evaluation.in_training import probe_labels, probe_tasks

    v = cfg.validation
    if not ((v.fewshot_suites or v.knn_suites) and v.every_steps > 0):
        return _target(cfg, None)
    try:
        read = probe_tasks(v, cfg.data)
    except (ConfigError, OSError) as e:
        return [Finding(FAIL, "probes", str(e).splitlines()[0])]
    said = []
    for spec, pairs in read.items():
        tasks = [t for _, t in pairs]
        what = f"{tasks[0].num_classes} classes" if len(tasks) == 1 else f"{len(tasks)} tasks"
        said.append(f"{spec}: {what}, {sum(len(t.trainval) for t in tasks)} train and "
                    f"{sum(len(t.test) for t in tasks)} test images")
    return [Finding(OK, "probes", "; ".join(said))] + _target(cfg, probe_labels(read))


def _target(cfg: Config, labels: Optional[dict[str, list[str]]]) -> list[Finding]:
    """``validation.target_metric`` against the names the evaluations log (``labels``: the probe
    suites' as read, a VTAB-1k task's or a folder's; None: no suite to read), and what the run does
    with it."""
    from pretrain.evaluation.target import Target

    v = cfg.validation
    if not v.target_metric:
        return []
    if problem := target_check(cfg, labels):
        return [Finding(FAIL, "target", ": ".join(problem))]
    return [Finding(OK, "target", f"{Target(v).words}: the first evaluation that reaches it is recorded with its "
                    "step, device-hours and images" + ("; the run ends there" if v.stop_at_target else ""))]


def _same_files(a, b) -> list[str]:
    """The shards of ShardSet ``a`` that are shards of ``b`` too (the same file, however named)."""
    from data_pipeline.storage.urls import is_remote

    def key(url: str) -> str:
        return url if is_remote(url) else os.path.realpath(url)

    theirs = {key(s.url) for s in b.shards}
    return [s.url for s in a.shards if key(s.url) in theirs]


# -------------------------------------------------------------------------------------- run dir
def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return p


def check_run_dir(cfg: Config, params: int) -> list[Finding]:
    from pretrain.checkpointing.rundir import RunDir, list_complete

    layout = RunDir.of(cfg.train.output_dir, cfg.checkpoint.dir)
    out_dir, ckpt_dir = layout.root, layout.checkpoints
    for key, d in (("train.output_dir", out_dir), ("checkpoint.dir", ckpt_dir)):
        why = unwritable(d)
        if why:
            return [Finding(FAIL, "run dir", f"{key}={d}: {why}; choose a writable folder")]
    need = memory.checkpoint_bytes(params, cfg.train.precision, cfg.optim.name, cfg.zero.stage, cfg.train.ema_decay > 0)
    free = shutil.disk_usage(_existing_ancestor(ckpt_dir)).free
    have = len(list_complete(ckpt_dir))
    earlier = f"; checkpoint.resume=false: the {have} checkpoint(s) there are kept in earlier-K/" if have and \
        not cfg.checkpoint.resume else ""
    have = have if cfg.checkpoint.resume else 0  # a fresh start keeps them beside its own
    # a save writes the new checkpoint before pruning to keep_last, so keep_last + 1 coexist; those
    # already there take no free space, so the free space is measured against the rest alone
    keep = cfg.checkpoint.keep_last
    to_write = max(1, keep + 1 - have)
    later = to_write * need
    size = f"a checkpoint is about {_gb(need)} ({params / 1e6:.1f}M params x {need / params:.1f} B)"
    if free < need:
        return [Finding(FAIL, "run dir", f"checkpoint.dir={ckpt_dir}: {_gb(free)} free but {size}; free space "
                                         "or set checkpoint.dir to a larger disk")]
    if free < later:
        there = f", {have} there already" if have else ""
        return [Finding(FAIL, "run dir", f"checkpoint.dir={ckpt_dir}: {_gb(free)} free; {size}; "
                                         f"checkpoint.keep_last={keep} (+1 while saving) holds {keep + 1}{there}: "
                                         f"the {to_write} still to write need {_gb(later)} more; lower "
                                         "checkpoint.keep_last, free space or set checkpoint.dir to a larger disk")]
    if cfg.checkpoint.resume:
        from data_pipeline.errors import ConfigError
        from pretrain.checkpointing.checkpoint import check_resumable
        from pretrain.config import to_dict

        try:
            found = check_resumable(ckpt_dir, to_dict(cfg))
        except ConfigError as e:
            return [Finding(FAIL, "resume", str(e))]
        if found is not None:
            return [Finding(OK, "run dir", f"{out_dir} writable, {_gb(free)} free; {size}; resumes from {found.name}")]
    return [Finding(OK, "run dir", f"{out_dir} writable, {_gb(free)} free; {size}{earlier}")]


# --------------------------------------------------------------------------------------- memory
def _capacity(gb: float) -> str:
    """A device's memory as the messages name it: 80, 79.6 (an H100 80GB reports 81,559 MiB)."""
    return f"{gb:.1f}".removesuffix(".0")


def check_memory(cfg: Config, world: int, gpu_memory_gb: Optional[float], shape: memory.ModelShape) -> list[Finding]:
    """The estimate against ``gpu_memory_gb``, the config's ``auto`` levers decided as training
    decides them; a warning where it does not fit, where the config checkpoints more blocks than
    memory needs (each recomputed block costs its forward again), and where it runs ZeRO-3 although
    ZeRO-2 fits (ZeRO-3 gathers the weights in every micro-step). ``gpu_memory_gb`` None: a job on
    DeepSpeed's CPU accelerator, priced per rank in host memory, with no device to fit."""
    from pretrain.perf import levers

    written = cfg.train.activation_checkpointing
    if gpu_memory_gb is None:
        cfg, _ = levers.resolve(cfg, world)  # as training on a CPU decides `auto`: nothing checkpointed
        est = memory.estimate(cfg, world, shape, cuda=False)
        detail = _estimate_words(cfg, world, shape, est, "per rank", auto=written == "auto")
        return [Finding(OK, "memory", f"{detail} in this machine's memory (no GPU here: DeepSpeed's CPU "
                                      f"accelerator, gloo; --gpu or --gpu-memory-gb checks a GPU job); "
                                      f"{_host_words(cfg, est)}")]
    budget = gpu_memory_gb * memory.GB
    usable = budget * memory.MEMORY_HEADROOM
    cap = _capacity(gpu_memory_gb)
    cfg, _ = levers.resolve(cfg, world, memory_bytes=budget)
    est = memory.estimate(cfg, world, shape)
    t = cfg.train
    selective = selective_checkpointing(t.activation_checkpointing)
    n = shape.depth if selective else t.activation_checkpointing
    detail = _estimate_words(cfg, world, shape, est, "per GPU", auto=written == "auto")
    host = _host_words(cfg, est)
    if est.total <= usable:
        found = [Finding(OK, "memory", f"{detail} of {cap} GB; {host}")]
        need = levers.fewest_checkpointed(cfg, world, shape, budget)
        if selective and need == 0:
            found.append(Finding(WARN, "memory", f"train.activation_checkpointing=selective recomputes every "
                                                 f"block's element-wise work but the run fits {cap} GB "
                                                 f"without checkpointing; set train.activation_checkpointing=auto "
                                                 f"(none here)"))
        elif written != "auto" and not selective and n > need:
            found.append(Finding(WARN, "memory", f"train.activation_checkpointing={str(written).lower()} recomputes "
                                                 f"{n} of {shape.depth} blocks but {need} would fit "
                                                 f"{cap} GB: each recomputed block costs its forward "
                                                 f"again; set train.activation_checkpointing=auto ({need} here)"))
        if cfg.zero.stage == 3:
            z2 = memory.estimate(_with(cfg, stage=2), world, shape)
            if z2.total <= usable:
                found.append(Finding(WARN, "memory", f"zero.stage=3 {_zero3_gathers(cfg, shape)}, but ZeRO-2 fits "
                                                     f"{cap} GB ({_gb(z2.total)} per GPU; building the "
                                                     f"model then takes {_gb(z2.host_build)} host memory per rank): "
                                                     f"set zero.stage=2 unless that host memory is short "
                                                     f"(vit-launch plan prices both)"))
        return found
    fixes = []
    if not selective and n < shape.depth:
        op_level = memory.estimate(levers.with_checkpointing(cfg, "selective"), world, shape).total
        if op_level <= usable:  # no matmul repeated: cheaper than recomputing whole blocks
            fixes.append(f"train.activation_checkpointing=selective ({_gb(op_level)})")
        if est.total_if_checkpointing(True) <= usable:
            fixes.append(f"train.activation_checkpointing=true ({_gb(est.total_if_checkpointing(True))})")
    mb = memory.largest_micro_batch(cfg, world, usable, shape, t.activation_checkpointing)
    mb = max((m for m in range(1, mb + 1) if t.global_batch_size % (m * world) == 0), default=0)
    if mb:
        fixes.append(f"train.micro_batch_size={mb} (more accumulation steps, same global batch)")
    if cfg.zero.stage < 3:
        z3 = memory.estimate(_with(cfg, stage=3), world, shape)
        if z3.total <= usable:
            fixes.append(f"zero.stage=3 ({_gb(z3.total)})")
    if cfg.zero.stage in (1, 2) and est.buffers > memory.GB:
        fixes.append("a smaller zero.reduce_bucket_size")
    advice = "set " + " or ".join(fixes) if fixes else "use more ranks with zero.stage=3 or a smaller model"
    return [Finding(WARN, "memory", f"estimated {detail} exceeds {_gb(usable)}, {memory.MEMORY_HEADROOM * 100:g} % of "
                                    f"{cap} GB (--gpu-memory-gb; the rest is the allocator's margin): "
                                    f"{advice}; {host}")]


def _estimate_words(cfg: Config, world: int, shape: memory.ModelShape, est: memory.MemoryEstimate, per: str,
                    auto: bool = False) -> str:
    """The estimate ``per`` device (a GPU, or a rank on the CPU) and its parts; ``cfg`` resolved,
    ``auto``: its checkpointing was ``auto`` as written."""
    from pretrain.perf import levers

    s, t = est.states, cfg.train
    selective = selective_checkpointing(t.activation_checkpointing)
    n = shape.depth if selective else t.activation_checkpointing
    ckpt = ("every block op by op (selective)" if selective
            else f"{n} of {shape.depth} blocks" + (" (auto)" if auto else "")
            + (f", their forward again: +{levers.recompute_share(cfg.model, n):.1%} FLOPs" if n else ""))
    other = f"{_gb(est.activations_other)} with activation checkpointing {'off' if n else 'on'}"
    micro = (f"micro batch {t.micro_batch_size}" if not t.resolution_schedule
             else f"its largest phase: {est.largest[0]} px, micro batch {est.largest[1]}")
    words = (f"{_gb(est.total)} {per} (ZeRO-{cfg.zero.stage}, {world} rank(s), {t.precision}, {micro}): "
             f"weights {_gb(s['weights'])}, gradients {_gb(s['gradients'])}, optimizer "
             f"{_gb(s['optimizer'])}, ZeRO buffers {_gb(est.buffers)}, activations {_gb(est.activations)} "
             f"(checkpointing {ckpt}; {other})" + (f", runtime {_gb(est.runtime)}" if est.runtime else ""))
    # ZeRO-3's terms under the names `vit-launch plan` gives them
    words += "".join(f", {name} {_gb(v)}" for name, v in (("gathered_weights", est.gathered_weights),
                                                          ("hpz_secondary", est.hpz_secondary)) if v)
    if s["cpu"]:
        words += f"; {_gb(s['cpu'])} host memory per rank for offloaded optimizer states"
    return words


def _host_words(cfg: Config, est: memory.MemoryEstimate) -> str:
    how = "one fp32 layer at a time under deepspeed.zero.Init" if cfg.zero.stage == 3 else "the whole fp32 model"
    return f"building the model takes {_gb(est.host_build)} host memory per rank ({how})"


def _zero3_gathers(cfg: Config, shape: memory.ModelShape) -> str:
    """What ZeRO-3 gathers in a micro-step of this config, by the memory model's rule
    (``memory.zero3_partitioned``, ``memory.zero3_released``): the forward's weights, and the
    backward's again only where DeepSpeed released them after their forward use."""
    tensors = memory.zero3_partitioned(shape.tensors, cfg.zero.stage3_param_persistence_threshold)
    again, part = memory.zero3_released(tensors), sum(tensors)
    fwd = f"gathers the weights ({part / 1e6:,.0f}M partitioned elements) in every micro-step's forward"
    if again:
        return f"{fwd} and {again / 1e6:,.0f}M of them again in its backward"
    return f"{fwd} and keeps them for its backward (within DeepSpeed's stage3_max_reuse_distance)"


def _with(cfg: Config, stage: int) -> Config:
    import dataclasses

    return dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage))


# ----------------------------------------------------------------------------------------- all
def layout_checks(cfg: Config, world: int, *, gpu_memory_gb: float = 80.0) -> list[Finding]:
    """What is known from the config and the number of ranks alone (batch arithmetic, memory
    estimate): what ``vit-launch slurm`` checks before it writes a script; data and disks belong to
    the cluster and are checked there, by the script."""
    return (check_batch(cfg, world) + check_deepspeed(cfg, world)
            + check_memory(cfg, world, gpu_memory_gb, memory.model_shape(cfg.model)))


def run_checks(cfg: Config, world: int, *, gpu_memory_gb: Optional[float] = 80.0) -> list[Finding]:
    """Every check; ``gpu_memory_gb`` None: the ranks run on DeepSpeed's CPU accelerator."""
    shape = memory.model_shape(cfg.model)
    return (check_batch(cfg, world) + check_deepspeed(cfg, world) + check_shards(cfg, world) + check_probe_suites(cfg)
            + check_run_dir(cfg, shape.params) + check_memory(cfg, world, gpu_memory_gb, shape))


def report(findings: list[Finding], prog: str, out, err) -> bool:
    """ok lines to ``out``; warnings and errors one line each to ``err``. True when none failed."""
    for f in findings:
        if f.level == OK:
            print(f"  ok  {f.line()}", file=out)
        else:
            print(f"{prog}: {f.level}: {f.line()}", file=err)
    return not any(f.level == FAIL for f in findings)
