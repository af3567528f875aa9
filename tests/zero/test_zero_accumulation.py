"""ZeRO (stages 1 and 2) follows torch's gradient semantics where they are easy to get wrong with sharded
gradients, bit for bit against torch's DDP with the unsharded optimizer in the same run (torch DDP on gloo; ZeRO
on gloo or the fastpar backend, 2 and 3 ranks):

- several synchronised backwards before one ``step()`` add up (no ``no_sync``): each backward adds onto the
  reduced gradient, as autograd adds onto DDP's ``.grad``;
- a parameter no rank used since ``zero_grad`` (``find_unused_parameters``) has no gradient and is not stepped:
  AdamW's weight decay and moments leave it alone, and its step count falls behind the others' as in torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastpar.launcher import spawn

CASES = {
    # name: (model, DDP arguments, backwards per step, steps)
    "two_synchronised_backwards": ("mlp", {}, 2, 4),
    "three_backwards_small_buckets": ("mlp", {"bucket_cap_mb": 0.002}, 3, 3),
    "unused_on_some_steps": ("unused", {"find_unused_parameters": True}, 1, 6),
    "unused_and_two_backwards": ("unused", {"find_unused_parameters": True}, 2, 4),
}


def _train(model, optimizer, kind: str, backwards: int, steps: int, rank: int) -> None:
    from ddp_models import make_input

    gen = torch.Generator().manual_seed(100 + rank)  # inputs differ per rank
    for step in range(steps):
        optimizer.zero_grad()
        for _ in range(backwards):
            model(make_input(kind, gen), step=step, rank=rank).square().mean().backward()
        optimizer.step()


def _rank(rank: int, world_size: int) -> dict:
    import warnings

    from ddp_models import MODELS

    import fastpar

    warnings.filterwarnings("ignore")
    gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    outcome = {}
    for name, (kind, ddp_args, backwards, steps) in CASES.items():
        params = {}
        for impl in ("torch", "zero", "zero2"):
            torch.manual_seed(0)
            module = MODELS[kind]()
            if impl == "torch":
                model = torch.nn.parallel.DistributedDataParallel(module, process_group=gloo, **ddp_args)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            else:
                model = fastpar.DDP(module, **ddp_args)
                optimizer = fastpar.ShardedOptimizer(
                    model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, shard_gradients=impl == "zero2"
                )
            _train(model, optimizer, kind, backwards, steps, rank)
            state = model.module.state_dict()  # waits for ZeRO's last all-gather
            params[impl] = {n: state[n].clone() for n, _ in module.named_parameters()}
        for stage in ("zero", "zero2"):
            outcome[f"{name} ({stage})"] = [
                n for n in params["torch"] if not torch.equal(params["torch"][n], params[stage][n])
            ]
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("world_size, backend", [(2, "gloo"), (3, "gloo"), (3, "fastpar")])
def test_accumulation_and_unused_parameters_match_torch_ddp_bit_for_bit(world_size, backend):
    results = spawn(_rank, world_size, backend=backend, timeout=600)
    for rank, outcome in enumerate(results):
        for case, differ in outcome.items():
            assert differ == [], f"rank {rank}, {case}: differs from torch DDP + AdamW in {differ}"
