"""Nodes on this machine for the multi-node tests: ``make_nodes(count, link)`` brings up a NodeCluster
(fastpar.nodes) torn down after the test, whatever happened; tests skip, with the reason, where the machine
cannot make namespaces (not root, no iproute2)."""

from __future__ import annotations

import pytest

from fastpar.nodes import NodeCluster, available


@pytest.fixture(scope="session")
def node_support() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(why)


@pytest.fixture
def make_nodes(node_support):
    made: list[NodeCluster] = []

    def make(count: int, link: str | None = "1gbit") -> NodeCluster:
        cluster = NodeCluster(count, link=link)
        made.append(cluster)
        return cluster.__enter__()

    yield make
    for cluster in made:
        cluster.down()
