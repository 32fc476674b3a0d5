"""MaxText checkpoints: the tree MaxText's decoder loads (its names, layers scanned on axis 1, its
head layout) written and read back exactly, through the CLI too, and what MaxText would compute
differently refused. MaxText itself runs in its own environment: scripts/maxtext_check.py (its
decoder on our export: Llama 3.8e-6, tied Qwen3 2.9e-6 from our logits)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("orbax.checkpoint", reason="the jax extra (installed by .[all], as CI does)")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from support import RECIPES, run_cli  # noqa: E402

from meshforge.core.errors import IncompatibleWeights  # noqa: E402
from meshforge.jax.maxtext import from_maxtext, load_maxtext, maxtext_config, save_maxtext, to_maxtext  # noqa: E402
from meshforge.models import get_model_spec  # noqa: E402
from meshforge.models.llama3.model import LlamaArgs  # noqa: E402
from meshforge.models.qwen3.model import Qwen3Args  # noqa: E402
from meshforge.run.checkpoint.dcp import load_full_model  # noqa: E402

LLAMA = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=96)
QWEN3 = Qwen3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, ffn_dim=96, tie_embeddings=True
)


def _state(family: str, args) -> dict[str, np.ndarray]:
    model = get_model_spec(family).build(args)
    model.init_weights(0)
    return {k: v.numpy() for k, v in model.state_dict().items() if k != "freqs_cis"}


def test_the_tree_has_maxtexts_names_and_shapes():
    """As MaxText 0.2.5 initialises these shapes (E 64, H 4, K 2, D 16, M 96, L 2): layers stacked
    on axis 1, query [E, L, H, D], out [H, L, D, E], the norms [dim, L]; Qwen3's q/k norms."""
    tree = to_maxtext(_state("qwen3", QWEN3), QWEN3)
    shapes = {k: v.shape for k, v in tree.items()}
    assert shapes["decoder/layers/self_attention/query/kernel"] == (64, 2, 4, 16)
    assert shapes["decoder/layers/self_attention/key/kernel"] == (64, 2, 2, 16)
    assert shapes["decoder/layers/self_attention/out/kernel"] == (4, 2, 16, 64)
    assert shapes["decoder/layers/self_attention/query_norm/scale"] == (16, 2)
    assert shapes["decoder/layers/mlp/wi_0/kernel"] == (64, 2, 96)
    assert shapes["decoder/layers/mlp/wo/kernel"] == (96, 2, 64)
    assert shapes["decoder/layers/pre_self_attention_layer_norm/scale"] == (64, 2)
    assert shapes["token_embedder/embedding"] == (256, 64) and shapes["decoder/logits_dense/kernel"] == (
        64,
        256,
    )
    assert len(tree) == 14


def test_llama_s_query_carries_the_attention_scale_and_qwen3_s_does_not():
    """MaxText folds 1/sqrt(head_dim) into Llama's query kernel; Qwen3 (q/k norms) scales at run
    time. A wrong Qwen3 scale hardly shows in logits (the norm cancels it): checked here."""
    for family, args, scale in (("llama3", LLAMA, 1 / 4), ("qwen3", QWEN3, 1.0)):
        state = _state(family, args)
        query = to_maxtext(state, args)["decoder/layers/self_attention/query/kernel"]
        ours = state["layers.1.attention.wq.weight"].T.reshape(64, 4, 16) * scale
        np.testing.assert_array_equal(query[:, 1], ours)


@pytest.mark.parametrize("family, args", [("llama3", LLAMA), ("qwen3", QWEN3)], ids=["llama3", "qwen3_tied"])
def test_a_written_checkpoint_reads_back_exactly(tmp_path, family, args):
    state = _state(family, args)
    items = save_maxtext(to_maxtext(state, args), tmp_path / "mt", maxtext_config(args))
    assert items == tmp_path / "mt" / "0" / "items" and (tmp_path / "mt" / "maxtext_config.json").is_file()
    back = from_maxtext(load_maxtext(tmp_path / "mt"), args)
    if args.tie_embeddings:
        state.pop("output.weight")  # the embedding's, written as MaxText's logits_dense
    assert set(back) == set(state)
    for k in state:
        np.testing.assert_array_equal(back[k], state[k], err_msg=k)


def test_what_maxtext_would_compute_otherwise_is_refused():
    long_context = dataclasses.replace(LLAMA, rope_scaling_factor=32.0)  # Llama 3.2's: MaxText applies 8
    with pytest.raises(IncompatibleWeights, match="MaxText's llama3.1 rotary applies"):
        to_maxtext(_state("llama3", LLAMA), long_context)
    with pytest.raises(IncompatibleWeights, match="no Llama 3 scaling"):
        to_maxtext({}, dataclasses.replace(QWEN3, rope_scaling_factor=8.0))
    moe = get_model_spec("qwen3_moe").flavors["debug"]
    with pytest.raises(IncompatibleWeights, match="the families llama3, qwen3 only, not 'qwen3_moe'"):
        to_maxtext({}, moe)
    tree = to_maxtext(_state("llama3", LLAMA), LLAMA)
    del tree["decoder/layers/mlp/wo/kernel"]
    tree["decoder/layers/mlp/wi_0/kernel"] = tree["decoder/layers/mlp/wi_0/kernel"][:, :, :48]
    with pytest.raises(
        IncompatibleWeights, match=r"wi_0/kernel: \(64, 2, 48\) \(want \(64, 2, 96\)\).*wo/kernel: missing"
    ):
        from_maxtext(tree, LLAMA)


@pytest.mark.slow
def test_export_and_import_through_the_cli(tmp_path):
    """`meshforge export --to maxtext` of a seed checkpoint, then `meshforge import --from maxtext`
    into the recipe: the same weights."""
    debug = [str(RECIPES / "debug_cpu.toml"), "mesh.pp=1", "mesh.tp=1", "mesh.dp_shard=1"]
    for args in (
        ["init", *debug, "--out", str(tmp_path / "seed")],
        ["export", str(tmp_path / "seed"), "--to", "maxtext", str(tmp_path / "mt")],
        ["import", str(tmp_path / "mt"), "--from", "maxtext", *debug, "--out", str(tmp_path / "back")],
    ):
        proc = run_cli(args, cwd=tmp_path, program="meshforge")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    (seed,), (back,) = ((tmp_path / d).glob("step-*") for d in ("seed", "back"))
    a, b = load_full_model(seed)[0].state_dict(), load_full_model(back)[0].state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_that_is_no_maxtext_checkpoint_is_refused(tmp_path):
    with pytest.raises(IncompatibleWeights, match="no MaxText checkpoint there"):
        load_maxtext(tmp_path)
