"""The machine a benchmark ran on: written into every JSON and at the top of ``fastpar bench all``'s summary,
and how busy it was: the load average against the CPUs this process may use, with a warning when other work
competed for them.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

from ..host import usable_cpu_count


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, machine-wide); None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def load_lines(before: float | None, after: float | None) -> tuple[str, str | None]:
    """The header text of the load around a run, and a warning when the machine was busier than the CPUs this
    process may use before the run started (the run's own ranks add to the load after it)."""
    cpus = usable_cpu_count()
    shown = ", ".join(f"{v:.2f} {w}" for v, w in ((before, "before"), (after, "after")) if v is not None)
    header = f"{shown or 'unknown'} (1 min) on {cpus} usable CPU{'s' if cpus != 1 else ''}"
    if before is not None and before > cpus:
        return header, (
            f"the machine was busier than its {cpus} usable CPU(s) before this run (load {before:.2f}): other work "
            "competed for the cores, so times are slower and verdicts unreliable; re-run on a quiet machine"
        )
    return header, None


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge the numbers: CPU, cores, GPUs, versions, kernel backend, date."""
    from ..info import collect

    facts = collect()
    gpus = []
    if facts["cuda_available"]:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    facts.update(
        cpu_model=cpu_model(),
        hostname=platform.node(),
        gpus=gpus,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    return facts


def machine_markdown(facts: dict[str, Any]) -> str:
    """``facts`` as a two-column Markdown table."""
    ext = facts["extension"]
    counts: dict[str, int] = {}
    for name in facts["gpus"]:
        counts[name] = counts.get(name, 0) + 1
    gpus = ", ".join(f"{n} x {name}" for name, n in counts.items()) or "none"
    rows = [
        ("date", facts["date"]),
        ("host", facts.get("hostname") or "unknown"),
        ("CPU", f"{facts['cpu_model']} ({facts['cpu_count']} logical cores)"),
        ("GPUs", gpus),
        ("torch", f"{facts['torch']} (CUDA {facts['torch_cuda'] or 'none'})"),
        ("NCCL", facts["nccl"] or "not available"),
        ("DALI", facts["dali"] or "not installed"),
        ("fastpar", f"{facts['fastpar']}, kernels: {ext['backend']} ({ext['reason']})"),
        ("python", f"{facts['python']} on {facts['platform']}"),
    ]
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
