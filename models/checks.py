"""Rules every decoder family of this shape obeys on a mesh: whole (kv) heads per tensor-
parallel rank, FFN and vocab split evenly, and tied embeddings only where one rank holds both."""

from __future__ import annotations

from meshforge.core.errors import Problem, nearest
from meshforge.core.topology import ParallelDims, divisors


def check_heads_on_mesh(a, dims: ParallelDims) -> list[Problem]:
    """Heads, kv heads, FFN and vocab against the tensor-parallel degree; tying vs TP/PP."""
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
            problems.append(
                Problem(
                    "mesh.tp",
                    tp,
                    f"FFN hidden {a.ffn_hidden_dim} and vocab {a.vocab_size} must be divisible by tp",
                )
            )
        if a.tie_embeddings:
            problems.append(
                Problem(
                    "model.tie_embeddings",
                    True,
                    "tied embeddings with tp > 1 are not supported (embedding and output shard "
                    "differently); use mesh.tp=1 or model.tie_embeddings=false",
                )
            )
    if dims.pp > 1 and a.tie_embeddings:
        problems.append(
            Problem(
                "model.tie_embeddings",
                True,
                "tied embeddings need embedding and output on one pipeline stage; "
                "use mesh.pp=1 or model.tie_embeddings=false",
            )
        )
    return problems
