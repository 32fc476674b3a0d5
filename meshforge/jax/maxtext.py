"""MaxText checkpoints of the dense families whose weight adapter names a MaxText decoder block
(models/<family>/adapter.py: Llama 3's and Qwen3's), written and read.

MaxText's decoder holds one parameter tree (`params/params/...` in an Orbax checkpoint, item
`items` at step 0) with the layers scanned: each block's arrays stacked on axis 1
(`param_scan_axis`). Read off MaxText 0.2.5's converters (`checkpoint_conversion/to_maxtext.py`,
`llama_or_mistral_ckpt.py`) and checked by running its own decoder on what this module writes
(scripts/maxtext_check.py, logits within 1e-5 of ours):
- kernels are `x @ W`: our `(out, in)` weights transposed, attention split into heads
  (query `[E, L, H, D]`, out `[H, L, D, E]`); w1/w3/w2 are MaxText's wi_0/wi_1/wo;
- Llama's query kernel carries the attention scale 1/sqrt(head_dim) (MaxText folds it into the
  weights; Qwen3, with q/k norms, scales at run time): the adapter's `maxtext_query_scaled`;
- RoPE: MaxText's `llama3.1` rotary (our Llama's: interleaved pairs, Llama 3.1 scaling with its
  factors 8/1/4/8192 fixed in MaxText's code) and its plain rotary for Qwen3 (rotate-half, ours too):
  no permutation either way, and any other RoPE scaling is refused, not approximated;
- a tied output is written as MaxText's untied `logits_dense` (its tied path rounds the embedding
  to bf16 for the logits and divides them by sqrt(dim)).
`maxtext_config` is the MaxText config that reads the tree (written beside it, for pyconfig).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from meshforge.core.errors import IncompatibleWeights
from meshforge.jax.bridge import nest
from meshforge.models import MODELS, spec_of
from meshforge.models.common.adapter import StateDictAdapter
from meshforge.models.common.moe import has_experts

SCAN_AXIS = 1  # MaxText's param_scan_axis
# (our name in a block, MaxText's under decoder/layers, how a (out, in) weight becomes its kernel)
BLOCK = {
    "attention_norm.weight": "pre_self_attention_layer_norm/scale",
    "ffn_norm.weight": "post_self_attention_layer_norm/scale",
    "attention.wq.weight": "self_attention/query/kernel",
    "attention.wk.weight": "self_attention/key/kernel",
    "attention.wv.weight": "self_attention/value/kernel",
    "attention.wo.weight": "self_attention/out/kernel",
    "attention.q_norm.weight": "self_attention/query_norm/scale",  # a family with q/k norms
    "attention.k_norm.weight": "self_attention/key_norm/scale",
    "feed_forward.w1.weight": "mlp/wi_0/kernel",
    "feed_forward.w3.weight": "mlp/wi_1/kernel",
    "feed_forward.w2.weight": "mlp/wo/kernel",
}


def maxtext_adapter(args) -> StateDictAdapter:
    """The adapter of `args`' family, which must have a MaxText decoder block for these args
    (its `maxtext_block` refuses what MaxText cannot compute the same way, naming it)."""
    spec = spec_of(args)
    if not has_maxtext(spec.adapter):
        readable = ", ".join(s.name for s in MODELS.values() if has_maxtext(s.adapter))
        raise IncompatibleWeights(f"MaxText checkpoints: the families {readable} only, not {spec.name!r}")
    if has_experts(args):
        raise IncompatibleWeights("MaxText checkpoints: dense models only (this one has experts)")
    spec.adapter.maxtext_block(args)  # raises for what MaxText would compute otherwise
    return spec.adapter


def has_maxtext(adapter: StateDictAdapter) -> bool:
    """Whether the family's adapter names a MaxText decoder block (overrides `maxtext_block`)."""
    return type(adapter).maxtext_block is not StateDictAdapter.maxtext_block


def maxtext_config(args) -> dict:
    """The MaxText config overrides (pyconfig keys) that read the exported tree as this model."""
    cfg = {
        "base_emb_dim": args.dim,
        "base_num_query_heads": args.n_heads,
        "base_num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "base_mlp_dim": args.ffn_hidden_dim,
        "base_num_decoder_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "normalization_layer_epsilon": args.norm_eps,
        "rope_max_timescale": args.rope_theta,
        "mlp_activations": ["silu", "linear"],
        "logits_via_embedding": False,
        "scan_layers": True,
        "param_scan_axis": SCAN_AXIS,
    }
    return {**cfg, **maxtext_adapter(args).maxtext_block(args)}


def to_maxtext(state: dict[str, np.ndarray], args) -> dict[str, np.ndarray]:
    """Our state dict (numpy, full) -> MaxText's flat tree ('decoder/layers/mlp/wo/kernel': array)."""
    scaled = maxtext_adapter(args).maxtext_query_scaled
    e, h, k, d = args.dim, args.n_heads, args.kv_heads, args.head_dim
    heads = {"wq": (e, h, d), "wk": (e, k, d), "wv": (e, k, d)}

    def kernel(name: str, w: np.ndarray) -> np.ndarray:
        proj = name.split(".")[1] if name.startswith("attention.w") else ""
        if proj in heads:
            w = w.T.reshape(heads[proj])
            return w / np.sqrt(d).astype(w.dtype) if proj == "wq" and scaled else w
        if proj == "wo":
            return w.T.reshape(h, d, e)
        return w.T if name.startswith("feed_forward") else w

    output = state.get("output.weight", state["tok_embeddings.weight"])  # tied: the embedding
    tree = {
        "token_embedder/embedding": state["tok_embeddings.weight"],
        "decoder/decoder_norm/scale": state["norm.weight"],
        "decoder/logits_dense/kernel": output.T,
    }
    for ours, theirs in BLOCK.items():
        per_layer = [
            state[f"layers.{i}.{ours}"] for i in range(args.n_layers) if f"layers.{i}.{ours}" in state
        ]
        if per_layer:
            tree[f"decoder/layers/{theirs}"] = np.stack([kernel(ours, w) for w in per_layer], axis=SCAN_AXIS)
    return {name: np.ascontiguousarray(a) for name, a in tree.items()}


def from_maxtext(tree: dict[str, np.ndarray], args) -> dict[str, np.ndarray]:
    """MaxText's flat tree -> our state dict; a missing or misshapen array is refused by name."""
    adapter = maxtext_adapter(args)
    e, d = args.dim, args.head_dim
    expected = to_maxtext_shapes(args)
    if bad := [
        f"{n}: {tree[n].shape if n in tree else 'missing'} (want {s})"
        for n, s in expected.items()
        if n not in tree or tuple(tree[n].shape) != s
    ]:
        raise IncompatibleWeights(
            f"the MaxText tree is not this {spec_of(args).name} model: " + "; ".join(bad[:4])
        )
    state = {
        "tok_embeddings.weight": tree["token_embedder/embedding"],
        "norm.weight": tree["decoder/decoder_norm/scale"],
    }
    if not args.tie_embeddings:
        state["output.weight"] = tree["decoder/logits_dense/kernel"].T
    for ours, theirs in BLOCK.items():
        if f"decoder/layers/{theirs}" not in expected:
            continue
        stacked = tree[f"decoder/layers/{theirs}"]
        for i in range(args.n_layers):
            w = np.take(stacked, i, axis=SCAN_AXIS)
            if ours == "attention.wq.weight" and adapter.maxtext_query_scaled:
                w = w * np.sqrt(d).astype(w.dtype)
            if ours.startswith("attention.w"):  # heads back into rows: (E, heads, D) -> (heads*D, E)
                w = w.reshape(e, -1).T if ours != "attention.wo.weight" else w.reshape(-1, e).T
            elif ours.startswith("feed_forward"):
                w = w.T
            state[f"layers.{i}.{ours}"] = np.ascontiguousarray(w)
    return state


def to_maxtext_shapes(args) -> dict[str, tuple[int, ...]]:
    """Every array of the model's MaxText tree and its shape (what `from_maxtext` requires)."""
    e, h, k, d, n = args.dim, args.n_heads, args.kv_heads, args.head_dim, args.n_layers
    m = args.ffn_hidden_dim
    shapes = {
        "token_embedder/embedding": (args.vocab_size, e),
        "decoder/decoder_norm/scale": (e,),
        "decoder/logits_dense/kernel": (e, args.vocab_size),
        "decoder/layers/pre_self_attention_layer_norm/scale": (e, n),
        "decoder/layers/post_self_attention_layer_norm/scale": (e, n),
        "decoder/layers/self_attention/query/kernel": (e, n, h, d),
        "decoder/layers/self_attention/key/kernel": (e, n, k, d),
        "decoder/layers/self_attention/value/kernel": (e, n, k, d),
        "decoder/layers/self_attention/out/kernel": (h, n, d, e),
        "decoder/layers/mlp/wi_0/kernel": (e, n, m),
        "decoder/layers/mlp/wi_1/kernel": (e, n, m),
        "decoder/layers/mlp/wo/kernel": (m, n, e),
    }
    if maxtext_adapter(args).maxtext_qk_norm:
        shapes["decoder/layers/self_attention/query_norm/scale"] = (d, n)
        shapes["decoder/layers/self_attention/key_norm/scale"] = (d, n)
    return shapes


def save_maxtext(tree: dict[str, np.ndarray], out: Path, config: dict) -> Path:
    """`out/0/items` as MaxText's converters write it ({'params': {'params': tree}} at step 0,
    `scan_layers` in the step's metadata), and `out/maxtext_config.json`; the items path, which
    MaxText's `load_parameters_path` takes."""
    with ocp.CheckpointManager(out.absolute(), item_names=("items",)) as manager:
        item = ocp.args.PyTreeSave({"params": {"params": nest(tree, "/")}})
        manager.save(0, args=ocp.args.Composite(items=item), custom_metadata={"scan_layers": True})
        manager.wait_until_finished()
    items = out.absolute() / "0" / "items"
    config = {**config, "load_parameters_path": str(items)}  # MaxText's key for a parameter checkpoint
    (out / "maxtext_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out / "0" / "items"


def load_maxtext(path: Path) -> dict[str, np.ndarray]:
    """A MaxText parameter checkpoint (its `.../N/items` folder, or the folder holding step 0) as
    a flat tree of numpy arrays, however it was sharded when saved."""
    items = path if path.name == "items" else path / "0" / "items"
    if not items.is_dir():
        raise IncompatibleWeights(
            f"{path}: no MaxText checkpoint there (want its 0/items folder, or that folder)"
        )
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(items)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", getattr(meta, "item_metadata", meta))
    if not isinstance(tree, dict) or "params" not in tree or "params" not in tree["params"]:
        raise IncompatibleWeights(f"{items}: no params/params tree (not a MaxText parameter checkpoint)")
    want = {"params": {"params": tree["params"]["params"]}}
    restore = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), want)
    got = checkpointer.restore(
        items, args=ocp.args.PyTreeRestore(item=want, restore_args=restore, partial_restore=True)
    )
    leaves = jax.tree_util.tree_leaves_with_path(got["params"]["params"])
    return {"/".join(p.key for p in path): np.asarray(v) for path, v in leaves}
