"""Blocking work away from the event loop, behind one small protocol.

Actors that do blocking file-system or host reads (the disk actor, the job execution
actor, maintenance, the facade's upload path) receive an `Offload` instead of calling
`trio.to_thread` themselves. Production passes `thread_offload` (a worker thread); the
runner passes its clock's `offload` (motor/clock.py: a thread under the real clock, inline
under the test clock, where a thread would let virtual time jump); actor-level tests pass
`inline_offload` (tests/fakes.py).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol

import trio


class Offload(Protocol):
    """Runs a blocking function away from the event loop and returns its result."""

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]: ...


def abandonable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as work whose result its caller may drop: a walk that only reads, or the
    trash's deletion (resumed by the next pass). When the caller is cancelled (the runner
    stops), `thread_offload` leaves it to its worker thread (a daemon) instead of waiting
    for it: a walk stuck on a file system that stopped answering held `motor serve`'s stop
    until it returned (stop 61)."""
    fn.abandonable = True  # type: ignore[attr-defined]
    return fn


async def thread_offload(fn: Callable[..., Any], *args: Any) -> Any:
    """The production offloader: a trio worker thread (see `abandonable`)."""
    return await trio.to_thread.run_sync(
        fn, *args, abandon_on_cancel=getattr(fn, "abandonable", False))


async def offload_unless(inline: bool, offload: Offload, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the event loop when `inline` (the caller knows it is a few cheap calls:
    a thread hop would cost more, above all on a loaded host), else through `offload`."""
    return fn(*args) if inline else await offload(fn, *args)
