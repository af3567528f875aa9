"""The "fastpar" backend on a group spanning real nodes (namespaces with their own /dev/shm, shaped links):
all-reduce, reduce-scatter, all-gather, broadcast and barrier run hierarchically (shared memory within a node,
gloo among the node leaders), every rank ends with the same bits, and those bits follow the documented order:
each node's ranks summed first, then the nodes' sums."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpar.launcher import free_port

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))
from nodes_collectives_worker import SHARE, inputs  # noqa: E402

WORKER = REPO / "tests" / "support" / "nodes_collectives_worker.py"
SHARDED = REPO / "tests" / "support" / "nodes_sharded_worker.py"


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env["GLOO_SOCKET_IFNAME"] = "eth0"  # each node's one link
    return env


def _run(nodes, layout: list[int], out: Path, worker: Path = WORKER) -> list[dict]:
    """Rank r on node layout[r]; returns what each rank saved."""
    world, port = len(layout), str(free_port())
    procs = [
        nodes[node].popen(
            [sys.executable, "-u", str(worker), str(rank), str(world), nodes[0].address, port, str(out)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, node in enumerate(layout)
    ]
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank} on node {layout[rank]}:\n{output[-4000:]}"
    return [torch.load(out / f"{rank}.pt") for rank in range(world)]


def _hierarchical_sum(values: list[torch.Tensor], layout: list[int]) -> torch.Tensor:
    """The documented order where it is exact whatever the ring: at most two ranks per node and two nodes (a sum of
    two is the same either way round)."""
    nodes = sorted(set(layout), key=layout.index)
    sums = []
    for node in nodes:
        members = [values[r] for r in range(len(layout)) if layout[r] == node]
        sums.append(members[0] + members[1] if len(members) == 2 else members[0])
    return sums[0] + sums[1]


def _check_common(got: list[dict], layout: list[int]) -> None:
    world = len(layout)
    nodes = len(set(layout))
    for rank, result in enumerate(got):
        assert result["status"] == {"backend": "fastpar", "shm": True, "reason": "", "nodes": nodes}, (rank, result)
    for key in ("sum", "sum_bf16", "avg", "sum_t", "parts", "coalesced", "all_gather", "broadcast"):
        for rank in range(1, world):
            assert torch.equal(got[rank][key], got[0][key]), f"{key}: rank {rank} differs from rank 0"
    xs = [inputs(r) for r in range(world)]
    exact = torch.stack([x["x"].double() for x in xs]).sum(0)
    torch.testing.assert_close(got[0]["sum"].double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0]["avg"], got[0]["sum"] / world)  # AVG: the group's sum, divided once
    torch.testing.assert_close(got[0]["sum_t"], sum(x["m"] for x in xs).t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0]["parts"], got[0]["coalesced"]) or nodes > 2  # both reduce each part alone
    ranks = torch.arange(world, dtype=torch.float32)
    assert torch.equal(got[0]["all_gather"], ranks.repeat_interleave(5))
    assert torch.equal(got[0]["all_gather_list"], ranks.repeat_interleave(3))
    assert torch.equal(got[0]["broadcast"], torch.full((7,), float(world - 1)))
    # reduce-scatter: this rank's share of the all-reduce of the whole input, as gloo defines it
    sums_of_whole = _reduce_whole(got, layout)
    for rank in range(world):
        share = got[rank]["reduce_scatter"]
        if sums_of_whole is not None:
            assert torch.equal(share, sums_of_whole[rank * SHARE : (rank + 1) * SHARE]), rank
        else:
            torch.testing.assert_close(share.double(), exact[rank * SHARE : (rank + 1) * SHARE], rtol=1e-5, atol=1e-5)


def _reduce_whole(got, layout):
    if len(set(layout)) != 2 or max(layout.count(n) for n in set(layout)) > 2:
        return None
    return _hierarchical_sum([inputs(r)["x"][: len(layout) * SHARE] for r in range(len(layout))], layout)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param([0, 0, 1, 1], id="2x2-blocked"),
        pytest.param([0, 1, 0, 1], id="2x2-interleaved"),
        pytest.param([0, 0, 1], id="2+1", marks=pytest.mark.slow),
        pytest.param([0, 1, 2, 0, 2], id="3-nodes-uneven", marks=pytest.mark.slow),
    ],
)
def test_collectives_run_hierarchically_with_the_same_bits_everywhere(make_nodes, tmp_path, layout):
    nodes = make_nodes(len(set(layout)), link="1gbit")
    got = _run(nodes, layout, tmp_path)
    _check_common(got, layout)
    if len(set(layout)) == 2:  # exact in the documented order
        xs = [inputs(r)["x"] for r in range(len(layout))]
        assert torch.equal(got[0]["sum"], _hierarchical_sum(xs, layout))


def test_one_rank_per_node_stays_on_gloo(make_nodes, tmp_path):
    """Nothing to share within a node: the group runs on gloo and says why."""
    nodes = make_nodes(2, link=None)
    got = _run(nodes, [0, 1], tmp_path)
    for result in got:
        status = result["status"]
        assert not status["shm"] and status["nodes"] == 0, status
        assert "host of its own" in status["reason"], status


@pytest.mark.slow
def test_fully_sharded_and_ddp_train_across_nodes(make_nodes, tmp_path):
    """FSDP2 (reduce-scatter, all-gather) and fastpar's DDP (all-reduce) on the hierarchical backend, 2 nodes x 2:
    every rank holds rank 0's parameters, which match one process training on all ranks' batches."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import nodes_sharded_worker as w

    got = _run(make_nodes(2, link="1gbit"), [0, 0, 1, 1], tmp_path, SHARDED)
    reference = w.make_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(w.STEPS):
        xs, ys = zip(*(w.batch(rank, step) for rank in range(4)), strict=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    expected = w.flat(reference)
    for rank, result in enumerate(got):
        assert result["status"]["nodes"] == 2, result["status"]
        assert result["fsdp_same_as_rank0"] and result["ddp_same_as_rank0"], rank
    torch.testing.assert_close(got[0]["fsdp"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0]["ddp"], expected, rtol=1e-5, atol=1e-6)
