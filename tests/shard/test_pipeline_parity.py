"""Acceptance: a model pipelined by ``fastpar.shard.pipeline_model`` over spawned CPU ranks trains bit for bit as
the same microbatches accumulated in one process -- each microbatch's ``(loss / microbatches).backward()`` in
order, one AdamW step -- for 1F1B and GPipe at 2 stages, interleaved 1F1B at 2 ranks x 2 virtual stages, 3
stages, and 2 stages x 2 data-parallel replicas (1F1B, and interleaved with 2 virtual stages), on gloo and on
the fastpar backend.

Why bit-identical is expected: the schedules are built with ``scale_grads=False`` and the loss of each
microbatch is divided by the number of microbatches before its backward, so every stage computes the same
terms as the one-process loop and autograd accumulates them into ``.grad`` in the same microbatch order (the
activation gradient crossing a split is computed by the same operations, on another rank). With 2 replicas
DDP all-reduces ``g_0 / 2 + g_1 / 2``; halving is exact, so the reference averages its replicas' accumulated
gradients the same way and still matches exactly.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_training import pipelined_and_reference

from fastpar.launcher import spawn

STEPS = 2
# name -> (model, world size, stages, schedule, virtual stages)
CASES = {
    "1f1b_2stages": ("mlp", 2, 2, "1f1b", 1),
    "gpipe_2stages": ("mlp", 2, 2, "gpipe", 1),
    "interleaved_2ranks_x2": ("mlp", 2, 2, "interleaved-1f1b", 2),
    "1f1b_3stages_blocks": ("blocks", 3, 3, "1f1b", 1),
    "gpipe_2stages_blocks": ("blocks", 2, 2, "gpipe", 1),
    "pp2_dp2": ("mlp", 4, 2, "1f1b", 1),
    "interleaved_pp2_dp2": ("mlp", 4, 2, "interleaved-1f1b", 2),
}
FAST = {("1f1b_2stages", "gloo")}


def _run(name: str, backend: str) -> list[dict]:
    kind, world, stages, schedule, virtual = CASES[name]
    return spawn(pipelined_and_reference, world, kind, stages, schedule, virtual, STEPS, backend=backend, timeout=600)


def _check(name: str, results: list[dict]) -> None:
    kind, world, stages, schedule, virtual = CASES[name]
    reference = results[0]["reference"]  # computed in rank 0's process: the ranks' threads and kernels
    held: set[int] = set()
    for rank, result in enumerate(results):
        for part in ("grads", "params"):
            differ = [k for k, v in result[part].items() if not torch.equal(v, reference[part][k])]
            assert differ == [], f"rank {rank}: {part} of {differ} differ from the one-process reference"
        last = any(i == stages * virtual - 1 for i in result["stage_indices"])
        for step, loss in enumerate(result["losses"]):
            if last:
                assert torch.equal(loss, reference["losses"][step][result["replica"]]), f"rank {rank} step {step}"
            else:
                assert loss is None
        if world // stages > 1:
            assert result["wrapped"] == "DistributedDataParallel"  # fastpar's, over the stage's replicas
        held |= set(result["params"])
        assert result["memory"]["parameters"] == sum(p.numel() * 4 for p in result["params"].values())
        assert result["memory"]["gradients"] >= result["memory"]["parameters"]
    assert held == set(reference["params"]), "the stages together hold every parameter of the model"
    assert len({r["points"] for r in results}) == 1, "every rank must use the same split"


PARAMS = [
    pytest.param(name, backend, id=f"{name}-{backend}", marks=() if (name, backend) in FAST else pytest.mark.slow)
    for name in CASES
    for backend in ("gloo", "fastpar")
]


@pytest.mark.parametrize(("name", "backend"), PARAMS)
def test_pipeline_trains_as_the_microbatches_accumulated_in_one_process(name, backend):
    _check(name, _run(name, backend))
