"""When ZeRO waits for the all-gather of updated parameters (fastpar/ddp/zero_hooks.py): each module waits for
its own parameters' buckets just before it runs; parameters read outside their module's forward are learned
in the first forward and waited for at the start of later ones; every forward ends with nothing in flight;
``state_dict`` / ``load_state_dict`` wait first. Driven with a recording wait function, in one process."""

from __future__ import annotations

import torch
from torch import nn

from fastpar.zero.hooks import ParameterGate


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scale = nn.Linear(4, 4)  # its weight is read by the parent directly; its forward never runs

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) @ self.scale.weight


def _gate():
    net = Net()
    bucket_of = {
        id(net.a.weight): 2,
        id(net.a.bias): 2,
        id(net.b.weight): 1,
        id(net.b.bias): 0,
        id(net.scale.weight): 3,
        id(net.scale.bias): 3,
    }
    calls: list[tuple[str, list[int]]] = []
    current = {"where": ""}

    def wait(indices):
        calls.append((current["where"], list(indices)))

    net.a.register_forward_pre_hook(lambda *a: current.update(where="a"))
    net.b.register_forward_pre_hook(lambda *a: current.update(where="b"))
    gate = ParameterGate(net, bucket_of, wait)
    return net, gate, calls, current


def test_first_forward_waits_for_everything_and_learns_what_is_read_outside_modules():
    net, gate, calls, current = _gate()
    assert gate.external_buckets is None
    current["where"] = "start"
    net(torch.ones(1, 4))
    assert calls[0] == ("start", [0, 1, 2, 3])  # not learned yet: everything at the start
    assert gate.external_buckets == [3]  # scale.weight (and bias) belong to a module that never ran


def test_later_forwards_wait_module_by_module():
    net, gate, calls, current = _gate()
    net(torch.ones(1, 4))
    calls.clear()
    current["where"] = "start"
    net(torch.ones(1, 4))
    # the gate's pre-hooks run before the user's (prepend), so each wait is recorded under the previous module
    assert calls == [("start", [3]), ("start", [2]), ("a", [0, 1]), ("b", [0, 1, 2, 3])]


def test_state_dict_and_load_state_dict_wait_first():
    net, _, calls, current = _gate()
    current["where"] = "save"
    net.a.state_dict()
    assert ("save", [2]) in calls
    calls.clear()
    net.load_state_dict(net.state_dict())
    assert {tuple(c[1]) for c in calls} >= {(0, 1), (2,), (3,)}


def test_removed_gate_waits_no_more():
    net, gate, calls, _ = _gate()
    gate.remove()
    net(torch.ones(1, 4))
    net.state_dict()
    assert calls == []
