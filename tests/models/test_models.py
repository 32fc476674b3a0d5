"""The Llama model: published shapes, forward/backward, init, pipeline split, TorchTitan parity."""

from __future__ import annotations

import pytest
import torch

from meshforge.configs.schema import PPConfig
from meshforge.models import Transformer, count_params, model_args
from meshforge.models.llama3.model import LlamaArgs
from meshforge.parallelisms.pp import split_model, stage_layout


@pytest.mark.parametrize(
    "flavor, expected",
    [
        ("1b", 1_235_814_400),  # Llama-3.2-1B (tied embeddings)
        ("3b", 3_212_749_824),  # Llama-3.2-3B (tied embeddings)
        ("8b", 8_030_261_248),  # Llama-3.1-8B
        ("70b", 70_553_706_496),  # Llama-3.1-70B
    ],
)
def test_published_parameter_counts(flavor, expected):
    with torch.device("meta"):
        model = Transformer(model_args("llama3", flavor))
    assert count_params(model) == expected


def test_published_ffn_sizes():
    assert model_args("llama3", "1b").ffn_hidden_dim == 8192
    assert model_args("llama3", "8b").ffn_hidden_dim == 14336
    assert model_args("llama3", "70b").ffn_hidden_dim == 28672


def test_module_names_follow_torchtitan():
    with torch.device("meta"):
        model = Transformer(model_args("llama3", "debug"))
    names = {n for n, _ in model.named_parameters()}
    for n in [
        "tok_embeddings.weight",
        "norm.weight",
        "output.weight",
        "layers.3.attention.wq.weight",
        "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
    ]:
        assert n in names
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]


def test_forward_backward_shapes():
    args = model_args("llama3", "debug")
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, args.vocab_size)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_causality():
    model = Transformer(model_args("llama3", "debug"))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (tokens[0, 8] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :8], b[0, :8])  # the future never leaks into the past
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_init_is_seeded_and_per_parameter():
    args = model_args("llama3", "debug")
    a, b, c = Transformer(args), Transformer(args), Transformer(args)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    c.init_weights(seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n
    # a pipeline stage initialised on its own draws the same values as the whole model
    with torch.device("meta"):
        meta = Transformer(args)
    stage = split_model(meta, [2, 3], is_first=False, is_last=True)
    stage.to_empty(device="cpu")
    stage.init_weights(seed=3)
    assert torch.equal(stage.layers["2"].attention.wq.weight, a.layers["2"].attention.wq.weight)
    assert stage.tok_embeddings is None and stage.output is not None


def test_tied_embeddings_share_one_tensor():
    args = LlamaArgs(
        dim=32, n_layers=1, n_heads=2, vocab_size=64, multiple_of=16, tie_embeddings=True, max_seq_len=16
    )
    model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert count_params(model) == 64 * 32 + 32 * 32 * 4 + 3 * 32 * model.args.ffn_hidden_dim + 3 * 32


def test_stage_layout_balances_and_honours_explicit_layouts():
    assert stage_layout(4, 2, PPConfig()) == [[0, 1], [2, 3]]
    assert stage_layout(4, 4, PPConfig()) == [[0], [1], [2], [3]]
    assert stage_layout(6, 2, PPConfig(embedding_weight=2.0)) == [[0, 1], [2, 3, 4, 5]]
    assert stage_layout(6, 2, PPConfig(output_weight=2.0)) == [[0, 1, 2, 3], [4, 5]]
    assert stage_layout(5, 2, PPConfig(layers_per_stage=[1, 4])) == [[0], [1, 2, 3, 4]]


@pytest.mark.slow
def test_logits_match_torchtitan():
    """Same weights -> our logits equal TorchTitan 0.3.0's llama3 within 1e-5 (fp32)."""
    pytest.importorskip("triton")  # TorchTitan imports on the CPU build only with triton
    pytest.importorskip("torchtitan", reason="the titan extra (installed by .[all], as CI does)")
    from torchtitan.models.llama3 import llama3_configs

    torch.manual_seed(0)
    titan = llama3_configs["debugmodel"](attn_backend="flex").build()
    titan.init_states()
    with torch.no_grad():
        for n, p in titan.named_parameters():
            if "norm" in n:  # non-trivial norms, so a misplaced norm shows
                p.uniform_(0.5, 1.5)
        for layer in titan.layers.values():  # sharpen attention: nearly flat logits hide bugs
            layer.attention.qkv_linear.wqkv.weight.mul_(3.0)
    ours = Transformer(
        LlamaArgs(
            dim=256,
            n_layers=6,
            n_heads=16,
            vocab_size=2048,
            multiple_of=256,
            rope_theta=500000.0,
            rope_scaling_factor=8.0,
            max_seq_len=1024,
        )
    )
    # TorchTitan 0.3.0 names: fused q/k/v unfused by its state-dict hooks, lm_head for output
    renamed = {
        k.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output."): v
        for k, v in titan.state_dict().items()
        if "rope.cache" not in k
    }
    missing, unexpected = ours.load_state_dict(renamed, strict=False)
    assert not unexpected and not [m for m in missing if m != "freqs_cis"]
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(64).repeat(2, 1)
    with torch.no_grad():  # flex attention has no CPU backward; the forward is what we compare
        expected = titan(tokens, positions, titan.get_attention_masks(positions))
        got = ours(tokens)
    assert expected.std() > 1.0  # the weights are sharp enough for the comparison to mean something
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_flops_per_token_for_llama_8b():
    from meshforge.run.observe.flops import flops_per_token

    args = model_args("llama3", "8b")
    # 6 x (8,030,261,248 - 128,256 x 4,096 embedding) + 12 x 32 layers x 32 heads x 128 x 8,192
    assert flops_per_token(args, 8192, 8_030_261_248) == 6 * 7_504_924_672 + 12_884_901_888
    tied = model_args("llama3", "1b")  # tied: the embedding matrix is also the output matmul
    assert flops_per_token(tied, 1, 1_235_814_400) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64
