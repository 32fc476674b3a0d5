"""Context parallel attention (parallelisms/cp.py): the head-tail sharding, and both methods on
gloo ranks against one process's causal attention, forward and backward."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch
import torch.nn.functional as F
from conftest import start_session_rank_server

from meshforge.parallelisms.cp import ATTENTION, positions, shape_problems, shard_sequence

SEQ, BATCH, HEAD_DIM = 32, 2, 8


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_hold_every_position_once_and_equal_causal_work(cp):
    held = [positions(SEQ, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(SEQ))
    if cp == 2:  # 4 chunks of 8: rank 0 the first and the last, rank 1 the middle two
        assert held[0].tolist() == [*range(0, 8), *range(24, 32)] and held[1].tolist() == list(range(8, 24))
    # a query at position p reads p + 1 keys: the head and tail chunks even the ranks out
    work = {int((p + 1).sum()) for p in held}
    assert len(work) == 1
    x = torch.arange(SEQ).repeat(BATCH, 1)
    for r in range(cp):
        assert torch.equal(shard_sequence(x, 1, cp, r), held[r].repeat(BATCH, 1))


def test_shapes_cp_cannot_split_are_refused_with_the_rule():
    assert shape_problems(32, 4, 2, 2, "alltoall") == []
    assert shape_problems(32, 4, 1, 4, "allgather") == []
    (odd,) = shape_problems(36, 4, 2, 4, "allgather")
    assert "seq_len 36" in odd and "multiple of 8" in odd
    (heads,) = shape_problems(32, 4, 2, 4, "alltoall")
    assert "4 heads and 2 kv heads must both divide by 4" in heads
    (method,) = shape_problems(32, 4, 2, 2, "ring")
    assert "one of allgather, alltoall" in method
    q, k = torch.zeros(1, 4, 8, 2), torch.zeros(1, 2, 8, 2)
    with pytest.raises(ValueError, match="must both divide by 4"):
        ATTENTION["alltoall"](q, k, k, None, 4, 0)


def _inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=g) for _ in range(2))
    weight = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g)  # the loss: sum(out * weight)
    return q, k, v, weight


def _rank(rank: int, cp: int, method: str, heads: int, kv_heads: int, port: int, out: str) -> None:
    """One cp rank: its shards of the inputs, the method's attention and the grads of its shards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    try:
        q, k, v, weight = (shard_sequence(t, 2, cp, rank).requires_grad_() for t in _inputs(heads, kv_heads))
        attn = ATTENTION[method](q, k, v, dist.group.WORLD, cp, rank)
        (attn * weight).sum().backward()
        torch.save({"out": attn.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,cp,heads,kv_heads",
    [
        ("allgather", 2, 4, 2),  # GQA: two query heads per kv head
        ("allgather", 4, 4, 1),
        ("alltoall", 2, 4, 2),
        ("alltoall", 4, 8, 4),
    ],
)
def test_cp_attention_equals_one_process(tmp_path, method, cp, heads, kv_heads):
    q, k, v, weight = (t.requires_grad_() for t in _inputs(heads, kv_heads))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    (full * weight).sum().backward()
    expected = {"out": full.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    start_session_rank_server()  # the ranks fork from it: torch is imported there already
    port, ctx = _free_port(), multiprocessing.get_context("forkserver")
    ranks = [
        ctx.Process(target=_rank, args=(r, cp, method, heads, kv_heads, port, str(tmp_path)))
        for r in range(cp)
    ]
    try:
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(120)
    finally:
        for p in ranks:
            if p.exitcode is None:  # hung in a collective: ended here, not left to the session
                p.kill()
                p.join()
    assert [p.exitcode for p in ranks] == [0] * cp
    for r in range(cp):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name, value in expected.items():
            diff = (got[name] - shard_sequence(value, 2, cp, r)).abs().max().item()
            assert diff < 1e-5, (name, r, diff)
