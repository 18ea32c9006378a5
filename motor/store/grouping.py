"""Group commit: the saves waiting in the store's inbox written in one transaction.

The store actor (motor/store/actor.py) takes the save messages already waiting when it
handles one (`Actor.take_waiting`) and commits them with it: one commit instead of one per
save (issue 14). Its commit is a coroutine for both places a commit runs: off the event
loop it awaits a worker thread; on the loop it never suspends, and `run_inline` runs it
(and `commit_group` around it) to its end in the caller's task.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from .db import StoreFull, StoreLocked

__all__ = ["commit_group", "run_inline"]

#: writes `msgs` in one transaction; each message's answer
Commit = Callable[[list], Awaitable[list]]


async def commit_group(commit: Commit, msg: Any, waiting: list, log: logging.Logger) -> Any:
    """Commit `msg` and the `waiting` saves ((message, reply token or None) each) in one
    transaction, then answer the waiting ones; return the answer to `msg`. If that fails
    (nothing of it was written), each message in its own transaction, in order, so each
    caller gets its own answer (a `StoreFull` goes to those whose write did not fit).
    `StoreLocked` (nothing written, no one answered: another connection's write lock) is
    raised to the caller, who writes them all again."""
    if not waiting:
        return (await commit([msg]))[0]
    try:
        answers = await commit([msg, *(m for m, _ in waiting)])
    except StoreLocked:
        raise
    except Exception:
        return await _one_by_one(commit, msg, waiting, log)
    for (_, token), answer in zip(waiting, answers[1:]):
        if token is not None:
            token.reply(answer)
    return answers[0]


async def _one_by_one(commit: Commit, msg: Any, waiting: list, log: logging.Logger) -> Any:
    try:
        own, refused = (await commit([msg]))[0], None
    except StoreFull as exc:
        own, refused = None, exc
    for other, token in waiting:
        try:
            answer = (await commit([other]))[0]
        except (StoreFull, StoreLocked) as exc:
            if token is not None:
                token.fail(exc)
            else:
                log.warning("store: cast %r failed: %r", other, exc)
            continue
        if token is not None:
            token.reply(answer)
    if refused is not None:
        raise refused
    return own


def run_inline(coro) -> Any:
    """Run a coroutine that does not suspend (a commit on the event loop) to its end: its
    value, or what it raised."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("store: a commit on the event loop suspended")
