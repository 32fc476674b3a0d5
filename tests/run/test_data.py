"""The synthetic source (a known floor) and its index-addressed loader; corpora are in test_corpus.py."""

from __future__ import annotations

import torch

from meshforge.run.data.synthetic import MarkovSource, ShardedLoader


def test_markov_floor_is_the_true_models_cross_entropy():
    src = MarkovSource(vocab_size=64, seq_len=256, branching=4, seed=7)
    tokens = src.batch(range(64))  # (64, 257)
    p = src.probability(tokens[:, :-1], tokens[:, 1:])
    empirical = float(-p.log().mean())
    assert 0.5 < src.entropy_rate() < 4**0.5  # 4 successors: below log(4) = 1.386
    assert abs(empirical - src.entropy_rate()) < 0.03
    assert (p > 0).all()  # every step follows the chain


def test_sparse_sampler_draws_what_the_dense_chain_draws():
    """The sampler searches each row's few successors; a search over the dense V x V
    cumulative row (the textbook inverse-CDF draw) must give the same tokens."""
    from meshforge.core.seeding import seeded_generator

    src = MarkovSource(vocab_size=96, seq_len=40, branching=5, seed=3)
    dense = torch.zeros(96, 96, dtype=torch.float64).scatter_(1, src.successors, src.probs)
    assert torch.allclose(dense.sum(-1), torch.ones(96, dtype=torch.float64))
    assert (src.successors.sort(-1).values.diff(dim=-1) > 0).all()  # distinct successors
    cdf, pi_cdf = dense.cumsum(-1), src.stationary.cumsum(0)
    for i in (0, 7, 123):
        u = torch.rand(41, generator=seeded_generator(3, i), dtype=torch.float64)
        seq = [int(torch.searchsorted(pi_cdf, u[:1]).clamp_max(95))]
        for t in range(1, 41):
            seq.append(int(torch.searchsorted(cdf[seq[-1]], u[t : t + 1]).clamp_max(95)))
        assert src.batch([i])[0].tolist() == seq


def test_samples_depend_only_on_their_global_index():
    src = MarkovSource(vocab_size=32, seq_len=16, seed=1)
    assert torch.equal(src.batch([5, 6])[1], src.batch([6])[0])
    assert not torch.equal(src.batch([5])[0], src.batch([6])[0])
    assert src.batch([3]).shape == (1, 17)


def test_dp_shards_partition_the_global_batch():
    src = MarkovSource(vocab_size=32, seq_len=8, seed=1)
    one = ShardedLoader(src, micro_batch=8, grad_accum=2)  # 1 rank, 2 accumulation steps
    shards = [ShardedLoader(src, micro_batch=4, grad_accum=1, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(2):
        whole = torch.cat([b.inputs for b in one.next_step()])
        parts = torch.cat([s.next_step()[0].inputs for s in shards])
        assert sorted(map(tuple, whole.tolist())) == sorted(map(tuple, parts.tolist()))
    assert one.state_dict() == {"position": 32} == shards[0].state_dict()
    resumed = ShardedLoader(src, micro_batch=8, grad_accum=2)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(resumed.next_step()[0].inputs, one.next_step()[0].inputs)


def test_prefetching_loader_hands_out_the_same_stream_and_counts_only_what_it_handed_out():
    src = MarkovSource(vocab_size=32, seq_len=8, seed=1)
    plain = ShardedLoader(src, micro_batch=2, grad_accum=2, dp_rank=1, dp_size=2)
    ahead = ShardedLoader(src, micro_batch=2, grad_accum=2, dp_rank=1, dp_size=2, prefetch=True)
    for _ in range(3):
        for a, b in zip(plain.next_step(), ahead.next_step()):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert ahead.state_dict() == plain.state_dict() == {"position": 24}  # the step built ahead is not counted
    ahead.load_state_dict({"position": 8})  # a resume drops the step built ahead for position 24
    rewound = ShardedLoader(src, 2, 2, 1, 2)
    rewound.load_state_dict({"position": 8})
    assert torch.equal(ahead.next_step()[1].labels, rewound.next_step()[1].labels)
    ahead.close()


def test_labels_are_inputs_shifted_by_one():
    src = MarkovSource(vocab_size=32, seq_len=8, seed=1)
    b = ShardedLoader(src, micro_batch=2, grad_accum=1).next_step()[0]
    assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1])
