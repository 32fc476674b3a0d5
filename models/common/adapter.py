"""The weight adapter a family registers (as TorchTitan's `BaseStateDictAdapter`): its weights in
every other format. HF's names, row order and config.json; TorchTitan's names and flavors;
MaxText's tree. Every converter (meshforge/convert.py, interop/, jax/, migrate/) asks the family's
adapter (`ModelSpec.adapter`), so none of them names a family.

A family subclasses `StateDictAdapter` once, in models/<family>/adapter.py: it sets its HF names
(`names`) and model_type, writes `hf_config` and `args_from_hf_config`, and states what it has in
TorchTitan and MaxText (nothing, by default: those converters then refuse it by name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .hf_config import check_compatible, read_config
from .hf_names import (
    HFNames,
    from_torchtitan,
    load_hf_state,
    name_from_torchtitan,
    name_to_torchtitan,
    permute_from_hf,
    save_hf_state,
    to_torchtitan,
)


class StateDictAdapter:
    """One family's weight formats. Subclasses set the class attributes and the two HF config
    methods; the rest holds for any decoder whose HF layout `names` describes."""

    names: HFNames  # our parameter names <-> HF's (and which rows HF permutes)
    hf_model_type: str  # config.json's model_type, how an HF folder finds its family

    # TorchTitan's model.name whose flavors import as this family, and those flavors in our
    # args' names (migrate/torchtitan.py); None: TorchTitan jobs of it are refused
    torchtitan_model: str | None = None
    torchtitan_flavors: dict[str, dict[str, Any]] = {}
    torchtitan_notes: tuple[str, ...] = ()  # how TorchTitan trains it where that is not a key
    # TorchTitan flavor -> the longest training.seq_len it trains with the flavor's own RoPE (beyond
    # it TorchTitan switches to a scaling the flavor does not carry: the import refuses)
    torchtitan_rope_until: dict[str, int] = {}

    # MaxText (jax/maxtext.py): whether its query kernel carries 1/sqrt(head_dim), whether its
    # blocks hold q/k norms; `maxtext_block` gives the decoder-block config keys
    maxtext_query_scaled: bool = False
    maxtext_qk_norm: bool = False

    # --- HF --------------------------------------------------------------------------------

    def hf_config(self, args: Any, dtype: str = "float32") -> dict:
        """config.json of the equivalent HF model."""
        raise NotImplementedError

    def args_from_hf_config(self, cfg: dict) -> Any:
        """The family's args of an HF config.json; every key that would change the math and
        that we do not implement is refused."""
        raise NotImplementedError

    def read_hf_args(self, folder: Path) -> Any:
        """The args of the HF folder's config.json."""
        return self.args_from_hf_config(read_config(Path(folder)))

    def check_compatible(self, checkpoint_args: Any, recipe_args: Any) -> list[str]:
        """What differs between a checkpoint's model and the recipe's (empty when they match)."""
        return check_compatible(checkpoint_args, recipe_args)

    def hf_permuted_heads(self, name: str, args: Any) -> int | None:
        """How many heads `name`'s rows are permuted by in HF's layout (None: not permuted)."""
        return self.names.permuted(name, args)

    permute_from_hf = staticmethod(permute_from_hf)

    def tensor_to_hf(self, name: str, t: torch.Tensor, args: Any) -> tuple[str, torch.Tensor] | list | None:
        """One of our tensors as HF stores it (a pair, a list of pairs, or None: not stored)."""
        return self.names.tensor_to_hf(name, t, args)

    def to_hf(self, state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Our (or TorchTitan's) state dict -> HF names and row order."""
        return self.names.to_hf(state, args)

    def from_hf(self, state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """An HF state dict -> our names and row order."""
        return self.names.from_hf(state, args)

    def source_name(self, name: str, layout: str, available) -> str:
        """Where our parameter `name` is stored in a file of `layout` (hf | torchtitan | ours)."""
        return self.names.source_name(name, layout, available)

    def save_hf(self, state: dict[str, torch.Tensor], args: Any, out: Path, **kw) -> list:
        """An HF folder: config.json + safetensors (sharded with an index when large)."""
        return save_hf_state(self.names, self.hf_config, state, args, out, **kw)

    def load_hf(self, folder: Path) -> tuple[dict[str, torch.Tensor], Any]:
        """Our state dict and args from an HF folder (one or several safetensors files)."""
        return load_hf_state(self.names, self.read_hf_args, folder)

    # --- TorchTitan (0.3.0's names: the same scheme for every decoder) ----------------------

    name_from_torchtitan = staticmethod(name_from_torchtitan)
    name_to_torchtitan = staticmethod(name_to_torchtitan)
    from_torchtitan = staticmethod(from_torchtitan)
    to_torchtitan = staticmethod(to_torchtitan)

    # --- MaxText ---------------------------------------------------------------------------

    def maxtext_block(self, args: Any) -> dict | None:
        """The MaxText config keys of this family's decoder block for `args` (None: MaxText has
        no decoder for this family); raises IncompatibleWeights for what it cannot compute alike."""
        return None
