"""CPU time per training step of each thread of a rank, for ``fastpar bench ddp``'s variants interleaved in one process.

Where ``fastpar bench ddp`` prints each variant's wall and process CPU time, this splits rank 0's CPU per step by
thread (read from ``/proc/self/task/*/stat`` around every step): the compute thread (``main``), the "fastpar"
backend's threads (``shm``: ``fastpar-shm``, ``fastpar-shm-cb``) and gloo's (``gloo``). Used for the per-thread
tables in docs/guide/backend.md and docs/results/index.md.

    OMP_NUM_THREADS=1 python scripts/ddp_thread_cpu.py --model blocks --rounds 15 \\
        no_comm ddp_bucket_view ddp_view_cap fastpar_fp32@private fastpar_fp32

A variant is a ``fastpar bench ddp`` variant name; ``@private`` builds it with ``FASTPAR_SHM_BUCKETS=0`` (fastpar
DDP's buckets in private memory). ``--backend gloo`` runs every variant on gloo instead of the "fastpar" backend.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist

TICKS = os.sysconf("SC_CLK_TCK")
STEPS_PER_ROUND = 3


def thread_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by kind (main, shm, gloo, other)."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(tid) == os.getpid():
            kind = "main"
        elif name.startswith("fastpar-shm"):
            kind = "shm"
        elif "gloo" in name or name.startswith("pt_"):
            kind = "gloo"
        else:
            kind = "other"
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
    return out


def process_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(rank: int, world: int, specs: list[str], model: str, rounds: int, backend: str) -> dict | None:
    from fastpar.bench.benchmarks.ddp_variants import Trainee
    from fastpar.bench.benchmarks.training_step import MODELS

    torch.manual_seed(0)
    trainees = {}
    for spec in specs:
        variant, _, flag = spec.partition("@")
        os.environ["FASTPAR_SHM_BUCKETS"] = "0" if flag == "private" else "1"
        trainees[spec] = Trainee(variant, model, torch.device("cpu"), 0.01)
    x = torch.randn(64, MODELS[model][0])
    for trainee in trainees.values():
        for _ in range(2):
            trainee.step(x)
    wall = {s: [] for s in specs}
    cpu = {s: [] for s in specs}
    threads = {s: {} for s in specs}
    for _ in range(rounds):
        for spec, trainee in trainees.items():
            dist.barrier()
            for _ in range(STEPS_PER_ROUND):
                before, c0, t0 = thread_seconds(), process_seconds(), time.perf_counter()
                trainee.step(x)
                wall[spec].append(time.perf_counter() - t0)
                cpu[spec].append(process_seconds() - c0)
                for kind, seconds in thread_seconds().items():
                    threads[spec][kind] = threads[spec].get(kind, 0.0) + seconds - before.get(kind, 0.0)
    medians = torch.tensor(
        [[sorted(v)[len(v) // 2] for v in wall.values()], [sorted(v)[len(v) // 2] for v in cpu.values()]],
        dtype=torch.float64,
    )
    gathered = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    if rank != 0:
        return None
    steps = rounds * STEPS_PER_ROUND
    return {
        spec: {
            "wall_ms": max(g[0, i].item() for g in gathered) * 1e3,
            "cpu_ms": max(g[1, i].item() for g in gathered) * 1e3,
            "rank0_threads_ms": {k: v / steps * 1e3 for k, v in sorted(threads[spec].items()) if v > 0},
        }
        for i, spec in enumerate(specs)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="fastpar bench ddp variant names (name@private: private buckets)")
    parser.add_argument("--model", default="blocks", choices=("mlp", "blocks"))
    parser.add_argument("--rounds", type=int, default=15, help=f"interleaved rounds of {STEPS_PER_ROUND} steps")
    parser.add_argument("--backend", default="fastpar", choices=("fastpar", "gloo"))
    flags = parser.parse_args()
    import fastpar  # noqa: F401  (registers the "fastpar" backend)
    from fastpar.launcher import spawn

    results = spawn(rank_main, 2, flags.variants, flags.model, flags.rounds, flags.backend, backend=flags.backend)
    floor = None
    for spec, row in results[0].items():
        floor = floor or row["wall_ms"]
        threads = " ".join(f"{k}={v:.1f}" for k, v in row["rank0_threads_ms"].items())
        print(
            f"{flags.model:6} {spec:28} {row['wall_ms']:8.2f} ms  cpu {row['cpu_ms']:7.2f} ms  "
            f"x{row['wall_ms'] / floor:.3f}  rank 0 CPU per step by thread (ms): {threads}"
        )


if __name__ == "__main__":
    main()
