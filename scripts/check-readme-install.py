#!/usr/bin/env python3
"""README's lines that install fastpar, checked and run as written.

    scripts/check-readme-install.py            # list them; fail if one builds with isolation
    scripts/check-readme-install.py --run      # also run them, in order, in one shell, in a fresh clone

A line installs fastpar when it pip-installs the checkout (``.``, ``-e .``, ``'.[extra]'``) or the name
``fastpar``. Each must install the checkout (the name would come from the package index) and build without
isolation: an isolated build compiles the extension against the torch pip fetches for the build (a CUDA
torch of gigabytes), not the torch the user runs. With ``--run`` the lines
run as a reader would paste them, from a clone of this repository's HEAD (the first one sets up the venv
the others use); then ``fastpar info --json`` must report the compiled extension.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
# pip install ... <the checkout or the name fastpar>, with or without extras and quotes
_INSTALLS_FASTPAR = re.compile(
    r"pip install\b[^&|;]*?(?:\s-e\s+|\s)['\"]?(?:\.|fastpar)(?:\[[^\]]*\])?['\"]?(?=\s|$|&|;)"
)


def install_lines(readme: str) -> list[str]:
    """Shell lines of README that install fastpar: those of fenced blocks (the set-up a reader pastes, which makes
    the venv), then those in inline code, each group in order of appearance."""
    found: list[tuple[int, str]] = []
    for block in _FENCE.finditer(readme):
        offset = block.start(1)
        for line in block.group(1).splitlines(keepends=True):
            text = line.split(" #", 1)[0].strip()
            if _INSTALLS_FASTPAR.search(text):
                found.append((offset, text))
            offset += len(line)
    outside = _FENCE.sub(lambda m: " " * len(m.group(0)), readme)
    for span in _INLINE.finditer(outside):
        if _INSTALLS_FASTPAR.search(span.group(1)):
            found.append((len(readme) + span.start(), span.group(1).strip()))
    return [text for _, text in sorted(found)]


def problems(line: str) -> list[str]:
    """What is wrong with each ``pip install`` of fastpar in ``line`` (empty when nothing is)."""
    found = []
    for command in re.split(r"&&|\|\||;|\|", line):
        if not _INSTALLS_FASTPAR.search(command):
            continue
        if "--no-build-isolation" not in command:
            found.append("builds with isolation (add --no-build-isolation)")
        if re.search(r"(?:\s|['\"])fastpar(?:\[|['\"\s]|$)", command):
            found.append("installs the name fastpar from the package index, not this checkout (use . or '.[extra]')")
    return found


def run(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="fastpar-readme-install-") as work:
        clone = Path(work) / "fastpar"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True)
        script = "set -euo pipefail\n" + "\n".join(f"echo '+ {line}'\n{line}" for line in lines)
        script += "\nfastpar info --json > info.json\n"
        subprocess.run(["bash", "-c", script], cwd=clone, check=True)
        backend = json.loads((clone / "info.json").read_text())["extension"]["backend"]
        if backend != "compiled":
            raise SystemExit(f"after README's install lines the extension backend is {backend!r}, expected compiled")
        print(f"README's {len(lines)} install line(s) ran as written in a fresh clone; extension: {backend}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the lines in a fresh clone of HEAD")
    args = parser.parse_args()
    lines = install_lines((ROOT / "README.md").read_text())
    for line in lines:
        print(f"README: {line}")
    if not lines:
        print("README has no line that installs fastpar", file=sys.stderr)
        return 1
    wrong = {line: found for line in lines if (found := problems(line))}
    for line, found in wrong.items():
        print(f"README line {line!r}: {'; '.join(found)}", file=sys.stderr)
    if wrong:
        return 1
    if args.run:
        run(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
