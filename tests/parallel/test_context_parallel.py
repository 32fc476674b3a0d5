"""Context parallel attention (parallelisms/cp.py): the head-tail sharding, and both methods on
gloo ranks against one process's causal attention, forward and backward."""

from __future__ import annotations

import multiprocessing
import tempfile

import pytest
import torch
import torch.nn.functional as F
from support import start_session_rank_server

from meshforge.parallelisms.cp import (
    ATTENTION,
    _lower_right_causal,
    positions,
    prefix_causal_attention,
    shape_problems,
    shard_sequence,
)

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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefix_causal_attention_without_a_mask_equals_the_masked_one(dtype, tol):
    """The CPU kernel (two fused calls merged by log-sum-exp, no mask) against SDPA with the
    lower-right causal mask, output and dq, dk, dv; GQA (4 query heads on 2 kv heads)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 12, 8, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    results = []
    for masked in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = prefix_causal_attention(*leaves, masked=masked)
        (out.float() * weight.float()).sum().backward()
        results.append([out.detach().float(), *(t.grad.float() for t in leaves)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert (a - b).abs().max().item() < tol, name
    mask = _lower_right_causal(5, 12, torch.device("cpu"))  # the masked kernel's: query i is position 7 + i
    assert mask.sum(1).tolist() == [8, 9, 10, 11, 12] and mask[0, 7] and not mask[0, 8]


def _inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=g) for _ in range(2))
    weight = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g)  # the loss: sum(out * weight)
    return q, k, v, weight


def _rank(
    rank: int, cp: int, store: str, method: str, heads: int, kv_heads: int, masked: bool, out: str
) -> None:
    """One cp rank: its shards of the inputs, the method's attention and the grads of its shards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cp)
    try:
        q, k, v, weight = (shard_sequence(t, 2, cp, rank).requires_grad_() for t in _inputs(heads, kv_heads))
        attn = ATTENTION[method](q, k, v, dist.group.WORLD, cp, rank, masked=masked)
        (attn * weight).sum().backward()
        torch.save({"out": attn.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ranks(target, cp: int, *args) -> None:
    """`target(rank, cp, store, *args)` on `cp` gloo ranks forked from the session's rank server
    (torch is imported there already), meeting through a new file store; each must exit cleanly."""
    start_session_rank_server()
    store, ctx = f"{tempfile.mkdtemp()}/store", multiprocessing.get_context("forkserver")
    ranks = [ctx.Process(target=target, args=(r, cp, store, *args)) for r in range(cp)]
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,cp,heads,kv_heads,masked",
    [
        ("allgather", 2, 4, 2, False),  # GQA: two query heads per kv head
        ("allgather", 2, 4, 2, True),  # the masked kernel CUDA runs
        ("allgather", 4, 4, 1, False),
        ("allgather", 4, 4, 1, True),
        ("alltoall", 2, 4, 2, False),
        ("alltoall", 4, 8, 4, False),
    ],
)
def test_cp_attention_equals_one_process(tmp_path, method, cp, heads, kv_heads, masked):
    q, k, v, weight = (t.requires_grad_() for t in _inputs(heads, kv_heads))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    (full * weight).sum().backward()
    expected = {"out": full.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    _run_ranks(_rank, cp, method, heads, kv_heads, masked, str(tmp_path))
    for r in range(cp):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name, value in expected.items():
            diff = (got[name] - shard_sequence(value, 2, cp, r)).abs().max().item()
            assert diff < 1e-5, (name, r, diff)


# --- a whole model under cp -------------------------------------------------------------------

MODEL_SEQ = 16


def _model(family: str):
    """A tiny model of `family`, the same weights on every rank (seeded init)."""
    from meshforge.models.llama3.model import LlamaArgs, Transformer
    from meshforge.models.qwen3.model import Qwen3Args, Qwen3Transformer

    if family == "qwen3":  # QK-norm and half-split RoPE
        args = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, ffn_dim=48)
        model = Qwen3Transformer(args)
    else:
        args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
        model = Transformer(args)
    model.init_weights(seed=0)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (BATCH, MODEL_SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _summed_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), logits


def _model_rank(rank: int, cp: int, store: str, method: str, family: str, out: str) -> None:
    """One cp rank: this rank's tokens through the model; the loss and grads summed over cp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.configs.schema import CPConfig
    from meshforge.parallelisms.cp import apply_cp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cp)
    try:
        model = _model(family)
        apply_cp(model, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), CPConfig(method), MODEL_SEQ)
        tokens, labels = (shard_sequence(t, 1, cp, rank) for t in _batch())
        loss, logits = _summed_loss(model, tokens, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for g in [loss.detach(), *grads.values()]:
            dist.all_reduce(g)  # every token counted once: the cp ranks' sums add up to the whole
        torch.save({"loss": loss.detach(), "logits": logits.detach(), "grads": grads}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,cp,family", [("allgather", 2, "llama3"), ("alltoall", 2, "qwen3"), ("allgather", 4, "qwen3")]
)
def test_a_model_under_cp_gives_one_process_loss_logits_and_grads(tmp_path, method, cp, family):
    model = _model(family)
    loss, logits = _summed_loss(model, *_batch())
    loss.backward()
    _run_ranks(_model_rank, cp, method, family, str(tmp_path))
    for r in range(cp):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert abs(got["loss"].item() - loss.item()) < 1e-4 * loss.item()
        assert (got["logits"] - shard_sequence(logits.detach(), 1, cp, r)).abs().max() < 1e-5
        for name, p in model.named_parameters():
            assert (got["grads"][name] - p.grad).abs().max() < 1e-5, (name, r)
