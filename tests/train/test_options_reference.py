"""The reference's table of TrainingOptions lists every field once, with the default the dataclass has."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from fastpar.train import TrainingOptions

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "train.md"


def _shown(default) -> str:
    if isinstance(default, str):
        return f'"{default}"'
    if isinstance(default, int) and not isinstance(default, bool) and default == 0o600:
        return "0o600"  # the checkpoint mode, as people write it
    return repr(default)


def test_every_option_is_listed_with_its_default():
    text = PAGE.read_text()
    section = text[text.index("## Every option") : text.index("## Sharding options")]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.M))
    fields = {f.name: f.default for f in dataclasses.fields(TrainingOptions)}
    assert sorted(rows) == sorted(fields), f"missing {set(fields) - set(rows)}, unknown {set(rows) - set(fields)}"
    for name, default in fields.items():
        assert rows[name] == _shown(default), f"{name}: the table says {rows[name]}, the default is {default!r}"
