"""The per-gradient hot path in the extension (``fastpar.ddp.extension_hooks``): in the common mode the C++ hooks run,
with the same bits as the Python hooks (``FASTPAR_DDP_HOT_PATH=python``) and as torch's DDP, on gloo and on the
fastpar backend; its errors name the parameter as the Python path's do, and leave the next step clean."""

from __future__ import annotations

import os

import pytest
import torch
from ddp_models import train

from fastpar.launcher import spawn
from fastpar.ops import loader

if loader.kernels_for(torch.device("cpu"))[0] not in ("compiled", "jit"):
    pytest.skip("fastpar._C does not serve CPU tensors here: the hooks stay in Python", allow_module_level=True)

# name -> (model kind, fastpar DDP arguments, train() arguments, compared with torch DDP given these arguments)
CASES = {
    "views": ("mlp", {}, {}, {}),
    "no_views": ("mlp", {"gradient_as_bucket_view": False}, {}, {}),
    "torch_views": ("mlp", {"gradient_as_bucket_view": True}, {}, {"gradient_as_bucket_view": True}),
    "grads_in_views": ("cnn", {}, {"set_to_none": False}, {}),
    "channels_last": ("cnn", {}, {"channels_last": True}, {}),
    "strided_params": ("strided", {}, {}, {}),
    "no_sync": ("mlp", {}, {"accumulate": "no_sync"}, {}),
    "small_buckets": ("resnet", {"bucket_cap_mb": 0.004}, {}, {"bucket_cap_mb": 0.004}),
    "bf16_grads": ("mlp", {"grad_dtype": torch.bfloat16}, {}, None),  # no torch peer: compared between paths
}
FAST = ("views", "no_views", "torch_views", "grads_in_views", "no_sync")


def _wrapper(ddp_args: dict, python_hooks: bool, seen: list, copy_on_arrival: bool = False):
    def wrap(module):
        import fastpar

        os.environ["FASTPAR_DDP_HOT_PATH"] = "python" if python_hooks else "auto"
        try:
            model = fastpar.DDP(module, **ddp_args)
        finally:
            os.environ.pop("FASTPAR_DDP_HOT_PATH")
        if copy_on_arrival:  # every gradient copied into its bucket as it arrives
            model.reducer.set_copy_on_arrival(0)
        seen.append(model)
        return model

    return wrap


def _rank(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    outcome = {}
    for name in names:
        kind, ddp_args, train_args, torch_args = CASES[name]
        for arrival in (False, True):
            key = f"{name}/{'arrival' if arrival else 'pack'}"
            native, python = [], []
            got = train(_wrapper(ddp_args, False, native, arrival), kind, rank, **train_args)
            ref = train(_wrapper(ddp_args, True, python, arrival), kind, rank, **train_args)
            entry = {
                "hot_path": native[0].comm_stats()["hot_path"],
                "python_hot_path": python[0].comm_stats()["hot_path"],
                "differ_python": [k for k in ref if not torch.equal(ref[k], got[k])],
                "same_layout": native[0].reducer.layout() == python[0].reducer.layout(),  # rebuilt from arrival
                "same_ready_order": native[0].reducer.grad_ready_order == python[0].reducer.grad_ready_order,
            }
            if torch_args is not None:
                peer = train(lambda m, a=torch_args: torch.nn.parallel.DistributedDataParallel(m, **a), kind, rank)
                if train_args:
                    peer = train(
                        lambda m, a=torch_args: torch.nn.parallel.DistributedDataParallel(m, **a),
                        kind,
                        rank,
                        **train_args,
                    )
                entry["differ_torch"] = [k for k in peer if not torch.equal(peer[k], got[k])]
            outcome[key] = entry
    return outcome


class _Twice(torch.nn.Module):
    """``shared`` can run in two reentrant checkpoints (its gradient arrives twice); ``tail`` can be skipped."""

    def __init__(self):
        super().__init__()
        self.pre, self.shared, self.tail = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, twice=False, skip_tail=False):
        from torch.utils.checkpoint import checkpoint

        h = self.shared(self.pre(x))
        if twice:
            h = checkpoint(self.shared, self.pre(x), use_reentrant=True)
            h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return h if skip_tail else self.tail(h)


def _errors_rank(rank: int, world_size: int) -> dict:
    import fastpar

    torch.manual_seed(0)
    model = fastpar.DDP(_Twice())
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):  # the second backward runs in the extension (after torch's rebuild)
        model(x).sum().backward()
    out = {"hot_path": model.comm_stats()["hot_path"]}
    for name, kwargs in (("twice", {"twice": True}), ("unused", {"skip_tail": True})):
        try:
            model(x, **kwargs).sum().backward()
        except RuntimeError as exc:
            out[name] = str(exc)
        model(x).sum().backward()  # the next step is clean
        out[f"after_{name}"] = model.comm_stats()["hot_path"]
    return out


@pytest.fixture(scope="module")
def gloo_results():
    return spawn(_rank, 2, tuple(CASES), timeout=900)


@pytest.fixture(scope="module")
def fastpar_backend_results():
    return spawn(_rank, 2, FAST, backend="fastpar", timeout=900)


def _check(results: list[dict], key: str) -> None:
    for rank, outcome in enumerate(results):
        entry = outcome[key]
        assert entry["hot_path"] == "extension", f"rank {rank}: the C++ hooks did not run"
        assert entry["python_hot_path"] == "python", f"rank {rank}: FASTPAR_DDP_HOT_PATH=python was ignored"
        assert entry["differ_python"] == [], f"rank {rank}: differs from the Python hooks in {entry['differ_python']}"
        assert entry["same_layout"], f"rank {rank}: the rebuilt buckets differ from the Python hooks'"
        assert entry["same_ready_order"], f"rank {rank}: the logged arrival order differs from the Python hooks'"
        assert entry.get("differ_torch", []) == [], f"rank {rank}: differs from torch DDP in {entry['differ_torch']}"


@pytest.mark.parametrize("staging", ["pack", "arrival"])
@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_extension_hooks_give_the_python_hooks_and_torchs_bits(gloo_results, case, staging):
    _check(gloo_results, f"{case}/{staging}")


@pytest.mark.slow
@pytest.mark.parametrize("staging", ["pack", "arrival"])
@pytest.mark.parametrize("case", FAST)
def test_extension_hooks_on_the_fastpar_backend(fastpar_backend_results, case, staging):
    _check(fastpar_backend_results, f"{case}/{staging}")


def test_extension_hooks_report_errors_like_the_python_hooks():
    for out in spawn(_errors_rank, 2):
        assert out["hot_path"] == "extension"
        assert "parameter shared." in out.get("twice", "") and "received a gradient twice" in out["twice"], out
        assert "tail.weight" in out.get("unused", ""), out
        assert out["after_twice"] == out["after_unused"] == "extension"
