"""torch's own DDP comm hooks on the "fastpar" backend. PowerSGD and the quantization hooks issue a collective inside
a ``Future.then()`` callback and wait for it there; fp16/bf16 compression chain callbacks on the backend's future.
Each hook trains with torch's DDP and with fastpar's DDP, on the fastpar backend and on gloo in the same processes,
to bit-identical parameters. A callback that waits for a collective a peer never makes fails at the group's
timeout, naming the rank and the collective (never a hang).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_comm_faults import _run

from fastpar.launcher import spawn


def _allgather_quantized_hook(group, bucket):
    """torch's quantization_pertensor_hook, step for step (all-gather the scales; in a callback quantize, all-gather
    and wait; dequantize and average in the next), reading the all-gather's future value as gloo gives it."""
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as q

    tensor, world = bucket.buffer(), group.size()
    observer = torch.ao.quantization.MinMaxObserver()
    observer(tensor)
    scale, zero = observer.calculate_qparams()
    mine = torch.FloatTensor([scale, zero])
    fut = dist.all_gather(q._get_allgather_out_list(mine, world), mine, group=group, async_op=True).get_future()
    scales = []

    def quantize_and_allgather(fut):
        scales.extend(fut.wait())
        quantized = q._quantize_per_tensor_backend(tensor, scales[group.rank()][0], scales[group.rank()][1])
        out = q._get_allgather_out_list(quantized, world)
        return dist.all_gather(out, quantized, group=group, async_op=True).get_future().wait()

    def dequantize_and_average(fut):
        total = torch.zeros_like(tensor, dtype=torch.float32)
        for r, quantized in enumerate(fut.wait()):
            total += q._dequantize_per_tensor_backend(quantized, scales[r][0], scales[r][1])
        return total / world

    return fut.then(quantize_and_allgather).then(dequantize_and_average)


def _bf16_compress_hook(state, bucket):
    """torch's bf16_compress_hook, which both DDPs refuse by name without CUDA and NCCL 2.10 (older NCCL cannot
    reduce bf16); gloo and the fastpar backend do."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _hooks():
    """name -> make(group) -> (state, hook), a fresh state per training (PowerSGD's state is the run's memory).
    Not batched_powerSGD_hook: in torch 2.13 it fails its own shape assertion on every backend, gloo included."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks

    def power_sgd(hook):
        def make(group):
            # compression from step 2 on (steps 0 and 1 are plain all-reduces): the step the hang was at
            state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=1,
                start_powerSGD_iter=2,
                min_compression_rate=0.5,
                random_seed=0,
            )
            return state, hook

        return make

    return {
        "allreduce": lambda g: (g, default_hooks.allreduce_hook),
        "fp16_compress": lambda g: (g, default_hooks.fp16_compress_hook),
        "bf16_compress": lambda g: (g, _bf16_compress_hook),
        "fp16_wrapped_allreduce": lambda g: (g, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        "powerSGD": power_sgd(powerSGD_hook.powerSGD_hook),
        "fp16_wrapped_powerSGD": power_sgd(default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)),
        # torch's quantization hooks index the all-gather's future value as NCCL returns it (a list of lists): on
        # gloo they raise an IndexError inside the callback, and must raise the same on the fastpar backend
        "quantization_pertensor": lambda g: (g, quantization_hooks.quantization_pertensor_hook),
        "quantization_perchannel": lambda g: (g, quantization_hooks.quantization_perchannel_hook),
        "allgather_quantized": lambda g: (g, _allgather_quantized_hook),
    }


def _outcome(run) -> dict | str:
    """The trained parameters, or the error (as text) the training raised."""
    try:
        return run()
    except Exception as exc:  # without the Python stacks ("At: ..."): they say which thread ran the callback
        return f"{type(exc).__name__}: {str(exc).split(chr(10))[0]}"


def _same_outcome(a, b) -> list[str]:
    """What differs between two outcomes: parameter names, or 'outcome' when they are not alike."""
    if isinstance(a, str) or isinstance(b, str):
        return [] if a == b else [f"outcome: {str(a)[:300]!r} vs {str(b)[:300]!r}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def _hooked(ddp_class, make):
    def wrap(module, group):
        model = ddp_class(module, process_group=group)
        model.register_comm_hook(*make(group))
        return model

    return wrap


def _hooks_rank(rank: int, world: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from ddp_models import train
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastpar

    gloo = dist.new_group(backend="gloo")
    differing, trained = {}, {}
    for ddp_name, ddp_class in (("torch", TorchDDP), ("fastpar", fastpar.DDP)):
        for hook_name, make in _hooks().items():
            wrap = _hooked(ddp_class, make)
            on_gloo = _outcome(lambda wrap=wrap: train(lambda m: wrap(m, gloo), "mlp", rank, steps=6))
            on_fastpar = _outcome(lambda wrap=wrap: train(lambda m: wrap(m, dist.group.WORLD), "mlp", rank, steps=6))
            differing[f"{ddp_name}/{hook_name}"] = _same_outcome(on_gloo, on_fastpar)
            trained[f"{ddp_name}/{hook_name}"] = not isinstance(on_gloo, str)
    return {"status": fastpar.comm.shm_status(), "differing": differing, "trained": trained}


def test_torch_comm_hooks_give_gloos_parameters_on_the_fastpar_backend():
    for rank, result in enumerate(spawn(_hooks_rank, 2, backend="fastpar", timeout=900)):
        assert result["status"]["shm"], result["status"]
        bad = {case: keys for case, keys in result["differing"].items() if keys}
        assert bad == {}, f"rank {rank}: parameters differ from the same training on gloo: {bad}"
        failed_on_gloo = sorted(case for case, ok in result["trained"].items() if not ok)
        assert failed_on_gloo == [
            f"{ddp}/quantization_{kind}" for ddp in ("fastpar", "torch") for kind in ("perchannel", "pertensor")
        ], failed_on_gloo


def _callback_waits_for_a_collective_never_made(rank: int, world: int):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        dist.all_reduce(torch.ones(4))  # the one whose callback rank 0 runs
        time.sleep(12)  # alive, but never makes the one issued inside the callback
        return None

    def second_all_reduce(fut):  # as PowerSGD does: a collective issued and waited for inside the callback
        return dist.all_reduce(torch.ones(4), async_op=True).get_future().wait()

    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), async_op=True).get_future().then(second_all_reduce).wait()
        return "completed", time.monotonic() - start
    except Exception as exc:
        return str(exc), time.monotonic() - start


@pytest.mark.slow
def test_a_callback_stuck_waiting_fails_at_the_timeout_naming_the_rank():
    outcome, _ = _run(_callback_waits_for_a_collective_never_made, 2, pg_timeout=3, wait=90)
    kind, value = outcome[0]
    assert kind == "ok", f"rank 0 did not return (a hang ends as 'died'): {outcome[0]}"
    message, seconds = value
    assert "rank 1" in message and "all_reduce #3" in message, message
    assert seconds < 30, seconds
