"""How close the memory planner's predictions come to measurements on 2 CPU ranks (gloo, or ``--backend fastpar``:
the planner then prices the collectives with the profile shipped for that backend, as the Trainer does).

    python bench/plan_accuracy.py --layers 6 --hidden 256 --vocab 4000 --seq-len 128 --batch-size 8 --rounds 7

For each strategy of the plan (DDP, ZeRO-1, ZeRO-2 when the installed ShardedOptimizer shards gradients,
FSDP2 resharding on and off, the plan's pipeline) it prints the predicted and measured model-state bytes per
rank (parameters + gradients + optimizer state; the largest rank), the predicted and measured step time
(measured: interleaved rounds, slowest rank's median), and the ratio of each. Activations: the planner's
bytes beside the peak a profiler sees during one forward + backward in this process
(``torch.profiler`` memory events, gradients allocated beforehand so the peak is activations and transients).
Timing under load is noise: the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

import torch  # noqa: E402
from strategy_measure import compare_state, measure_rank, measured_profile, slowest_rank_medians, spec_of  # noqa: E402

from fastpar.costmodel.memory_planner import plan  # noqa: E402
from fastpar.costmodel.model_probe import ProbeResult, probe  # noqa: E402
from fastpar.costmodel.perf_profile import Profile  # noqa: E402
from fastpar.costmodel.planner_comm import SHIPPED_PROFILES  # noqa: E402
from fastpar.costmodel.strategy_time import optimizer_seconds_per_element  # noqa: E402
from fastpar.launcher import spawn  # noqa: E402


def profiled_activation_peak(model_kwargs: dict, batch_size: int, threads: int = 1) -> int:
    """Peak CPU bytes allocated during one forward + backward beyond what existed before it (gradients
    allocated beforehand)."""
    from torch.profiler import ProfilerActivity, profile

    from fastpar.costmodel.reference_transformer import ReferenceTransformer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = ReferenceTransformer(**model_kwargs)
    ids = model.example_batch(batch_size)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.loss(model(ids), ids).backward()
    # each op's own allocations (self_cpu_memory_usage) and the frees ("[memory]" events), in time order
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def scaled(result: ProbeResult, factor: float) -> ProbeResult:
    """``result`` with every time multiplied by ``factor``."""
    times = ("forward_s_per_sample", "backward_s_per_sample", "forward_fixed_s", "backward_fixed_s")
    return replace(result, **{name: [t * factor for t in getattr(result, name)] for name in times})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backend", default="gloo", choices=("gloo", "fastpar"), help="the ranks' backend")
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    model = dict(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq_len=args.seq_len)
    spec = spec_of(model)
    plan_args = dict(
        devices=2,
        device_memory="1TB",
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        threads=1,
        backend=args.backend,
    )
    torch.set_num_threads(1)  # as each spawned rank runs
    measured = probe(spec, batch_size=2, seq_len=args.seq_len, alongside=1)  # as plan() times CPU ranks
    opt_s = optimizer_seconds_per_element("adamw")
    predicted = plan(spec, probe_result=measured, **plan_args)
    import fastpar

    zero2 = "shard_gradients" in fastpar.ShardedOptimizer.__init__.__code__.co_varnames
    strategies = {}
    for e in predicted.estimates:
        if e.strategy == "zero2" and not zero2:
            continue
        strategies[e.label] = (e.strategy, e.options)
    strategies["local"] = ("local", {})
    config = {
        "model": model,
        "batch_size": args.batch_size,
        "strategies": strategies,
        "warmup": 2,
        "rounds": args.rounds,
        "collective_bytes": [1 << 16, 1 << 20, 1 << 22, 1 << 24],
    }
    load_before = os.getloadavg()
    results = spawn(measure_rank, 2, config, backend=args.backend, timeout=1800)
    load_after = os.getloadavg()
    steps = slowest_rank_medians(results)
    rows = []
    # the plan's own compute (the probe), against a step without communication timed in the same rounds: what
    # the load did between the probe and the measurement, so the communication model is judged apart from it
    forward, backward = measured.seconds(args.batch_size, args.seq_len)
    floor = sum(forward) + sum(backward) + opt_s * spec.numel
    correction = steps["local"] / floor
    corrected = plan(spec, probe_result=scaled(measured, correction), **plan_args)
    corrected_step = {e.label: e.step_s for e in corrected.estimates}
    shipped = ROOT / "bench" / "results" / SHIPPED_PROFILES[args.backend]
    wire = measured_profile(results, Profile.load(shipped), args.backend)
    both = plan(spec, probe_result=scaled(measured, correction), profile=wire, **plan_args)
    both_step = {e.label: e.step_s for e in both.estimates}
    print(
        f"compute floor: predicted {floor * 1e3:.1f} ms, measured in the rounds {steps['local'] * 1e3:.1f} ms "
        f"(x{correction:.2f}); 'corr': the prediction with the compute measured in the rounds; "
        "'corr+wire': and the collectives timed in the rounds"
    )
    print(
        f"{'strategy':<22}{'state pred':>12}{'state meas':>12}{'ratio':>7}{'step pred ms':>14}{'step meas ms':>14}"
        f"{'ratio':>7}{'corr ms':>9}{'ratio':>7}{'corr+wire':>11}{'ratio':>7}"
    )
    for e in predicted.estimates:
        if e.label not in strategies:
            continue
        predicted_state, measured_state = compare_state(e, results)
        row = {
            "strategy": e.label,
            "state_predicted": predicted_state,
            "state_measured": measured_state,
            "bytes_measured": [r[e.label]["bytes"] for r in results],
            "step_predicted_s": e.step_s,
            "step_measured_s": steps[e.label],
            "step_predicted_corrected_s": corrected_step[e.label],
            "step_predicted_corrected_wire_s": both_step[e.label],
        }
        rows.append(row)
        print(
            f"{e.label:<22}{predicted_state:>12}{measured_state:>12}{predicted_state / measured_state:>7.3f}"
            f"{e.step_s * 1e3:>14.1f}{steps[e.label] * 1e3:>14.1f}{e.step_s / steps[e.label]:>7.2f}"
            f"{corrected_step[e.label] * 1e3:>9.1f}{corrected_step[e.label] / steps[e.label]:>7.2f}"
            f"{both_step[e.label] * 1e3:>11.1f}{both_step[e.label] / steps[e.label]:>7.2f}"
        )
    ddp = next(e for e in predicted.estimates if e.strategy == "ddp")
    peak = profiled_activation_peak(model, args.batch_size)
    print(
        f"activations: predicted {ddp.memory.activations} B, profiled peak {peak} B, ratio {ddp.memory.activations / peak:.3f}"
    )
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min) on {os.cpu_count()} cores")
    print(predicted.table())
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": model,
                    "batch_size": args.batch_size,
                    "backend": args.backend,
                    "rows": rows,
                    "activations_predicted": ddp.memory.activations,
                    "activations_profiled_peak": peak,
                    "load": [load_before, load_after],
                    "compute_floor": {"predicted_s": floor, "measured_s": steps["local"]},
                    "collectives_in_rounds": wire.to_json()["collectives"],
                    "plan": predicted.to_json(),
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
