"""motor's HTTP API: the ASGI app (`make_app`) and its hypercorn server (`serve_api`)."""

from motor.api.app import MotorApp, event_line, make_app, read_token_file, refusal_body
from motor.api.server import SocketInUse, claim_socket_path, serve_api

__all__ = [
    "MotorApp", "event_line", "make_app", "read_token_file", "refusal_body",
    "SocketInUse", "claim_socket_path", "serve_api",
]
