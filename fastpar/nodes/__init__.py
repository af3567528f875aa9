"""Nodes on one machine: namespaces joined by a shaped switch, for multi-node tests and benchmarks; a Slurm
cluster over them (``NodeSlurm``) for multi-node batch jobs."""

from fastpar.nodes.harness import Node, NodeCluster, NodeHarnessError, available, link_rate_bits, remove_stale
from fastpar.nodes.slurm import NodeSlurm, slurm_available

__all__ = [
    "Node",
    "NodeCluster",
    "NodeHarnessError",
    "NodeSlurm",
    "available",
    "link_rate_bits",
    "remove_stale",
    "slurm_available",
]
