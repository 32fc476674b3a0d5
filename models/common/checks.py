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
    if tp > 1:
        valid_tp = nearest(tp, [d for d in divisors(a.kv_heads) if a.n_heads % d == 0])
        if a.n_heads % tp:
            problems.append(
                Problem("mesh.tp", tp, f"n_heads={a.n_heads} is not divisible by tp; valid tp: {valid_tp}")
            )
        if a.kv_heads % tp:
            problems.append(
                Problem(
                    "mesh.tp",
                    tp,
                    f"n_kv_heads={a.kv_heads} is not divisible by tp (each rank needs "
                    f"whole kv heads, so n_kv_heads >= tp); valid tp: {valid_tp}",
                )
            )
        if a.ffn_hidden_dim % tp or a.vocab_size % tp:
            whole = [d for d in divisors(a.ffn_hidden_dim) if a.vocab_size % d == 0 and d > 1]
            tied = " (the tied embedding and output shard it alike)" if a.tie_embeddings else ""
            problems.append(
                Problem(
                    "mesh.tp",
                    tp,
                    f"FFN hidden {a.ffn_hidden_dim} and vocab {a.vocab_size}{tied} must be divisible by "
                    f"tp; valid tp: {nearest(tp, whole or [1])}",
                )
            )
    return problems
