"""The GPUs a pipeline file can name (`cluster.gpu`), with the numbers the planner needs.

Pure data, no torch: `python -m pipeline plan` runs on login nodes.

Where the numbers come from
- memory_gib: what the CUDA driver hands to a process, i.e. the `total_memory`
  that `torch.cuda.get_device_properties` reports (nvidia-smi's total minus what
  the driver keeps, ECC on), rounded down to 0.1 GiB. An "80 GB" A100 or H100
  gives ~79.2-79.3 GiB, an RTX 4090 23.6 GiB. The CUDA context and allocator
  fragmentation are NOT subtracted here; the planner adds them as a workspace item.
- bf16_tflops: dense (no 2:4 sparsity) tensor-core peak with fp32 accumulation,
  from NVIDIA's data sheets and architecture whitepapers: A100 312, H100 SXM 989,
  H100 PCIe 756, H200 989 (same GH100 compute as H100 SXM), L40S 362, RTX A6000
  154.8. GeForce cards run bf16/fp16 with fp32 accumulation at half their
  fp16-accumulate rate, which is what training uses: RTX 4090 165.2 (330 with fp16
  accumulate), RTX 3090 71 (142). V100 has no bf16 tensor cores (None): bf16 runs
  at the fp32 rate there; fp16 gets 125.
- fp32_tflops: plain CUDA-core fp32, since PyTorch leaves TF32 matmuls off by
  default (`torch.backends.cuda.matmul.allow_tf32 = False`).
- interconnect / link_gbs: how GPUs of one node talk. NVLink parts get the bus
  bandwidth NCCL typically reaches for all-gather / reduce-scatter (A100 NVLink3
  ~200 GB/s, H100/H200 NVLink4 ~350, V100 NVLink2 ~100); PCIe parts ~20 GB/s with
  peer-to-peer (data-center cards), ~10 GB/s for GeForce cards whose driver
  disables peer-to-peer so traffic bounces through host memory.
- host_link_gbs: pinned host<->GPU copy rate over PCIe (Gen4 x16 ~20 GB/s in
  practice, Gen5 ~40, consumer boards sharing lanes ~12).
- memory_bandwidth_gbs: HBM/GDDR bandwidth, as the datasheet gives it.
- measured_memory_bandwidth_gbs: what a GPU on record really moves: a 1 GiB device-to-device
  copy, bytes read + written per second, the figure `python -m pipeline calibrate` measures
  (H100 2,589 GB/s on 2026-11-26, 77% of the 3,350 datasheet). The planner's memory-bound
  terms (the loss, the optimizer step, LoRA, decoding) are bytes over THIS figure: their
  bytes-per-X constants (pipeline/plan/rates.py) are fitted on it, so a calibration of the
  same kind of GPU changes them little. Other GPUs are planned at MEMORY_FRACTION of their
  datasheet bandwidth, as MATMUL_FRACTION does for matmuls.
- measured_host_link_gbs: the slower direction of a pinned 1 GiB host<->GPU copy where a
  GPU on record measured it (H100 55.2 GB/s on 2026-11-26, PCIe Gen5); else host_link_gbs.
- host_memory_gib / network_gbs: a typical node of that GPU (DGX A100 1 TB,
  DGX H100/H200 2 TB, 8x200 Gb/s InfiniBand; PCIe servers 256-512 GB, one
  100 Gb/s port). Real clusters differ: Slurm's `cluster.mem` overrides the RAM.
- measured_matmul_tflops: the median bf16 rate of 8192^3 matmuls where a GPU run on
  record measured it (benchmarks/results: H100 708 on 2026-11-22, H200 785 on
  2026-11-26); other GPUs are planned at MATMUL_FRACTION of their datasheet peak, the
  lower of those two measurements' fractions, until a record or `python -m pipeline
  calibrate` says better.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GiB = 1024**3
MATMUL_FRACTION = 0.72
# A device copy's share of the datasheet bandwidth: 2,589 / 3,350 GB/s on the one GPU that
# measured it (H100, benchmarks/results/h100-2026-11-26/calibration-h100.json).
MEMORY_FRACTION = 0.77


@dataclass(frozen=True)
class GPU:
    name: str
    description: str
    memory_gib: float
    bf16_tflops: float | None
    fp16_tflops: float
    fp32_tflops: float
    interconnect: Literal["nvlink", "pcie"]
    link_gbs: float
    host_link_gbs: float
    memory_bandwidth_gbs: float
    host_memory_gib: float
    network_gbs: float  # per node, inter-node
    measured_matmul_tflops: float | None = None
    measured_memory_bandwidth_gbs: float | None = None
    measured_host_link_gbs: float | None = None

    @property
    def copy_bandwidth_gbs(self) -> float:
        """GB/s a device copy moves (read + write): measured where a record has it, else
        MEMORY_FRACTION of the datasheet; the basis of the planner's memory-bound terms."""
        return self.measured_memory_bandwidth_gbs or self.memory_bandwidth_gbs * MEMORY_FRACTION

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for the precision a stage trains in."""
        if precision == "bf16":
            return self.bf16_tflops if self.bf16_tflops is not None else self.fp32_tflops
        if precision == "fp16":
            return self.fp16_tflops
        return self.fp32_tflops


_CATALOGUE = [
    GPU("a100-40gb", "NVIDIA A100 SXM4 40 GB", 39.4, 312.0, 312.0, 19.5, "nvlink", 200.0, 20.0, 1555.0, 1024, 200.0),
    GPU("a100-80gb", "NVIDIA A100 SXM4 80 GB", 79.3, 312.0, 312.0, 19.5, "nvlink", 200.0, 20.0, 2039.0, 1024, 200.0),
    GPU("h100-80gb", "NVIDIA H100 SXM5 80 GB", 79.2, 989.0, 989.0, 67.0, "nvlink", 350.0, 40.0, 3350.0, 2048, 400.0,
        measured_matmul_tflops=708.0, measured_memory_bandwidth_gbs=2589.0, measured_host_link_gbs=55.2),
    GPU("h100-pcie", "NVIDIA H100 PCIe 80 GB", 79.2, 756.0, 756.0, 51.0, "pcie", 25.0, 40.0, 2000.0, 1024, 50.0),
    GPU("h200", "NVIDIA H200 SXM 141 GB", 139.8, 989.0, 989.0, 67.0, "nvlink", 350.0, 40.0, 4800.0, 2048, 400.0,
        measured_matmul_tflops=785.0),
    GPU("l40s", "NVIDIA L40S 48 GB", 44.4, 362.0, 362.0, 91.6, "pcie", 20.0, 20.0, 864.0, 512, 25.0),
    GPU("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", 23.6, 165.2, 165.2, 82.6, "pcie", 10.0, 12.0, 1008.0, 256, 12.5),
    GPU("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", 23.7, 71.0, 71.0, 35.6, "pcie", 10.0, 12.0, 936.0, 256, 12.5),
    GPU("a6000", "NVIDIA RTX A6000 48 GB", 47.5, 154.8, 154.8, 38.7, "pcie", 20.0, 20.0, 768.0, 512, 12.5),
    GPU("v100-32gb", "NVIDIA V100 SXM2 32 GB", 31.7, None, 125.0, 15.7, "nvlink", 100.0, 12.0, 900.0, 512, 25.0),
]

GPUS: dict[str, GPU] = {g.name: g for g in _CATALOGUE}

# Other spellings people write in pipeline files. Ambiguous ones ("a100": 40 or
# 80 GB? "h100": SXM or PCIe?) are deliberately absent: the planner must not guess memory.
ALIASES = {
    "a100-80g": "a100-80gb",
    "a100-40g": "a100-40gb",
    "h100-sxm": "h100-80gb",
    "h100-80g": "h100-80gb",
    "h200-141gb": "h200",
    "4090": "rtx4090",
    "rtx-4090": "rtx4090",
    "3090": "rtx3090",
    "rtx-3090": "rtx3090",
    "rtx-a6000": "a6000",
    "v100": "v100-32gb",
}


def gpu(name: str) -> GPU:
    """The catalogue entry for a GPU name (case-insensitive); ValueError naming the known ones."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU '{name}'; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]


# How torch.cuda.get_device_name spells the catalogue's GPUs (checked in this order).
_DEVICE_NAMES = (
    ("h100 pcie", "h100-pcie"), ("h100", "h100-80gb"), ("h200", "h200"),
    ("a100-sxm4-80gb", "a100-80gb"), ("a100 80gb", "a100-80gb"), ("a100-pcie-80gb", "a100-80gb"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"),
    ("l40s", "l40s"), ("rtx 4090", "rtx4090"), ("rtx 3090", "rtx3090"), ("rtx a6000", "a6000"),
    ("v100", "v100-32gb"),
)


def gpu_for_device(device_name: str) -> GPU | None:
    """The catalogue entry of a device as torch names it (e.g. 'NVIDIA H100 80GB HBM3'),
    for its datasheet peak; None for a GPU the catalogue does not hold."""
    name = device_name.lower()
    return next((GPUS[entry] for spelled, entry in _DEVICE_NAMES if spelled in name), None)


def decoding_tokens_per_s_limit(gpu: GPU, weight_bytes: float, sequences: int) -> float:
    """The most tokens/s one GPU can decode for a model of `weight_bytes`: decoding is bound by
    memory, every weight read once per step, each step one token for each of the `sequences`
    decoded together, at the datasheet bandwidth (the KV cache's reads left out: a ceiling, not
    an estimate). What RL's generate_bandwidth_fraction divides by."""
    return sequences * gpu.memory_bandwidth_gbs * 1e9 / weight_bytes
