"""torch's own torchrun, its stores listening only where they are named (run as ``python -m workbench.launch.torchrun``).

torch's ``TCPStore`` server listens on every interface (``::``) whatever host it is given, which
would put a one-node job's rendezvous store, the store its ranks bootstrap from and any process
group a single process sets up for itself on the network.  This entry runs
``torch.distributed.run.main`` unchanged except for one thing: a store server is handed a socket
bound to the address of the host it is named by (TCPStore's own ``master_listen_fd``).

- **One node** (training's :class:`workbench.launch.plan.LaunchPlan`, generation's and verification's
  ranks: :func:`one_node_args`): the c10d rendezvous at ``127.0.0.1`` on a free port and
  ``--local-addr 127.0.0.1``, so both of torchrun's stores listen on the loopback only; with a
  loopback rendezvous every rank is on this machine, so the ranks' gloo and NCCL sockets are put on
  the loopback interface too (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless exported).
- **Several nodes** (``--rdzv-endpoint HOST:PORT``): node 0's store listens on HOST's address only
  (it must be an address of node 0: :func:`bind_problem` is checked before launch); gloo and NCCL
  use the interfaces you export (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``), as torch's own do.
- **One process** (conversion, generation on one rank): :func:`private_world` makes a 1-rank group
  on an in-memory store, no listening store at all, gloo on the loopback.

The SLURM script (:func:`workbench.launch.slurm.batch_script`) runs this entry too, with the first
node's address as SLURM reaches it as the rendezvous host: its store listens on that address only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import Any, Sequence

__all__ = ["MODULE", "LOOPBACK", "one_node_args", "loopback_interface", "loopback_env", "listening_socket",
           "bind_problem", "install", "private_world", "main"]

MODULE = "workbench.launch.torchrun"
LOOPBACK = "127.0.0.1"
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
               "master_listen_fd", "use_libuv")


def one_node_args() -> list[str]:
    """torchrun's rendezvous options for one node: everything on the loopback, a port the OS picks (so the
    store is the job's own and the rendezvous id needs no uniqueness)."""
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:0", "--rdzv-id", "workbench",
            "--local-addr", LOOPBACK, "--nnodes", "1"]


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
                return name
    except Exception:  # noqa: BLE001  (no psutil answer: the usual name)
        pass
    return "lo"


def loopback_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with gloo's and NCCL's sockets on the loopback, unless already chosen."""
    out = dict(os.environ if env is None else env)
    name = None
    for var in _IFNAME_VARS:
        if not out.get(var):
            name = name or loopback_interface()
            out[var] = name
    return out


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _address(host: str, port: int) -> tuple[int, tuple]:
    """(family, sockaddr) of ``host`` to bind: its IPv4 address first ('localhost': 127.0.0.1)."""
    infos = socket.getaddrinfo(host or LOOPBACK, port, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s address (not every interface) at ``port`` (0: the OS picks)."""
    family, sockaddr = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def bind_problem(host: str) -> str | None:
    """Why a store could not listen on ``host`` on this machine (it does not resolve, or is not one of its
    addresses), else None."""
    try:
        listening_socket(host, 0).close()
    except OSError as e:
        return f"{host} is not an address of this machine ({e.strerror or e})"
    return None


def install() -> None:
    """Make every ``torch.distributed.TCPStore`` server of this process listen on its named host only
    (the class in ``torch.distributed`` and in the modules that imported it by name)."""
    import torch.distributed as dist

    base = dist.TCPStore
    if getattr(base, "_workbench_named_host", False):
        return

    class NamedHostTCPStore(base):  # type: ignore[misc, valid-type]
        """A TCPStore whose server listens on the address of ``host_name`` only."""

        _workbench_named_host = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = dict(zip(_STORE_ARGS, args))
            bound.update(kwargs)
            if bound.get("is_master") and bound.get("master_listen_fd") is None:
                try:
                    sock = listening_socket(str(bound.get("host_name") or LOOPBACK), int(bound.get("port") or 0))
                except OSError as e:
                    raise RuntimeError(f"the store cannot listen on {bound.get('host_name')}:{bound.get('port')} ({e}); "
                                       "the rendezvous endpoint must name this machine (node 0)") from e
                bound["port"] = sock.getsockname()[1]
                bound["master_listen_fd"] = sock.detach()  # the store owns (and closes) it from here
            bound = {k: v for k, v in bound.items() if v is not None or k in ("world_size",)}
            super().__init__(**bound)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("torch.distributed") and getattr(mod, "TCPStore", None) is base:
            mod.TCPStore = NamedHostTCPStore
    dist.TCPStore = NamedHostTCPStore


def private_world(device: str = "cpu") -> None:
    """A one-process group (rank 0 of 1) on an in-memory store: nothing listens for peers that cannot
    exist; gloo's own socket on the loopback.  megatron's parallel state is the caller's."""
    import torch.distributed as dist

    for var, value in loopback_env({var: os.environ.get(var, "") for var in _IFNAME_VARS}).items():
        os.environ[var] = value
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR=LOOPBACK)
    dist.init_process_group(backend="gloo" if device == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)


def main(argv: Sequence[str] | None = None) -> None:
    """torchrun with :func:`install`; a loopback rendezvous puts the ranks' gloo and NCCL sockets on the loopback."""
    from torch.distributed import run

    args = list(sys.argv[1:] if argv is None else argv)
    parsed = run.parse_args(args)
    host = (parsed.rdzv_endpoint or "").rpartition(":")[0].strip("[]") if parsed.rdzv_endpoint else parsed.master_addr
    if parsed.standalone or _is_loopback(host or ""):
        os.environ.update(loopback_env())
    install()
    run.main(args)

