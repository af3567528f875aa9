"""The one storage counter (fastpar/tensor_storage.py): each storage once and whole, across calls; meta tensors
told apart; a DTensor by its local shard; and every memory report counts with it (no second counter)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from fastpar.launcher import spawn
from fastpar.tensor_storage import StorageCounter, storage_bytes, storage_key

PACKAGE = Path(__file__).resolve().parents[1] / "fastpar"


def test_views_of_one_buffer_count_the_buffer_once_and_whole():
    flat = torch.zeros(100)
    a, b = flat[:10], flat[10:30].view(4, 5)
    assert storage_bytes([a, b, None, flat]) == 400  # the whole buffer, although the views cover 30 elements
    assert storage_bytes([torch.zeros(3), torch.zeros(5, dtype=torch.float64)]) == 12 + 40
    assert storage_bytes([torch.zeros(0)]) == 0


def test_tied_parameters_count_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert storage_bytes([*emb.parameters(), *head.parameters()]) == 160


def test_a_counter_gives_a_storage_to_the_first_category_that_counts_it():
    flat, other = torch.zeros(8), torch.zeros(2)
    counter = StorageCounter(exclude=[other])
    assert counter.count([flat[:4]]) == 32
    assert counter.count([flat[4:], other]) == 0  # flat counted already, other excluded
    assert flat in counter and other in counter and torch.zeros(1) not in counter


def test_meta_tensors_are_told_apart():
    a, b = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    assert storage_key(a) != storage_key(b) and storage_key(a) == storage_key(a.view(3, 1))
    assert storage_bytes([a, a[1:], b]) == 24


def _dtensor_rank(rank: int, world_size: int) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.zeros(8, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    return storage_bytes([sharded]), sharded.to_local().numel() * 4


def test_a_dtensor_counts_its_local_shard():
    for counted, local in spawn(_dtensor_rank, 2):
        assert counted == local == 64


def test_no_other_module_counts_storages_itself():
    """One storage counter: a module reading ``untyped_storage()`` to count or key memory
    outside tensor_storage.py is a second counter."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "tensor_storage.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("untyped_storage", "_cdata"):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not offenders, f"count storages with fastpar.tensor_storage, not by hand: {offenders}"
