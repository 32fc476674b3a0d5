"""TorchTitan 0.2's float8 training (`model.converters` and `[quantize.linear.float8]`, its
Float8LinearConverter over torchao) -> the recipe's [float8] section (parallelisms/float8.py)."""

from __future__ import annotations

from meshforge.migrate.report import Imported
from meshforge.migrate.source import Keys

CONVERTERS = ("float8", "quantize.linear.float8")  # the converter's name, before and after 0.2's rename
SECTION = "quantize.linear.float8"


def float8(k: Keys, out: Imported) -> None:
    """float8 when the job converts its linears to it; any other converter (MX, grouped-matmul
    float8) is refused."""
    converters = k.take("model.converters", [])
    others = [c for c in converters if c not in CONVERTERS]
    if others:
        out.refuse("model.converters", others, "MX / grouped-matmul float8 training is not implemented")
    if len(others) == len(converters):
        return
    out.set("float8.enabled", True)
    # TorchTitan 0.2's recipe_name None is torchao's default config: tensorwise dynamic scaling
    out.set("float8.recipe", k.take(f"{SECTION}.recipe_name", None) or "tensorwise")
    fqns = k.take(f"{SECTION}.filter_fqns", [])
    out.set("float8.exclude", fqns)
    if fqns:
        out.notes.append(
            f"float8.exclude = {fqns}: TorchTitan keeps a module whose name contains an entry, meshforge one "
            "whose name is or ends in it; MoE routers and dims not divisible by 16 stay in both"
        )
    all_gather = k.take(f"{SECTION}.enable_fsdp_float8_all_gather", False)
    if all_gather:
        out.refuse(
            f"{SECTION}.enable_fsdp_float8_all_gather",
            True,
            "FSDP's float8 all-gather is not implemented (weights are gathered in fsdp.param_dtype)",
        )
    if (v := k.take(f"{SECTION}.precompute_float8_dynamic_scale_for_fsdp", False)) and not all_gather:
        out.skip(
            f"{SECTION}.precompute_float8_dynamic_scale_for_fsdp",
            v,
            "no effect without the float8 all-gather",
        )
    if v := k.take(f"{SECTION}.emulate", False):
        out.skip(f"{SECTION}.emulate", v, "TorchTitan's test mode: the same float8 math, run by torchao here")
