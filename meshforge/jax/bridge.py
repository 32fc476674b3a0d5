"""Torch -> JAX: arrays (DLPack), weights (a pytree for models/common/jax_decoder.py), shardings
(DeviceMesh placements -> PartitionSpec), and the parity check between the two models.

Needs the `jax` extra (`pip install -e ".[jax]"`); on CPU,
XLA_FLAGS=--xla_force_host_platform_device_count=8 gives 8 JAX devices.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, PartitionSpec
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshforge.core.errors import Problem, RecipeError
from meshforge.core.topology import FLATTENED, MESH_DIMS
from meshforge.interop.weights import to_numpy
from meshforge.models import spec_of

ZERO_COPY = (torch.float32, torch.bfloat16, torch.float16)


# --- arrays ----------------------------------------------------------------------------


def to_jax(t: torch.Tensor) -> jax.Array:
    """Zero-copy view of a CPU/CUDA tensor as a JAX array (fp32/bf16/fp16; ints too).

    The two share memory: an in-place write to `t` shows in the returned array. The
    tensor is detached first (DLPack refuses tensors that require grad). int64 needs JAX's
    x64 mode; without it we copy to int32 explicitly rather than let JAX truncate.
    """
    t = t.detach()
    if t.dtype == torch.int64 and not jax.config.jax_enable_x64:
        if t.numel() and (t.max() > np.iinfo(np.int32).max or t.min() < np.iinfo(np.int32).min):
            raise OverflowError("int64 values outside int32; enable jax_enable_x64 to move them")
        return jnp.asarray(t.to(torch.int32).numpy())  # a copy, by necessity
    return jax.dlpack.from_dlpack(t.contiguous())


def to_torch(a: jax.Array) -> torch.Tensor:
    """Zero-copy view of a (single-device) JAX array as a torch tensor."""
    return torch.from_dlpack(a)


# --- weights ---------------------------------------------------------------------------


def state_to_pytree(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None = None, consume: bool = False
) -> dict[str, jax.Array]:
    """A torch state dict -> the flat pytree models/common/jax_decoder.py takes (copies, bit-exact).
    consume=True empties `state` as it goes, so (with no other reference to the tensors)
    the host holds one parameter twice at most, never the whole model."""
    out = {}
    for name in list(state):
        t = state.pop(name) if consume else state[name]
        if name == "freqs_cis":
            continue
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = jnp.asarray(to_numpy(t if dtype is None else t.to(dtype)))
    return out


def nest(flat: dict, sep: str = ".") -> dict:
    """A flat {'a.b.c': v} mapping as nested dicts (Orbax's trees), split at `sep`."""
    nested: dict = {}
    for name, v in flat.items():
        *path, leaf = name.split(sep)
        d = nested
        for k in path:
            d = d.setdefault(k, {})
        d[leaf] = v
    return nested


def _flatten(nested: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in nested.items():
        name = f"{prefix}{k}"
        out.update(_flatten(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def save_pytree(params: dict[str, jax.Array], path) -> None:
    """An Orbax checkpoint of the pytree (nested by name: Orbax joins tree paths with dots)."""
    import orbax.checkpoint as ocp  # slow to import: only when a pytree is saved

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), nest(params))


def load_pytree(path) -> dict[str, jax.Array]:
    """The flat pytree from save_pytree's Orbax checkpoint."""
    import orbax.checkpoint as ocp  # slow to import: only when a pytree is loaded

    with ocp.StandardCheckpointer() as ckptr:
        return _flatten(ckptr.restore(Path(path).absolute()))


def read_sharded(reader, shardings: dict) -> dict[str, jax.Array]:
    """Parameters placed straight from files: each device's shard is read on its own
    (`jax.make_array_from_callback` + safetensors slices), so the host never holds a
    whole model. `reader` is an interop.WeightReader; `shardings` maps names to
    NamedShardings."""

    def fetch(name):
        return lambda index: to_numpy(reader.read(name, index))

    return {
        name: jax.make_array_from_callback(reader.shape(name), sharding, fetch(name))
        for name, sharding in shardings.items()
    }


# --- shardings -------------------------------------------------------------------------


def jax_twin(args):
    """The JAX twin module of the family whose args `args` are (models/common/spec.py)."""
    return importlib.import_module(spec_of(args).jax_twin)


def jax_mesh(degrees: dict[str, int], devices=None) -> Mesh:
    """A jax Mesh with the recipe's axis names and sizes, in the DeviceMesh's order (pp must be 1
    on the JAX side, and is left out)."""
    names = [k for k in MESH_DIMS if k in degrees and k != "pp"]
    shape = [degrees[k] for k in names]
    n = int(np.prod(shape))
    devices = np.asarray(devices if devices is not None else jax.devices()[:n]).reshape(shape)
    return Mesh(devices, tuple(names))


def placements_to_spec(placements, mesh_dim_names: tuple[str, ...], ndim: int) -> PartitionSpec:
    """DTensor placements on a DeviceMesh -> the PartitionSpec that lays the global array out
    the same way on a jax Mesh with the same axis names.

    Shard(d) on mesh dim i puts axis i on tensor dim d. Several mesh dims sharding one tensor
    dim nest in placement order (the first is outermost) - except FSDP's _StridedShard,
    which shards *inside* the TP shard: (_StridedShard(0), Shard(0)) on (dp, tp) is
    P(("tp", "dp")), not P(("dp", "tp")). A flattened dim (FSDP's dp_shard x cp) is its dims in
    order, outer first, as the flattening ranks them. Partial placements have no PartitionSpec.
    """
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    strided: list[list[str]] = [[] for _ in range(ndim)]
    for axis, p in zip(mesh_dim_names, placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"placement {p} on mesh dim {axis!r} is a pending reduction, not a layout; "
                "reduce it (redistribute to Replicate) before exporting"
            )
        if isinstance(p, Replicate):
            continue
        names = FLATTENED.get(axis, (axis,))
        if isinstance(p, _StridedShard):
            strided[p.dim % ndim].extend(names)
        elif isinstance(p, Shard):
            per_dim[p.dim % ndim].extend(names)
    # a strided shard splits each of the later (plain) shards further: it is the innermost axis
    axes = [plain + inner for plain, inner in zip(per_dim, strided)]
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in axes]
    while entries and entries[-1] is None:  # trailing dims unsharded: JAX's canonical spelling
        entries.pop()
    return PartitionSpec(*entries)


def check_even(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    """JAX needs every sharded dim divisible by its axes; torch pads uneven shards."""
    for d, axes in enumerate(spec):
        if axes is None:
            continue
        n = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
        if shape[d] % n:
            problem = (
                f"dim {d} of size {shape[d]} is not divisible by {n} ({axes}): torch pads this "
                "uneven shard, JAX cannot place it; choose a mesh that divides it"
            )
            raise RecipeError([Problem("mesh", dict(mesh.shape), problem)])


# --- parity ----------------------------------------------------------------------------


@dataclass
class Parity:
    max_abs_logit_diff: float
    mean_kl: float
    top1_agreement: float

    def within(self, dtype: str) -> bool:
        """The targets: fp32 max|dlogit| <= 1e-4 and KL <= 1e-6; bf16 KL <= 2e-3, top-1 >= 0.95."""
        if dtype == "float32":
            return self.max_abs_logit_diff <= 1e-4 and self.mean_kl <= 1e-6
        return self.mean_kl <= 2e-3 and self.top1_agreement >= 0.95


def compare_logits(reference: np.ndarray, other: np.ndarray) -> Parity:
    """max |dlogit|, mean KL(reference || other) per token, and top-1 agreement."""
    a, b = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
    kl = (np.exp(la) * (la - lb)).sum(-1).mean()
    return Parity(
        float(np.abs(a - b).max()), float(max(kl, 0.0)), float((a.argmax(-1) == b.argmax(-1)).mean())
    )


def sharpen(model: torch.nn.Module, factor: float) -> None:
    """Scale the attention projections and the output head: freshly initialised logits are
    nearly flat and barely depend on attention, so they agree whatever the bugs (a missing
    RoPE permutation, tiled GQA heads, a broken RoPE buffer)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(
                (
                    "attention.wq.weight",
                    "attention.wk.weight",
                    "attention.wv.weight",
                    "attention.wo.weight",
                    "output.weight",
                )
            ):
                p.mul_(factor)


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: `model.to(bfloat16)` would also cast the complex RoPE buffer
    to a real dtype, dropping its imaginary part (torch only warns)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def run_parity(
    model: torch.nn.Module, args, tokens: torch.Tensor, dtype: str = "float32", params: dict | None = None
) -> Parity:
    """Logits of the torch model and of the JAX twin (on `params`, default: the model's own
    weights) for the same tokens, compared (both in `dtype`)."""
    forward = jax_twin(args).forward
    if dtype == "bfloat16":
        cast_params(model, torch.bfloat16)
    with torch.no_grad():
        ref = model(tokens).float().numpy()
    params = params if params is not None else state_to_pytree(model.state_dict())
    got = np.asarray(jax.jit(lambda p, t: forward(p, t, args))(params, jnp.asarray(tokens.numpy())))
    return compare_logits(ref, got)
