"""The layers of docs/architecture.md, checked from the source: every import of a meshforge module
points down (or within its layer), no import cycle, and no meshforge import hidden inside a
function (but for the CLI's start-up time and modules that need an optional extra)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import EXTRAS, REPO

# bottom to top: a module may import its own layer and the layers below it
LAYERS = [
    "core",
    "configs",
    "models",
    "parallelisms",
    "interop",
    "recipe",
    "run",
    "simulate",
    "jax",
    "convert",
    "migrate",
    "experiments",
    "cli",
]
# where each import package lives in the repo (setuptools package-dir in pyproject.toml)
ROOTS = {
    "meshforge": REPO / "meshforge",
    "meshforge.configs": REPO / "configs",
    "meshforge.models": REPO / "models",
    "meshforge.parallelisms": REPO / "parallelisms",
}
# modules whose import needs an optional extra (jax): imported inside the function that needs them
OPTIONAL = (
    "meshforge.jax",
    "meshforge.models.common.jax_decoder",
    "meshforge.models.llama3.jax",
    "meshforge.models.qwen3.jax",
    "meshforge.models.qwen3_moe.jax",
)
LOCAL_IMPORTS_ALLOWED = ("meshforge.cli",)  # start-up time: `run_recipe --help` must not import torch


def module_files() -> dict[str, Path]:
    """Module name -> file, for every meshforge module in the repo."""
    out = {}
    for root_name, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([root_name, *parts])
            if root_name == "meshforge" and parts and parts[0] in ("configs", "models", "parallelisms"):
                continue
            out[name] = path
    return out


def layer_of(module: str) -> str:
    if module == "meshforge":
        return "core"  # the package itself holds only __version__
    return module.split(".")[1]


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported meshforge module, inside a function?, line) for every import in the file."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for t in targets:
                if t == "meshforge" or t.startswith("meshforge."):
                    while t not in known and "." in t:
                        t = t.rpartition(".")[0]
                    found.append((t, in_function, child.lineno))
            visit(child, local)

    visit(ast.parse(path.read_text()), False)
    return found


def graph(files: dict[str, Path]) -> dict[str, list[tuple[str, bool, int]]]:
    known = set(files)
    return {name: imports(name, path, known) for name, path in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A list of modules forming an import cycle, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def violations(g: dict[str, list[tuple[str, bool, int]]]) -> list[str]:
    """Every import that points up a layer, or hides a meshforge import in a function."""
    out = []
    for src, found in g.items():
        for dst, local, line in found:
            if local and not src.startswith(LOCAL_IMPORTS_ALLOWED) and not dst.startswith(OPTIONAL):
                out.append(f"{src}:{line} imports {dst} inside a function")
            if LAYERS.index(layer_of(dst)) > LAYERS.index(layer_of(src)):
                out.append(
                    f"{src}:{line} imports {dst}, a higher layer ({layer_of(dst)} above {layer_of(src)})"
                )
    return out


def test_every_import_points_down_and_none_is_hidden():
    files = module_files()
    assert {"meshforge.configs.schema", "meshforge.run.train.trainer", "meshforge.parallelisms.fsdp"} <= set(
        files
    )
    assert set(map(layer_of, files)) <= set(LAYERS), "a module outside the layers of docs/architecture.md"
    assert violations(graph(files)) == []


def test_no_import_cycle():
    g = graph(module_files())
    assert find_cycle({src: {dst for dst, _, _ in found if dst != src} for src, found in g.items()}) is None


def test_configs_import_nothing_of_meshforge_but_core():
    g = graph(module_files())
    for src, found in g.items():
        if layer_of(src) == "configs":
            assert {layer_of(dst) for dst, _, _ in found} <= {"core", "configs"}, src


def test_the_checks_catch_a_cycle_an_upward_and_a_hidden_import(tmp_path, monkeypatch):
    """The checker is not vacuous: a reintroduced cycle (estimate <-> sweep, as before the
    layers), an upward import and a function-local import are each reported."""
    pkg = tmp_path / "meshforge"
    (pkg / "simulate").mkdir(parents=True)
    (pkg / "experiments").mkdir()
    for init in (pkg / "__init__.py", pkg / "simulate" / "__init__.py", pkg / "experiments" / "__init__.py"):
        init.write_text("")
    (pkg / "simulate" / "estimate.py").write_text("from meshforge.experiments.sweep import mesh_shapes\n")
    (pkg / "experiments" / "sweep.py").write_text(
        "from meshforge.simulate import estimate\n\ndef f():\n    from meshforge.simulate.estimate import x\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOTS", {"meshforge": pkg})
    g = graph(module_files())
    cycle = find_cycle({src: {dst for dst, _, _ in found} for src, found in g.items()})
    assert cycle is not None and set(cycle) == {"meshforge.simulate.estimate", "meshforge.experiments.sweep"}
    found = violations(g)
    assert any(
        "meshforge.simulate.estimate:1 imports meshforge.experiments.sweep, a higher layer" in v
        for v in found
    ), found
    assert any(
        "meshforge.experiments.sweep:4 imports meshforge.simulate.estimate inside a function" in v
        for v in found
    ), found


@pytest.mark.parametrize("limit", [380])
def test_modules_stay_readable(limit):
    """No module of the core over about 350 lines (formatted), so each reads in one sitting."""
    long = {
        name: n for name, path in module_files().items() if (n := len(path.read_text().splitlines())) > limit
    }
    assert long == {}


# Imported first, so that only what meshforge's own modules do at import is measured (torch's
# pipelining sets TORCHINDUCTOR_CACHE_DIR at import, DCP configures its logger).
THIRD_PARTY = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "matplotlib",
    "wandb",
    "scipy.optimize",  # tune --calibrate-from's fit; scipy sets its own warnings filters on import
    *EXTRAS,
)
IMPORT_EFFECTS = r"""
import importlib, importlib.util, json, logging, os, sys, warnings
libs, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for lib in libs:
    if importlib.util.find_spec(lib.split(".")[0]) is not None:
        importlib.import_module(lib)
import matplotlib

def loggers():
    found = {"<root>": logging.getLogger(), **logging.root.manager.loggerDict}
    return {
        n: [lg.level, len(lg.handlers), len(lg.filters), lg.propagate, lg.disabled]
        for n, lg in found.items()
        if isinstance(lg, logging.Logger)
    }

def state():
    return {
        "warnings filters": [repr(f) for f in warnings.filters],
        "os.environ": dict(os.environ),
        "matplotlib backend": repr(matplotlib.rcParams._get_backend_or_none()),
    }

before, logs_before = state(), loggers()
for m in modules:
    importlib.import_module(m)
after = state()
changed = {k: [before[k], v] for k, v in after.items() if before[k] != v and k != "os.environ"}
env_before, env_after = before["os.environ"], after["os.environ"]
for name in sorted(set(env_before) | set(env_after)):
    if env_before.get(name) != env_after.get(name):
        changed[f"os.environ {name}"] = [env_before.get(name), env_after.get(name)]
unconfigured = [logging.NOTSET, 0, 0, True, False]  # a logger created by getLogger and left alone
for name, config in loggers().items():  # (loggers that libraries imported on the way set up are theirs)
    if name in logs_before or name.startswith("meshforge"):
        if config != logs_before.get(name, unconfigured):
            changed[f"logger {name}"] = [logs_before.get(name, unconfigured), config]
print(json.dumps(changed))
"""


def import_side_effects(modules: list[str], libs=THIRD_PARTY, path: Path | None = None) -> dict:
    """What importing `modules` (in a fresh interpreter) changed: warnings filters, os.environ,
    matplotlib's backend, any logger's level, handlers, filters or propagation."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(path or ""), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EFFECTS, json.dumps(list(libs)), json.dumps(modules)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter imports torch, every extra and ~100 modules
def test_importing_any_module_changes_no_process_wide_state():
    """Warnings filters, logging, os.environ and matplotlib's backend are the process's, not a
    module's: every meshforge module (the optional-extra ones where the extra is installed)
    imports without touching them."""
    available = importlib.util.find_spec("jax") is not None
    modules = [
        m
        for m in module_files()
        if (available or not m.startswith(OPTIONAL)) and not m.endswith("__main__")  # that one runs the CLI
    ]
    assert len(modules) > 90
    assert import_side_effects(modules) == {}


def test_the_import_check_sees_each_kind_of_side_effect(tmp_path):
    (tmp_path / "planted_effects.py").write_text(
        "import logging, os, warnings, matplotlib\n"
        "warnings.filterwarnings('ignore', message='planted')\n"
        "logging.getLogger('matplotlib').addFilter(logging.Filter('x'))\n"
        "os.environ['PLANTED'] = '1'\n"
        "matplotlib.use('Agg')\n"
    )
    found = import_side_effects(["planted_effects"], libs=["matplotlib"], path=tmp_path)
    assert set(found) == {"warnings filters", "os.environ PLANTED", "matplotlib backend", "logger matplotlib"}
    assert found["os.environ PLANTED"] == [None, "1"]
    assert found["matplotlib backend"] == ["None", "'Agg'"]


# Where a family's name may stand outside its folder, each for a reason the family cannot own.
FAMILY_NAME_ALLOWED = {
    ("configs/model.py", "llama3"): "the schema's default model.name (configs sits below models)",
    ("meshforge/migrate/torchtitan.py", "llama3"): "TorchTitan's own default model.name",
    ("models/common/hf_config.py", "llama3"): "HF's rope_type of Llama 3 frequency scaling",
    ("meshforge/simulate/host_probes.py", "meshforge.models.llama3.model"): "the probes time Llama 3",
    ("meshforge/simulate/rate_probes.py", "meshforge.models.llama3.model"): "the probes time Llama 3",
}


def family_mentions(path: Path, families: list[str]) -> list[tuple[int, str]]:
    """(line, text) of every string literal that is a family's name and every identifier or
    imported module that names one as a whole word (`llama3`, `LLAMA3_FLAVORS`, `.qwen3.`)."""
    words = [re.compile(rf"(^|[._]){re.escape(f)}($|[._])") for f in families]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts = [node.value] if node.value in families else []
        elif isinstance(node, ast.ImportFrom):
            texts = [node.module or "", *(a.name for a in node.names)]
        else:
            texts = [getattr(node, a) for a in ("id", "attr", "name", "asname", "arg") if hasattr(node, a)]
        found += [
            (node.lineno, t) for t in texts if isinstance(t, str) and any(w.search(t.lower()) for w in words)
        ]
    return found


def test_no_family_is_named_outside_its_folder():
    """A family's name (its registry key) stands only in models/<family>/ and the registry's line
    for it: every converter, parallelism and check asks the family's spec and adapter."""
    from meshforge.models import MODELS

    families = list(MODELS)
    exempt = {REPO / "models" / f for f in families} | {REPO / "models" / "registry.py"}
    found = []
    for path in module_files().values():
        if path in exempt or any(folder in path.parents for folder in exempt):
            continue
        rel = path.relative_to(REPO).as_posix()
        found += [
            f"{rel}:{line}: {text}"
            for line, text in family_mentions(path, families)
            if (rel, text) not in FAMILY_NAME_ALLOWED
        ]
    assert found == []


def test_the_family_check_sees_a_literal_an_identifier_and_an_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from meshforge.models.qwen3.model import Qwen3Args\n"
        "LLAMA3_FLAVORS = {}\n"
        "if family == 'qwen3_moe':\n"
        "    note = 'the llama3 family, in prose'\n"
    )
    assert family_mentions(planted, ["llama3", "qwen3", "qwen3_moe"]) == [
        (1, "meshforge.models.qwen3.model"),
        (2, "LLAMA3_FLAVORS"),
        (3, "qwen3_moe"),
    ]


# The activation-checkpointing modes, asked of configs/activation_checkpoint.py's ACPolicy alone.
# migrate/ reads TorchTitan's and DeepSpeed's own configs, whose mode names coincide with ours.
AC_MODE_NAMES = {"full", "selective", "op", "memory_budget"}
AC_POLICY_MODULE = "meshforge.configs.activation_checkpoint"


def mode_strings_compared(path: Path, names: set[str]) -> list[int]:
    """Lines of `path` where a Compare has one of `names` as a literal (alone or in a tuple/set)."""

    def literals(node: ast.expr) -> set:
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {e.value for e in elts if isinstance(e, ast.Constant)}

    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare) and any(literals(e) & names for e in [node.left, *node.comparators])
    ]


# Each policy's modes, asked of its type alone. migrate/ reads TorchTitan's and DeepSpeed's own
# configs, whose mode names coincide with ours.
POLICY_MODES = {
    AC_POLICY_MODULE: AC_MODE_NAMES,  # ACPolicy
    "meshforge.models.common.moe": {"aux_loss", "aux_free"},  # Balancing (model.load_balance)
}


@pytest.mark.parametrize("policy_module", sorted(POLICY_MODES))
def test_no_policy_mode_string_is_compared_outside_its_type(policy_module):
    """Every caller asks the policy (wraps_blocks, per_op, period, adds_loss, ...) what a mode does."""
    found = {
        name: lines
        for name, path in module_files().items()
        if name != policy_module and not name.startswith("meshforge.migrate")
        if (lines := mode_strings_compared(path, POLICY_MODES[policy_module]))
    }
    assert found == {}


def test_the_mode_check_sees_each_shape_of_comparison(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('a = m == "op"\nb = m in ("none", "full")\nc = "memory_budget" != m\nd = m == "x"\n')
    assert mode_strings_compared(planted, AC_MODE_NAMES) == [1, 2, 3]


# Each folder's own floors, bottom to top (a module may import its own floor and those below):
# a rank's setup, then what runs in it, the trainer, and the launcher on top. Every folder
# holding sub-folders is listed; a flat folder's modules only need to be free of cycles.
# "*" is every sub-folder not named, one floor: models' families sit on common/ and may build on
# one another (qwen3_moe on qwen3), so adding a family adds no line here.
FLOORS = {
    "meshforge.run": ["rank", "data", "checkpoint", "observe", "optimizers", "train", "launch"],
    "meshforge.models": ["common", "*"],
    "meshforge.experiments": ["search"],
}


def floor_index(order: list[str], sub: str) -> int:
    return order.index(sub) if sub in order else order.index("*")


def floor_violations(g: dict[str, list[tuple[str, bool, int]]], floors: dict[str, list[str]]) -> list[str]:
    """Every import between two sub-folders of one folder that points up its floors."""
    out = []
    for folder, order in floors.items():

        def floor(module: str) -> str | None:
            rest = module.removeprefix(f"{folder}.").split(".")
            return rest[0] if module.startswith(f"{folder}.") and len(rest) > 1 else None

        for src, found in g.items():
            for dst, _, line in found:
                a, b = floor(src), floor(dst)
                if a and b and floor_index(order, b) > floor_index(order, a):
                    out.append(f"{src}:{line} imports {dst}, a higher floor of {folder} ({b} above {a})")
    return out


def test_no_import_points_up_a_folders_own_floors():
    files = module_files()
    with_subfolders = {
        name.rpartition(".")[0]
        for name, path in files.items()
        if path.name == "__init__.py" and name.count(".") >= 2
    }
    assert with_subfolders == set(FLOORS), "a folder with sub-folders needs its floors in FLOORS"
    for folder, order in FLOORS.items():  # every sub-folder has a floor
        subs = {
            name.split(".")[2] for name in files if name.startswith(f"{folder}.") and name.count(".") >= 3
        }
        assert subs == set(order) or ("*" in order and set(order) - {"*"} <= subs), folder
    assert floor_violations(graph(files), FLOORS) == []


def test_the_floor_check_sees_an_upward_import():
    g = {"meshforge.run.train.lifecycle": [("meshforge.run.launch.watch", False, 24)]}
    assert floor_violations(g, FLOORS) == [
        "meshforge.run.train.lifecycle:24 imports meshforge.run.launch.watch, a higher floor of "
        "meshforge.run (launch above train)"
    ]
