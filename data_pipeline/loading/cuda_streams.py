"""The CUDA side of training-process decode (``data.decode_device: cuda``, and ``dali`` on a GPU):
the streams a batch's work runs on and the only calls that order them (:class:`CudaStreams`), and
nvJPEG's call with the stream rule it needs (:func:`decode_jpeg`). ``batch.decode`` and ``batch.prefetch``
reach CUDA's ordering through these alone, so a recording stand-in checks that order on a machine
without a GPU (tests/unit/test_decode_streams.py)."""
from __future__ import annotations

import warnings

import torch

# torchvision 0.29 deprecates its codecs for TorchCodec (not one of our dependencies); decode_jpeg
# still works, and its warning would come once per batch.
warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision.io.image")


def decode_jpeg(data, device: torch.device):
    """torchvision's decode_jpeg to RGB (``data``: one uint8 file tensor or a list of them).

    On CUDA, nvJPEG writes on a private stream of torchvision's that waits for nothing of the
    caller's, into blocks taken from the caching allocator on the caller's *current* stream, which
    may be handed a block that kernels still queued there read (pytorch/vision#9606,
    meta-pytorch/torchcodec#1634). So call it only with :attr:`CudaStreams.decode` current, a stream
    that allocates nothing else, and ``record_stream`` every output on the stream that reads it
    (``BatchDecoder._decode``): the allocator then hands a block back to nvJPEG only once that
    stream has passed the point where the block was freed. torchvision synchronises its private
    stream before returning: the calling thread waits for the decode itself, not for any stream of
    ours."""
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as tv_decode_jpeg

    return tv_decode_jpeg(data, mode=ImageReadMode.RGB, device=device)



class CudaStreams:
    """The streams of ``data.decode_device: cuda`` (and of ``dali`` on a GPU) and the only calls
    that order them. The prefetcher (``prefetch.finish``) and the decoder reach CUDA's
    ordering through these methods alone, so a recording stand-in can check their order on a
    machine without a GPU.

    ``compute``: the training step's stream (the one current when the loader was built).
    ``side``: uploads, crops, normalises and mixes the next batch (and takes DALI's output:
    :meth:`take`). ``decode``: current only while nvJPEG's call allocates its outputs (see
    :func:`decode_jpeg`); nothing runs on it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self.decode = torch.cuda.Stream(device)

    def use(self, stream):
        """Context in which ``stream`` is current (where kernels and allocations go)."""
        return torch.cuda.stream(stream)

    def record(self, stream) -> torch.cuda.Event:
        """An event marking the work queued on ``stream`` so far."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        """Work queued on ``stream`` from now on starts after ``event`` (on the device; the host goes on)."""
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """``tensor`` (allocated on another stream) is used on ``stream``: once freed, its memory is
        reused only after ``stream`` has passed that point."""
        tensor.record_stream(stream)

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, copied on the current stream without holding the host: from
        pinned memory (pinned here if it is not; the pinned-memory cache serves it after warm-up)."""
        return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(self.device, non_blocking=True)

    def take(self, pipe) -> torch.Tensor:
        """The output of a DALI pipeline's run (``dali_decode.DaliCrop``) as a uint8 torch tensor on
        the current stream, with no host wait on the device: DALI binds its outputs to that stream
        (the stream waits on DALI's event; DALI frees their memory in that stream's order), the tensor
        is allocated there by torch's caching allocator, and the device-to-device copy into it is
        queued there, before DALI's buffer is let go. The host waits only for DALI's own CPU work
        (parsing, Huffman decoding, queueing its kernels), as for nvJPEG's call."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        stream = torch.cuda.current_stream(self.device)
        (out,) = pipe.outputs(cuda_stream=stream)
        dense = out.as_tensor()
        return feed_ndarray(dense, torch.empty(dense.shape(), dtype=torch.uint8, device=self.device),
                            cuda_stream=stream)
