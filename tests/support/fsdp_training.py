"""Models and training loops for the fully sharded tests: a small transformer-like model (embedding, repeated
blocks, norm, head), an MLP stack, FSDP2 applied by hand the way its docs show, and a loop that trains a
sharded model and returns its losses and gathered parameters."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny_transformer() -> nn.Module:
    return TinyTransformer()


def mlp_stack(width: int = 20, depth: int = 4) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def shared_layer_stack(width: int = 20, depth: int = 4) -> nn.Module:
    """``mlp_stack`` whose blocks 1 and 3 are one Linear (ALBERT-style sharing): FSDP2 can't shard them apart."""
    model = mlp_stack(width, depth)
    model[3].weight, model[3].bias = model[1].weight, model[1].bias
    return model


def gpt_style_init(module: nn.Module) -> None:
    """An ``init_fn`` of the kind passed to ``model.apply``: normal weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def shard_by_hand(model: nn.Module, unit_names: list[str], mp_policy=None, group=None) -> nn.Module:
    """FSDP2 as its documentation applies it: ``fully_shard`` on each unit, then on the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    unit_policy = MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, None, policy.cast_forward_inputs)
    for name in unit_names:  # the output cast on the root only, as fully_shard_model applies a policy
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=unit_policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def batch(kind: str, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    if kind == "transformer":
        return torch.randint(0, 50, (4, 6), generator=gen)
    return torch.randn(8, 20, generator=gen)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.float().square().mean()


def train(model: nn.Module, kind: str, rank: int, steps: int = 4, lr: float = 1e-2) -> dict:
    """AdamW steps on rank-dependent batches; the losses and every parameter gathered in full."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_of(model, batch(kind, step, rank))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "params": full_parameters(model)}


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def differing(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not bit-identical (both dicts of tensors, or of lists of tensors)."""
    bad = []
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            if len(x) != len(y) or not all(torch.equal(u, v) for u, v in zip(x, y, strict=True)):
                bad.append(key)
        elif not torch.equal(x, y):
            bad.append(key)
    return bad


class LiveBytes:
    """Peak bytes of tensor storage alive on real devices while active (a dispatch mode that counts every op's
    fresh output storage until Python frees it; a DTensor counts its local shard). What torch allocates
    outside the dispatcher is not seen, so tests check this measurement against a run that must exceed a bound."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._mode = None

    def __enter__(self) -> LiveBytes:
        import weakref

        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, DTensor):
                        t = t._local_tensor
                    if not isinstance(t, torch.Tensor) or t.is_meta:
                        continue
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                    if size and key not in tracker._seen:
                        tracker._seen.add(key)
                        tracker.live += size
                        tracker.peak = max(tracker.peak, tracker.live)
                        weakref.finalize(storage, tracker._free, key, size)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _free(self, key: int, size: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= size
