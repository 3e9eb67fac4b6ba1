"""Ports a server is about to listen on: free, or taken, and by which process.

Checked before a server starts, so a second `up` on the same ports says which port is taken and by what
instead of reporting the first instance's server as its own.
"""
from __future__ import annotations

import errno
import socket

from cosyvoice_triton.errors import PortInUse


def port_taken(address: str, port: int) -> bool:
    """True when a listening socket cannot bind `address:port` now (SO_REUSEADDR, as servers bind, so a
    port in TIME_WAIT counts as free)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def port_owner(port: int) -> str | None:
    """"NAME (pid N)" of the process listening on `port`, when this user may see it; else None."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return f"{psutil.Process(conn.pid).name()} (pid {conn.pid})"
            except psutil.Error:
                return f"pid {conn.pid}"
    return None


def check_ports_free(address: str, ports: dict[str, int | None]) -> None:
    """Raise PortInUse naming every taken port of `ports` (what it is for -> port; None: picked later)."""
    taken = []
    for what, port in ports.items():
        if port is not None and port_taken(address, port):
            owner = port_owner(port)
            taken.append(f"{what} {address}:{port} is in use" + (f" by {owner}" if owner else ""))
    if taken:
        raise PortInUse("; ".join(taken) + ". Stop that process, or choose other ports (0: a free one).")
