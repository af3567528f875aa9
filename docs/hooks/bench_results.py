"""MkDocs hook: serves bench/results/ (plots, raw tables, profiles) under ``bench-results/`` without copying them
into docs/, so the results pages link and show the files the benchmarks wrote. Markdown reports are not pages of
their own: docs/results/ includes them with pymdownx.snippets."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.is_file() and path.suffix != ".md":
            files.append(File.generated(config, f"bench-results/{path.name}", abs_src_path=str(path)))
    return files
