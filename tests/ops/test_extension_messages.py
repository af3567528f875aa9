"""The extension's error messages are built without iostreams (csrc/text.h says why): every TORCH_CHECK/TORCH_WARN
in csrc/ takes one message argument (a literal or ``text(...)``), and nothing there streams into an ostringstream.
A number streamed by an extension built with a newer GCC than the libstdc++ it runs against crashed the process
instead of raising; the message tests (tests/ops/test_ops.py and the backend's fault tests) show the text is right."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_MACRO = re.compile(r"\b(TORCH_CHECK\w*|TORCH_WARN\w*)\s*\(")


def _arguments(source: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' ends just before ``start``."""
    args, current, depth, quote, i = [], "", 0, None, start
    while i < len(source):
        c = source[i]
        if quote:
            current += c
            if c == "\\":
                current += source[i + 1]
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            current += c
        elif c in "([{":
            depth += 1
            current += c
        elif c in ")]}":
            if depth == 0:
                return [*args, current.strip()]
            depth -= 1
            current += c
        elif c == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += c
        i += 1
    raise AssertionError("unbalanced call")


def _sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".cuh"))


def test_every_check_takes_one_message_argument():
    offenders = []
    for path in _sources():
        source = path.read_text()
        for m in _MACRO.finditer(source):
            if source[: m.start()].rstrip().endswith("#define"):
                continue
            args = _arguments(source, m.end())
            if len(args) > 2:
                line = source.count("\n", 0, m.start()) + 1
                offenders.append(f"{path.relative_to(CSRC)}:{line} {m.group(1)} has {len(args) - 1} message parts")
    assert not offenders, "wrap the message in text(...) (csrc/text.h):\n" + "\n".join(offenders)


def test_no_iostreams_in_the_extension():
    offenders = [
        f"{path.relative_to(CSRC)}:{n}"
        for path in _sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"std::(o|i)?stringstream|<sstream>|std::cerr|std::cout|c10::str\(", line)
    ]
    assert not offenders, "build message text with text(...) (csrc/text.h), not iostreams: " + ", ".join(offenders)
