"""What `meshforge tune --calibrate` prints: each constant of the profile it measured, and how."""

from __future__ import annotations

from rich.table import Table

from meshforge.simulate.core_sharing import SATURATING_STEPS, SHARING_TOKENS
from meshforge.simulate.hardware import Profile
from meshforge.simulate.rate_probes import CPU_PROBE, GPU_PROBE, REFERENCE_LLAMA, REFERENCE_TOKENS


def profile_table(profile: Profile, errors: dict[int, float], points: int) -> Table:
    """Each measured constant of a calibrated `profile` with how it was measured; `errors`: each
    group size's link fit's RMS error over its `points` timings."""
    table = Table(title=f"hardware profile {profile.name}", title_justify="left")
    for column in ("measured", "rate", "how"):
        table.add_column(column)
    gpu = profile.shared_cores == 0
    alone = "one GPU" if gpu else f"one rank alone, {profile.threads_per_rank} thread(s)"
    probe = GPU_PROBE if gpu else CPU_PROBE
    shapes, nbytes = probe.matmul_shapes, probe.memory_bytes
    for dtype, rate in profile.matmul_flops.items():
        table.add_row(
            f"matmul {dtype}", f"{rate / 1e9:.1f} GFLOP/s", f"median of {len(shapes)} shapes, {alone}"
        )
    for dtype, rate in profile.attention_flops.items():
        table.add_row(
            f"attention {dtype}",
            f"{rate / 1e9:.1f} GFLOP/s",
            f"causal GQA SDPA forward and backward, {alone}",
        )
    table.add_row(
        "memory-bound",
        f"{profile.memory_Bps / 1e9:.2f} GB/s",
        f"c = a + b on {nbytes >> 20} MiB tensors, {alone}",
    )
    table.add_row(
        "host work per op", f"{profile.op_overhead_s * 1e6:.1f} us", f"a tiny Llama's step, {alone}"
    )
    table.add_row(
        "per DTensor op",
        f"{profile.dtensor_op_overhead_s * 1e6:.1f} us",
        "a TP block's DTensor ops (fake 2-rank mesh), beyond their local ops",
    )
    table.add_row(
        "per FSDP unit",
        f"{profile.fsdp_unit_overhead_s * 1e3:.2f} ms",
        "its hooks per microbatch, forward and backward (a tiny Llama fully_shard-ed on a fake "
        "2-rank mesh), beyond their ops",
    )
    table.add_row(
        "per checkpointed block",
        f"{profile.checkpoint_overhead_s * 1e3:.2f} ms",
        "its hooks per microbatch, forward and backward (a tiny Llama under full AC), beyond its ops "
        "and the recompute's",
    )
    if not gpu:
        table.add_row(
            "model rate share",
            f"{profile.model_rate_share:.2f}",
            f"of the rates above, in a Llama's step (dim {REFERENCE_LLAMA.dim}, {REFERENCE_LLAMA.n_layers} "
            f"layers, {REFERENCE_TOKENS[0] * REFERENCE_TOKENS[1]} tokens) less its host work",
        )
    if profile.sharing_slowdown:
        table.add_row(
            "ranks sharing cores",
            ", ".join(f"{n}: x{s:.2f}" for n, s in sorted(profile.sharing_slowdown.items())),
            f"the reference Llama's step on {SHARING_TOKENS[0] * SHARING_TOKENS[1]} tokens on n ranks "
            f"at once, over its share of {profile.shared_cores} cores",
        )
    if profile.arrival_skew:
        table.add_row(
            "wait for the last rank",
            ", ".join(f"{g}: {f:.2f}" for g, f in sorted(profile.arrival_skew.items())),
            "per group size, of the computing time since a rank's last collective: a small "
            "all-reduce behind the reference step, over behind a short one",
        )
    if profile.arrival_skew_cap:
        table.add_row(
            "that wait at most",
            ", ".join(f"{g}: {c * 1e3:.0f} ms" for g, c in sorted(profile.arrival_skew_cap.items())),
            f"per group size: the same all-reduce behind {SATURATING_STEPS} reference steps, over behind "
            "a short one (the lateness stops growing)",
        )
    for g, link in sorted(profile.links.items()):
        table.add_row(
            f"groups of {g}",
            f"{link.latency_s * 1e6:.0f} us + busbw {link.bandwidth_Bps / 1e9:.2f} GB/s",
            f"{profile.calibrated_world // g} group(s) at once behind compute, fit to {points} timings "
            f"(RMS error {errors[g]:.0%})",
        )
    if send := profile.kind_links.get("send", {}).get(2):
        table.add_row(
            "pipeline send",
            f"{send.latency_s * 1e6:.0f} us + {send.bandwidth_Bps / 1e9:.2f} GB/s",
            f"{profile.calibrated_world // 2} pair(s) at once behind compute, each rank sending, receiving",
        )
    return table
