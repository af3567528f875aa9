"""The documentation stays true to the code: every code block of README.md and docs/guide/*.md runs as written,
or says why not in a ``<!-- no-run: reason -->`` comment right above it; README stays a short front door whose
links resolve; the trainer guide shows examples/train_classifier.py itself.

A block runs in a fresh folder holding links to the repository's examples/, tests/ and bench/ (so paths read as
from a clone's root), in its own process: ``python block.py``, ``torchrun --nproc_per_node=N block.py``, or
``bash``. The comment above a block chooses how:

    <!-- run -->                      python blocks run without it; bash blocks need it
    <!-- run: torchrun=2 slow -->     with N ranks; slow: only in the full suite
    <!-- run: cuda -->                needs a GPU (skipped without one)
    <!-- run: slurm -->               needs Slurm's daemons and a munge that answers (skipped without them, as
                                      tests/nodes/ is; scripts/slurm-up.sh provides both, and CI runs it first)
    <!-- run: expect=TEXT -->         TEXT must appear in the output (last option: the rest of the comment)
    <!-- run: output -->              the ```text block that follows shows the output: each of its lines
                                      appears in the output, in order (it may be an excerpt)
    <!-- run: output vary=REGEX -->   ... where the text REGEX matches in a line may differ (timings, picks
                                      made from timings, dates); last option: the rest of the comment
    <!-- no-run: reason -->           not run, and why

``--8<-- "path"`` lines (pymdownx.snippets, as the site is built) are replaced by the file they include.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch_teardown import aborted_at_teardown

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide"
DOC_PAGES = [README, *sorted(GUIDE.glob("*.md"))]
README_MAX_LINES = 200

_FENCE = re.compile(r"^```(\S*)\n(.*?)^```\s*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(no-run|run)\s*(?::\s*(.*?))?\s*-->\s*$")
_SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$', re.M)
_RUNNABLE = {"python", "bash"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: str | None = None  # "run", "no-run" or None
    reason: str = ""
    torchrun: int = 0
    slow: bool = False
    cuda: bool = False
    slurm: bool = False
    expect: list[str] = field(default_factory=list)
    output: bool = False  # compare with the shown output: the ```text block right after this one
    vary: str = ""  # a regular expression: what may differ between runs in a line of the shown output
    shown: str | None = None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.marker == "run" or (self.marker is None and self.lang == "python")


def _parse_options(block: Block, text: str) -> None:
    text = text or ""
    if "vary=" in text:
        text, vary = text.split("vary=", 1)
        block.vary = vary.strip()
        re.compile(block.vary)
    if "expect=" in text:
        text, expect = text.split("expect=", 1)
        block.expect.append(expect.strip())
    for word in text.split():
        if word.startswith("torchrun="):
            block.torchrun = int(word.split("=", 1)[1])
        elif word == "slow":
            block.slow = True
        elif word == "cuda":
            block.cuda = True
        elif word == "slurm":
            block.slurm = True
        elif word == "output":
            block.output = True
        else:
            raise ValueError(f"{block.name}: unknown option {word!r} in the run comment")


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    found, previous_end = [], 0
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        block = Block(page, line, match.group(1), match.group(2))
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        if marker:
            block.marker = marker.group(1)
            if block.marker == "no-run":
                block.reason = (marker.group(2) or "").strip()
            else:
                _parse_options(block, marker.group(2))
        if found and found[-1].output and block.lang == "text" and not text[previous_end : match.start()].strip():
            found[-1].shown = block.code  # the output the block above prints, shown right after it
        found.append(block)
        previous_end = match.end()
    return found


def _masked(lines: list[str], vary: str) -> list[str]:
    return [" ".join((re.sub(vary, "~", line) if vary else line).split()) for line in lines]


def _shown_lines_missing(shown: str, output: str, vary: str) -> list[str]:
    """The shown lines that do not appear in ``output`` in order (whitespace runs and ``vary`` matches aside)."""
    wanted = [line for line in _masked(shown.splitlines(), vary) if line]
    got = iter(_masked(output.splitlines(), vary))
    missing = []
    for line in wanted:
        if not any(line == candidate for candidate in got):
            missing.append(line)
            got = iter(_masked(output.splitlines(), vary))  # report every missing line, not just the first
    return missing


ALL_BLOCKS = [b for page in DOC_PAGES for b in blocks_of(page)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.lang in _RUNNABLE and b.runs]


def _expand_snippets(code: str) -> str:
    return _SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text().rstrip("\n"), code)


def _params():
    for block in RUN_BLOCKS:
        marks = [pytest.mark.slow] if block.slow else []
        if block.cuda:
            marks.append(pytest.mark.cuda)
        yield pytest.param(block, id=block.name, marks=marks)


def _sandbox(tmp_path: Path) -> dict:
    """A clone-like working folder and an environment where ``fastpar`` and this checkout are found."""
    for name in ("examples", "tests", "bench"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    for name, command in (("fastpar", f"{sys.executable} -m fastpar"), ("python", sys.executable)):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')  # the console script; this venv's python
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "FASTPAR_JOBS_DIR": str(tmp_path / "jobs"),
        "MPLBACKEND": "Agg",
    }


@pytest.mark.parametrize("block", list(_params()))
def test_code_block_runs_as_written(block: Block, tmp_path):
    if block.slurm:
        from fastpar.nodes.slurm import slurm_available

        ready, why = slurm_available()
        if not ready:
            pytest.skip(why)
    env = _sandbox(tmp_path)
    code = _expand_snippets(block.code)
    if block.lang == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        (tmp_path / "block.py").write_text(code)
        command = [sys.executable, "block.py"]
        if block.torchrun:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={block.torchrun}",
                "block.py",
            ]
    for _attempt in range(2):  # once more only after torch's teardown abort (torch_teardown.py)
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        if not (block.torchrun and aborted_at_teardown(done.returncode, done.stdout + done.stderr)):
            break
    output = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"{block.name} failed (exit {done.returncode}):\n{code}\n--- output ---\n{output[-4000:]}"
    )
    for text in block.expect:
        assert text in output, f"{block.name}: expected {text!r} in its output:\n{output[-4000:]}"
    if block.output:
        missing = _shown_lines_missing(block.shown, done.stdout, block.vary)
        assert not missing, (
            f"{block.name}: the output the page shows is not what the command prints; not found, in order:\n"
            + "\n".join(missing)
            + f"\n--- output ---\n{done.stdout[-4000:]}"
        )


def test_every_block_runs_or_says_why():
    problems = []
    for block in ALL_BLOCKS:
        if not block.lang:
            problems.append(f"{block.name}: a code block without a language (```python, ```bash, ```text ...)")
        elif block.marker == "no-run" and not block.reason:
            problems.append(f"{block.name}: <!-- no-run: ... --> needs a reason")
        elif block.lang == "bash" and block.marker is None:
            problems.append(f"{block.name}: a bash block needs <!-- run --> or <!-- no-run: reason --> above it")
        elif block.marker == "run" and block.lang not in _RUNNABLE:
            problems.append(f"{block.name}: only python and bash blocks can run, not {block.lang!r}")
        elif block.output and block.shown is None:
            problems.append(f"{block.name}: <!-- run: output --> needs a ```text block right after it")
    assert not problems, "\n".join(problems)
    assert any(b.torchrun for b in RUN_BLOCKS) and any(not b.slow for b in RUN_BLOCKS)  # the parser finds markers


def test_snippets_name_files_that_exist():
    for block in ALL_BLOCKS:
        for path in _SNIPPET.findall(block.code):
            assert (ROOT / path).is_file(), f"{block.name} includes {path}, which does not exist"


def test_readme_is_a_short_front_door():
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it <= {README_MAX_LINES}, move the rest to docs/"
    )
    assert not re.search(r"(?<![\w&/])#\d+\b|\bissues? \d+|load average", text, re.I), (
        "README: no issue numbers or load averages"
    )


def test_readme_links_resolve():
    text = README.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README links to files that do not exist: {broken}"


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_quick_start_is_one_set_up_command_and_the_test_commands():
    blocks = [b for b in blocks_of(README) if b.lang == "bash"]
    quick = _section(README.read_text(), "Quick start")
    in_quick = [b.code.strip() for b in blocks if b.code in quick]
    assert len(in_quick) == 4 and all(len(b.splitlines()) == 1 for b in in_quick), in_quick
    setup, test_setup, fast, full = in_quick
    assert setup.count("pip install --no-build-isolation -e .") == 1 and "build_ext" not in setup  # builds once
    assert setup.endswith("fastpar demo")
    assert test_setup == "pip install --no-build-isolation -e '.[test]'"  # what the tests import
    assert fast == "python -m pytest -q tests" and full == "python -m pytest -q tests --full"


def test_trainer_guide_shows_the_example_file():
    text = (GUIDE / "trainer.md").read_text()
    shown = [b for b in blocks_of(GUIDE / "trainer.md") if b.lang == "python" and b.runs]
    assert any(
        _expand_snippets(b.code) == (ROOT / "examples" / "train_classifier.py").read_text().rstrip("\n") for b in shown
    ), "the trainer guide should run examples/train_classifier.py as it is"
    assert '--8<-- "examples/train_classifier.py"' in text


def test_docs_carry_no_issue_numbers():
    pages = [*sorted(GUIDE.glob("*.md")), ROOT / "docs" / "design.md", ROOT / "docs" / "index.md"]
    for page in pages:
        assert not re.search(r"(?<![\w&/])#\d+\b|\bissues? \d+", page.read_text(), re.I), f"{page.name}: issue number"


def test_shown_output_is_compared_where_it_does_not_vary(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: output vary=\\s+[\\d.]+ ms$ -->\n```bash\nrun-it\n```\n\n```text\nsize 4.03 MiB\nstep 12.5 ms\n```\n"
    )
    (block, shown) = blocks_of(page)
    assert block.output and block.shown == shown.code and block.vary == r"\s+[\d.]+ ms$"
    assert _shown_lines_missing(block.shown, "header\nsize   4.03 MiB\nstep 99.1 ms\n", block.vary) == []
    assert _shown_lines_missing(block.shown, "size 4.10 MiB\nstep 12.5 ms\n", block.vary) == ["size 4.03 MiB"]
    assert _shown_lines_missing(block.shown, "step 12.5 ms\nsize 4.03 MiB\n", block.vary) == ["step~"]  # order


def test_the_planner_guide_compares_its_shown_output():
    shown = [b for b in blocks_of(GUIDE / "planner.md") if b.output]
    assert shown and all(b.shown and "pick:" in b.shown for b in shown)
