"""The manager's side of a D-Bus connection, for the tests' fake systemd managers."""

from __future__ import annotations

import socket
from typing import Iterator

from jeepney import Parser

from socket_helpers import read_until

#: the server's answer to a client's EXTERNAL authentication
AUTH_OK = b"OK 0123456789abcdef0123456789abcdef\r\n"


def dbus_messages(conn: socket.socket, greeting: bytes = AUTH_OK) -> Iterator:
    """Read the client's EXTERNAL authentication up to BEGIN, send `greeting` (the auth OK
    and whatever a test puts right behind it), then yield each message the client sends
    (jeepney's), until it closes the connection."""
    buf, complete = read_until(conn, b"BEGIN\r\n")
    if not complete:
        return
    assert buf.startswith(b"\0AUTH EXTERNAL "), buf
    conn.sendall(greeting)
    parser = Parser()
    parser.add_data(buf.partition(b"BEGIN\r\n")[2])
    while True:
        msg = parser.get_next_message()
        if msg is None:
            data = conn.recv(65536)
            if not data:
                return
            parser.add_data(data)
            continue
        yield msg
