"""Text from the runner made safe to print on a terminal (no rich: the lean CLI imports it).

A job's command, a repository name, an error detail come from whoever submitted the job;
printed raw, their control characters would reach the operator's terminal (an ESC starts
a terminal control sequence: colours, the window title, ...). `printable` shows them as
escapes instead (C0, DEL and C1: `\\x1b`, `\\n`, `\\t`, ...).
"""

from __future__ import annotations

__all__ = ["printable"]

_ESCAPES = {c: ("\\t" if c == 9 else "\\n" if c == 10 else "\\r" if c == 13 else
                f"\\x{c:02x}") for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}


def printable(text: str) -> str:
    """`text` with its control characters escaped."""
    return text.translate(_ESCAPES)
