"""Nodes on one machine: namespaces joined by a shaped switch, for multi-node tests and benchmarks."""

from fastpar.nodes.harness import Node, NodeCluster, NodeHarnessError, available, link_rate_bits, remove_stale

__all__ = ["Node", "NodeCluster", "NodeHarnessError", "available", "link_rate_bits", "remove_stale"]
