"""``fastpar.sweep``: train many networks at once (MATLAB's ``parfor`` over hyperparameters) — one trial
per config, each a submitit job, as many at once as this machine has slots (one GPU each, or disjoint
CPU cores), the rest queued; on Slurm every trial is a Slurm job and Slurm queues them.

Everything lives in the sweep's folder: ``trials/<key>/`` per trial (its job: pickled call, result, logs,
progress), ``results.jsonl`` and ``curves.png``. Run the same sweep again and finished trials are not
rerun (their results are read back), trials still running are waited for, failed ones run again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import channel
from .curves import plot_trials
from .executor import check_resources, resolve_cluster
from .future import JobFuture
from .live import LiveTable
from .results import CANCELLED, COMPLETED, FAILED, RUNNING, SweepResult, Trial, choose_metric, record_of
from .slots import plan_slots
from .store import RECORD_FILE, JobRecord
from .submission import describe, start_job
from .task import pack_call

REFRESH_S = 1.0


def trial_keys(fn_name: str, configs: Sequence[Any]) -> list[str]:
    """A stable name per (function, config); repeated configs get -2, -3, ..."""
    keys, seen = [], {}
    for config in configs:
        text = json.dumps([fn_name, config], sort_keys=True, default=repr)
        key = hashlib.sha1(text.encode()).hexdigest()[:12]
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}-{seen[key]}")
    return keys


def _reattach(trial: Trial) -> None:
    """Pick up what an earlier run of the sweep left in the trial's folder."""
    if not (trial.folder / RECORD_FILE).is_file():
        return
    future = JobFuture(JobRecord.load(trial.folder))
    state = future.state()
    if state == COMPLETED:
        trial.state, trial.resumed, trial.result = COMPLETED, True, future.result()
    elif state in ("RUNNING", "PENDING"):  # still going: wait for it instead of starting another
        trial.state, trial.future, trial.started = RUNNING, future, time.monotonic()
    else:  # failed or cancelled: keep its files for reading, run it again in a fresh folder
        attempt = 1
        while (old := trial.folder.with_name(f"{trial.folder.name}.attempt-{attempt}")).exists():
            attempt += 1
        trial.folder.rename(old)


class _Sweep:
    def __init__(
        self,
        train_fn: Callable[[Any], Any],
        configs: Sequence[Any],
        folder: Path,
        cluster: str,
        params: dict[str, Any],
        slots: list | None,
        max_parallel: int | None,
        live: bool,
    ) -> None:
        self.fn_name = describe(train_fn)
        names = [f"config {i}" for i in range(len(configs))]
        # every call is packed before the first trial starts: a config that can't travel stops the sweep at once
        self.payloads = [pack_call(train_fn, (config,), [name]) for config, name in zip(configs, names, strict=True)]
        self.folder, self.cluster, self.params = folder, cluster, params
        keys = trial_keys(self.fn_name, configs)
        self.trials = [
            Trial(i, k, c, folder / "trials" / k) for i, (k, c) in enumerate(zip(keys, configs, strict=True))
        ]
        self.free = list(slots) if slots is not None else None  # None: the cluster queues the trials
        self.capacity = max_parallel
        self.running: dict[concurrent.futures.Future, Trial] = {}
        self.table = LiveTable(self.trials, live=live)

    def _start(self, trial: Trial) -> None:
        slot = self.free.pop(0) if self.free is not None else None
        params = dict(self.params)
        if slot is not None:
            params["gpus_per_node"] = len(slot.gpus)
        trial.slot, trial.state, trial.seconds = slot, RUNNING, None
        trial.started = time.monotonic()
        trial.future = start_job(
            self.payloads[trial.index],
            kind="trial",
            name=f"trial-{trial.index}",
            what=f"{self.fn_name}({trial.short_config(80)})",
            cluster=self.cluster,
            params=params,
            folder=trial.folder,
            slot=slot,
            threads_from_cores=self.free is None,
        )
        self.running[trial.future] = trial

    def _take_slot_of(self, trial: Trial) -> None:
        """A re-attached trial keeps the slot it was started on: no other trial may start there."""
        held = trial.future.record.slot
        if self.free is None or held is None:
            return
        for slot in self.free:
            if [slot.index, list(slot.cpus), list(slot.gpus)] == [held["index"], held["cpus"], held["gpus"]]:
                self.free.remove(slot)
                trial.slot = slot
                return

    def _finish(self, trial: Trial) -> None:
        future = trial.future
        trial.seconds = time.monotonic() - trial.started if trial.started is not None else None
        if future.cancelled():
            trial.state, trial.error = CANCELLED, "cancelled"
        elif (error := future.exception()) is not None:
            trial.state, trial.error = (
                FAILED,
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            )
        else:
            trial.state, trial.result = COMPLETED, future.result()
        if self.free is not None and trial.slot is not None:
            self.free.append(trial.slot)

    def _room(self) -> bool:
        if self.capacity is not None and len(self.running) >= self.capacity:
            return False
        return self.free is None or bool(self.free)

    def run(self) -> None:
        for trial in self.trials:
            _reattach(trial)
            if trial.future is not None:  # still running from an earlier run of the sweep
                self.running[trial.future] = trial
                self._take_slot_of(trial)
        pending = [t for t in self.trials if t.state not in (COMPLETED, RUNNING)]
        try:
            while pending or self.running:
                while pending and self._room():
                    self._start(pending.pop(0))
                self.table.update()
                done, _ = concurrent.futures.wait(
                    list(self.running), timeout=REFRESH_S, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in done:
                    self._finish(self.running.pop(future))
        except KeyboardInterrupt:
            for future in list(self.running):
                future.cancel()
            self.table.close()
            finished = sum(t.state == COMPLETED for t in self.trials)
            raise KeyboardInterrupt(
                f"sweep interrupted: its running trials were stopped; {finished} finished trial(s) are kept in "
                f"{self.folder}. Run the same sweep again to resume"
            ) from None
        self.table.update()
        self.table.close()


def sweep(
    train_fn: Callable[[Any], Any],
    configs: Sequence[Any],
    *,
    folder: str | Path = "fastpar-sweep",
    metric: str | None = None,
    mode: str | None = None,
    cpus_per_trial: int | None = None,
    gpus_per_trial: int | None = None,
    max_parallel: int | None = None,
    cluster: str = "auto",
    resources: Mapping[str, Any] | None = None,
    live: bool = True,
    plot: bool = True,
) -> SweepResult:
    """Run ``train_fn(config)`` for every config, many at once, and compare them.

    ``train_fn`` trains one network (typically with a ``fastpar.Trainer``; give its ``output_dir`` as
    ``fastpar.jobs.job_dir()`` to keep each trial's files in its folder) or computes anything; its return
    value is the trial's result. Locally each trial runs in a slot: ``gpus_per_trial`` GPUs (default 1 when
    the machine has GPUs) or ``cpus_per_trial`` cores (default 1 without GPUs), pinned; ``max_parallel``
    caps the trials at once. ``metric``/``mode`` choose the best trial (default: val_loss, val_accuracy,
    loss, ... whichever the trials report; "max" for accuracies). ``resources`` go to submitit (e.g.
    ``timeout_min``, ``slurm_partition``). Returns a :class:`~fastpar.jobs.SweepResult`; writes
    ``results.jsonl`` and ``curves.png`` (every trial's validation curve) into ``folder``.
    """
    if not callable(train_fn):
        raise TypeError(f"train_fn must be a function taking one config, got {type(train_fn).__name__}")
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Sequence) or not configs:
        raise ValueError("configs must be a non-empty list of configs (e.g. [{'lr': 0.1}, {'lr': 0.01}])")
    cluster = resolve_cluster(cluster)
    params = check_resources(resources)
    if cluster == "local":
        slots = plan_slots(cpus_per_trial, gpus_per_trial, max_parallel=max_parallel)
    else:
        slots = None
        params.setdefault("gpus_per_node", gpus_per_trial or 0)
        params.setdefault("cpus_per_task", cpus_per_trial or 1)
    root = Path(folder).resolve()
    root.mkdir(parents=True, exist_ok=True)
    run = _Sweep(train_fn, list(configs), root, cluster, params, slots, max_parallel, live)
    run.run()
    histories = [channel.read_history(t.folder) for t in run.trials]
    records = [record_of(t, h[-1] if h else None) for t, h in zip(run.trials, histories, strict=True)]
    metric, mode = choose_metric(records, metric, mode)
    result = SweepResult(records, [t.result for t in run.trials], metric, mode, root, None)
    result.save()
    if plot:
        best = result.best
        labels = [f"{t.index}: {t.short_config(30)}" for t in run.trials]
        result.plot_path = plot_trials(labels, histories, root / "curves.png", metric, best["trial"] if best else None)
    return result
