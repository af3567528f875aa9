"""README.md stays true to the code: the Quick start is two commands, and the training example it shows
is examples/train_classifier.py itself."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def test_quick_start_is_one_set_up_command_and_one_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", _section("Quick start"), flags=re.S)
    assert [len(b.strip().splitlines()) for b in blocks] == [1, 1]
    setup, tests = (b.strip() for b in blocks)
    assert setup.count("pip install --no-build-isolation -e .") == 1 and "build_ext" not in setup  # builds once
    assert setup.endswith("fastpar demo") and tests == "python -m pytest -q tests"


def test_training_example_is_the_example_file():
    example = (ROOT / "examples" / "train_classifier.py").read_text()
    shown = re.search(r"```python\n(import argparse.*?)```", _section("Training: "), flags=re.S)
    assert shown is not None, "README's Training section should show examples/train_classifier.py"
    assert example.endswith(shown.group(1)), "README's excerpt differs from examples/train_classifier.py"
