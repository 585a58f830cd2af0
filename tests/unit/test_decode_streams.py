"""data.decode_device: cuda, its logic on the CPU: the prefetch on a side stream ordered by
events (its stream calls recorded instead of made), no host reads, the batched crop against the
per-sample one, and the same batches as the cpu path."""
import collections
import contextlib
import functools
import io
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from decode_samples import broken_jpegs, calm_and_busy, decode_cfg, encode_image, run_loader  # noqa: E402
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from data_pipeline.config import AugmentConfig
from data_pipeline.errors import TooManyCorruptSamples
from data_pipeline.loading.batch.crop_atlas import crop_batch
from data_pipeline.loading.batch.decode import BatchDecoder
from data_pipeline.loading.batch.prefetch import finish
from data_pipeline.loading.batch.record import BatchRecord
from data_pipeline.loading.batch.wire import DeferredBatch
from data_pipeline.loading.cuda_streams import decode_jpeg
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.transforms import Deferred, SampleTransform


# ------------------------------------------------- data.decode_device: cuda, its logic on the CPU
# The cuda path (one batch ahead on a side stream, ordered by events; one roi_align per batch) runs
# here for real on CPU tensors; only the CUDA runtime under CudaStreams' interface is stood in for.
class RecordingStreams:
    """Stands in for CudaStreams (the CUDA runtime) and logs each call in order: ("use", s) ...
    ("end", s) around the work a stream is current for, ("record", s, event), ("wait", s, event),
    ("record_stream", s, id(tensor)), ("upload", current stream), ("take", current stream) (a DALI
    pipeline's output, taken on the host)."""
    compute, side, decode = "compute", "side", "decode"

    def __init__(self, log: list):
        self.log, self.current, self.events = log, ["compute"], 0

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("use", stream))
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()
            self.log.append(("end", stream))

    def record(self, stream):
        self.events += 1
        self.log.append(("record", stream, f"ev{self.events}"))
        return f"ev{self.events}"

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream, id(tensor)))

    def upload(self, tensor):
        self.log.append(("upload", self.current[-1]))
        return tensor

    def take(self, pipe):
        from data_pipeline.loading.dali_decode import host_output

        self.log.append(("take", self.current[-1]))
        return host_output(pipe)


@pytest.fixture
def as_on_cuda(monkeypatch):
    """Loaders built with decode_device=cpu run the cuda path (prefetch, batched crop) on the CPU
    with RecordingStreams; decode_jpeg calls are logged as ("decode", current stream, outputs)."""
    from data_pipeline.loading import loader
    from data_pipeline.loading.batch import decode as batch_decode

    log = []
    streams = RecordingStreams(log)
    monkeypatch.setattr(loader, "BatchDecoder", functools.partial(BatchDecoder, streams=streams, batched=True))
    decode = batch_decode.decode_jpeg

    def logged(data, device):
        out = decode(data, device)
        log.append(("decode", streams.current[-1], len(out) if isinstance(data, list) else 1))
        return out

    monkeypatch.setattr(batch_decode, "decode_jpeg", logged)
    return log


SIZES = [(40, 48), (48, 40), (36, 60), (60, 36), (44, 44), (20, 70)]  # (h, w); 20x70: longer than 4 x 16


def _smooth_jpeg(h: int, w: int, i: int) -> bytes:
    """Gradients and a wave: where resampling methods agree to a grey level or two (on noise they
    differ at crop edges by tens of levels, see test_cuda_batch_decode_matches_cpu)."""
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([xx * 4 + i, yy * 5, (xx + yy) * 2 + 3 * i + 20 * np.sin(xx / 4.0)], -1)
    return encode_image(arr.clip(0, 255).astype(np.uint8), "JPEG", quality=90)


@pytest.fixture(scope="module")
def smooth(tmp_path_factory, shard_kit):
    root = tmp_path_factory.mktemp("smooth")
    shards = [[(f"{s:02d}{i:04d}", {"jpg": _smooth_jpeg(*SIZES[i % len(SIZES)], i), "cls": str(i % 5).encode()})
               for i in range(32)] for s in range(4)]
    return shard_kit.make_shards(root, shards, [f"c{i}" for i in range(5)])


def _levels(a, b):
    """|a - b| of two normalised batches in grey levels (AugmentConfig's std: 0.5)."""
    return (a - b).abs() * 0.5 * 255


def test_cuda_path_orders_each_batch_by_events(smooth, as_on_cuda):
    """Per batch: the side stream waits on an event of the compute stream before any work of the
    batch; nvJPEG runs with the decode stream current, the side stream waits on its event and every
    decoded image is marked as read there; uploads go on the side stream; an event on the side
    stream closes the batch. Batch N+1 is issued before batch N is handed out; the compute stream
    waits on batch N's event, and images and targets are marked as read there, before the caller
    gets them."""
    log = as_on_cuda
    loader = build_loader(decode_cfg(smooth, "cpu", workers=0), batch_size=8, img_size=16)
    got = []
    for k, (x, y) in enumerate(loader):
        log.append(("got", k, id(x), id(y)))
        got.append((x, y))  # held, so that ids stay theirs
        if k == 4:
            break
    starts = [i for i, e in enumerate(log) if e[:2] == ("record", "compute")]
    ends = [i for i, e in enumerate(log) if e[:2] == ("record", "side")]
    handed = [i for i, e in enumerate(log) if e[0] == "got"]
    assert len(starts) == len(ends) == 6 and len(handed) == 5  # batches 0-4 handed out, 5 issued
    for s, e in zip(starts, ends):
        issue = log[s:e + 1]
        assert issue[1] == ("wait", "side", log[s][2]) and issue[2] == ("use", "side") and issue[-2] == ("end", "side")
        assert not [x for x in issue if x[0] in ("got", "record_stream", "wait") and x[1] == "compute"]
        assert {x[1] for x in issue if x[0] == "upload"} <= {"side"}
        decodes = [j for j, x in enumerate(issue) if x[0] == "decode"]
        assert decodes and all(issue[j][1] == "decode" for j in decodes)
        after = issue[decodes[-1] + 1:]  # nvJPEG's outputs: ordered before the side stream reads them
        n = sum(issue[j][2] for j in decodes)
        assert after[0] == ("end", "decode") and after[1][:2] == ("record", "decode")
        assert after[2] == ("wait", "side", after[1][2])
        assert [x[:2] for x in after[3:3 + n]] == [("record_stream", "side")] * n
    for k, (h, (x, y)) in enumerate(zip(handed, got)):
        assert ends[k + 1] < h  # batch k+1 was issued (decode included) before batch k was handed out
        assert log[h - 3:h] == [("wait", "compute", log[ends[k]][2]), ("record_stream", "compute", id(x)),
                                ("record_stream", "compute", id(y))]
        assert x.shape == (8, 3, 16, 16) and torch.isfinite(x).all()


def test_cuda_path_reads_nothing_on_the_host(smooth, as_on_cuda, monkeypatch):
    """No tensor read on the host and no synchronize in the training process while batches are
    decoded, cropped, normalised and mixed, after start-up (counted as tests/integration/test_host_sync.py
    counts; the worker runs in its own process). RandAugment (per sample, its draws on the host) is
    not part of this check."""
    counts = collections.Counter()

    def counting(owner, name):
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            f = sys._getframe(1)
            counts[f"{name} from {f.f_code.co_filename}:{f.f_code.co_name}"] += 1
            return orig(*a, **k)
        monkeypatch.setattr(owner, name, wrapper)

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__"):
        counting(torch.Tensor, name)
    counting(torch.cuda, "synchronize")
    counting(torch.cuda.Stream, "synchronize")
    counting(torch.cuda.Event, "synchronize")
    loader = build_loader(decode_cfg(smooth, "cpu", workers=1, mixup_alpha=0.8, cutmix_alpha=1.0), batch_size=8,
                          img_size=16)
    for n, (x, y) in enumerate(loader, 1):
        assert x.shape == (8, 3, 16, 16) and y.shape == (8, 5)
        if n == 1:  # start-up: the DataLoader iterator draws its base seed (a host generator's .item())
            counts.clear()
        if n == 7:
            break
    assert not counts, dict(counts)  # batches 3 to 8 finished (issued one ahead), 2 to 7 handed out


def _deferred_batch(train: bool, n: int):
    """n smooth JPEGs as the worker ships them (boxes and flips drawn from their seeds): the first
    five SIZES in turn, a worker-decoded sample at row 1 and the long one (20x70) at row 2."""
    tf = SampleTransform(AugmentConfig(), 16, train)
    samples = []
    for i in range(n):
        data = _smooth_jpeg(*(SIZES[5] if i == 2 else SIZES[i % 5]), i)
        samples.append(tf.defer(Image.open(io.BytesIO(data)), data, seed=i))
    samples[1] = torch.full((3, 16, 16), 100, dtype=torch.uint8)
    return tf, DeferredBatch.pack(samples, None)


def _record(train: bool, n: int, epoch: int = 0) -> BatchRecord:
    return BatchRecord(train, 0, {"counts": {}, "bad_by_shard": {}}, epoch, keys=[str(i) for i in range(n)],
                       shards=["s"] * n)


def _finish(decoder, batch):
    return decoder(batch, torch.arange(len(batch.items)) % 5, _record(decoder.transform.train, len(batch.items)))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batched_crop_matches_the_per_sample_crop(train):
    """The cuda path's crop (one roi_align: area average; framed by each image's own edge) against
    the cpu path's (torch's antialiased resize of the crop alone), on the same libjpeg-turbo pixels:
    random crops and flips (train) or resize + center crop (eval), landscape, portrait and square
    images, a worker-decoded row and one image too long for the atlas: within a grey level on
    average. A box off by a pixel or a wrong flip is far outside that."""
    tf, batch = _deferred_batch(train, 18)
    want, _ = _finish(BatchDecoder(tf, AugmentConfig(), "cpu", 10 ** 8, 5), batch)
    got, _ = _finish(BatchDecoder(tf, AugmentConfig(), "cpu", 10 ** 8, 5, batched=True), batch)
    d = _levels(want, got)
    assert want.shape == got.shape == (18, 3, 16, 16)
    assert d.mean() < 0.5 and d.max() <= 3.01, (d.mean(), d.max())
    assert torch.equal(want[1], got[1])
    # the discrimination of that bound, on crop_batch itself
    items = [it for it in batch.items if isinstance(it, Deferred) and max(it.size) <= 64]
    pixels = [decode_jpeg(batch.file(it), torch.device("cpu")) for it in items]
    dec = BatchDecoder(tf, AugmentConfig(), "cpu", 10 ** 8, 5)
    ref = torch.stack([tf.finish(px, it) for px, it in zip(pixels, items)]).float()
    boxes, flips = [dec._box(it) for it in items], [it.flip for it in items]
    assert (ref - crop_batch(pixels, boxes, flips, 16)).abs().mean() < 0.5  # grey levels
    off = [(top + 1, left, h, w) for top, left, h, w in boxes]
    assert (ref - crop_batch(pixels, off, flips, 16)).abs().mean() > 2
    assert (ref - crop_batch(pixels, boxes, [not f for f in flips], 16)).abs().mean() > 5


class _Kernels(TorchDispatchMode):
    """Counts the operators that run kernels (views aside), by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace != "image":  # decode: one batched call on CUDA
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_batched_crop_kernels_do_not_grow_with_the_batch():
    """The same operators, as often, for a batch of 6 as for 24: no per-sample kernel in the cuda
    path's crop, resize, flip, scatter and normalisation (one roi_align, no interpolate)."""
    counts = []
    for n in (6, 24):
        tf, batch = _deferred_batch(True, n)
        with _Kernels() as k:
            out, _ = _finish(BatchDecoder(tf, AugmentConfig(), "cpu", 10 ** 8, 5, batched=True), batch)
        assert out.shape == (n, 3, 16, 16)
        counts.append(k.counts)
    # the one sample too long for the atlas (20x70, a side over 4 x 16) is cropped alone in both
    assert counts[0] == counts[1] and counts[0]["torchvision.roi_align"] == 1, counts
    assert counts[0]["aten._upsample_bilinear2d_aa"] == 1 and not [n for n in counts[0] if "grid_sampler" in n]
    pixels = [torch.randint(0, 255, (3, h, w), dtype=torch.uint8) for h, w in SIZES[:5] * 4]
    per_batch = []
    for n in (5, 20):
        with _Kernels() as k:
            crop_batch(pixels[:n], [(1, 2, 10, 12)] * n, [i % 2 == 0 for i in range(n)], 16)
        per_batch.append(sum(k.counts.values()))
    assert per_batch[0] == per_batch[1] <= 12, per_batch


@pytest.mark.parametrize("aug", [{}, {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}], ids=["crop-flip", "mixup-cutmix"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_cuda_path_on_cpu_gives_the_cpu_paths_batches(tmp_path, shard_kit, monkeypatch, aug, train):
    """Prefetched and batch-cropped, the same samples in the same order as the cpu path: keys,
    targets, counters and resume state exactly (a JPEG that fails to decode included), pixels
    within the resampling difference."""
    samples = [(f"{i:04d}", {"jpg": _smooth_jpeg(*SIZES[i % len(SIZES)], i), "cls": str(i % 5).encode()})
               for i in range(40)]
    root = shard_kit.make_shards(tmp_path / "s", [broken_jpegs(samples, at=(7, 27))], [f"c{i}" for i in range(5)])
    want_loader, want = run_loader(decode_cfg(root, "cpu", workers=2, **aug), train=train, batches=4)
    from data_pipeline.loading import loader

    monkeypatch.setattr(loader, "BatchDecoder", functools.partial(
        BatchDecoder, streams=RecordingStreams([]), batched=True))
    got_loader, got = run_loader(decode_cfg(root, "cpu", workers=2, **aug), train=train, batches=4)
    assert [k for *_, k in got] == [k for *_, k in want] and len(got) == len(want) >= 3
    for (a, ta, _), (b, tb, _) in zip(want, got):
        assert torch.equal(ta, tb) and a.shape == b.shape
        assert _levels(a, b).mean() < 0.5 and _levels(a, b).max() <= 3.01
    assert got_loader.counters == want_loader.counters and got_loader.counters["corrupt_image"] >= 1
    if train:
        assert got_loader.state() == want_loader.state()


def test_randaugment_on_the_batched_crop():
    """RandAugment runs sample by sample after the batched crop and flip, replaying each sample's
    draws: the same ops as the cpu path. Its thresholds (posterize, solarize, equalize) can turn a
    grey level of resampling difference into tens, so the bound is on most samples; with other ops
    (no RandAugment, say) samples differ by tens of levels."""
    _, batch = _deferred_batch(True, 24)  # the crop and flip draws come before RandAugment's
    tf = SampleTransform(replace(AugmentConfig(), randaugment_ops=2, randaugment_magnitude=9), 16, True)
    want, _ = _finish(BatchDecoder(tf, AugmentConfig(), "cpu", 10 ** 8, 5), batch)
    got, _ = _finish(BatchDecoder(tf, AugmentConfig(), "cpu", 10 ** 8, 5, batched=True), batch)
    per_sample = _levels(want, got).mean((1, 2, 3))
    assert torch.isfinite(got).all() and (per_sample < 2).sum() >= 20, per_sample


def test_an_error_finishing_the_next_batch_is_raised_in_batch_order():
    """The prefetcher finishes batch N+1 before handing out N; an error there (no JPEG of a first
    batch decoded, say) reaches the caller when it asks for N+1, after N."""
    tf, batch = _deferred_batch(True, 4)
    calls = []

    class Failing(BatchDecoder):
        def __call__(self, batch, targets, record):
            calls.append(record.epoch)
            if record.epoch == 1:
                raise TooManyCorruptSamples("batch 1")
            return super().__call__(batch, targets, record)

    decoder = Failing(tf, AugmentConfig(), "cpu", 10 ** 8, 5, streams=RecordingStreams([]), batched=True)
    records = [_record(True, 4, epoch=n) for n in range(3)]  # the epoch field tells the batches apart
    it = finish(decoder, iter([(batch, torch.zeros(4, dtype=torch.int64), r) for r in records]))
    x, _, r = next(it)
    assert r.epoch == 0 and x.shape == (4, 3, 16, 16) and calls == [0, 1]
    with pytest.raises(TooManyCorruptSamples, match="batch 1"):
        next(it)


@pytest.mark.gpu
def test_cuda_prefetch_is_ordered_by_events_alone(smooth):
    """With the compute stream kept busy after each batch (as a training step keeps it), batches
    finished one ahead on the side stream equal those of a run that drains the device after each
    batch; and after start-up no torch call synchronises (sync debug mode set to error; torchvision's
    own wait for nvJPEG, inside its decode, is not a torch call)."""
    calm_and_busy(lambda: build_loader(decode_cfg(smooth, "cuda", mixup_alpha=0.8, cutmix_alpha=1.0), batch_size=8,
                                       img_size=16))
