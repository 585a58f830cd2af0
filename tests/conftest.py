"""Shared pytest setup. Everything runs on CPU; checks that need a GPU carry the `gpu` marker and
are collected only where CUDA is present (`make test-gpu`; CI never has one)."""
import getpass
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Keep test processes off the network and out of W&B's servers.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One ninja for every process: DeepSpeed JIT-builds its CPU comm op with whichever `ninja` is on
# PATH, and ninja 1.11 (Debian) and 1.13 (the venv's) hash build commands differently, so mixing
# them rebuilds the op (~1 min) on every switch.
_bin = os.path.dirname(sys.executable)
if not os.environ.get("PATH", "").startswith(_bin + os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")
# torch.compile builds its kernels in the compiling process: inductor's default, a pool of compile
# workers per process, each importing torch, costs more CPU than it saves on two cores the two test
# workers already share (on a cold cache, test_compile.py measured 204 CPU-s with the pool, 156
# without). The kernels and their results are the same either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])  # read at its import


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (runs only where one is present)")
    config.addinivalue_line("markers", "cluster: real sshd/pdsh/SLURM daemons (make test-cluster; not in make test)")
    config.addinivalue_line("markers", "slow: runs that start training processes (deepspeed runner or python -m "
                            "pretrain.train); `pytest -m \"not slow and not cluster and not gpu\"` is the quick "
                            "inner loop, `make test` adds the slow ones")
    # as data_pipeline/loading/cuda_streams.py does for training: pytest resets warning filters per
    # test, and torchvision's deprecation of its codecs would otherwise be reported once per decode
    config.addinivalue_line("filterwarnings", "ignore:The image decoding and encoding capabilities of "
                            "TorchVision are deprecated:DeprecationWarning")


@pytest.fixture(scope="session", autouse=True)
def _private_temp_folder(tmp_path_factory):
    """Every process the tests start, and the tests themselves, make their temporary files in a
    folder of this test session, removed when it ends: a job killed on purpose cannot clean up
    (W&B's media folders, multiprocessing's socket folders), and would leave them in the system's
    temp folder run after run. torch.compile's cache, pytest's own folders and this process's
    multiprocessing folder stay where they always are."""
    import multiprocessing.util

    tmp_path_factory.getbasetemp()
    multiprocessing.util.get_temp_dir()  # removed by this process at its exit, after this fixture
    inductor = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    before = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    folder = tempfile.mkdtemp(prefix="vitscale-tests-")
    os.chmod(folder, 0o1777)  # as /tmp: daemons of the cluster tests run as their own users (munge)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = None
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for the in-process work of every test: `make test` runs two test
    processes on two cores, and OpenMP threads contending with the other process (and its jobs)
    ran a tiny fine-tune 7x slower (36 s vs 5 s at load 4). Restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _own_wandb_service():
    """A test that used W&B in-process leaves no service behind for the next one to share."""
    yield
    if "wandb" in sys.modules:
        try:
            sys.modules["wandb"].teardown()
        except Exception:
            pass
    os.environ.pop("WANDB_SERVICE", None)


def _held(paths: set) -> set:
    """Those of ``paths`` some live process has open or mapped (/proc/PID/fd and /proc/PID/maps)."""
    def links(pid):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                yield os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile (the listing's own descriptor, say)
                pass

    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            names = set(links(pid))
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone, or not ours to read
            continue
        held |= {p for p in paths if str(p) in names or str(p) in maps}
    return held


@pytest.fixture(autouse=True)
def _no_shm_left():
    """A safety net for the machine, not a check (test_distributed checks the release): a job killed
    before its ranks released DeepSpeed's 66 MB /dev/shm buffers (pretrain.distributed.process) would leave
    them in RAM for good. Files that appeared during this test and that no live process holds go
    when it ends; one a job is still setting up (another test run's, say) stays: DeepSpeed's ranks
    spin forever waiting for a peer's file that disappeared."""
    pattern = f"deepspeed_allreduce_buffer_{os.getuid()}_*"
    before = set(Path("/dev/shm").glob(pattern))
    yield
    new = set(Path("/dev/shm").glob(pattern)) - before
    if new:
        for f in new - _held(new):
            f.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """tests/integration (real jobs, tens of seconds a file) first, the quick unit tests after:
    `make test` hands whole files to two workers in this order (pytest-xdist's loadfile with
    --no-loadscope-reorder), so the many short tests fill the end of the run instead of one worker
    waiting while the other runs a long job alone (xdist's own order, by tests per file, puts the
    one-test jobs last).

    `gpu` tests are a tier of their own (`make test-gpu`), like `cluster`: selected where CUDA is
    present, deselected (not skipped) elsewhere, so a CPU run reports only tests that ran."""
    items.sort(key=lambda item: item.path.parent.name != "integration")  # stable: files keep their order
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if "gpu" not in item.keywords]


# ------------------------------------------------------------------ data pipeline: real shards
# Helpers are handed out as fixtures (``shard_kit``) so test files need not import conftest.
import io  # noqa: E402
import tarfile  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402


def _image_bytes(w: int = 20, h: int = 20, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A real encoded image with some texture (flat images make JPEG checks meaningless)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = (rng.random((h, w, 3)) * 64 + rng.random(3) * 191).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, fmt)
    return buf.getvalue()


def _write_tar(path, samples) -> None:
    """samples: list of (key, {ext: bytes}) written in order, members sorted by extension."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext in sorted(members):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(members[ext])
                tar.addfile(info, io.BytesIO(members[ext]))


def _make_shards(root, shards, classes, multi_label=False, prefix="train"):
    """Write shards (a list of sample lists, see ``_write_tar``) and their manifest.json."""
    from data_pipeline.shards.manifest import FORMAT, VERSION, write_manifest

    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, samples in enumerate(shards):
        name = f"{prefix}-{i:06d}.tar"
        _write_tar(root / name, samples)
        entries.append({"name": name, "samples": len(samples), "bytes": (root / name).stat().st_size})
    write_manifest(root, {"format": FORMAT, "version": VERSION, "split": prefix, "source": "test",
                          "classes": list(classes), "multi_label": multi_label,
                          "total": sum(e["samples"] for e in entries), "shards": entries})
    return root


def _id_shards(root, counts, size=20):
    """Shards whose label *is* the sample's global id, so targets reveal exactly what was read."""
    shards, gid = [], 0
    for c in counts:
        samples = []
        for _ in range(c):
            samples.append((f"{gid:06d}", {"jpg": _image_bytes(size, size, seed=gid), "cls": str(gid).encode()}))
            gid += 1
        shards.append(samples)
    return _make_shards(root, shards, [f"s{i}" for i in range(gid)])


@pytest.fixture(scope="session")
def shard_kit():
    return types.SimpleNamespace(image_bytes=_image_bytes, write_tar=_write_tar,
                                 make_shards=_make_shards, id_shards=_id_shards)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory):
    """Demo images (real JPEGs) in shards: ``demo_shards(n, shard_size)`` is the manifest's path,
    written once per test process for each layout."""
    from dist_utils import demo_manifest

    made = {}

    def get(n: int, shard_size: int):
        if (n, shard_size) not in made:
            made[n, shard_size] = demo_manifest(tmp_path_factory, n, shard_size)
        return made[n, shard_size]

    return get


@pytest.fixture(scope="session")
def shards(demo_shards):
    """The tiny runs' data: 256 demo images in 4 shards of 64, its manifest's path."""
    return demo_shards(256, 64)


@pytest.fixture
def tiny_run(shards, tmp_path):
    """A factory of tiny training jobs (``dist_utils.TinyRun``) on this test's ``shards``, each in
    its own run folder under ``tmp_path``: ``tiny_run("train.steps=4", via="deepspeed", ranks=2,
    name="ref").run()``. ``shards=`` and ``run_dir=`` may be given instead."""
    from dist_utils import TinyRun

    def make(*extra, name="run", **kw):
        kw.setdefault("shards", shards)
        kw.setdefault("run_dir", tmp_path / name)
        return TinyRun(extra=extra, **kw)

    return make


@pytest.fixture(scope="session")
def demo_train(tmp_path_factory):
    """384 demo images in 16 shards of 24 (real procedurally drawn JPEGs)."""
    from data_pipeline.shards.writer import write_demo_shards

    out = tmp_path_factory.mktemp("demo") / "train"
    write_demo_shards(out, split="train", n=384, shard_size=24)
    return out


@pytest.fixture(scope="session")
def balanced_ids(tmp_path_factory):
    """16 shards x 12 samples, label = sample id."""
    return _id_shards(tmp_path_factory.mktemp("ids") / "shards", [12] * 16)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shard_kit):
    """Shards mixing what the training process decodes with what workers decode
    (``decode_samples.mixed_samples``): four shards of 32, five classes."""
    from decode_samples import mixed_samples

    root = tmp_path_factory.mktemp("mixed")
    return shard_kit.make_shards(root, [mixed_samples(32, s) for s in range(4)], [f"c{i}" for i in range(5)])
