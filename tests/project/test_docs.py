"""The README and docs/ as a newcomer meets them: short, commands CI runs, links that resolve, no
dated records and no measured figure typed in (the benchmark records hold those), and the
README's cross-framework resume run as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
RESULTS = REPO / "benchmarks" / "results"


def pages() -> list[Path]:
    """What a user reads: the README and every docs page (the benchmark records are apart)."""
    return [README, *sorted(DOCS.glob("*.md"))]


def bash_lines(text: str) -> list[str]:
    """Every line inside a ```bash block."""
    return [ln for block in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in block.splitlines()]


def test_the_readme_is_short_and_its_two_setup_commands_are_the_ones_ci_runs():
    readme = README.read_text()
    assert len(readme.splitlines()) <= 250
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    (install,) = [ln for ln in ci if ln.startswith("python3 -m venv") and ln.endswith("run_recipe")]
    (tests,) = [ln for ln in ci if ln.endswith("python -m pytest -q")]
    assert {install, tests} <= set(bash_lines(readme)), "README's set-up commands differ from .ci/run"
    assert bash_lines(readme).index(install) < bash_lines(readme).index(tests)
    assert "mkdocs build --strict" in "\n".join(ci)


def test_every_relative_link_of_the_readme_and_docs_reaches_a_file():
    """mkdocs --strict checks docs/ (anchors too); the README is not in the site, so here."""
    checked = 0
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(REPO)} links {target}, which does not exist"
            checked += 1
    assert checked >= 40


def test_no_dated_record_in_the_readme_or_docs():
    """Dates and clock times belong to benchmarks/results/ and CHANGELOG.md."""
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(-\d\d:\d\d)? UTC\b|\bsince stop\b|\buntil stop\b")
    found = [
        f"{page.relative_to(REPO)}:{n}: {line.strip()}"
        for page in pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if dated.search(line)
    ]
    assert not found, "\n".join(found)


# A measured figure typed into prose: a duration, a test count, a loss going from one value to
# another, a throughput, a rate or an MFU. Targets (`< 60 s`, `>= 50% MFU`) are not measured.
MEASURED = re.compile(
    r"\b\d+(\.\d+)?\s?(ms|us|min|minutes|seconds|s)\b|\b\d+m\d+s\b|\b\d[\d,]* tests\b"
    r"|\b\d+\.\d+ -> \d+\.\d+|\b\d[\d,.]*k? tokens/s\b|\b\d+(\.\d+)? [GT](FLOP|B)/s\b|\b\d+(\.\d+)?% MFU"
)
TARGET = re.compile(r"(<|<=|>=|within) $")


def measured_figures(line: str) -> list[str]:
    """The figures of a line that are not a target or a command's argument."""
    if line.lstrip().startswith(("run_recipe", "meshforge", "torchrun", "#SBATCH", "srun")):
        return []
    return [m.group(0) for m in MEASURED.finditer(line) if not TARGET.search(line[: m.start()])]


def test_the_readme_and_docs_quote_no_measured_figure_they_could_let_go_stale():
    """Typed numbers drift; a figure is read in its benchmark record, which the page links."""
    found = [
        f"{page.relative_to(REPO)}:{n}: {figures} in {line.strip()[:100]}"
        for page in pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if (figures := measured_figures(line))
    ]
    assert not found, "\n".join(found)
    assert measured_figures("the default run took 38 s") == ["38 s"]
    assert measured_figures("loss 7.6 -> 4.5, 595 tests") == ["7.6 -> 4.5", "595 tests"]
    assert measured_figures("target < 60 s, >= 50% MFU") == []


def test_every_benchmark_record_names_its_date_machine_and_commit_at_its_top():
    for record in sorted(RESULTS.glob("*.md")):
        top = "\n".join(record.read_text().splitlines()[:8])
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", top), f"{record.name}: no date at its top"
        assert re.search(r"Linux|CPUs|H200|H100|VM", top), f"{record.name}: no machine at its top"
        assert re.search(r"\b[0-9a-f]{7,40}\b", top), f"{record.name}: no commit at its top"


def test_the_docs_link_every_benchmark_record():
    linked = "\n".join(p.read_text() for p in pages())
    missing = [r.name for r in sorted(RESULTS.glob("*.md")) if f"benchmarks/results/{r.name}" not in linked]
    assert not missing, f"records no page links: {missing}"


def resume_commands() -> list[str]:
    """The README's cross-framework resume: torch, then JAX from its checkpoint, then torch again."""
    lines = [ln for ln in bash_lines(README.read_text()) if ln.startswith("run_recipe debug_cpu checkpoint")]
    jax = [ln for ln in bash_lines(README.read_text()) if "backend=jax" in ln and "checkpoint.load" in ln]
    assert len(lines) == 2 and len(jax) == 1
    return [lines[0], jax[0], lines[1]]


def test_each_line_of_the_cross_framework_resume_saves_what_the_next_resumes():
    """Issue 67: a run that a later line continues must save (its records would be cut back to the
    last checkpoint otherwise); docs/jax.md gives the same three lines."""
    commands = resume_commands()
    for command in commands:
        assert "checkpoint.enabled=true" in command.split(), command
    assert "checkpoint.load=auto" not in commands[0] and all(
        "checkpoint.load=auto" in c for c in commands[1:]
    )
    assert all(c in bash_lines((DOCS / "jax.md").read_text()) for c in commands)


@pytest.mark.slow
def test_the_readme_cross_framework_resume_runs_as_written(tmp_path):
    """torch 1-10, JAX 11-20 from torch's step 10, torch 21-30 from JAX's step 20: every step once,
    and the JAX steps kept when torch continues them (it starts from JAX's step-20 checkpoint)."""
    pytest.importorskip("jax")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    metrics = tmp_path / "outputs" / "debug_cpu" / "metrics.jsonl"
    after = []
    for command in resume_commands():
        words = shlex.split(command)
        exe = Path(sys.executable).parent / words[0]
        done = subprocess.run(
            [str(exe), *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        after.append([json.loads(line) for line in metrics.read_text().splitlines()])
    assert [r["step"] for r in after[-1]] == list(range(1, 31))
    assert after[-1][:20] == after[1][:20] and after[1][:10] == after[0][:10]
    checkpoints = tmp_path / "outputs" / "debug_cpu" / "checkpoints"
    assert (checkpoints / "step-00000030" / "meta.json").exists()


def test_a_benchmark_record_is_written_with_its_date_machine_and_commit(tmp_path):
    """The header comes from the result's provenance (benchmarks/recorded.py), not from typing."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from recorded import provenance, save
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = {"rows": [], **provenance(), "commit": "abc1234"}
    save(tmp_path, "demo", result, ["# A demo record", "", "| a |", "|---|"])
    lines = (tmp_path / "demo.md").read_text().splitlines()
    assert lines[0] == "# A demo record" and lines[2].endswith("measured at commit abc1234.")
    assert result["date"] in lines[2] and result["machine"]["platform"] in lines[2]
    assert json.loads((tmp_path / "demo.json").read_text())["commit"] == "abc1234"


def test_every_docs_page_is_in_the_site_navigation_and_the_architecture_page_stays_short():
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in DOCS.glob("*.md")}
    assert len((DOCS / "architecture.md").read_text().splitlines()) <= 300
