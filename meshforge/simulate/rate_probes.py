"""A device's compute rates as `meshforge tune --calibrate` measures them: matmul FLOP/s per dtype at
a transformer's shapes, causal grouped-query attention's, and memory-bound bytes/s, each at the sizes
of the device measured (one CPU rank's, or one GPU's); and the share of them a model's step reaches."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshforge.models.llama3.model import LlamaArgs, Transformer
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.simulate.hardware import MAX_MODEL_RATE_SHARE, Profile
from meshforge.simulate.host_probes import llama_step, median_seconds, seconds_and_cost
from meshforge.simulate.op_costs import PhaseCost, sdpa_step_flops
from meshforge.simulate.step_time import phase_time


@dataclasses.dataclass(frozen=True)
class RateProbe:
    """What is timed on one kind of device."""

    matmul_shapes: tuple[tuple[int, int, int], ...]  # (m, k, n); a dtype's rate is their median
    matmul_dtypes: tuple[str, ...]
    attention_dtypes: tuple[str, ...]
    attention_shape: tuple[int, int, int, int, int]  # batch, query heads, kv heads, sequence, head dim
    memory_bytes: int  # per tensor of c = a + b: 3 x this moved, well past the caches
    calls: int  # calls per timing: a wait for a GPU costs ~10 us


# a small transformer's matmuls (q/k/v/o projections, an MLP up-projection, a long-sequence
# attention product): the median is the typical one, not pulled by a shape that suits (or misses)
# the cache; float16 left out (CPUs have no fp16 matmul units, flops.py); attention at the shrunk
# llm_1b's sizes
CPU_PROBE = RateProbe(
    matmul_shapes=((2048, 256, 256), (2048, 256, 1024), (512, 512, 2048)),
    matmul_dtypes=("float32", "bfloat16"),
    attention_dtypes=("float32", "bfloat16"),
    attention_shape=(2, 8, 2, 128, 32),
    memory_bytes=16 << 20,
    calls=1,
)
# llm_1b's matmuls at 8,192 tokens (dim 2,048, MLP 8,192, a 32,768-column slice of the output
# layer) and its attention; fp32 attention runs another kernel (no flash): left to the matmul rate
GPU_PROBE = RateProbe(
    matmul_shapes=((8192, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048), (8192, 2048, 32768)),
    matmul_dtypes=("float32", "bfloat16", "float16"),
    attention_dtypes=("bfloat16", "float16"),
    attention_shape=(2, 32, 8, 4096, 64),
    memory_bytes=1 << 30,
    calls=10,
)


def compute_rates(device: str, rounds: int) -> dict:
    """This device's matmul and attention FLOP/s by dtype and memory-bound bytes/s, as a Profile
    holds them (`matmul_flops`, `attention_flops`, `memory_Bps`): each the fastest of `rounds`
    readings, since a busy neighbour on a shared host only slows one (this VM's memory rate read
    4.6 GB/s in one calibration, 19-28 GB/s in twenty readings minutes later)."""
    probe = GPU_PROBE if device == "cuda" else CPU_PROBE

    def fastest(rate: Callable[..., float], *args) -> float:
        return max(rate(*args, device, probe.calls) for _ in range(rounds))

    matmul = {
        name: statistics.median(fastest(matmul_rate, s, name) for s in probe.matmul_shapes)
        for name in probe.matmul_dtypes
    }
    attention = {
        name: fastest(attention_rate, probe.attention_shape, name) for name in probe.attention_dtypes
    }
    return {
        "matmul_flops": matmul,
        "attention_flops": attention,
        "memory_Bps": fastest(memory_rate, probe.memory_bytes),
    }


def matmul_rate(shape: tuple[int, int, int], dtype: str, device: str, calls: int) -> float:
    """FLOP/s of an (m, k) x (k, n) product (its operands freed on return: 2 GiB at a GPU's sizes)."""
    m, k, n = shape
    a = torch.randn(m, k, dtype=DTYPES[dtype], device=device)
    b = torch.randn(k, n, dtype=DTYPES[dtype], device=device)
    return 2 * m * k * n / median_seconds(lambda: torch.mm(a, b), device, calls)


def attention_rate(shape: tuple[int, ...], dtype: str, device: str, calls: int) -> float:
    """FLOP/s of causal grouped-query SDPA's forward and backward, as the model calls it, its FLOPs
    counted as the trace counts them (op_costs.sdpa_step_flops: one formula whichever kernel runs)."""
    batch, heads, kv_heads, seq, head_dim = shape

    def tensor(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, dtype=DTYPES[dtype], device=device, requires_grad=True)

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, dtype=DTYPES[dtype], device=device)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    return sdpa_step_flops(q, k, v) / median_seconds(step, device, calls)


def memory_rate(nbytes: int, device: str, calls: int) -> float:
    """Bytes/s read and written by c = a + b on float32 tensors of `nbytes` each."""
    a, b, c = (torch.ones(nbytes // 4, device=device) for _ in range(3))
    return 3 * nbytes / median_seconds(lambda: torch.add(a, b, out=c), device, calls)


# a Llama whose step is mostly arithmetic (~30 ms here, a tenth of it host work), of neither
# benchmarked recipe's shape: dim 128, 4 layers, vocabulary 2,048, 4 x 128 tokens
REFERENCE_LLAMA = LlamaArgs(
    dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=64, max_seq_len=128
)
REFERENCE_TOKENS = (4, 128)


def model_rate_share(rates: dict, op_overhead_s: float) -> float:
    """The share of the probes' rates (`rates`: compute_rates') that a model's step reaches on a CPU,
    read on the reference Llama's step (share_of_rates). The probes time one kernel on warm
    operands; in a step its operands come cold from the op before, and ops no probe times run (the
    embedding's and the loss's backward). Read 0.76-0.84 here (calibrations: 0.79-0.84); on other
    Llamas 0.70 (debug_cpu's at 1,024 tokens), 0.72-0.78 (llm_1b shrunk), 0.87-0.91 (dim 128, 2
    layers, 256 tokens)."""
    return share_of_rates(*seconds_and_cost(reference_llama_step()), rates, op_overhead_s)


def reference_llama_step(tokens: tuple[int, int] = REFERENCE_TOKENS) -> Callable[[], None]:
    """A training step of the reference Llama on `tokens` (batch, sequence): the same model and
    tokens each time, the caller's random generator untouched."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(REFERENCE_LLAMA)
        batch = torch.randint(0, REFERENCE_LLAMA.vocab_size, tokens)
    return llama_step(model, batch)


def share_of_rates(seconds: float, cost: PhaseCost, rates: dict, op_overhead_s: float) -> float:
    """A step's arithmetic (`cost`) priced at `rates`, over its timed `seconds` less its ops at
    `op_overhead_s` each (at most MAX_MODEL_RATE_SHARE, should the host's share be misread)."""
    rated = {k: rates[k] for k in ("matmul_flops", "attention_flops", "memory_Bps")}
    at_rates = Profile("probes", "compute_rates", ranks_per_node=1, **rated)  # no host cost: arithmetic only
    arithmetic = phase_time(cost.as_dict(), at_rates, overlap=False).compute_s
    return arithmetic / max(seconds - cost.ops * op_overhead_s, arithmetic / MAX_MODEL_RATE_SHARE)
