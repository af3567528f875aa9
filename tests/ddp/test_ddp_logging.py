"""``_get_ddp_logging_data()`` against torch's, run side by side on spawned gloo ranks: the same keys at every step,
the same values for everything but clocks, runtime statistics sampled at torch's iterations (with torch's running
averages), and ``can_set_static_graph`` only where torch sets it (Lightning reads it at teardown)."""

from __future__ import annotations

import sys

import torch

from fastpar.launcher import spawn

sys.path.insert(0, __file__.rsplit("/", 1)[0])

CLOCKS = {  # host clocks and durations: compared by their structure, not their values
    "forward_compute_time",
    "backward_compute_time",
    "backward_comm_time",
    "backward_compute_comm_overlap_time",
    "avg_forward_compute_time",
    "avg_backward_compute_time",
    "avg_backward_comm_time",
    "avg_backward_compute_comm_overlap_time",
    "forward_compute_time_start",
    "backward_compute_time_start",
    "backward_compute_time_end",
    "backward_comm_time_start",
    "backward_comm_time_end",
}
# name -> (model kind, DDP arguments, sample rate or None). The first case logs can_set_static_graph=0 on rank 0;
# torch writes that key once per process, so the cases after it compare everything else.
CASES = {
    "unused_changes": ("unused", {"find_unused_parameters": True}, None),
    "mlp_small_buckets": ("mlp", {"bucket_cap_mb": 0.004}, 3),
    "unused_static": ("unused", {"static_graph": True, "find_unused_parameters": True}, 4),
    "comm_hook": ("mlp", {}, 2),
    "no_sync": ("mlp", {}, 3),
}
STEPS = 14


def _run(cls, kind: str, ddp_args: dict, rate, rank: int, name: str) -> list[dict]:
    from ddp_models import MODELS, make_input
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    module = MODELS[kind]()
    if "static_graph" in ddp_args:  # a static graph: the sometimes-used layer is never used
        module.forward = lambda x, step=0, rank=0, m=module: m.out(torch.tanh(m.body(x)))
    # fastpar's defaults log what they do: gradients kept as bucket views, ~4 MiB buckets on CPU at 2 ranks
    defaults = {"gradient_as_bucket_view": False, "bucket_cap_mb": 25}
    model = cls(module, **(defaults | ddp_args))
    if name == "comm_hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if rate is not None:
        model._set_ddp_runtime_logging_sample_rate(rate)
    gen = torch.Generator().manual_seed(rank)
    out = [model._get_ddp_logging_data()]
    for step in range(STEPS):
        if name == "no_sync" and step % 3 == 1:
            with model.no_sync():
                model(make_input(kind, gen), step=step, rank=rank).square().mean().backward()
        model(make_input(kind, gen), step=step, rank=rank).square().mean().backward()
        out.append(model._get_ddp_logging_data())
    return out


def _logging_rank(rank: int, world_size: int) -> dict:
    import fastpar

    results = {}
    keep_alive = []  # torch logs can_set_static_graph when a Logger is destroyed: keep every wrapper alive
    for name, (kind, ddp_args, rate) in CASES.items():
        ref = _run(torch.nn.parallel.DistributedDataParallel, kind, ddp_args, rate, rank, name)
        got = _run(fastpar.DDP, kind, ddp_args, rate, rank, name)
        keep_alive.append((ref, got))
        results[name] = (ref, got)
    return results


def _averages_follow(samples: list[dict]) -> bool:
    """Each avg_* is torch's integer running mean of the durations at the sampled iterations."""
    for average, duration in (
        ("avg_forward_compute_time", "forward_compute_time"),
        ("avg_backward_compute_time", "backward_compute_time"),
        ("avg_backward_comm_time", "backward_comm_time"),
    ):
        mean, n = 0, 0
        for data in samples:
            n += 1
            mean = (data[duration] + mean * (n - 1)) // n
            if data[average] != mean:
                return False
    return True


def test_logging_data_matches_torch():
    results = spawn(_logging_rank, 2, timeout=300)
    for rank, per_case in enumerate(results):
        for name, (ref, got) in per_case.items():
            sampled, last_start = [], None
            for step, (theirs, ours) in enumerate(zip(ref, got, strict=True)):
                where = f"rank {rank}, {name}, after step {step}"
                ours = dict(ours)
                if name != "unused_changes":
                    assert ours.pop("can_set_static_graph", None) in (None, 0), where
                    theirs = {k: v for k, v in theirs.items() if k != "can_set_static_graph"}
                assert sorted(ours) == sorted(theirs), f"{where}: keys {set(ours) ^ set(theirs)}"
                differ = {k: (theirs[k], ours[k]) for k in theirs if k not in CLOCKS and theirs[k] != ours[k]}
                assert not differ, f"{where}: (torch, fastpar) {differ}"
                if ours.get("forward_compute_time_start", last_start) != last_start:  # a new sample
                    sampled.append(ours)
                    assert ours["forward_compute_time_start"] <= ours["backward_compute_time_start"], where
                    assert ours["backward_compute_time_start"] <= ours["backward_comm_time_start"], where
                    assert ours["backward_comm_time_start"] <= ours["backward_comm_time_end"], where
                    assert ours["backward_compute_time_start"] <= ours["backward_compute_time_end"], where
                last_start = ours.get("forward_compute_time_start")
            assert len(sampled) >= 5 and _averages_follow(sampled), f"rank {rank}, {name}"
    # the case that exercises can_set_static_graph: the unused set changes on rank 0 only
    assert results[0]["unused_changes"][1][-1]["can_set_static_graph"] == 0
    assert "can_set_static_graph" not in results[1]["unused_changes"][1][-1]
