"""``python -m fastpar.nodes``: nodes on this machine from the command line (root).

    python -m fastpar.nodes 2 --link 1gbit                     # up until Ctrl-C; prints how to enter each node
    python -m fastpar.nodes 2 --link 1gbit -- python train.py  # the command on every node at once, then down
    python -m fastpar.nodes 2 --slurm /tmp/nodes-slurm         # and a Slurm over them (SLURM_CONF printed)

With a command, each node runs it with ``FASTPAR_NODE`` (its index), ``FASTPAR_NODES`` (the count) and
``FASTPAR_NODE0_ADDRESS`` set; the exit status is the first non-zero one. Everything is removed on the way out, also
after Ctrl-C or a failure.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading

from .harness import NodeCluster, NodeHarnessError, available, link_rate_bits


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m fastpar.nodes",
        description="Nodes on this machine (network, UTS and mount namespaces on a tbf-shaped switch); needs root.",
        epilog="After --: a command to run on every node (then the nodes go down).",
    )
    parser.add_argument("count", type=int, help="how many nodes (1 to 200)")
    parser.add_argument("--link", default="1gbit", help="each link's rate, a tc rate, or 'none' (default 1gbit)")
    parser.add_argument("--slurm", metavar="FOLDER", help="also run a Slurm over the nodes, configured in FOLDER")
    flags = parser.parse_args(argv)
    if flags.link.lower() != "none":
        try:
            link_rate_bits(flags.link)
        except ValueError as exc:
            parser.error(str(exc))
    if not 1 <= flags.count <= 200:
        parser.error(f"count {flags.count}: choose 1 to 200 nodes")
    return flags, command


def _run_everywhere(nodes: NodeCluster, command: list[str], extra_env: dict[str, str]) -> int:
    procs = []
    for node in nodes:
        env = (
            os.environ
            | extra_env
            | {
                "FASTPAR_NODE": str(node.index),
                "FASTPAR_NODES": str(len(nodes)),
                "FASTPAR_NODE0_ADDRESS": nodes[0].address,
            }
        )
        procs.append(node.popen(command, env=env))
    statuses = [proc.wait() for proc in procs]
    for node, status in zip(nodes, statuses, strict=True):
        if status:
            print(f"fastpar.nodes: {node.hostname} ({node.address}) exited with status {status}", file=sys.stderr)
    return next((s for s in statuses if s), 0)


def _leave(signum, frame) -> None:
    """SIGTERM leaves like Ctrl-C: through the context managers, which remove everything."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    flags, command = _parse(sys.argv[1:] if argv is None else argv)
    ok, why = available()
    if not ok:
        print(f"fastpar.nodes: cannot make nodes here: {why}", file=sys.stderr)
        return 2
    link = None if flags.link.lower() == "none" else flags.link
    signal.signal(signal.SIGTERM, _leave)
    try:
        with NodeCluster(flags.count, link=link) as nodes:
            slurm_env: dict[str, str] = {}
            slurm = None
            if flags.slurm:
                from .slurm import NodeSlurm

                slurm = NodeSlurm(nodes, flags.slurm).__enter__()
                slurm_env = {"SLURM_CONF": str(slurm.conf)}
            try:
                if command:
                    return _run_everywhere(nodes, command, slurm_env)
                for node in nodes:
                    enter = shlex.join(node.command(["bash"]))
                    print(f"{node.hostname} {node.address}: {enter}")
                if slurm is not None:
                    print(f"Slurm: controller on node0; on a node run Slurm's commands with SLURM_CONF={slurm.conf}")
                print(f"links: {link or 'not shaped'}; Ctrl-C takes everything down", flush=True)
                threading.Event().wait()
            finally:
                if slurm is not None:
                    slurm.down()
    except KeyboardInterrupt:
        return 130
    except NodeHarnessError as exc:
        print(f"fastpar.nodes: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
