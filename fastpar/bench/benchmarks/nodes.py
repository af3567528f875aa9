"""``fastpar bench nodes``: the "fastpar" backend and fastpar's DDP across nodes joined by a shaped wire.

The benchmark makes K nodes on this machine (``fastpar.nodes``: network, UTS and mount namespaces, each with its
own address, hostname and /dev/shm, on a switch whose links ``tc tbf`` shapes to ``--link``), starts P ranks on
each (rank r on node r // P) and times, in interleaved rounds on the same ranks:

- all-reduce of ``--size`` bytes of float32 on the "fastpar" backend (hierarchical across the nodes: shared memory
  within a node, gloo among the node leaders) and on gloo (the peer). The floor is the link's rate: an all-reduce
  over K nodes must move 2(K-1)/K of the buffer out of each node, so ``size x 2(K-1)/K / rate`` seconds;
- a DDP training step of ``--model`` (ddp_variants): torch DDP on gloo (the peer), fastpar's DDP in fp32 and
  with bf16 gradients on the "fastpar" backend, and the model without communication (the compute floor); then a
  profile of rank 0's step per variant (forward, backward, its wait for the wire, optimizer) beside the gradients'
  link floor and the best step the wire allows;
- a ZeRO step of the same model with AdamW (unless ``--no-zero``): torch's ZeroRedundancyOptimizer over torch DDP
  on gloo (the peer), fastpar's ZeRO-1 and ZeRO-2 (``ShardedOptimizer``) on the "fastpar" backend, and the floor.

Every variant's result is checked (all-reduce: exact sums; DDP: every rank ends with rank 0's parameters; ZeRO:
every variant ends with torch's ZeRO's parameters, bit for bit).
The goals (2 nodes x 2 ranks over 1gbit) are printed as MET / NOT MET; at other shapes the same figures print
without goals. Needs root and iproute2 (the nodes are namespaces); the nodes and links are gone afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ...launcher import RankError
from ..context import BenchContext
from ..goals import AT_LEAST, AT_MOST, Goal, beyond_floor
from ..harness import BenchUsageError, WrongResultError, format_bytes, median, parse_bytes
from ..table import BenchReport, Column, PlotSpec

DESCRIPTION = "fastpar backend and DDP across K nodes on a tbf-shaped link vs gloo and torch DDP (needs root)"
USES: set[str] = set()
DEFAULTS = {"iters": 3, "warmup": 1, "rounds": 5}
PORT = 29511  # in node 0's own network namespace: nothing else listens there

ALLREDUCE_VS_GLOO = Goal("fastpar all-reduce speed", "gloo's", 1.6, AT_LEAST)
ALLREDUCE_VS_LINK = Goal("fastpar all-reduce", "of the link-rate bound", 0.80, AT_LEAST, unit="%")
FP32_VS_DDP = Goal("fastpar_fp32 step", "torch DDP on gloo", 0.75, AT_MOST)
BF16_VS_DDP = Goal("fastpar_bf16 step", "torch DDP on gloo", 0.55, AT_MOST)
GOAL_SHAPE = (2, 2, "1gbit")  # nodes, ranks per node, link: where the goals apply


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("nodes")
    group.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    group.add_argument("--procs-per-node", type=int, default=2, help="ranks on each node (default 2)")
    group.add_argument("--link", default="1gbit", help="each node's link rate, a tc rate (default 1gbit)")
    group.add_argument("--size", default="16M", help="all-reduce buffer in bytes, K/M/G allowed (default 16M)")
    group.add_argument("--model", default="mlp", help="DDP model: mlp, blocks or none (default mlp)")
    group.add_argument("--batch", type=int, default=64, help="DDP batch per rank (default 64)")
    group.add_argument("--steps", type=int, default=2, help="DDP steps per variant per round (default 2)")
    group.add_argument(
        "--extra-variants",
        default="",
        help="more DDP variants of 'fastpar bench ddp' to time beside them, comma-separated (e.g. fastpar_cap_4)",
    )
    group.add_argument(
        "--no-zero",
        dest="zero",
        action="store_false",
        help="leave out the ZeRO steps (torch's ZeroRedundancyOptimizer on gloo vs fastpar's ZeRO-1/2)",
    )
    group.add_argument("--timeout", type=float, default=900, help="seconds before the run is stopped (default 900)")


def check_flags(flags: argparse.Namespace) -> None:
    from ...nodes import link_rate_bits
    from .ddp_variants import MODELS

    if not 1 <= flags.nodes <= 16:
        raise BenchUsageError(f"--nodes {flags.nodes}: choose 1 to 16")
    if not 1 <= flags.procs_per_node <= 8:
        raise BenchUsageError(f"--procs-per-node {flags.procs_per_node}: choose 1 to 8")
    try:
        link_rate_bits(flags.link)
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    if flags.model != "none" and flags.model not in MODELS:
        raise BenchUsageError(f"--model {flags.model!r}: choose one of {', '.join(MODELS)} or none")
    from .ddp_variants import VARIANTS

    if parse_bytes(flags.size) < 4:
        raise BenchUsageError(f"--size {flags.size}: at least 4 bytes")
    unknown = [v for v in _extra(flags) if v not in VARIANTS]
    if unknown:
        raise BenchUsageError(f"--extra-variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")


def _extra(flags: argparse.Namespace) -> list[str]:
    return [v for v in flags.extra_variants.split(",") if v and v not in ("no_comm", "fastpar_fp32", "fastpar_bf16")]


def _launch(nodes, flags, config: dict, out: Path) -> list[dict]:
    world = flags.nodes * flags.procs_per_node
    root = str(Path(__file__).resolve().parents[3])  # the directory holding the fastpar package
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
        GLOO_SOCKET_IFNAME="eth0",  # each node's one link
        OMP_NUM_THREADS=str(config["threads"]),
    )
    procs = []
    for rank in range(world):
        argv = [sys.executable, "-m", "fastpar.bench.benchmarks.nodes_rank", str(rank), str(world)]
        argv += [nodes[0].address, str(PORT), str(out), json.dumps(config)]
        procs.append(
            nodes[rank // flags.procs_per_node].popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    failed = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=flags.timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RankError(
                f"rank {rank} (node {rank // flags.procs_per_node}) did not finish in {flags.timeout} s"
            ) from None
        if proc.returncode:
            failed.append(
                f"rank {rank} on node {rank // flags.procs_per_node} exited {proc.returncode}:\n{output[-3000:]}"
            )
    if failed:
        raise RankError(failed[0])
    return json.loads(out.read_text())


def run(ctx: BenchContext) -> BenchReport:
    from ...nodes import NodeCluster, available, link_rate_bits

    flags = ctx.flags
    ok, why = available()
    if not ok:
        raise BenchUsageError(f"bench nodes makes nodes from Linux namespaces, which this machine cannot: {why}")
    nbytes = parse_bytes(flags.size) // 4 * 4
    config = {
        "bytes": nbytes,
        "iters": ctx.iters,
        "warmup": ctx.warmup,
        "rounds": ctx.rounds,
        "model": "" if flags.model == "none" else flags.model,
        "batch": flags.batch,
        "steps": flags.steps,
        "extra_variants": _extra(flags),
        "zero": flags.zero,
        "threads": ctx.threads,
        "timeout_s": flags.timeout,
    }
    with NodeCluster(flags.nodes, link=flags.link) as nodes, tempfile.TemporaryDirectory() as tmp:
        every = _launch(nodes, flags, config, Path(tmp) / "result.json")
    return _report(ctx, every, nbytes, link_rate_bits(flags.link))


def _crossing(nodes: int, per_node: int, nbytes: int) -> tuple[float, float]:
    """Bytes out of the busiest node's link: (the hierarchy's all-reduce among K leaders, gloo's ring over all ranks
    in rank order, each ring edge carrying 2(n-1)/n of the buffer)."""
    world = nodes * per_node
    leaders = 2 * (nodes - 1) / nodes * nbytes
    out_edges = [0] * nodes
    for r in range(world):
        a, b = r // per_node, (r + 1) % world // per_node
        if a != b:
            out_edges[a] += 1
    ring = max(out_edges) * 2 * (world - 1) / world * nbytes
    return leaders, ring


def _profile_lines(flags, first: dict, rate_bits: float, peer_s: float, labels: dict[str, str]) -> list[str]:
    """Where rank 0's DDP step goes (forward, backward with the sync, of it the wait for the wire, optimizer),
    beside what the gradients need on the wire, and the best step the wire allows: the model's own forward and
    optimizer plus the longer of its backward and the link floor (perfect overlap)."""
    profile, grad_bytes = first["profile"], first["grad_bytes"]
    lines = []
    for v in ("ddp_gloo", "fastpar_fp32", "fastpar_bf16", "no_comm"):
        ph = {k: ms * 1e3 for k, ms in profile[v].items()}
        wait = "" if ph["wait"] != ph["wait"] else f" (of it waiting for the wire after the compute: {ph['wait']:.0f})"
        lines.append(
            f"profile, rank 0, median ms: {labels[v].removeprefix('DDP step: ')}: forward {ph['forward']:.0f}, "
            f"backward {ph['backward']:.0f}{wait}, optimizer {ph['optimizer']:.0f}"
        )
    own = profile["no_comm"]
    for v, width in (("fastpar_fp32", 1.0), ("fastpar_bf16", 0.5)):
        hier, ring = _crossing(flags.nodes, flags.procs_per_node, grad_bytes * width)
        floor = hier * 8 / rate_bits
        best = own["forward"] + max(own["backward"], floor) + own["optimizer"]
        lines.append(
            f"{v}: {hier / 2**20:.1f} MiB of gradients out of each node's link per step ({floor * 1e3:.0f} ms at the "
            f"link's rate; gloo's ring: {ring / 2**20:.1f} MiB, {ring * 8 / rate_bits * 1e3:.0f} ms); the best step "
            f"the wire allows, the model's forward + max(backward, link floor) + optimizer: {best * 1e3:.0f} ms = "
            f"{best / peer_s:.2f}x the peer's measured step"
        )
    return lines


def _step_row(label: str, seconds: float, peer: float, steps: dict[str, float]) -> dict:
    """A training step's row: its time, against the peer's and against the model without communication."""
    return {"what": label, "ms": seconds * 1e3, "vs_peer": seconds / peer, "vs_floor": seconds / steps["no_comm"]}


def _report(ctx: BenchContext, every: list[dict], nbytes: int, rate_bits: float) -> BenchReport:
    flags = ctx.flags
    first = every[0]
    wrong = {v: text for result in every for v, text in result.get("wrong", {}).items()}
    if wrong:
        raise WrongResultError("; ".join(f"{v}: {text}" for v, text in wrong.items()))
    leaders_bytes, ring_bytes = _crossing(flags.nodes, flags.procs_per_node, nbytes)
    link_floor = leaders_bytes * 8 / rate_bits if flags.nodes > 1 else 0.0
    times = {name: median(values) for name, values in first["allreduce"].items()}
    report = BenchReport(
        benchmark="nodes",
        title=f"{flags.nodes} nodes x {flags.procs_per_node} ranks, links shaped to {flags.link} (tc tbf)",
        columns=[
            Column("what", "what", 44),
            Column("ms", "median ms", 11, ".1f"),
            Column("vs_peer", "x peer", 8, ".2f"),
            Column("vs_floor", "x floor", 8, ".2f"),
        ],
        header={
            "status": json.dumps(first["status"]),
            "all-reduce": f"{format_bytes(nbytes)} float32, {ctx.iters} per round, {ctx.rounds} rounds, interleaved",
        },
        config=ctx.config(),
        plot=PlotSpec("bar", "what", "vs_peer", ylabel="time / the peer's (gloo; torch DDP on gloo)"),
    )
    ar_peer = times["gloo"]
    for name, label in (("gloo", "all-reduce gloo (peer)"), ("fastpar", "all-reduce fastpar")):
        report.rows.append(
            {
                "what": label,
                "ms": times[name] * 1e3,
                "vs_peer": times[name] / ar_peer,
                "vs_floor": times[name] / link_floor if link_floor else float("nan"),
            }
        )
    report.rows.append({"what": "all-reduce link-rate floor", "ms": link_floor * 1e3, "vs_floor": 1.0})
    report.footer.append(
        f"bytes out of the busiest node's link per all-reduce: the hierarchy {leaders_bytes / 2**20:.2f} MiB, "
        f"gloo's ring {ring_bytes / 2**20:.2f} MiB; by the wire alone the speed-up over gloo is at most "
        f"{ring_bytes / leaders_bytes:.2f}x"
        if flags.nodes > 1
        else "one node: nothing crosses a link"
    )
    goals_apply = (flags.nodes, flags.procs_per_node, flags.link.lower()) == GOAL_SHAPE
    if goals_apply:
        speedup = ar_peer / times["fastpar"]
        report.goals.append(ALLREDUCE_VS_GLOO.check(speedup, detail=f"wire bound {ring_bytes / leaders_bytes:.2f}x"))
        share = link_floor / times["fastpar"]
        flag = beyond_floor("all-reduce fastpar", times["fastpar"], link_floor, "the link-rate floor")
        report.goals.append(ALLREDUCE_VS_LINK.check(share, flag=flag))
    if "ddp" in first:
        steps = {v: median(values) for v, values in first["ddp"].items()}
        peer = steps["ddp_gloo"]
        labels = {
            "ddp_gloo": "DDP step: torch DDP on gloo (peer)",
            "fastpar_fp32": "DDP step: fastpar fp32",
            "fastpar_bf16": "DDP step: fastpar bf16 grads",
            "no_comm": "DDP step: no communication (floor)",
        }
        for v in ("ddp_gloo", "fastpar_fp32", "fastpar_bf16", "no_comm", *_extra(flags)):
            report.rows.append(_step_row(labels.get(v, f"DDP step: {v} (fastpar backend)"), steps[v], peer, steps))
        report.header["ddp"] = (
            f"model {flags.model}, batch {flags.batch}/rank, {flags.steps} steps per round, SGD, "
            f"{ctx.threads} thread(s) per rank"
        )
        if "profile" in first and flags.nodes > 1:
            report.footer.extend(_profile_lines(flags, first, rate_bits, peer, labels))
        if goals_apply:
            for goal, v in ((FP32_VS_DDP, "fastpar_fp32"), (BF16_VS_DDP, "fastpar_bf16")):
                flag = beyond_floor(v, steps[v], steps["no_comm"], "no_comm")
                report.goals.append(goal.check(steps[v] / peer, flag=flag))
    if "zero" in first:
        steps = {v: median(values) for v, values in first["zero"].items()}
        peer = steps["zero_torch"]
        labels = {
            "zero_torch": "ZeRO step: torch ZeRO on gloo (peer)",
            "zero_fastpar": "ZeRO step: fastpar ZeRO-1",
            "zero2_fastpar": "ZeRO step: fastpar ZeRO-2",
            "no_comm": "ZeRO step: no communication (floor)",
        }
        for v, label in labels.items():
            report.rows.append(_step_row(label, steps[v], peer, steps))
        report.header["zero"] = (
            f"model {flags.model}, AdamW, batch {flags.batch}/rank, {flags.steps} steps per round; each step waits "
            "for its parameters' all-gather; no goal is set for these rows"
        )
    if not goals_apply:
        report.notes.append("the goals are set for 2 nodes x 2 ranks over 1gbit; this shape prints figures only")
    report.summary = {"allreduce_ms": {k: v * 1e3 for k, v in times.items()}, "link_floor_ms": link_floor * 1e3}
    return report
