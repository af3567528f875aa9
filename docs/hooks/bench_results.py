"""MkDocs hooks: serve bench/results/ (plots, raw tables, profiles) under ``bench-results/`` without copying them
into docs/, so the results pages link and show the files the benchmarks wrote (Markdown reports are included by
pymdownx.snippets instead); and drop the Sphinx role prefixes (``:func:``, ``:class:`` ...) some docstrings use,
which Markdown would print as text before the name."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
_SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):(?=<code)")


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.is_file() and path.suffix != ".md":
            files.append(File.generated(config, f"bench-results/{path.name}", abs_src_path=str(path)))
    return files


def on_page_content(html, page, config, files):
    return _SPHINX_ROLE.sub("", html)
