"""Model FLOPs per token, achieved FLOP/s, and MFU against the device's peak.

FLOPs per trained token = 6 N + 6 L H (Q + V) T (PaLM, appendix B, where Q = V gives its
12 L H Q T; TorchTitan uses the same): 6 N for the forward and backward of every matmul weight
(N = parameters without the input embedding, a lookup, and, in a mixture of experts, without the
experts a token's router did not pick: its active parameters), plus the attention scores (query and
key heads of width Q) and weighted values (value heads of width V, MLA's narrower than Q), which
scale with the sequence length T (L layers, H heads). Activation recomputation is
not counted: MFU measures useful work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshforge.models.common.moe import unpicked_params
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.run.rank.distributed import DistEnv

# Dense peak TFLOP/s per device, by (name fragment, compute dtype). MFU is reported only
# where the device is known; add yours here. float32 is the plain fp32 (CUDA core) peak, not
# TF32's tensor-core one: meshforge never enables TF32 (torch's default keeps fp32 matmuls fp32).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},  # SXM
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
    "V100": {"float16": 125.0, "float32": 15.7},  # no bf16: the GPUs fp16 + loss scaling is for
    "T4": {"float16": 65.0, "float32": 8.1},
}


def flops_per_token(args, seq_len: int, n_params: int) -> float:
    embedding = 0 if args.tie_embeddings else args.vocab_size * args.dim  # a lookup, not a matmul
    value_width = getattr(args, "v_head_dim", args.head_dim)  # a family's own, else its query width
    attention = 6 * args.n_layers * args.n_heads * (args.head_dim + value_width) * seq_len
    return 6 * (n_params - embedding - unpicked_params(args)) + attention


def gpu_peak_flops(device: torch.device, dtype: str) -> float | None:
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in GPU_PEAK_TFLOPS.items():
        if fragment in name:
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


# A matmul's operands can each come transposed (A or A^T times B or B^T). A CPU's kernels differ
# by up to 17x between these layouts in bfloat16 (an AMD EPYC, one thread: 0.9 GFLOP/s for A @ B,
# 9.5 for A @ B^T, the forward's, 16 for A^T @ B, the weight gradient's), and a training step runs
# several of them, so a peak taken on one slow layout was exceeded (MFU 199% on a bf16 run).
LAYOUTS = ((False, False), (False, True), (True, False), (True, True))
LAYOUT_READINGS = 3  # each layout's best reading of these picks the fastest (one a busy host slowed misleads)


def _best_seconds(product, repeats: int) -> float:
    product()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_matmul_flops(
    product_of: Callable, sizes: tuple[int, ...] = (256, 512, 1024), repeats: int = 5
) -> float:
    """The best matmul FLOP/s over a few square sizes, in the operand layout that runs fastest
    (picked at the smallest size, so the slow layouts cost little, on its best of LAYOUT_READINGS: one
    reading a busy host slowed could pick a slower layout and understate the peak).
    `product_of(n, layout)` gives a function that runs one n x n product (of whichever framework
    the run computes with)."""
    fastest = min(LAYOUTS, key=lambda layout: _best_seconds(product_of(sizes[0], layout), LAYOUT_READINGS))
    return max(2 * n**3 / _best_seconds(product_of(n, fastest), repeats) for n in sizes)


def measure_cpu_matmul_flops(
    sizes: tuple[int, ...] = (256, 512, 1024), repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """This process's peak torch matmul FLOP/s in `dtype` with its current threads
    (`peak_matmul_flops`): the CPU 'peak' for MFU (a CPU with bf16 matrix units runs bf16 faster
    than fp32: each is its own peak)."""

    def product_of(n: int, layout: tuple[bool, bool]) -> Callable:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a, b = a.t() if layout[0] else a, b.t() if layout[1] else b
        return lambda: a @ b

    return peak_matmul_flops(product_of, sizes, repeats)


def cpu_share(ranks_on_host: int, threads: int, cores: int) -> float:
    """The part of the host's matmul rate one rank gets, as a multiple of what one process
    measures alone with `threads` threads: ranks that together ask for more threads than the
    host has cores share those cores (8 ranks of 1 thread on 2 cores: each gets 2/8 of a core's
    worth, a quarter of the rate measured alone)."""
    return min(1.0, cores / (ranks_on_host * min(threads, cores)))


def usable_cores() -> int:
    """The cores this process may run on (its affinity: cgroups, Slurm), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_peak_flops(env: DistEnv, param_dtype: str) -> float | None:
    """Per-device peak in the compute dtype: the GPU's datasheet number, or this CPU's measured
    matmul rate (rank 0 measures once) times one rank's share of the host's cores
    (`cpu_share`: the ranks on this host divide the cores between them)."""
    if env.device.type == "cuda":
        return gpu_peak_flops(env.device, param_dtype)
    if param_dtype == "float16":
        return None  # CPUs have no fp16 matmul units (here: 1-3 GFLOP/s vs 70 fp32): no peak to hold to
    dtype = DTYPES[param_dtype]
    peak = torch.tensor(measure_cpu_matmul_flops(dtype=dtype) if env.is_main else 0.0, dtype=torch.float64)
    if dist.is_initialized():
        dist.broadcast(peak, src=0)
    return float(peak) * cpu_share(env.local_world_size, torch.get_num_threads(), usable_cores())
