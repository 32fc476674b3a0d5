"""Name maps between our parameter names and HF's / TorchTitan's, for any family whose
HF layout is `model.embed_tokens`, `model.layers.N.<sub-module>`, `model.norm`, `lm_head`,
with optionally some rows permuted per head (Llama's q/k: interleaved vs rotate-half RoPE),
and optionally parameters HF stores as several tensors (MoE experts saved one per expert) or
as part of one (transformers' fused `gate_up_proj`)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from meshforge.core.files import save_safetensors

HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DECODER_LAYER = {  # ours -> HF, within a block of the shared decoder
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
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows (Meta) -> rotate-half rows (HF), per head."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half rows (HF) -> interleaved-pair rows (Meta): the inverse of permute_to_hf."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _full(index, ndim: int) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    return index + (slice(None),) * (ndim - len(index))


def _shape(t) -> list[int]:
    return list(t.shape) if isinstance(t, torch.Tensor) else list(t.get_shape())


class Stacked:
    """Several HF tensors (safetensors slices or tensors) seen as one, stacked on a new first
    dim; a slice reads only the parts it covers (an expert-parallel rank: its own experts)."""

    def __init__(self, parts: list):
        self.parts = parts

    def get_shape(self) -> list[int]:
        return [len(self.parts), *_shape(self.parts[0])]

    def __getitem__(self, index) -> torch.Tensor:
        first, *rest = _full(index, len(self.get_shape()))
        chosen = [p[tuple(rest)] for p in self.parts[first]]
        return torch.stack(chosen) if chosen else self.parts[0][tuple(rest)][None][:0]


class Chunk:
    """Chunk `i` of `n` equal ones along `dim` of one HF tensor (gate of a fused gate_up_proj)."""

    def __init__(self, whole, dim: int, i: int, n: int):
        self.whole, self.dim = whole, dim
        self.size = _shape(whole)[dim] // n
        self.start = i * self.size

    def get_shape(self) -> list[int]:
        shape = _shape(self.whole)
        shape[self.dim] = self.size
        return shape

    def __getitem__(self, index) -> torch.Tensor:
        index = list(_full(index, len(self.get_shape())))
        a, b, _ = index[self.dim].indices(self.size)
        index[self.dim] = slice(self.start + a, self.start + max(a, b))
        return self.whole[tuple(index)]


class _Assembled:
    """A safe_open handle's interface (`get_slice`) over a view: what WeightReader opens."""

    def __init__(self, view):
        self.view = view

    def get_slice(self, key: str):
        return self.view


class HFNames:
    """One family's HF names: `layer` maps a block's parameter (ours) to HF's; `permuted(name,
    args)` says by how many heads a parameter's rows are permuted in HF's layout (or None).

    `stacked` maps a block's parameter that HF saves as one tensor per index of its first dim
    to that tensor's name with `{}` for the index (`moe.experts.w1` ->
    `mlp.experts.{}.gate_proj.weight`): written so, read so. `fused` says where else it may be
    found: (HF name, dim, i, n), chunk i of n along dim of one tensor (transformers' in-memory
    `mlp.experts.gate_up_proj`); read only."""

    def __init__(
        self,
        layer: dict[str, str],
        permuted: Callable[[str, object], int | None],
        family: str,
        stacked: dict[str, str] | None = None,
        fused: dict[str, tuple[str, int, int, int]] | None = None,
    ):
        self.layer, self.permuted, self.family = layer, permuted, family
        self.stacked, self.fused = stacked or {}, fused or {}
        self._layer_back = {v: k for k, v in layer.items()}
        self._top_back = {v: k for k, v in HF_TOP.items()}
        self._stacked_back = [
            (re.compile(r"(\d+)".join(map(re.escape, hf.split("{}"))) + "$"), ours)
            for ours, hf in self.stacked.items()
        ]
        self._fused_back: dict[str, list[str]] = {}
        for ours, (hf, *_) in self.fused.items():
            self._fused_back.setdefault(hf, []).append(ours)

    def composite(self, name: str) -> bool:
        """Whether our parameter `name` is stored by HF as several tensors or part of one."""
        m = _LAYER_KEY.match(name)
        return m is not None and (m.group(2) in self.stacked or m.group(2) in self.fused)

    def owners(self, hf: str) -> list[str]:
        """Our composite parameters that the HF tensor `hf` holds (all or part of); [] if none."""
        m = _HF_LAYER_KEY.match(hf)
        if m is None:
            return []
        layer, rest = m.groups()
        found = [ours for pattern, ours in self._stacked_back if pattern.match(rest)]
        return [f"layers.{layer}.{ours}" for ours in found or self._fused_back.get(rest, [])]

    def view(self, name: str, open_hf: Callable[[str], object], available) -> Stacked | Chunk:
        """Our composite parameter as a lazy view (`get_shape`, `[index]`) over the HF tensors
        in `available`, opened by `open_hf(hf_name)`: its stacked parts, else its fused chunk."""
        layer, rest = _LAYER_KEY.match(name).groups()
        parts: list = []
        if rest in self.stacked:
            template = f"model.layers.{layer}.{self.stacked[rest]}"
            while template.format(len(parts)) in available:
                parts.append(open_hf(template.format(len(parts))))
        if parts:
            return Stacked(parts)
        where = [f"model.layers.{layer}.{self.stacked[rest]}"] if rest in self.stacked else []
        if rest in self.fused:
            hf, dim, i, n = self.fused[rest]
            if f"model.layers.{layer}.{hf}" in available:
                return Chunk(open_hf(f"model.layers.{layer}.{hf}"), dim, i, n)
            where.append(f"model.layers.{layer}.{hf}")
        raise KeyError(f"{name}: the HF {self.family} checkpoint has none of {' or '.join(where)}")

    def hf_name(self, name: str) -> str:
        """Our parameter name -> HF's."""
        if name in HF_TOP:
            return HF_TOP[name]
        m = _LAYER_KEY.match(name)
        return f"model.layers.{m.group(1)}.{self.layer[m.group(2)]}"

    def our_name(self, hf: str) -> str | None:
        """HF's parameter name -> ours; None for buffers we recompute (rotary_emb)."""
        if hf in self._top_back:
            return self._top_back[hf]
        m = _HF_LAYER_KEY.match(hf)
        if m is None or m.group(2) not in self._layer_back:
            if "rotary_emb" in hf:
                return None
            raise KeyError(f"unexpected HuggingFace {self.family} parameter {hf!r}")
        return f"layers.{m.group(1)}.{self._layer_back[m.group(2)]}"

    def tensor_to_hf(self, name: str, t: torch.Tensor, args) -> tuple[str, torch.Tensor] | list | None:
        """One of our tensors as HF stores it: a (name, tensor) pair, a list of them (a stacked
        parameter), or None (the tied output, which HF ties itself)."""
        name = name_from_torchtitan(name)
        if name == "output.weight" and args.tie_embeddings:
            return None
        m = _LAYER_KEY.match(name)
        if m and m.group(2) in self.stacked:  # one HF tensor per index of the first dim
            template = f"model.layers.{m.group(1)}.{self.stacked[m.group(2)]}"
            return [(template.format(i), part) for i, part in enumerate(t)]
        heads = self.permuted(name, args)
        return self.hf_name(name), t if heads is None else permute_to_hf(t, heads)

    def to_hf(self, state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """Our (or TorchTitan's) state dict -> HF names and row order."""
        pairs = (self.tensor_to_hf(k, v, args) for k, v in state.items() if not _rope_cache(k))
        return dict(_pairs(pairs))

    def from_hf(self, state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """An HF state dict -> our names and row order."""
        out, composite = {}, set()
        for hf, t in state.items():
            owners = self.owners(hf)  # a part of a composite parameter: assembled below
            composite.update(owners)
            ours = None if owners else self.our_name(hf)
            if ours is None:
                continue
            heads = self.permuted(ours, args)
            out[ours] = t if heads is None else permute_from_hf(t, heads)
        for ours in sorted(composite):
            out[ours] = self.view(ours, state.__getitem__, state)[()]
        if args.tie_embeddings:
            out.pop("output.weight", None)
        return out

    def source_name(self, name: str, layout: str, available) -> str:
        """Where our parameter `name` is stored in a file of `layout` (hf | torchtitan | ours).
        `available`: the names in the files, each to its safe_open handle (WeightReader's map);
        a composite parameter is added to it as one lazy view, under our name."""
        if layout == "torchtitan":
            return name_to_torchtitan(name)
        if layout != "hf":
            return name
        if name == "output.weight" and "lm_head.weight" not in available:
            return "model.embed_tokens.weight"  # tied in the HF checkpoint
        if self.composite(name):
            if name not in available:
                available[name] = _Assembled(
                    self.view(name, lambda hf: available[hf].get_slice(hf), available)
                )
            return name
        return self.hf_name(name)


def _pairs(items):
    """(name, tensor) pairs from tensor_to_hf's answers: a pair, a list of pairs, or None."""
    for item in items:
        if isinstance(item, list):
            yield from item
        elif item is not None:
            yield item


def _rope_cache(name: str) -> bool:
    return "rope.cache" in name or name == "freqs_cis"


# --- TorchTitan 0.3.0 (the same scheme for its llama3 and qwen3) --------------------------


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
    return {name_from_torchtitan(k): v for k, v in state.items() if not _rope_cache(k)}


def to_torchtitan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under TorchTitan 0.3.0's names."""
    return {name_to_torchtitan(k): v for k, v in state.items()}


# --- HF folders: one tensor at a time in, sharded safetensors + index out ------------------

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # HF's own default max_shard_size ("5GB")


def save_hf_shards(pairs, config: dict, out, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list:
    """Write (hf_name, tensor) pairs (or lists of them), as they come, into safetensors shards of at most
    `max_shard_bytes` (a single model.safetensors when one is enough, as HF does) with
    `model.safetensors.index.json`, and config.json. Only one shard is in memory at a time.
    Returns the files written."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            tmp = out / f".shard-{len(shards):05d}.safetensors"
            save_safetensors(current, tmp, metadata={"format": "pt"})
            shards.append((tmp, list(current)))
            current, size = {}, 0

    for name, t in _pairs(pairs):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name], size, total = t.contiguous(), size + nbytes, total + nbytes
    flush()
    files = []
    if len(shards) == 1:
        shards[0][0].replace(out / "model.safetensors")
        files.append(out / "model.safetensors")
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(shards, 1):
            final = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tmp.replace(final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return files


def save_hf_state(names: HFNames, config, state: dict[str, torch.Tensor], args, out, **kw) -> list:
    """A family's HF folder from our state dict: `config(args, dtype)` -> config.json, the
    tensors under HF names (sharded with an index when large)."""
    pairs = list(_pairs(names.tensor_to_hf(k, v, args) for k, v in state.items()))
    dtype = str(pairs[0][1].dtype).removeprefix("torch.")
    return save_hf_shards(pairs, config(args, dtype), out, **kw)


def load_hf_state(names: HFNames, read_args, folder) -> tuple[dict[str, torch.Tensor], object]:
    """Our state dict and args from a family's HF folder (one or several safetensors files)."""
    from pathlib import Path

    from safetensors.torch import load_file

    args = read_args(folder)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return names.from_hf(state, args), args
