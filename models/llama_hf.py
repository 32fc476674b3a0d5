"""The Llama family's weight formats: HuggingFace `LlamaForCausalLM` and TorchTitan names.

Our parameter names are TorchTitan's classic Llama 3 names; TorchTitan 0.3.0 saves
`attention.qkv_linear.wq.weight` and `lm_head.weight` instead. HuggingFace rotates q and k
by halves (rotate_half) where Meta/TorchTitan rotate interleaved pairs, so the rows of wq
and wk are permuted per head on the way to HF and back (as HF's own
convert_llama_weights_to_hf does). Registered as the family's `interop` (models/spec.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .llama import LlamaArgs

# ours -> HF, per layer (the "{i}" is the layer id)
_HF_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


# --- HuggingFace ------------------------------------------------------------------------


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows (Meta) -> rotate-half rows (HF), per head."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half rows (HF) -> interleaved-pair rows (Meta): the inverse of permute_to_hf."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def hf_permuted_heads(name: str, args: LlamaArgs) -> int | None:
    """How many heads `name`'s rows are permuted by in HF's layout (None: not permuted)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def hf_name(name: str) -> str:
    """Our parameter name -> HF's."""
    if name in _HF_TOP:
        return _HF_TOP[name]
    m = _LAYER_KEY.match(name)
    return f"model.layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}"


def to_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our (or TorchTitan's) state dict -> HF LlamaForCausalLM names and q/k row order."""
    out = {}
    for name, t in from_torchtitan(state).items():
        if name == "output.weight" and args.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself
        heads = hf_permuted_heads(name, args)
        out[hf_name(name)] = t if heads is None else permute_to_hf(t, heads)
    return out


def from_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> our names and q/k row order."""
    top = {v: k for k, v in _HF_TOP.items()}
    layer = {v: k for k, v in _HF_LAYER.items()}
    out = {}
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if m is None or m.group(2) not in layer:
            if "rotary_emb" in name:
                continue  # a buffer some exports carry; we recompute RoPE
            raise KeyError(f"unexpected HuggingFace Llama parameter {name!r}")
        ours = f"layers.{m.group(1)}.{layer[m.group(2)]}"
        heads = hf_permuted_heads(ours, args)
        out[ours] = t if heads is None else permute_from_hf(t, heads)
    if args.tie_embeddings:
        out.pop("output.weight", None)
    return out


def hf_config(args: LlamaArgs, dtype: str = "float32") -> dict:
    """config.json of the equivalent HF LlamaForCausalLM."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": args.head_dim,
        "torch_dtype": dtype,
    }
    if args.rope_scaling_factor is not None:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return cfg


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    """LlamaArgs of an HF Llama config.json (FFN width from intermediate_size)."""
    scaling = cfg.get("rope_scaling") or {}
    args = LlamaArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads"),
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", 10000.0),
        max_seq_len=cfg.get("max_position_embeddings", 8192),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        rope_scaling_factor=scaling.get("factor") if scaling.get("rope_type") == "llama3" else None,
        rope_low_freq_factor=scaling.get("low_freq_factor", 1.0),
        rope_high_freq_factor=scaling.get("high_freq_factor", 4.0),
        rope_original_max_seq_len=scaling.get("original_max_position_embeddings", 8192),
    )
    hidden = cfg["intermediate_size"]
    args.multiple_of, args.ffn_dim_multiplier = hidden, None  # rounds 8/3 * dim up to exactly `hidden`
    if args.ffn_hidden_dim != hidden:
        raise ValueError(f"intermediate_size {hidden} is below 8/3 x hidden_size; not a Llama FFN")
    return args


def read_hf_args(folder: Path) -> LlamaArgs:
    """The args of the HF folder's config.json."""
    return args_from_hf_config(json.loads((Path(folder) / "config.json").read_text()))


def check_compatible(checkpoint_args: LlamaArgs, recipe_args: LlamaArgs) -> list[str]:
    """What differs between a checkpoint's model and the recipe's (empty when they match)."""
    keys = (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "norm_eps",
        "rope_theta",
        "rope_scaling_factor",
        "tie_embeddings",
    )
    return [
        f"{k}: checkpoint {getattr(checkpoint_args, k)}, recipe {getattr(recipe_args, k)}"
        for k in keys
        if getattr(checkpoint_args, k) != getattr(recipe_args, k)
    ]


def save_hf(state: dict[str, torch.Tensor], args: LlamaArgs, out: Path) -> None:
    """An HF Llama folder: config.json + model.safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf = {k: v.contiguous() for k, v in to_hf(state, args).items()}
    dtype = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=1) + "\n")
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
    """Our state dict and args from an HF Llama folder (one or several safetensors files)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    args = read_hf_args(folder)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return from_hf(state, args), args


# --- TorchTitan -------------------------------------------------------------------------


def name_from_torchtitan(name: str) -> str:
    """A TorchTitan 0.3.0 name (attention.qkv_linear.wq, lm_head) -> the classic one we use."""
    return name.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output.")


def name_to_torchtitan(name: str) -> str:
    """Our name -> TorchTitan 0.3.0's (its state-dict hooks fuse q/k/v on load)."""
    return re.sub(r"\.attention\.(w[qkv])\.", r".attention.qkv_linear.\1.", name).replace(
        "output.", "lm_head."
    )


def from_torchtitan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TorchTitan state dict under our names (its RoPE cache dropped: we recompute it)."""
    return {
        name_from_torchtitan(k): v for k, v in state.items() if "rope.cache" not in k and k != "freqs_cis"
    }


def to_torchtitan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under TorchTitan 0.3.0's names."""
    return {name_to_torchtitan(k): v for k, v in state.items()}


def source_name(name: str, layout: str, available: set[str] | dict) -> str:
    """Where our parameter `name` is stored in a file of `layout` (hf | torchtitan | ours)."""
    if layout == "torchtitan":
        return name_to_torchtitan(name)
    if layout != "hf":
        return name
    if name == "output.weight" and "lm_head.weight" not in available:
        return "model.embed_tokens.weight"  # tied in the HF checkpoint
    return hf_name(name)
