"""Decode only the crop window of a JPEG on the CPU: nvImageCodec's libjpeg-turbo backend.

A training sample's random resized crop is drawn from the header's size before any pixel is
decoded (``transforms.SampleTransform``); this module then decodes just that window: libjpeg-turbo
skips the scanlines above it (entropy-decoded, not transformed), stops after its last row, and
transforms only the columns it covers (``jpeg_skip_scanlines`` / ``jpeg_crop_scanline``, as DALI's
``decoders.image_crop`` does). With the default area 0.08-1 about half of an image's pixels go
unused, so this is about half the decode. nvImageCodec (``pip install nvidia-nvimgcodec-cu13``,
NVIDIA's codec library under DALI) needs no GPU or driver for its CPU backend.

The window's pixels are the same as that window of a full decode: the same integer IDCT and fancy
(triangle-filter) chroma upsampling as PIL's and torchvision's libjpeg-turbo, both set here rather
than left to defaults, and libjpeg-turbo decodes the blocks bordering the window that upsampling
reads. ``tests/unit/test_crop_decode.py`` measures it against PIL on real JPEG bytes.

Safety and corrupt samples: callers pass only bytes that ``decode.open_image`` has parsed and checked
(a JPEG, no larger than ``data.max_image_pixels``). A window decode reads only the file up to the
window's last row, and nvImageCodec returns an image for some files whose damage PIL reports as an
error (a stray marker in the entropy-coded data: "unsupported marker type", "two SOF markers"). So
only *plain* files go this way (:func:`plain`): one baseline scan whose coded data holds no marker
but restart markers, then the end-of-image marker at the end of the file. Everything else, and any
file this decoder fails on, is decoded with PIL, which decides as before whether the sample is
corrupt: a cut-short file (the usual damage) lacks its end marker, and damage inside plain coded
data is a warning for libjpeg (garbled blocks), never an error, in PIL as here.

The decoder object is made lazily in the process that uses it (a DataLoader worker, after fork):
nothing of it crosses a fork.
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterator, Optional

import numpy as np

from data_pipeline.errors import ConfigError

__all__ = ["CropDecoder", "plain", "window_size", "decoder", "unavailable", "resolve", "describe"]

_MODULE = "nvidia.nvimgcodec"
_decoders: dict = {}  # pid -> CropDecoder of that process
_SEQUENTIAL = (0xC0, 0xC1)  # SOF0 baseline, SOF1 extended sequential (Huffman): one pass top to bottom


def _segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(marker, position, end) of each marker segment after SOI, up to and including the first SOS
    (start of scan), fill bytes skipped; ends early at anything that is not a segment lying whole
    inside ``data``."""
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        end = pos + 2 + length
        if length < 2 or end > n:
            return
        yield marker, pos, end
        if marker == 0xDA:
            return
        pos = end


def plain(data: bytes) -> bool:
    """Whether ``data`` is a sequential JPEG whose first scan covers the image and whose coded data,
    after that scan's header, holds no marker but restart markers up to an end-of-image marker that
    ends the file (zero bytes after it allowed). Reads the marker segments before the scan (a few
    dozen bytes each), then checks the coded data (:func:`_coded_data_plain`)."""
    if data[:2] != b"\xff\xd8":
        return False
    sequential = False
    for marker, _, end in _segments(data):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header (SOFn)
            sequential = marker in _SEQUENTIAL
        if marker == 0xDA:  # SOS: the coded data starts after its header
            return sequential and _coded_data_plain(data, end)
    return False


# Segments a header may hold for window_size: DHT, DRI, COM (skipped as PIL skips them), and APP0,
# DQT, SOF0/1 (checked as PIL's parser reads them). Anything else (EXIF or XMP in APP1, ICC
# profiles, Adobe's APP14, other frame types) sends the file to PIL.
_SKIPPED = frozenset((0xC4, 0xDD, 0xFE))


def window_size(data: bytes) -> Optional[tuple[int, int]]:
    """(width, height) of a JPEG that the window decode takes, from one walk over its markers; None
    for any other file (then PIL opens it, and :func:`plain` decides). A size here means: what
    :func:`plain` accepts, one frame header of 8-bit samples with 1 or 3 components, no marker
    segment but those PIL reads without a possible error or a side effect on orientation or colour
    (so ``PIL.Image.open`` gives a JPEG of that size in mode L or RGB, EXIF orientation 1). Each
    segment must lie inside the file."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    size = None
    for marker, pos, end in _segments(data):
        length = end - pos - 2
        if marker == 0xDA:  # SOS: the coded data follows its header
            return size if size is not None and _coded_data_plain(data, end) else None
        if marker in _SEQUENTIAL:  # SOF0/SOF1: precision, height, width, components
            components = data[pos + 9] if length >= 8 else 0
            if size is not None or components not in (1, 3) or length != 8 + 3 * components or data[pos + 4] != 8:
                return None
            height, width = (data[pos + 5] << 8) | data[pos + 6], (data[pos + 7] << 8) | data[pos + 8]
            if not (width and height):
                return None
            size = (width, height)
        elif marker == 0xDB:  # DQT: whole tables of 8- or 16-bit entries, as PIL reads them
            at = pos + 4
            while at < end:
                table = 1 + 64 * (1 + (data[at] >> 4))
                if data[at] >> 4 > 1 or (data[at] & 15) > 3 or at + table > end:
                    return None
                at += table
        elif marker == 0xE0:  # APP0: PIL reads a JFIF version at bytes 5..6
            if data.startswith(b"JFIF", pos + 4) and length < 2 + 7:
                return None
        elif marker not in _SKIPPED:
            return None
    return None


def _coded_data_plain(data: bytes, start: int) -> bool:
    """Whether the coded data from ``start`` holds no marker but stuffed 0xFF bytes (FF00) and
    restart markers (FFD0..FFD7), and ends with the end-of-image marker FFD9, zero bytes after it
    allowed. The 0xFF bytes are found with numpy (about 30 us for 180 KB)."""
    coded = np.frombuffer(data, np.uint8, count=len(data.rstrip(b"\x00")))[start:]
    at = np.flatnonzero(coded[:-1] == 0xFF)  # each 0xFF and the byte after it
    after = coded[at + 1]
    # FF00 is a stuffed 0xFF, FFD0..FFD7 a restart marker; the last one must be FFD9 at the end
    return at.size > 0 and at[-1] == coded.size - 2 and after[-1] == 0xD9 \
        and bool(((after[:-1] == 0) | ((after[:-1] >= 0xD0) & (after[:-1] <= 0xD7))).all())


def _quietly(make):
    """``make()`` with file descriptor 2 sent to a temporary file: nvImageCodec prints a few lines
    for each GPU library it cannot load (nvJPEG, nvJPEG2000, nvTIFF), which the CPU backend does not
    use. What it printed joins the error when ``make`` fails."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            return make()
        except ImportError:
            raise
        except Exception as e:
            os.dup2(saved, 2)
            sink.seek(0)
            raise RuntimeError(f"{type(e).__name__}: {e}; {sink.read().decode(errors='replace')[-500:]}") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class CropDecoder:
    """``decoder(data, top, left, h, w)`` -> uint8 (h, w, 3) RGB array of that window of the image
    (grey JPEGs replicated to three channels), or None when the file does not decode."""

    def __init__(self):
        # nvImageCodec's own log (a warning per failed file) off unless the user asked for it
        os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")

        def make():
            from nvidia import nvimgcodec

            decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                         backends=[nvimgcodec.Backend(nvimgcodec.CPU_ONLY)],
                                         options=":fancy_upsampling=1 :fast_idct=0")
            return nvimgcodec, decoder

        self._nv, self._decoder = _quietly(make)
        self._params = self._nv.DecodeParams(apply_exif_orientation=False, color_spec=self._nv.SRGB,
                                             allow_any_depth=False)
        self.version = self._nv.__version__

    def __call__(self, data: bytes, top: int, left: int, h: int, w: int) -> Optional[np.ndarray]:
        nv = self._nv
        try:
            stream = nv.CodeStream(data)
            if (top, left, h, w) != (0, 0, stream.height, stream.width):
                stream = stream.get_sub_code_stream(region=nv.Region(start=(top, left), end=(top + h, left + w)))
            image = self._decoder.decode(stream, params=self._params)
        except RuntimeError:  # a header it cannot parse, a window outside the image
            return None
        if image is None:  # nvImageCodec's answer for a file that fails to decode
            return None
        out = np.asarray(image)  # a view: the array keeps the image alive
        if out.ndim != 3 or out.shape != (h, w, 3):
            return None
        return out


def unavailable() -> Optional[str]:
    """Why the crop decoder cannot run in this process (None: it can). Imports nvImageCodec."""
    try:
        decoder()
    except ImportError as e:
        return f"{_MODULE} does not import ({e}); pip install nvidia-nvimgcodec-cu13"
    except RuntimeError as e:
        return f"{_MODULE} imports but its CPU decoder does not start: {e}"
    return None


def decoder() -> CropDecoder:
    """This process's decoder (made on first use: after fork in a worker)."""
    pid = os.getpid()
    if pid not in _decoders:
        _decoders.clear()  # a forked child drops its parent's entry
        _decoders[pid] = CropDecoder()
    return _decoders[pid]


def resolve(choice: str, key: str = "data.worker_decoder") -> str:
    """``auto`` -> ``nvimgcodec`` when its decoder starts here, else ``pil``; ``nvimgcodec`` that
    cannot start is a one-line ``ConfigError`` naming ``key`` and why."""
    if choice == "pil":
        return "pil"
    if choice not in ("auto", "nvimgcodec"):
        raise ConfigError(f"{key}: {choice!r}; use auto, nvimgcodec or pil")
    why = unavailable()
    if choice == "nvimgcodec" and why is not None:
        raise ConfigError(f"{key}: nvimgcodec, but {why}")
    return "nvimgcodec" if why is None else "pil"


def describe(choice: str) -> str:
    """The worker decode path ``data.worker_decoder=choice`` resolves to, in words, for the start-up
    log (``choice`` already resolved: ``nvimgcodec`` or ``pil``)."""
    if choice == "nvimgcodec":
        return f"crop window only (nvImageCodec {decoder().version}, libjpeg-turbo on the CPU)"
    return "whole image (PIL, DCT-scaled at 1/2..1/8 when the crop has at least twice the pixels per side)"
