"""Socket reads the tests' fake servers share."""

from __future__ import annotations

import socket


def read_until(conn: socket.socket, marker: bytes) -> tuple[bytes, bool]:
    """Read from `conn` until `marker` has arrived (a request's head, an authentication's
    end); (all bytes read, whether the marker came before the peer closed)."""
    buf = b""
    while marker not in buf:
        data = conn.recv(65536)
        if not data:
            return buf, False
        buf += data
    return buf, True
