"""Hardware profiles (simulate/hardware.py): the shipped files, the TOML schema, collective
pricing, and the calibration's fit (a real calibration of this machine runs in test_tune_command.py's
tune fixture)."""

from __future__ import annotations

import dataclasses
import tempfile
from functools import partial
from pathlib import Path

import pytest
from rich.console import Console

from meshforge.core.errors import RecipeError, RunError, UsageError
from meshforge.run.observe.flops import GPU_PEAK_TFLOPS, usable_cores
from meshforge.simulate.calibrate import _launch, calibrate, cost_under_load, local_profile
from meshforge.simulate.core_sharing import counts_to_measure, measure_sharing
from meshforge.simulate.fake_rank import trace_pool
from meshforge.simulate.hardware import MAX_ARRIVAL_SKEW, MAX_ARRIVAL_SKEW_CAP_S, Link, Profile
from meshforge.simulate.host_probes import PROBE_ROUNDS, host_costs, least_of, op_overhead
from meshforge.simulate.link_fit import fit_link
from meshforge.simulate.op_costs import PhaseCost
from meshforge.simulate.profile_toml import SHIPPED, load_profile, save_profile
from meshforge.simulate.rate_probes import compute_rates, model_rate_share, share_of_rates

KIB, MIB = 1 << 10, 1 << 20


def small_profile(**changes) -> Profile:
    fields = dict(
        name="test",
        source="made up for a test",
        matmul_flops={"float32": 1e11},
        memory_Bps=1e10,
        ranks_per_node=8,
        links={2: Link(10e-6, 1e9), 8: Link(70e-6, 1e9)},
    )
    return Profile(**{**fields, **changes})


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_shipped_profiles_load_with_achievable_rates(name):
    profile = load_profile(name)
    assert load_profile(str(SHIPPED[name])) == profile  # by name or by path
    assert profile.name == name and profile.ranks_per_node == 8 and profile.calibrated_world == 0
    peaks = GPU_PEAK_TFLOPS[name.upper()]  # run/observe/flops.py: the one table of datasheet peaks
    for dtype, rate in profile.matmul_flops.items():
        assert 0.6 * peaks[dtype] * 1e12 <= rate < peaks[dtype] * 1e12, dtype
    assert sorted(profile.links) == [2, 4, 8] and profile.inter_node is not None
    assert profile.link(8, False).bandwidth_Bps > profile.link(16, True).bandwidth_Bps  # NVLink > IB
    assert "datasheet" in profile.source and "nccl" in profile.source


def test_unknown_and_bad_keys_are_refused_by_name(tmp_path):
    text = SHIPPED["h100"].read_text()
    text = text.replace("memory_Bps =", "bandwith_Bps = 1\nmemory_Bps =")
    text = text.replace("[links.4]\nlatency_s", "[links.4]\nlatency = 1\nlatency_s")
    text = text.replace("float32 = 5.0e13", "float32 = -1\nfloat64 = 1e12")
    text = text.replace("model_rate_share = 1.0", "model_rate_share = 5.0")  # over calibrate's bound
    text += "\n[sharing_slowdown]\n4 = 1.1\n8 = 0.9\n1 = 2.0\n"
    text += "\n[arrival_skew]\n8 = 2.5\n\n[arrival_skew_cap]\n4 = 0.03\n8 = 30\n"  # 30: ms written as s
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as caught:
        load_profile(str(path))
    fields = {p.field: p.message for p in caught.value.problems}
    assert set(fields) == {
        "bandwith_Bps",
        "links.4.latency",
        "matmul_flops.float32",
        "matmul_flops.float64",
        "sharing_slowdown.8",  # faster than an equal share of the cores
        "sharing_slowdown.1",  # one rank shares nothing
        "model_rate_share",
        "arrival_skew.8",
        "arrival_skew_cap.8",
    }
    assert "seconds in [0, 1.0]" in fields["arrival_skew_cap.8"]
    assert "<= 4" in fields["model_rate_share"]
    assert "did you mean latency_s" in fields["links.4.latency"]
    assert "unknown key" in fields["bandwith_Bps"] and "> 0" in fields["matmul_flops.float32"]
    assert str(path) in caught.value.source


def test_sharing_is_measured_for_the_counts_that_outnumber_the_cores():
    """Calibrate times ranks sharing the cores for each divisor of the world whose threads outnumber
    the cores. 3 ranks told there are 2 cores: each step against 1.5x alone, at least 1 (faster than
    an equal share is noise) and well under the 1.5 that leaving out the equal share would read
    (this machine: 1.10 for 4 ranks on its 2 cores; a machine with 3 cores or more reads 1). The
    same launch measures the world's only group's wait for its last rank: a share of the computing
    time in [0, MAX_ARRIVAL_SKEW] (0.3-0.4 for groups of 8 here), and the seconds it grows to in
    [0, MAX_ARRIVAL_SKEW_CAP_S] (~0.03 for 8)."""
    assert counts_to_measure(8, 1, 2) == [4, 8] and counts_to_measure(6, 1, 2) == [3, 6]
    assert counts_to_measure(8, 2, 2) == [2, 4, 8] and counts_to_measure(2, 1, 2) == []
    if usable_cores() < 2:  # one core: 3 ranks' share is a third, alone would read 2x (not this)
        pytest.skip("needs 2 cores or more, as this project's machines have")
    with tempfile.TemporaryDirectory() as tmp:
        sharing = partial(measure_sharing, cores=2, timeout_s=120)
        measured = _launch(sharing, 3, 1, Path(tmp) / "sharing", "cpu")
    slowdown, skew, cap = measured["slowdown"], measured["arrival_skew"], measured["arrival_skew_cap"]
    assert list(slowdown) == ["3"] and 1.0 <= slowdown["3"] < 1.45
    assert list(skew) == ["3"] and 0.0 <= skew["3"] < MAX_ARRIVAL_SKEW  # the bound would be a clamped misread
    # milliseconds here (3-19 for 2-8 ranks): far under the 1 s clamp, which a reading in the wrong
    # unit would reach
    assert list(cap) == ["3"] and 0.0 <= cap["3"] < MAX_ARRIVAL_SKEW_CAP_S / 4


def test_a_missing_profile_names_the_shipped_ones():
    with pytest.raises(UsageError, match="'h1000'.*did you mean h100.*h100, h200"):
        load_profile("h1000")


def test_save_and_load_round_trip(tmp_path):
    calibrated = small_profile(  # every field --calibrate writes, per-kind links among them
        shared_cores=2,
        calibrated_world=8,
        threads_per_rank=2,
        op_overhead_s=12e-6,
        dtensor_op_overhead_s=40e-6,
        fsdp_unit_overhead_s=1.1e-3,
        checkpoint_overhead_s=0.8e-3,
        sharing_slowdown={4: 1.08, 8: 1.2},
        arrival_skew={2: 0.09, 8: 0.32},
        arrival_skew_cap={2: 0.005, 8: 0.028},
        model_rate_share=0.8,
        peak_flops={"float32": 2e11},
        attention_flops={"float32": 6e10},
        kind_links={"reduce_scatter": {2: Link(20e-6, 5e8), 8: Link(90e-6, 4e8)}},
    )
    for profile in (load_profile("h200"), calibrated):
        path = tmp_path / f"{profile.name}.toml"
        save_profile(profile, path)
        assert load_profile(str(path)) == profile
        assert path.read_text().startswith(
            f"# hardware profile {profile.name}\n# {profile.source.splitlines()[0]}"
        )


def test_collective_time_uses_the_algorithm_factors():
    profile = small_profile()
    link = profile.link(8, False)

    def bandwidth_part(kind: str, nbytes: int = 64 * MIB) -> float:
        return profile.collective_time(kind, nbytes, 8) - link.latency_s

    assert bandwidth_part("all_reduce") == pytest.approx(2 * bandwidth_part("all_gather"))
    assert bandwidth_part("reduce_scatter") == pytest.approx(64 * MIB * 7 / 8 / 1e9)
    assert bandwidth_part("broadcast") == pytest.approx(64 * MIB / 1e9)
    assert profile.collective_time("all_reduce", 64 * MIB, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        profile.collective_time("allreduce", 1, 8)


def test_link_interpolates_between_measured_group_sizes():
    profile = small_profile(inter_node=Link(50e-6, 4e8))
    assert profile.link(2, False) == Link(10e-6, 1e9)  # measured
    assert profile.link(3, False) == Link(pytest.approx(20e-6), 1e9)  # nearest 2, 2 ring steps for 1
    assert profile.link(4, False) == Link(pytest.approx(30e-6), 1e9)  # a tie: the larger, 8: 3 steps of 7
    assert profile.link(64, True) == Link(50e-6, 4e8)  # across nodes: as written
    with pytest.raises(RecipeError, match="inter_node"):
        small_profile().link(16, True)
    with pytest.raises(ValueError, match="node of 8"):
        profile.link(16, False)


def test_a_dtype_without_a_rate_is_refused_naming_it():
    with pytest.raises(RecipeError, match=r"(?s)hardware profile test.*'bfloat16'.*float32"):
        small_profile().matmul_rate("bfloat16")


def test_fit_recovers_a_known_link():
    truth = Link(300e-6, 2e9)
    timings = [
        (kind, n, truth.latency_s + n * factor / truth.bandwidth_Bps)
        for kind, factor in (("all_gather", 3 / 4), ("all_reduce", 3 / 2))
        for n in (4 * KIB, 64 * KIB, 4 * MIB)
    ]
    link, error = fit_link(4, timings)
    assert link.latency_s == pytest.approx(truth.latency_s) and link.bandwidth_Bps == pytest.approx(2e9)
    assert error == pytest.approx(0, abs=1e-9)


def test_a_collective_is_timed_as_what_it_adds_behind_compute():
    """cost_under_load on a clock that a burst moves 5 ms and the collective 2 ms: 2 ms each, the
    bursts' own time taken out, the ranks synchronised before each loop; a cost lost in noise
    (the loop with the collective no slower) is 0, which the fit leaves out (next test)."""
    now, synced = [0.0], []

    def advance(seconds):
        return lambda: now.__setitem__(0, now[0] + seconds)

    cost = cost_under_load(advance(2e-3), advance(5e-3), lambda: synced.append(now[0]), 10, lambda: now[0])
    assert cost == pytest.approx(2e-3)
    assert synced == pytest.approx([14e-3, 64e-3])  # after the warm-up, and after the bursts alone
    assert cost_under_load(advance(0), advance(5e-3), lambda: None, 10, lambda: now[0]) == 0.0


@pytest.mark.parametrize("noise", [0.2, 5.0])
def test_fit_leaves_out_a_timing_that_noise_moved(noise):
    """A timing behind compute is a difference of two loops: one that noise cut to a fifth (or
    made 5x) is left out wherever it falls, and the link is the truth (least squares on all of
    them put the latency up to two thirds low, or found no bandwidth when a 4 MiB timing was cut)."""
    truth = Link(3e-3, 3e8)
    timings = [
        (kind, n, truth.latency_s + n * factor / truth.bandwidth_Bps)
        for kind, factor in (("all_gather", 1 / 2), ("all_reduce", 1.0), ("reduce_scatter", 1 / 2))
        for n in (4 * KIB, 64 * KIB, 512 * KIB, 4 * MIB)
    ]
    for i, (kind, n, seconds) in enumerate(timings):
        link, error = fit_link(2, [*timings[:i], (kind, n, seconds * noise), *timings[i + 1 :]])
        assert link.latency_s == pytest.approx(truth.latency_s, rel=1e-6), (kind, n)
        assert link.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6), (kind, n)
        assert error > 0.2  # the left-out timing still counts in the error reported
    zeroed = [(kind, n, 0.0 if n == 4 * KIB else seconds) for kind, n, seconds in timings]
    link, _ = fit_link(2, zeroed)  # costs noise drowned (0) are no timings
    assert link.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6)
    with pytest.raises(RunError, match="too busy"):
        fit_link(2, [(kind, n, 0.0) for kind, n, _ in timings])


def test_a_dtensor_op_an_fsdp_unit_and_a_checkpointed_block_cost_the_host_more_than_a_local_op():
    """The DTensor probe (a TP block's sharding propagation and redistribution on a fake 2-rank
    mesh), the FSDP probe (a tiny Llama wrapped as a run wraps it, on a fake 2-rank mesh) and the
    AC probe (the tiny Llama under full AC) run, in a process of their own as calibrate runs them
    (they set up a process group): a DTensor op costs more than a plain op (its work is Python on
    top), a unit's hooks per microbatch far more (~150 ops' worth on this project's VM: unsharding,
    copies, resharding in Python), and so do a checkpointed block's (~110: every saved tensor
    packed and unpacked in Python, twice), beyond the recompute's ops. Each is its probe's least
    of PROBE_ROUNDS readings, as calibrate keeps it: one reading of the plain op, 2x its usual on a
    busy CI host, once read level with the Llama's."""
    with trace_pool(1) as pool:
        costs, plain_op = pool.submit(host_costs).result()
    # calibrate builds a GPU's Profile from them as they are (Profile(**rates)): each is a field
    assert set(costs) <= {field.name for field in dataclasses.fields(Profile)}
    per_op, per_dtensor_op, per_unit, per_block = (
        costs[name]
        for name in (
            "op_overhead_s",
            "dtensor_op_overhead_s",
            "fsdp_unit_overhead_s",
            "checkpoint_overhead_s",
        )
    )
    assert 0 < plain_op < per_op < 1e-3  # a transformer's op brings module calls, views, autograd nodes
    assert per_dtensor_op > per_op
    assert 20 * per_op < per_unit < 0.1
    assert 20 * per_op < per_block < 0.1


def test_each_rate_is_the_fastest_of_its_rounds(monkeypatch):
    """A slow reading (a busy neighbour on a shared host) does not become the profile's rate: each
    probe runs `rounds` times and the fastest is kept, here the second of three."""
    from meshforge.simulate import rate_probes

    readings = {}

    def reading(name: str):
        def probe(*args) -> float:
            n = readings.setdefault((name, args[:-2]), iter([4.6e9, 27e9, 19e9]))
            return next(n)

        return probe

    for name in ("matmul_rate", "attention_rate", "memory_rate"):
        monkeypatch.setattr(rate_probes, name, reading(name))
    rates = rate_probes.compute_rates("cpu", rounds=PROBE_ROUNDS)
    assert rates["memory_Bps"] == 27e9
    assert rates["matmul_flops"] == {"float32": 27e9, "bfloat16": 27e9}
    assert rates["attention_flops"] == {"float32": 27e9, "bfloat16": 27e9}
    probe = rate_probes.CPU_PROBE
    shapes = len(probe.matmul_shapes) * len(probe.matmul_dtypes)
    assert len(readings) == 1 + shapes + len(probe.attention_dtypes)  # each probed, three rounds each


def test_a_models_step_reaches_a_share_of_the_probes_rates():
    """The reference Llama's step, priced at the probes' rates and its ops' host cost as measured
    here, against its timed seconds: a share below 1 (its operands are cold, its embedding's and
    loss's backward untimed by any probe; 0.79-0.84 in calibrations here), yet well above a few
    tenths. The share itself: a step of 1 GFLOP at 100 GFLOP/s, 1 GB at 10 GB/s and 1000 ops at
    10 us, that took 0.16 s, ran its 0.11 s of arithmetic in 0.15 s."""
    rates, per_op = compute_rates("cpu", rounds=PROBE_ROUNDS), least_of(op_overhead)  # as calibrate
    assert 0.3 < max(model_rate_share(rates, per_op) for _ in range(3)) < 1.2
    cost = PhaseCost(flops={"float32": 1e9}, memory_bytes=1e9, ops=1000)
    at = {"matmul_flops": {"float32": 1e11}, "attention_flops": {}, "memory_Bps": 1e10}
    assert share_of_rates(0.16, cost, at, 1e-5) == pytest.approx(0.11 / 0.15)
    assert share_of_rates(0.01, cost, at, 1e-5) == 4.0  # the host's part misread: bounded


def test_calibrating_gpus_refuses_what_it_cannot_measure(monkeypatch, tmp_path):
    """On a GPU, --calibrate measures one GPU's compute: without a CUDA device, or for a world of
    more (NCCL links are not measured), it refuses with the way round, before any process starts;
    a cached profile of the other kind of device is refused too (each is priced by its own model)."""
    with pytest.raises(UsageError, match="no CUDA device: calibrate on the GPU node, or tune with --profile"):
        calibrate(1, 1, None, Console(), device="cuda")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(UsageError, match=r"calibrating 4 GPUs: measuring NCCL links is not implemented"):
        calibrate(4, 1, None, Console(), device="cuda")
    cpu_ranks = tmp_path / "cpu.toml"
    save_profile(small_profile(shared_cores=2), cpu_ranks)
    with pytest.raises(UsageError, match="measured CPU ranks, but the recipe runs on cuda"):
        local_profile(None, False, str(cpu_ranks), 1, Console(), "cuda")
    assert local_profile(None, False, str(cpu_ranks), 1, Console(), "cpu").shared_cores == 2
