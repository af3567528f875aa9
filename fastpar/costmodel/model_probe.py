"""What one forward and backward of the model measures: activation bytes per layer and compute time per layer.

Activations are the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
counted once per storage (a view and its base, or a tensor saved by two ops, are one allocation), without
the parameters, buffers and the input batch, and charged to the layer whose forward saved them (tensors
saved between layers -- a residual sum in the parent, the loss -- go to the layer that ran last). They are
measured on a small batch and scaled: linearly in the batch, and through ``a*L + b*L^2`` in the sequence
length when the model has one (two lengths measured; the L^2 part is attention's scores where the kernel
keeps them).

Compute: forward and backward are timed at two small batch sizes (b and 2b, interleaved, medians after a
warm-up) and fitted as a fixed cost per step plus a cost per sample, so per-step overheads are not scaled
with the batch; per layer, the forward is timed by hooks and the backward is split in the forward's proportions. A model
too large to build on the host is measured on the meta device instead: the saved tensors' shapes are
exact (attention through torch's math path), and compute comes from a FLOP count
(``torch.utils.flop_counter``) at a measured matmul rate.

On CPU ranks (one thread each) the timing runs in a forked child, the measured rank, while the peers run the
same steps; given the plan's optimizer, the child then times its step in the model's loop (forward, backward,
step) on its own copy of the parameters. The child's and the peers' allocators are set as a warmed-up training
process's are: on CPU a step's gradients and the optimizer's temporaries (each as large as its parameter) come
and go through glibc's allocator, which maps a large block afresh -- a page fault per page -- until enough large
blocks were freed to raise its threshold, and may give freed memory back and map it again: timed in the caller's
process, the same step comes out fast or slow depending on what the process ran before. The children keep
blocks up to 256 MiB in the heap and freed memory until 512 MiB is free (``mallopt``), so every plan times the
steady state, and the caller's process, its allocator and its parameters are left as they were.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from statistics import median

import torch
from torch import nn

from ..tensor_storage import StorageCounter
from ..user_errors import UserError
from .model_spec import ModelSpec, model_layers
from .strategy_time import make_optimizer

__all__ = ["ProbeResult", "matmul_flops_per_s", "probe"]

_REPEATS = 5
_WARMUP = 3  # rounds before the timed ones: a forked child first copies the pages it writes
# timing the optimizer in the model's loop holds gradients and the optimizer's state (and parameters written, so
# copied) in the child and in each peer: above this many bytes in all a plan times a lone tensor instead
OPTIMIZER_TIMING_LIMIT_BYTES = 1 << 30
_OPTIMIZER_STEPS = 5  # timed, after 2 that create the state and settle the allocator
# glibc's mallopt parameters: keep blocks up to this size in the heap, and freed memory until this much is free
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BLOCK_LIMIT, _HEAP_TRIM_LIMIT = 256 << 20, 512 << 20


@dataclass
class ProbeResult:
    """Per layer (the spec's layer order): activation bytes per sample at ``seq_len`` and seconds per sample."""

    layer_names: list[str]
    act_linear: list[
        float
    ]  # bytes per sample per token (the a of a*L + b*L^2; a total per sample when seq_len is None)
    act_quadratic: list[float]  # bytes per sample per token^2
    float_share: float  # share of activation bytes in floating-point tensors (those a dtype change scales)
    output_linear: list[float]  # bytes per sample per token of each layer's output (what a stage boundary sends)
    forward_s_per_sample: list[float]
    backward_s_per_sample: list[float]
    forward_fixed_s: list[float]  # per step whatever the batch (Python and launch overheads)
    backward_fixed_s: list[float]
    seq_len: int | None  # the length the times were measured at
    method: str
    on_meta: bool = False  # activations from shapes on the meta device (attention through torch's math path)  # "measured on cpu" / "meta device + FLOP count"
    notes: list[str] = field(default_factory=list)
    optimizer: str | None = None  # the optimizer timed in the loop, if one was
    optimizer_s_per_element: float | None = None  # its step's seconds per parameter element

    def activation_bytes(self, batch: float, seq_len: int | None) -> list[float]:
        """Bytes per layer for ``batch`` samples of ``seq_len`` tokens."""
        if seq_len is None:
            return [batch * a for a in self.act_linear]
        return [
            batch * (a * seq_len + b * seq_len * seq_len)
            for a, b in zip(self.act_linear, self.act_quadratic, strict=True)
        ]

    def output_bytes(self, batch: float, seq_len: int | None) -> list[float]:
        return [batch * a * (seq_len or 1) for a in self.output_linear]

    def seconds(self, batch: float, seq_len: int | None) -> tuple[list[float], list[float]]:
        """(forward, backward) seconds per layer for ``batch`` samples: a fixed part plus one linear in tokens."""
        scale = batch * ((seq_len / self.seq_len) if seq_len and self.seq_len else 1.0)
        forward = [a + scale * t for a, t in zip(self.forward_fixed_s, self.forward_s_per_sample, strict=True)]
        backward = [a + scale * t for a, t in zip(self.backward_fixed_s, self.backward_s_per_sample, strict=True)]
        return forward, backward


class _SavedTensorCounter:
    """Counts saved-tensor storages per layer; knows which layer is running through forward hooks."""

    def __init__(
        self, module: nn.Module, layers: list[tuple[str, nn.Module | None, bool]], exclude: list[torch.Tensor]
    ):
        self.bytes = [0.0] * len(layers)
        self.outputs = [0.0] * len(layers)
        self.float_bytes = 0.0
        self.storages = StorageCounter(exclude)
        self.current = None
        self.last = len(layers) - 1 if layers else 0
        self.handles = []
        for i, (_, m, _) in enumerate(layers):
            if m is None:
                continue
            self.handles.append(m.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self.handles.append(m.register_forward_hook(lambda _m, _a, out, i=i: self._leave(i, out)))

    def _enter(self, i: int) -> None:
        self.current = i

    def _leave(self, i: int, out) -> None:
        self.current, self.last = None, i
        self.outputs[i] = float(sum(t.numel() * t.element_size() for t in _input_tensors(out)))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = self.storages.count([t])  # each storage once: all views of an allocation (meta tensors too)
        if nbytes:
            where = self.current if self.current is not None else self.last
            self.bytes[where] += nbytes
            if t.is_floating_point():
                self.float_bytes += nbytes
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _input_tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _input_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _input_tensors(v)]
    return []


def _call(module: nn.Module, batch):
    return module(**batch) if isinstance(batch, dict) else module(batch)


def _forward(spec: ModelSpec, module: nn.Module, batch):
    """The first forward of a plan: an input made from the command line's shape that the model refuses is the
    user's to fix, in one line."""
    if spec.input_shape is None:
        return _call(module, batch)
    try:
        return _call(module, batch)
    except Exception as exc:  # noqa: BLE001 - the model raised on our input; --debug shows its traceback
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"{spec.describe} refused an input of shape (batch, {', '.join(map(str, spec.input_shape))}): {first}; "
            "check --input-shape and --input-dtype"
        ) from exc


def _saved_bytes(spec: ModelSpec, module: nn.Module, layers, batch) -> tuple[list[float], float, list[float]]:
    exclude = [*module.parameters(), *module.buffers(), *_input_tensors(batch)]
    counter = _SavedTensorCounter(module, layers, exclude)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = spec.loss_of(_forward(spec, module, batch), batch)
    finally:
        counter.close()
    del loss
    return counter.bytes, counter.float_bytes, counter.outputs


def _timed_step(spec: ModelSpec, module: nn.Module, layers, batch) -> tuple[list[float], float, float]:
    """(forward seconds per layer, forward seconds, backward seconds) of one step."""
    starts, spans, handles = {}, [0.0] * len(layers), []
    for i, (_, m, _) in enumerate(layers):
        if m is None:
            continue
        handles.append(m.register_forward_pre_hook(lambda _m, _a, i=i: starts.__setitem__(i, time.perf_counter())))
        handles.append(
            m.register_forward_hook(
                lambda _m, _a, _o, i=i: spans.__setitem__(i, spans[i] + time.perf_counter() - starts[i])
            )
        )
    try:
        t0 = time.perf_counter()
        loss = spec.loss_of(_call(module, batch), batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    module.zero_grad(set_to_none=True)
    return spans, t1 - t0, t2 - t1


class _Peers:
    """``count`` forked processes stepping the same model on the same batch until the block ends: the other CPU
    ranks of a run, so the clock in this process sees the cores and memory bandwidth shared as they will be."""

    def __init__(self, spec: ModelSpec, module: nn.Module, batch, count: int, optimizer: str | None = None) -> None:
        self.spec, self.module, self.batch, self.count, self.optimizer = spec, module, batch, count, optimizer
        self.procs: list = []

    def __enter__(self) -> _Peers:
        if self.count <= 0:
            return self
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # the model and batch are already built here; a fork shares them as they are
        self.stop, started = ctx.Event(), ctx.Semaphore(0)
        for _ in range(self.count):
            proc = ctx.Process(
                target=_peer_steps, args=(self.spec, self.module, self.batch, self.optimizer, self.stop, started)
            )
            proc.daemon = True
            proc.start()
            self.procs.append(proc)
        for _ in self.procs:
            started.acquire(timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        if not self.procs:
            return
        self.stop.set()
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _peer_steps(spec, module, batch, optimizer, stop, started) -> None:
    torch.set_num_threads(1)
    _keep_freed_memory()
    step = None
    if optimizer is not None:  # the peers step too (on their copy of the model): they share memory bandwidth
        step = make_optimizer(optimizer, [p for p in module.parameters() if p.requires_grad]).step
    started.release()
    while not stop.is_set():
        spec.loss_of(_call(module, batch), batch).backward()
        if step is not None:
            step()
        module.zero_grad(set_to_none=True)


def matmul_flops_per_s(device: str | torch.device = "cpu", n: int = 512) -> float:
    """Floating-point operations per second of an ``n x n`` fp32 matmul here (the rate FLOP counts are timed at)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm-up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        if a.device.type == "cuda":
            torch.cuda.synchronize()  # CPU-GPU sync point: the product must be done before the clock stops
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / median(times)


def probe(
    spec: ModelSpec,
    *,
    batch_size: int,
    seq_len: int | None,
    device: str | torch.device = "cpu",
    materialize_limit_bytes: int = 2 << 30,
    flops_per_s: float | None = None,
    alongside: int = 0,
    optimizer: str | None = None,
) -> ProbeResult:
    """Measure ``spec``'s activations and compute on a batch of ``batch_size`` (kept small: 1-2 samples).
    ``flops_per_s``: time the compute as FLOPs at this rate instead of with a clock (planning for a device
    that is not here). ``alongside``: CPU ranks that will share this host with the measured one; that many
    forked processes run the same steps while the clock runs, so the time is a rank's among its peers
    (2 ranks on 2 cores compute 2-3x slower each than one process alone, measured). ``optimizer``: a plan's
    optimizer name, timed in the model's loop by the forked child on CPU when the model is small enough
    (:data:`OPTIMIZER_TIMING_LIMIT_BYTES`; the module docstring says why)."""
    device = torch.device(device)
    # the caller's random streams stay as they were (the Trainer plans between seeding and its first step)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return _probe(spec, batch_size, seq_len, device, materialize_limit_bytes, flops_per_s, alongside, optimizer)


def _probe(
    spec, batch_size, seq_len, device, materialize_limit_bytes, flops_per_s, alongside, optimizer=None
) -> ProbeResult:
    counts = spec.layers()
    fp32_bytes = 4 * sum(layer.numel for layer in counts)
    real = fp32_bytes <= materialize_limit_bytes or spec.fixed_batch is not None
    module = spec.build(device if real else "meta")
    if spec.fixed_batch is not None:  # a built module: measured where it lives
        device = next(module.parameters(), torch.empty(0)).device
    elif real and any(p.is_meta for p in module.parameters()):
        module = module.to_empty(device=device)  # a constructor that built on meta: values don't matter here
    layers = model_layers(module)  # the spec's layers, less the "<root>" row (no module of its own)
    names = [c.name for c in counts]
    rows = len(counts)
    lengths = [seq_len] if seq_len is None else sorted({max(1, seq_len // 2), seq_len})
    samples = {}
    for n in lengths:
        batch = spec.batch(module, batch_size, n, device if real else "meta")
        per_layer, floats, outputs = _saved_bytes(spec, module, layers, batch)
        samples[n] = ([b / batch_size for b in per_layer] + [0.0] * (rows - len(per_layer)), floats)
        pad = [0.0] * (rows - len(outputs))
        output_linear = [o / batch_size / (n or 1) for o in outputs] + pad  # the longest length wins (last)
    total = sum(sum(v[0]) for v in samples.values()) * batch_size
    float_share = sum(v[1] for v in samples.values()) / total if total else 1.0
    if seq_len is None or len(lengths) == 1:
        only = samples[lengths[0]][0]
        per_token = only if seq_len is None else [b / seq_len for b in only]
        act_lin, act_quad = per_token, [0.0] * rows
    else:
        l1, l2 = lengths
        act_lin, act_quad = [], []
        for b1, b2 in zip(samples[l1][0], samples[l2][0], strict=True):
            # b = a*L + q*L^2 through both points; a negative q is noise from allocation rounding: keep it linear
            q = (b2 / l2 - b1 / l1) / (l2 - l1)
            q = max(q, 0.0)
            act_quad.append(q)
            act_lin.append(b2 / l2 - q * l2)
    notes = []
    fixed = (0.0, 0.0)
    optimizer_s_per_element = None
    if real and flops_per_s is None:
        # two batch sizes, interleaved, so a fixed cost per step is not scaled with the batch
        sizes = [batch_size] if spec.fixed_batch is not None else [batch_size, 2 * batch_size]
        batches = {b: spec.batch(module, b, seq_len, device) for b in sizes}
        alongside = alongside if device.type == "cpu" else 0
        timed = optimizer if _optimizer_timed(optimizer, module, device, alongside) else None
        with _Peers(spec, module, batches[sizes[-1]], alongside, timed):
            if device.type == "cpu" and torch.get_num_threads() == 1 and hasattr(os, "fork"):
                # a forked child is the measured rank: its allocator set as a warmed-up rank's (module docstring)
                measured = _in_child(_timed_loop, spec, module, layers, batches, sizes, timed)
            else:  # a multi-threaded process does not fork safely (OpenMP): timed here, the optimizer apart
                measured = None
            runs, optimizer_s_per_element = measured or _timed_loop(spec, module, layers, batches, sizes, None)
        top = sizes[-1]
        spans = [median(r[0][i] for r in runs[top]) for i in range(len(layers))]
        totals = {b: (median(r[1] for r in runs[b]), median(r[2] for r in runs[b])) for b in sizes}
        per_sample, fixed = [], []
        for part in (0, 1):
            t_top = totals[top][part]
            if len(sizes) == 1:
                slope = t_top / top
            else:
                # noise can make the difference tiny or negative: at least a tenth of the average per sample
                slope = max((t_top - totals[sizes[0]][part]) / (top - sizes[0]), 0.1 * t_top / top)
            per_sample.append(slope * top)
            fixed.append(max(0.0, t_top - slope * top))
        fwd, bwd = per_sample
        batch_size = top
        method = f"measured on {torch.device(device).type}"
    else:
        where = device if real else "meta"
        spans, fwd, bwd, rate = _flop_times(spec, module, layers, batch_size, seq_len, flops_per_s, where)
        method = ("measured activations" if real else "meta device") + f" + FLOP count at {rate:.3g} FLOP/s"
        if not real:
            notes.append(f"model too large to build here ({fp32_bytes / 2**30:.1f} GiB fp32): activations from shapes")
    spans = spans + [0.0] * (rows - len(spans))
    share = [s / sum(spans) if sum(spans) > 0 else 1.0 / rows for s in spans]
    return ProbeResult(
        layer_names=names,
        act_linear=act_lin,
        act_quadratic=act_quad,
        output_linear=output_linear,
        float_share=float_share,
        forward_s_per_sample=[fwd * s / batch_size for s in share],
        backward_s_per_sample=[bwd * s / batch_size for s in share],
        forward_fixed_s=[fixed[0] * s for s in share],
        backward_fixed_s=[fixed[1] * s for s in share],
        seq_len=seq_len,
        method=method,
        on_meta=not real,
        notes=notes,
        optimizer=optimizer if optimizer_s_per_element is not None else None,
        optimizer_s_per_element=optimizer_s_per_element,
    )


def _flop_times(spec, module, layers, batch_size, seq_len, flops_per_s, device):
    from torch.utils.flop_counter import FlopCounterMode

    rate = flops_per_s or matmul_flops_per_s("cpu" if torch.device(device).type == "meta" else device)
    counter = FlopCounterMode(display=False)
    per_layer = [0.0] * len(layers)
    marks = {}
    handles = []
    for i, (_, m, _) in enumerate(layers):
        if m is None:
            continue
        handles.append(m.register_forward_pre_hook(lambda _m, _a, i=i: marks.__setitem__(i, counter.get_total_flops())))
        handles.append(
            m.register_forward_hook(
                lambda _m, _a, _o, i=i: per_layer.__setitem__(i, per_layer[i] + counter.get_total_flops() - marks[i])
            )
        )
    try:
        with counter:
            batch = spec.batch(module, batch_size, seq_len, device)
            # the sum stands for the loss: its FLOPs are negligible, and torch's decomposition of
            # cross_entropy under a dispatch mode mixes meta and cpu tensors
            loss = _input_tensors(_call(module, batch))[0].float().sum()
            forward_flops = counter.get_total_flops()
            loss.backward()
            total = counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
    spans = [f / rate for f in per_layer]
    return spans, forward_flops / rate, (total - forward_flops) / rate, rate


def _optimizer_timed(optimizer: str | None, module: nn.Module, device: torch.device, peers: int) -> bool:
    """Time ``optimizer`` in the model's loop: on CPU, when the child and the peers can hold its state."""
    if optimizer is None or device.type != "cpu" or not hasattr(os, "fork"):
        return False
    from .strategy_memory import OPTIMIZER_STATE

    params = [p for p in module.parameters() if p.requires_grad]
    states = OPTIMIZER_STATE[optimizer][0] if optimizer in OPTIMIZER_STATE else 2
    held = sum(p.numel() * p.element_size() for p in params) * (2 + states) * (1 + peers)
    return bool(params) and held <= OPTIMIZER_TIMING_LIMIT_BYTES


def _keep_freed_memory() -> None:
    """This (forked) process's glibc allocator as a warmed-up training process's: large blocks from the heap, freed
    memory kept for the next step (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK_LIMIT)
        libc.mallopt(_M_TRIM_THRESHOLD, _HEAP_TRIM_LIMIT)
    except (OSError, AttributeError):
        pass


def _timed_loop(spec, module: nn.Module, layers, batches: dict, sizes: list[int], optimizer: str | None):
    """({batch size: [timed steps]}, optimizer seconds per element or None): the probe's rounds (the first
    :data:`_WARMUP` warm up), then, given ``optimizer``, its steps in the model's loop at the largest batch."""
    runs = {b: [] for b in sizes}
    for k in range(_REPEATS + _WARMUP):
        for b in sizes:
            run = _timed_step(spec, module, layers, batches[b])
            if k >= _WARMUP:
                runs[b].append(run)
    if optimizer is None:
        return runs, None
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params)
    times = []
    for k in range(2 + _OPTIMIZER_STEPS):  # 2 create the state and settle the allocator
        batch = batches[sizes[-1]]
        spec.loss_of(_call(module, batch), batch).backward()
        t0 = time.perf_counter()
        opt.step()
        if k >= 2:
            times.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=True)
    return runs, median(times) / sum(p.numel() for p in params)


def _in_child(fn, *args):
    """``fn(*args)`` in a forked child (one thread, the allocator of :func:`_keep_freed_memory`; what it changes
    stays there); None if the child failed or could not start (a daemonic caller may not have children)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(fn, args, send), daemon=True)
    try:
        child.start()
    except (AssertionError, OSError):
        receive.close()
        return None
    finally:
        send.close()  # the child holds its own end: a child that dies ends the pipe, and recv raises EOFError
    try:
        value = receive.recv()
    except EOFError:
        value = None
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join(5)
    return value


def _child_main(fn, args, send) -> None:
    torch.set_num_threads(1)
    _keep_freed_memory()
    try:
        send.send(fn(*args))
    except BaseException:  # the parent measures in its own process instead
        send.send(None)
    send.close()
