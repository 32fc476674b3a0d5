"""mkdocs hook: the recorded benchmark pages join the site, so the links to them are checked.

A docs page links a record as GitHub reads it, `../benchmarks/results/<name>.md`; mkdocs sees only
`docs/`, so each record is added as `results/<name>.md` and the links are rewritten to that path.
A link to a record that does not exist then fails `mkdocs build --strict` as any broken link does.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
LINK_AS_WRITTEN = "](../benchmarks/results/"


def on_files(files: Files, config) -> Files:
    """Every `benchmarks/results/*.md` as the site's `results/<name>.md`."""
    for record in sorted((BENCHMARKS / "results").glob("*.md")):
        files.append(
            File(
                f"results/{record.name}",
                src_dir=str(BENCHMARKS),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A docs page's links to the records, pointed at where the site keeps them."""
    return markdown.replace(LINK_AS_WRITTEN, "](results/")
