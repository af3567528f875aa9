"""The docs site follows a user's path, not the package layout: set up and swap in DDP, train (Trainer, data,
checkpoints), models that don't fit, jobs, measuring and tuning, what lies underneath, then design, reference and
results. The navigation (mkdocs.yml) and the home page's list (docs/index.md) both keep that order."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

USER_PATH = [
    "guide/install.md",
    "guide/ddp.md",
    "guide/trainer.md",
    "guide/language-models.md",
    "guide/integrations.md",
    "guide/data.md",
    "guide/checkpoints.md",
    "guide/zero.md",
    "guide/fsdp.md",
    "guide/pipeline.md",
    "guide/planner.md",
    "guide/jobs.md",
    "guide/topology.md",
    "guide/bench.md",
    "guide/costmodel.md",
    "guide/backend.md",
    "guide/kernels.md",
    "design.md",
]


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:\n") :]
    return re.findall(r"^\s+- (?:[^\n]*?: )?([\w/.-]+\.md)$", nav, re.M)


def test_every_guide_page_is_on_the_users_path():
    guides = {f"guide/{p.name}" for p in (ROOT / "docs" / "guide").glob("*.md")}
    assert guides <= set(USER_PATH), f"place {sorted(guides - set(USER_PATH))} on the user's path (and in the nav)"


def test_navigation_follows_the_users_path():
    pages = _nav_pages()
    assert [p for p in pages if p in USER_PATH] == USER_PATH
    # the home page first; reference and results after the guide and the design
    assert pages[0] == "index.md"
    last_guide = pages.index(USER_PATH[-1])
    assert all(pages.index(p) > last_guide for p in pages if p.startswith(("reference/", "results/")))


def test_home_page_lists_the_guides_in_the_same_order():
    index = (ROOT / "docs" / "index.md").read_text()
    start = index.index("## Start here")
    linked = [p for p in re.findall(r"\]\(([\w/.-]+\.md)\)", index[start:]) if p in USER_PATH]
    assert list(dict.fromkeys(linked)) == USER_PATH
