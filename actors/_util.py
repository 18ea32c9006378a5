from __future__ import annotations

import trio


def single_leaf(eg: BaseExceptionGroup) -> BaseException | None:
    """The one non-Cancelled exception inside ``eg``, or None if there is not exactly one."""
    _, rest = eg.split(trio.Cancelled)
    if rest is None:
        return None
    leaves: list[BaseException] = []
    stack: list[BaseException] = [rest]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None
