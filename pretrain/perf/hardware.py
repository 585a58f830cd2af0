"""The hardware the performance model prices a job on: GPU types (data-sheet peaks, memory,
bandwidths and the one calibrated efficiency constant per type) and interconnect presets, and how a
CUDA device name or a GPU type maps onto them. Numbers only, no torch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class GPU:
    peak_tflops: float  # dense bf16 tensor-core peak (data sheet, no sparsity)
    memory_gb: float  # what the device reports (nvidia-smi's MiB / 1024): GiB, the unit of every estimate
    hbm_gbs: float  # memory bandwidth, GB/s
    link_gbps: float  # a GPU's own intra-node link, one direction, Gbit/s (NVLink or PCIe)
    efficiency: float  # achieved fraction of peak on large ViT matmuls (the one constant per type)
    calibration: str  # where efficiency comes from
    sms: int = 0  # streaming multiprocessors (data sheet): a GEMM's tiles fill them in waves; 0: not modelled


# memory_gb: the capacity nvidia-smi reports, where a report was found (MiB / 1024): A100 80GB 81,920 MiB,
# A100 40GB 40,960, L40S 46,068 (modal-labs/modal-client#2797), H100 80GB HBM3 81,559 (NVIDIA/nccl#1264),
# H100 NVL 95,830 (NVIDIA/gpu-admin-tools#4), H200 143,771 (benchmarks/results/vit-train-h200.md), B200
# 183,359 (NVIDIA/TensorRT-LLM#10278), RTX 3090 24,576 (noonghunna/club-3090#1128) and RTX 4090 24,564
# (RLinf/RLinf#255); H100 PCIe and H200 NVL carry the data sheet's GB until a report is found.
# efficiency: A100 and H100 are solved by ``pretrain.perf.published.calibrate`` from one published point each (the
# test recomputes them); the other types borrow from the closest calibrated architecture.
GPUS: dict[str, GPU] = {
    "a100-40gb": GPU(312.0, 40960 / 1024, 1555, 2400, 0.581, "borrowed from a100-80gb (same SMs and clocks)", sms=108),
    "a100-80gb": GPU(312.0, 81920 / 1024, 2039, 2400, 0.581,
                     "calibrated: NeMo ViT-g/14, 8 x A100-80GB, 693 img/s", sms=108),
    "h100-sxm": GPU(989.4, 81559 / 1024, 3350, 3600, 0.398,
                    "calibrated: NeMo ViT-g/14, 8 x H100, 1,428 img/s", sms=132),
    # the PCIe cards: lower clocks and power, GPUs joined by PCIe Gen5 x16 (NVLink bridges pair them at most)
    "h100-pcie": GPU(756.0, 80, 2000, 512, 0.398, "borrowed from h100-sxm (Hopper SMs)", sms=114),
    "h100-nvl": GPU(835.0, 95830 / 1024, 3900, 512, 0.398, "borrowed from h100-sxm (Hopper SMs)", sms=132),
    "h200-nvl": GPU(835.0, 141, 4800, 512, 0.398, "borrowed from h100-sxm (Hopper SMs)", sms=132),
    "h200": GPU(989.4, 143771 / 1024, 4800, 3600, 0.398, "borrowed from h100-sxm (same Hopper SMs)", sms=132),
    "b200": GPU(2250.0, 183359 / 1024, 8000, 7200, 0.398, "borrowed from h100-sxm (no published ViT point)", sms=148),
    "l40s": GPU(362.0, 46068 / 1024, 864, 256, 0.581, "borrowed from a100-80gb (no published ViT point)", sms=142),
    "rtx3090": GPU(71.0, 24576 / 1024, 936, 256, 0.581, "borrowed from a100-80gb (bf16 with fp32 accumulate)", sms=82),
    "rtx4090": GPU(165.2, 24564 / 1024, 1008, 256, 0.581,
                   "borrowed from a100-80gb (bf16 with fp32 accumulate)", sms=128),
}


@dataclass(frozen=True)
class Network:
    """A node preset: its links, and the CPU cores its loaders share (physical cores)."""
    intra_gbps: Optional[float]  # per GPU, one direction; None: the GPU's own link
    inter_gbps: float  # per node, all NICs together, one direction
    note: str = ""
    cpu_cores: int = 64


NETWORKS: dict[str, Network] = {
    "dgx-a100": Network(2400, 8 * 200, "NVLink 3 (300 GB/s per GPU), 8 x 200 Gb/s HDR InfiniBand per node; "
                        "2 x AMD EPYC 7742 (128 cores)", 128),
    "dgx-h100": Network(3600, 8 * 400, "NVLink 4 (450 GB/s per GPU), 8 x 400 Gb/s NDR InfiniBand per node; "
                        "2 x Xeon Platinum 8480C (112 cores)", 112),
    "pcie-100gbe": Network(256, 100, "PCIe 4.0 x16 between GPUs, one 100 Gb/s Ethernet NIC per node; "
                           "64 cores assumed", 64),
}


def gpu_of(layout) -> GPU:
    """The GPU of a ``pretrain.perf.perfmodel.Layout``: its :data:`GPUS` entry with the layout's
    overrides (peak, bandwidth, memory, efficiency); a type not in the table needs ``peak_tflops``."""
    if layout.gpu not in GPUS and layout.peak_tflops is None:
        raise KeyError(f"unknown GPU {layout.gpu!r}; known: {', '.join(GPUS)}")
    g = GPUS.get(layout.gpu, GPU(0, 0, 0, 0, 1.0, "given"))
    return replace(g, peak_tflops=layout.peak_tflops or g.peak_tflops, hbm_gbs=layout.hbm_gbs or g.hbm_gbs,
                   memory_gb=layout.memory_gb or g.memory_gb,
                   efficiency=layout.efficiency if layout.efficiency is not None else g.efficiency)


# nccl-tests bus bandwidth against the line rate: NVLink about 0.8 (A100 all-reduce ~235 of
# 300 GB/s), InfiniBand/RoCE about 0.9 (8 x HDR nodes ~180 of 200 GB/s).
LINK_EFFICIENCY = {"intra": 0.8, "inter": 0.9}
# Fixed cost of one collective (kernel launch, ring set-up, first chunk's hops), seconds.
LATENCY_S = {"intra": 15e-6, "inter": 40e-6}


def ring_link(world: int, gpus_per_node: int, gpu: Optional[str], network: Optional[str] = None) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in s) of the slowest link a ring of ``world`` ranks
    crosses (``gpus_per_node`` to a node), from ``network`` or the GPU type's usual preset (an H100
    DGX where the type is unknown)."""
    key = gpu if gpu in GPUS else "h100-sxm"
    net = NETWORKS[network or default_network(key)]
    if world > max(1, gpus_per_node):
        return net.inter_gbps / 8 * 1e9 * LINK_EFFICIENCY["inter"], LATENCY_S["inter"]
    intra = min(net.intra_gbps or GPUS[key].link_gbps, GPUS[key].link_gbps)
    return intra / 8 * 1e9 * LINK_EFFICIENCY["intra"], LATENCY_S["intra"]


# CUDA device names (torch.cuda.get_device_name) -> GPUS keys, most specific first
DEVICE_NAMES = [("A100", "40GB", "a100-40gb"), ("A100", "", "a100-80gb"), ("H100", "PCIe", "h100-pcie"),
                ("H100", "NVL", "h100-nvl"), ("H100", "", "h100-sxm"), ("H200", "NVL", "h200-nvl"),
                ("H200", "", "h200"), ("B200", "", "b200"), ("L40S", "", "l40s"), ("3090", "", "rtx3090"),
                ("4090", "", "rtx4090")]


def gpu_key(device_name: str) -> Optional[str]:
    """The :data:`GPUS` key of a CUDA device name, e.g. 'NVIDIA H100 80GB HBM3' -> 'h100-sxm'."""
    for part, extra, key in DEVICE_NAMES:
        if part in device_name and extra in device_name:
            return key
    return None


def default_network(gpu: str) -> str:
    """The interconnect preset a GPU type usually comes with (DGX nodes; PCIe boxes otherwise)."""
    if gpu.startswith("a100"):
        return "dgx-a100"
    return "dgx-h100" if gpu in ("h100-sxm", "h200", "b200") else "pcie-100gbe"
