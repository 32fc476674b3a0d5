"""Rules every decoder family of this shape obeys on a mesh: whole (kv) heads per tensor-
parallel rank, FFN and vocab split evenly."""

from __future__ import annotations

from meshforge.core.errors import Problem, nearest
from meshforge.core.topology import ParallelDims, divisors


def check_heads_on_mesh(a, dims: ParallelDims) -> list[Problem]:
    """Heads, kv heads, FFN and vocab against the tensor-parallel degree (tied or not)."""
    problems = []
    if a.n_heads % a.kv_heads:
        problems.append(
            Problem(
                "model.n_kv_heads",
                a.kv_heads,
                f"must divide n_heads={a.n_heads}; valid: {nearest(a.kv_heads, divisors(a.n_heads))}",
            )
        )
    tp = dims.tp
    if tp > 1 and tp not in valid_tp(a):
        tied = " (the tied embedding and output shard it alike)" if a.tie_embeddings else ""
        uneven = [
            f"n_heads={a.n_heads}" if a.n_heads % tp else "",
            f"n_kv_heads={a.kv_heads} (each rank needs whole kv heads)" if a.kv_heads % tp else "",
            f"FFN hidden {a.ffn_hidden_dim}" if a.ffn_hidden_dim % tp else "",
            f"vocab {a.vocab_size}{tied}" if a.vocab_size % tp else "",
        ]
        fix = f"not divisible by tp; valid tp: {nearest(tp, valid_tp(a))}"
        problems.append(Problem("mesh.tp", tp, f"{', '.join(filter(None, uneven))}: {fix}"))
    return problems


def valid_tp(a) -> list[int]:
    """The tensor-parallel degrees that split heads, kv heads, FFN and vocab evenly: the one rule
    behind every "valid tp" a message offers."""
    split = (a.n_heads, a.kv_heads, a.ffn_hidden_dim, a.vocab_size)
    return [d for d in divisors(a.kv_heads) if all(n % d == 0 for n in split)]
