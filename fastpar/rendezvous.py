"""Where a job's stores listen, and how an agent finds the rendezvous.

torch's ``TCPStore`` binds every interface. fastpar binds each store to one address and hands the socket over
(``master_listen_fd``): a local run's stores to 127.0.0.1, a multi-node run's to the address of the node that
hosts them (the rendezvous store on the endpoint's address, the workers' store on rank 0's node address). Whoever
reaches a store can read what it holds and, through the rendezvous state torch unpickles, run code in the agent;
binding one address keeps it off every other network of the host, though the one between the nodes must
still be trusted.

An agent advertises the address its node uses to reach the endpoint (read from the routing table, no name
lookup), and one that cannot reach the endpoint fails in seconds naming the address it tried.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
import sys
import time

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
RDZV_READ_TIMEOUT_S = 60.0  # torch's c10d rendezvous store default
REACH_TIMEOUT_S = 60.0  # how long an agent waits for the rendezvous host to start listening
BOUND_RDZV_BACKEND = "fastpar-bound"
# Set in an agent's environment at each rendezvous (and so in its workers'): the round all nodes joined, 0 at the
# start. A later round is a restart of the whole job, whichever node failed.
RDZV_ROUND_ENV = "FASTPAR_RDZV_ROUND"
_UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.EHOSTDOWN}


class RendezvousUnreachableError(ConnectionError):
    """This node cannot reach the rendezvous endpoint; the message names the address it tried."""


def bound_store(host: str = LOOPBACK, timeout_s: float = 60.0, port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` only, at ``port`` (0: a free one; read ``.port``).
    Raises OSError when the port is taken or ``host`` is not an address of this node."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            None,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the listening socket now and closes it with itself
    return store


def resolve(host: str) -> str:
    """``host`` as an IP address (a name is looked up once)."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        try:
            return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as exc:
            raise RendezvousUnreachableError(f"rendezvous host {host!r} does not resolve: {exc}") from None


def address_towards(host: str) -> str:
    """The address of this node that its routes use to reach ``host`` (no packet is sent)."""
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as exc:
            raise RendezvousUnreachableError(
                f"this node ({socket.gethostname()}) has no route to the rendezvous host {host} ({address}): {exc}"
            ) from None
        return probe.getsockname()[0]


def wait_until_reachable(host: str, port: int, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Return once ``host:port`` accepts a connection. An unreachable host or network fails at once; a host
    that refuses (its agent not started yet) is retried for ``timeout_s``; both errors name the address."""
    address = resolve(host)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, max(0.5, timeout_s))):
                return
        except OSError as exc:
            if exc.errno in _UNREACHABLE:
                raise RendezvousUnreachableError(
                    f"this node ({socket.gethostname()}) cannot reach the rendezvous at {host}:{port}"
                    f" ({address}): {exc.strerror or exc}; check the address and the network between the nodes"
                ) from None
            last = str(exc.strerror or exc)
        if time.monotonic() >= deadline:
            raise RendezvousUnreachableError(
                f"nothing answered at the rendezvous {host}:{port} ({address}) for {timeout_s:.0f} s ({last}):"
                " is the agent of node 0 running, with the same endpoint?"
            )
        time.sleep(0.2)


def listen_address(host: str) -> str:
    """The one address a store for endpoint ``host`` listens on: the address ``host`` names; but a host *name*
    that resolves to loopback here (Debian's ``127.0.1.1 hostname`` line) while other nodes resolve it to the
    network gets every interface, as torch does, since binding loopback would lock the other nodes out."""
    address = resolve(host)
    literal = host.strip("[]") == address or host == "localhost"
    if not literal and ipaddress.ip_address(address).is_loopback:
        return "::" if ":" in address else "0.0.0.0"
    return address


def interface_of(address: str) -> str | None:
    """The name of this node's network interface holding IPv4 ``address`` (None: not found, or IPv6)."""
    import fcntl
    import struct

    if ":" in address:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                held = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if held == address:
                return name
    return None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except RendezvousUnreachableError:
        return False


def bound_rendezvous_handler(params):
    """torch's c10d dynamic rendezvous with both of its stores bound to one address each: the rendezvous store
    on the endpoint's address (hosted by the first agent able to bind it, the others its clients) and the
    workers' store on rank 0's ``local_addr``."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    name, port = params.endpoint.rsplit(":", 1)
    host, port = listen_address(name), int(port)
    local_addr = params.local_addr or address_towards(name)

    reported: list[str] = []  # the waiting nodes last reported

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        # torch's private hook for the workers' store: were it renamed, that store would listen on every
        # interface again, which the socket-table tests of the launch report
        def _create_tcp_store_server(self, master_addr, master_port):  # the workers' store, on rank 0's agent
            return bound_store(local_addr, RDZV_READ_TIMEOUT_S, master_port)

        def get_backend(self) -> str:
            return BOUND_RDZV_BACKEND

        def num_nodes_waiting(self) -> int:
            waiting = super().num_nodes_waiting()
            nodes = sorted({node.addr for node in self._state_holder.state.wait_list})
            if waiting and nodes != reported:  # the agent stops this node's workers next: say which node asked
                reported[:] = nodes
                print(
                    f"fastpar: node(s) {', '.join(nodes)} rejoined the job after a failure (rendezvous round "
                    f"{self._state_holder.state.round}); stopping this node's workers to restart them all",
                    file=sys.stderr,
                    flush=True,
                )
            return waiting

        def next_rendezvous(self):
            info = super().next_rendezvous()
            # The round every node joined: the workers this agent starts next inherit it (the same number on
            # every node, unlike TORCHELASTIC_RESTART_COUNT, which counts only this node's own failures).
            os.environ[RDZV_ROUND_ENV] = str(self._state_holder.state.round)
            return info

    try:
        store = bound_store(host, RDZV_READ_TIMEOUT_S, port)
    except OSError:  # not this node's address, or another agent of this run on this node hosts it
        wait_until_reachable(name, port)
        store = dist.TCPStore(
            resolve(name), port, None, is_master=False, timeout=datetime.timedelta(seconds=RDZV_READ_TIMEOUT_S)
        )
    backend = C10dRendezvousBackend(store, params.run_id)
    return BoundRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, local_addr=local_addr
    )


def register_bound_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BOUND_RDZV_BACKEND, bound_rendezvous_handler)  # idempotent


def restart_round() -> int:
    """Which start of the workers this is: the rendezvous round under fastpar's agent (the same on every node),
    else torchrun's TORCHELASTIC_RESTART_COUNT (this node's restarts); 0 for the first."""
    return int(os.environ.get(RDZV_ROUND_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
