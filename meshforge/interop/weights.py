"""Weights in, a slice at a time: torch <-> numpy bit-exactly, and readers that give any
slice of any parameter (our names) from safetensors files or arrays in memory, so each rank
(or JAX device) reads only its own shard. The name maps and row permutations come from the
model family's weight adapter (models/common/adapter.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshforge.core.errors import CheckpointError, CheckpointNotFound, IncompatibleWeights
from meshforge.models import spec_of

# --- torch <-> numpy, bit-exact ---------------------------------------------------------


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU copy as numpy; bf16 (which numpy lacks) as ml_dtypes.bfloat16, same bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """numpy (ml_dtypes.bfloat16 included) -> torch, same bits."""
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # e.g. a view of a JAX array: torch tensors may be written to
        a = a.copy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# --- lazy, sliced reads -----------------------------------------------------------------


class WeightReader:
    """Reads any slice of any parameter (our names) from a folder of safetensors files
    without loading the rest.

    `layout` is hf | torchtitan | ours. In HF's layout some rows are permuted per head
    (Llama's q/k), which needs whole heads, so those reads cover the heads the slice touches.
    """

    def __init__(self, folder: Path, args, layout: str = "hf"):
        self.args, self.adapter, self.layout = args, spec_of(args).adapter, layout
        self._files = open_safetensors(Path(folder))
        self._where = {name: f for f in self._files for name in f.keys()}
        if not self._where:
            raise CheckpointNotFound(f"the safetensors files in {folder} hold no tensors")

    def source_name(self, name: str) -> str:
        return self.adapter.source_name(name, self.layout, self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        src = self.source_name(name)
        return tuple(self._where[src].get_slice(src).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """`name`'s values at `index` (a tuple of slices, step 1), in our layout."""
        src = self.source_name(name)
        sl = self._where[src].get_slice(src)
        shape = sl.get_shape()
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        heads = self.adapter.hf_permuted_heads(name, self.args) if self.layout == "hf" else None
        if heads is None:
            return sl[index]
        rows, cols = index
        start, stop, _ = rows.indices(shape[0])
        hd = shape[0] // heads
        h0, h1 = start // hd, -(-stop // hd)  # the heads the rows touch
        block = self.adapter.permute_from_hf(sl[h0 * hd : h1 * hd, cols], h1 - h0)
        return block[start - h0 * hd : stop - h0 * hd]


def open_safetensors(folder: Path) -> list:
    """Every `*.safetensors` file in `folder`, opened (only its header is read: a truncated or
    corrupt file is refused here, naming it, not at the first tensor read)."""
    from safetensors import SafetensorError, safe_open

    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise CheckpointNotFound(f"no *.safetensors files in {folder}: point it at an HF model folder")
    opened = []
    for path in paths:
        try:
            opened.append(safe_open(str(path), framework="pt"))
        except SafetensorError as e:
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({e}); a truncated download? fetch it again"
            ) from e
    return opened


class ArrayReader:
    """WeightReader's interface over arrays already in memory (a JAX pytree, numpy arrays)."""

    def __init__(self, arrays: dict, where: str):
        self.arrays, self.where = arrays, where

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.arrays:
            raise IncompatibleWeights(f"{name} is missing from {self.where}")
        return tuple(self.arrays[name].shape)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        a = self.arrays[name]
        return from_numpy(np.asarray(a if index is None else a[index]))


def load_into(model: torch.nn.Module, reader: WeightReader | ArrayReader) -> None:
    """Fill a materialised (possibly sharded) model from `reader`, each rank reading only
    the slices it holds (DTensor local shards at their global offsets)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            expected = tuple(p.shape)
            if reader.shape(name) != expected:
                raise IncompatibleWeights(
                    f"{name}: the checkpoint holds {reader.shape(name)}, the recipe's model {expected}; "
                    "set model.* to the checkpoint's config"
                )
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                p.to_local().copy_(reader.read(name, index))
            else:
                p.copy_(reader.read(name))
        # buffers the family counts among its weights (DeepSeek-V3's router correction bias)
        for name, b in model.named_buffers():
            if name.rsplit(".", 1)[-1] in getattr(model, "weight_buffers", ()):
                b.copy_(reader.read(name))


def hf_reader_for(folder: Path, recipe_args) -> WeightReader:
    """A reader of an HF folder, after checking its config.json matches the recipe's model."""
    diff = spec_of(recipe_args).hf_mismatch(folder, recipe_args)
    if diff:
        raise IncompatibleWeights(
            f"the HF checkpoint {folder} does not match the recipe's model ("
            + "; ".join(diff)
            + "): pick the model.flavor of that checkpoint or set model.* to "
            "its config.json"
        )
    return WeightReader(folder, recipe_args, "hf")
