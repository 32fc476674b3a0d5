"""Context parallelism: every sequence split over the cp ranks, attention computed across them.

Written for gloo as for NCCL: torch 2.13's `context_parallel` has no sharding rule for the CPU
attention kernel, so the attention here runs on local tensors and moves K/V (or heads) with
functional collectives, whose backward is the matching collective.

Load balance: a sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r (head
and tail), so under the causal mask every rank has the same attention work. Inputs, labels and
RoPE positions are sharded the same way (`shard_sequence`, `positions`).

Two methods (`cp.method`):
- allgather: K and V are all-gathered over cp; each local chunk attends to the keys up to its
  own end (`prefix_causal_attention`: on CPU two fused calls merged by log-sum-exp, on CUDA SDPA
  with a lower-right causal mask); the backward reduce-scatters dK, dV.
- alltoall (DeepSpeed Ulysses): all-to-all from sequence-sharded to head-sharded, attention over
  the whole sequence on n_heads / cp heads, all-to-all back. Needs the heads (and kv heads) on
  each rank divisible by cp.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshforge.configs.schema import CPConfig
from meshforge.models.common.moe import moe_layers


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) that `rank` holds: the head one and its mirror at the tail."""
    return rank, 2 * cp - 1 - rank


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions `rank` holds, in the order it holds them (its two chunks)."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks_of(rank, cp)])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """`rank`'s part of `x` along its sequence dimension `dim` (its head and tail chunks)."""
    parts = x.chunk(2 * cp, dim=dim)
    return torch.cat([parts[c] for c in chunks_of(rank, cp)], dim=dim)


def shape_problems(seq_len: int, heads: int, kv_heads: int, cp: int, method: str) -> list[str]:
    """Why `method` cannot split these shapes over `cp` ranks (none when it can); `heads` and
    `kv_heads` are those of one tensor-parallel rank."""
    problems = []
    if method not in ATTENTION:
        problems.append(f"method {method!r}: one of {', '.join(ATTENTION)}")
    if seq_len % (2 * cp):
        problems.append(
            f"seq_len {seq_len}: cp {cp} cuts it in {2 * cp} equal chunks, so a multiple of {2 * cp}"
        )
    if method == "alltoall" and (heads % cp or kv_heads % cp):
        problems.append(
            f"alltoall gives each of the {cp} ranks whole heads: {heads} heads and {kv_heads} kv heads "
            f"must both divide by {cp} (allgather has no such rule)"
        )
    return problems


def _check(q: torch.Tensor, k: torch.Tensor, cp: int, method: str) -> None:
    problems = shape_problems(q.shape[2] * cp, q.shape[1], k.shape[1], cp, method)
    if problems:
        raise ValueError("; ".join(problems))


@functools.cache
def _natural_order(cp: int, device: torch.device) -> torch.Tensor:
    """For each chunk of the sequence in order, its index in a gather over cp (rank order, two
    chunks a rank): indexing the gathered chunks with it puts the sequence back in order. Cached
    on the device: no host-to-device copy per layer."""
    held = [c for r in range(cp) for c in chunks_of(r, cp)]
    return torch.tensor([held.index(c) for c in range(2 * cp)], device=device)


def forget_cached_tensors() -> None:
    """Drop the tensors cached above: a simulated rank's are fake tensors of its own trace, which
    the next trace in the same process must not inherit (simulate/trace.trace_depths)."""
    _natural_order.cache_clear()


def _reorder_chunks(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`x` (B, H, S, hd) cut into len(order) chunks along S, taken in `order`."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, len(order), s // len(order), d)
    return chunks.index_select(2, order).reshape(b, h, s, d)


def _lower_right_causal(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """True where query i (the last n_queries of n_keys positions) may read key j: j <= i + offset."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries)


def _flash_cpu(q, k, v, causal: bool):
    """CPU's fused attention with its log-sum-exp (GQA when k, v have fewer heads)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


class _PrefixCausalCPU(torch.autograd.Function):
    """Causal attention of queries that are the last L of the S positions of k, v, without a mask:
    the earlier S - L keys unmasked, the last L causally, two fused calls merged by their
    log-sum-exp; backward runs each call's backward with the merged output and log-sum-exp
    (ring attention's rule), so dq, dk, dv are exact and nothing of size L x S is kept."""

    @staticmethod
    def forward(ctx, q, k, v):
        past = k.shape[2] - q.shape[2]
        out, lse = _flash_cpu(q, k[:, :, past:].contiguous(), v[:, :, past:].contiguous(), True)
        if past:
            out_p, lse_p = _flash_cpu(q, k[:, :, :past].contiguous(), v[:, :, :past].contiguous(), False)
            merged = torch.logaddexp(lse_p, lse)
            out = (
                out_p.float() * (lse_p - merged).exp().unsqueeze(-1)
                + out.float() * (lse - merged).exp().unsqueeze(-1)
            ).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        past, dout = k.shape[2] - q.shape[2], dout.contiguous()
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        diag = [t[:, :, past:].contiguous() for t in (k, v)]
        dq, dk, dv = backward(dout, q, *diag, out, lse, 0.0, True)
        if past:
            earlier = [t[:, :, :past].contiguous() for t in (k, v)]
            dq_p, dk_p, dv_p = backward(dout, q, *earlier, out, lse, 0.0, False)
            dq, dk, dv = dq + dq_p, torch.cat([dk_p, dk], dim=2), torch.cat([dv_p, dv], dim=2)
        return dq, dk, dv


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool) -> torch.Tensor:
    """Causal attention of `q`, the last positions of those `k` and `v` hold. `masked`: SDPA with an
    explicit (L x S) boolean mask, K and V repeated to every query head first (on CUDA only the
    flash and math kernels take GQA, and flash takes no mask: the memory-efficient kernel then
    takes the mask, as a float bias it keeps for backward); else `_PrefixCausalCPU`, no mask."""
    if not masked:
        return _PrefixCausalCPU.apply(q, k, v)
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # query head h reads kv head h // groups
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=_lower_right_causal(q.shape[2], k.shape[2], q.device)
    )


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    cp: int,
    rank: int,
    masked: bool = False,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence. q: (B, H, S/cp, hd),
    k and v: (B, KVH, S/cp, hd), each this rank's head and tail chunks; returns q's shape.

    Each local chunk c attends to the keys of chunks 0..c, lower-right causal (its last query
    sees every one of them): `prefix_causal_attention`, unmasked on CPU; with `masked` (CUDA)
    through masks of (2cp+1) x S^2 / (4cp^2) elements in all (about S/2cp x S), kept for
    backward. torch's `causal_lower_right` spares nothing on torch 2.13: its Tensor subclass
    allocates a (2, L, S) float32 tensor (and creating it failed intermittently: "raw Tensor
    object is already associated to a python object")."""
    _check(q, k, cp, "allgather")
    order = _natural_order(cp, q.device)
    k_all, v_all = (
        _reorder_chunks(funcol.all_gather_single_autograd(t.contiguous(), gather_dim=2, group=group), order)
        for t in (k, v)
    )
    chunk = q.shape[2] // 2
    outs = []
    for slot, c in enumerate(chunks_of(rank, cp)):
        seen = (c + 1) * chunk  # the keys of chunks 0..c
        q_chunk = q[:, :, slot * chunk : (slot + 1) * chunk].contiguous()
        outs.append(prefix_causal_attention(q_chunk, k_all[:, :, :seen], v_all[:, :, :seen], masked))
    return torch.cat(outs, dim=2)


def _seq_sharded_to_head_sharded(x: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """(B, H, S/cp, hd) sequence-sharded -> (B, H/cp, S, hd) head-sharded, S in rank order."""
    b, h, s, d = x.shape
    blocks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # (cp, B, H/cp, S/cp, hd)
    got = funcol.all_to_all_single_autograd(blocks, None, None, group)  # block i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _head_sharded_to_seq_sharded(x: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse of `_seq_sharded_to_head_sharded`."""
    b, hc, s_all, d = x.shape
    blocks = (
        x.reshape(b, hc, cp, s_all // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    )  # (cp, B, H/cp, S/cp, hd)
    got = funcol.all_to_all_single_autograd(blocks, None, None, group)  # rank i's heads, my positions
    return got.transpose(0, 1).reshape(b, cp * hc, s_all // cp, d)


def alltoall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    cp: int,
    rank: int,
    masked: bool = False,
) -> torch.Tensor:
    """Ulysses: the same result as `allgather_attention`, moving heads instead of K/V (`rank` and
    `masked` are unused: the all-to-all orders the sequence by rank, the same on every rank, and
    the whole sequence's causal attention needs no mask)."""
    _check(q, k, cp, "alltoall")
    order = _natural_order(cp, q.device)
    qh, kh, vh = (_reorder_chunks(_seq_sharded_to_head_sharded(t, group, cp), order) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=qh.shape[1] != kh.shape[1])
    return _head_sharded_to_seq_sharded(_reorder_chunks(out, torch.argsort(order)), group, cp)


ATTENTION = {"allgather": allgather_attention, "alltoall": alltoall_attention}


def apply_cp(
    model: nn.Module, cp_mesh: DeviceMesh, cfg: CPConfig, seq_len: int, tp: int = 1, device_type: str = "cpu"
) -> None:
    """Make `model` (a Transformer, or one pipeline stage of it; its heads split over `tp`) attend
    across the ranks of `cp_mesh` by `cfg.method` and rotate its tokens by their positions: it
    then takes this rank's head and tail chunks of every `seq_len`-token sequence (`shard_sequence`).
    `device_type`: where the attention runs (CUDA takes the masked kernel; the estimator traces a
    CUDA recipe on CPU fake tensors, so the mesh's own type cannot say)."""
    group, cp, rank, method = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), cfg.method
    args = model.args
    problems = shape_problems(seq_len, args.n_heads // tp, args.kv_heads // tp, cp, method)
    if problems:
        raise ValueError("; ".join(problems))
    model.rope_positions = positions(seq_len, cp, rank)  # moved to freqs_cis' device in forward
    for block in model.layers.values():
        block.attention.attend = functools.partial(
            ATTENTION[method], group=group, cp=cp, rank=rank, masked=device_type == "cuda"
        )
    for moe in moe_layers(model).values():  # its balancing loss counts a whole sequence's choices
        moe.sequence_group = group


def sequence_shard(cp_mesh: DeviceMesh | None):
    """What a step does to its inputs and labels (B, S): this cp rank's head and tail chunks of
    every sequence (the identity without cp)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return lambda x: x
    return functools.partial(shard_sequence, dim=1, cp=cp_mesh.size(), rank=cp_mesh.get_local_rank())
