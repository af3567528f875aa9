"""Unchanged torch code under ZeRO: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a
ShardedOptimizer's parameters gives torch DDP + the unsharded optimizer + torch's clip bit for bit (ZeRO-1 and
ZeRO-2, the same total norm every step), or raises ``ZeroClipError`` naming ``opt.clip_grad_norm_``; on other
parameters in the same process it is torch's function, unchanged. Spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn

STEPS, MAX_NORM = 6, 0.01  # clips every step
KINDS = ("mlp", "frozen")  # frozen: model.parameters() also yields parameters without gradients


def _parity(rank: int, world_size: int, wrapper: bool = True) -> dict:
    """Parameters and norms of torch's run and of each ZeRO run clipped by torch's function (``wrapper=False``:
    as before the wrapper existed, to show the test catches it)."""
    import warnings

    from zero_training import build, run_case

    from fastpar.zero import torch_clip

    warnings.filterwarnings("ignore")
    if not wrapper:
        torch_clip.install = lambda: None
    out = {}
    for kind in KINDS:
        out[kind, "torch"] = run_case(rank, "torch", kind, "adamw", steps=STEPS, max_norm=MAX_NORM)
        for stage in (1, 2):
            out[kind, stage] = run_case(
                rank,
                "zero",
                kind,
                "adamw",
                steps=STEPS,
                max_norm=MAX_NORM,
                torch_clip=True,
                shard_gradients=stage == 2,
            )
    # torch's function on plain parameters while a ShardedOptimizer is alive: torch's, bit for bit
    alive = build("zero", "mlp", "adamw")
    out["installed"] = torch.nn.utils.clip_grad_norm_ is torch_clip.clip_grad_norm_
    out["mlp", "torch_again"] = run_case(rank, "torch", "mlp", "adamw", steps=STEPS, max_norm=MAX_NORM)
    del alive
    return out


def _refusals(rank: int, world_size: int) -> dict:
    """What each refused call raised (type, message), and the norms the other names of torch's function give."""
    import warnings

    from ddp_models import make_input
    from zero_training import build

    warnings.filterwarnings("ignore")
    model, opt = build("zero", "mlp", "adamw", shard_gradients=True)
    gen = torch.Generator().manual_seed(100 + rank)
    opt.zero_grad()
    model(make_input("mlp", gen)).square().mean().backward()
    params = list(model.parameters())
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    calls = {
        "subset": lambda: torch.nn.utils.clip_grad_norm_(params[:2], 1.0),
        "inf_norm": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=float("inf")),
        "l1_norm": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=1),
        "mixed": lambda: torch.nn.utils.clip_grad_norm_([*params, other], 1.0),
        "foreach_false": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False),
        "twice": lambda: torch.nn.utils.clip_grad_norm_(params + params[:1], 1.0),
        "module_name_subset": lambda: torch.nn.utils.clip_grad.clip_grad_norm_(params[1:], 1.0),
        "deprecated_subset": lambda: torch.nn.utils.clip_grad_norm(params[1:], 1.0),
    }
    out: dict = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:  # every rank refuses before any collective: the ranks stay in step
            out[name] = (type(exc).__name__, str(exc))
    big = 1e9  # measures, clips nothing: the calls below see the same gradients
    out["norms"] = [
        opt.clip_grad_norm_(big).item(),
        torch.nn.utils.clip_grad_norm_(reversed(params), big).item(),  # any order, a generator-like iterable
        torch.nn.utils.clip_grad_norm_(iter(params), big, 2).item(),
        torch.nn.utils.clip_grad.clip_grad_norm_(params, big).item(),
        torch.nn.utils.clip_grad_norm(params, big).item(),
    ]
    with model.no_sync():  # local, unreduced gradients in .grad
        model(make_input("mlp", gen)).square().mean().backward()
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        out["local"] = None
    except Exception as exc:
        out["local"] = (type(exc).__name__, str(exc))
    return out


def _check_parity(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["installed"]
        for kind in KINDS:
            ref = out[kind, "torch"]
            assert len(ref["norms"]) == STEPS and all(n > MAX_NORM for n in ref["norms"])  # clipping happened
            for stage in (1, 2):
                got = out[kind, stage]
                differ = [k for k in ref["params"] if not torch.equal(ref["params"][k], got["params"][k])]
                assert differ == [], f"rank {rank}, {kind}, ZeRO-{stage}: parameters differ from torch's in {differ}"
                assert got["norms"] == ref["norms"], f"rank {rank}, {kind}, ZeRO-{stage}: other total norms"
        again = out["mlp", "torch_again"]
        assert again["norms"] == out["mlp", "torch"]["norms"]
        assert all(torch.equal(v, out["mlp", "torch"]["params"][k]) for k, v in again["params"].items())


def test_torch_clip_under_zero_1_and_2_is_bit_identical_to_torch():
    _check_parity(spawn(_parity, 2, timeout=300))


@pytest.mark.slow
def test_torch_clip_under_zero_at_3_ranks():
    _check_parity(spawn(_parity, 3, timeout=600))


def test_what_torch_clip_cannot_do_exactly_is_refused_naming_the_sharded_clip():
    for out in spawn(_refusals, 2, timeout=300):
        expected = {
            "subset": "was given 2 of the 6 parameters",
            "inf_norm": "norm_type=inf",
            "l1_norm": "norm_type=1",
            "mixed": "together with 1 other tensor",
            "foreach_false": "foreach=False",
            "twice": "more than once",
            "module_name_subset": "was given 5 of the 6",
            "deprecated_subset": "was given 5 of the 6",
            "local": "local, unreduced gradients",
        }
        for name, fragment in expected.items():
            assert out[name] is not None, f"{name}: not refused"
            kind, message = out[name]
            assert kind == "ZeroClipError", f"{name}: {kind}: {message}"
            assert fragment in message and "opt.clip_grad_norm_(max_norm)" in message, message
        first, *rest = out["norms"]
        assert first > 0 and rest == [first] * len(rest)


def test_plain_parameters_get_torchs_function_unchanged():
    """In this process, with the wrapper installed and no ShardedOptimizer alive, or alive but not owning them."""
    from fastpar.zero import torch_clip

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    expected_grads = [p.grad.clone() for p in params]
    expected = torch_clip._original(params, 0.1, foreach=False)
    clipped = [p.grad.clone() for p in params]
    for p, g in zip(params, expected_grads, strict=True):
        p.grad = g.clone()
    torch_clip.install()
    try:
        assert torch.nn.utils.clip_grad_norm_ is torch_clip.clip_grad_norm_
        got = torch.nn.utils.clip_grad_norm_((p for p in params), 0.1, foreach=False)
        assert torch.equal(got, expected)
        assert all(torch.equal(p.grad, c) for p, c in zip(params, clipped, strict=True))
        with pytest.warns(UserWarning, match="empty generator"):
            torch.nn.utils.clip_grad_norm_((p for p in []), 0.1)
    finally:
        torch_clip.uninstall()
