"""Readable tables for status, jobs, health and workspaces (rich; plain when not a TTY)."""

from __future__ import annotations

import datetime as _dt
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def console() -> Console:
    file = sys.stdout
    is_tty = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, highlight=False, soft_wrap=False, width=None if is_tty else 200)


def size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-" if n is None else str(n)
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # pragma: no cover


def duration_ms(ms: Any) -> str:
    if not isinstance(ms, (int, float)):
        return "-" if ms is None else str(ms)
    if ms < 1000:
        return f"{int(ms)}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def when_ms(ms: Any) -> str:
    if not isinstance(ms, (int, float)) or not ms:
        return "-"
    return _dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def cpus(value: Any) -> str:
    """[0,1,2,3,8] -> "0-3,8"."""
    if not value:
        return "-"
    if not isinstance(value, list):
        return str(value)
    out, ids = [], sorted(int(c) for c in value)
    start = prev = ids[0]
    for c in ids[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def command(value: Any, limit: int = 60) -> str:
    if isinstance(value, list):
        text = " ".join(str(a) for a in value)
    else:
        text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def cell(key: str, value: Any) -> Text:
    if key.endswith("_bytes"):
        return Text(size(value))
    if key.endswith(("_at_ms", "_start_ms")):
        return Text(when_ms(value))
    if key.endswith("_ms"):
        return Text(duration_ms(value))
    if key == "cpus":
        return Text(cpus(value))
    if key == "command":
        return Text(command(value))
    if value is None:
        return Text("-")
    if isinstance(value, bool):
        return Text("yes" if value else "no")
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return Text(",".join(str(v) for v in value) or "-")
    if isinstance(value, (dict, list)):
        import msgspec

        return Text(msgspec.json.encode(value).decode())
    return Text(str(value))


def _outcome(rec: dict) -> str:
    if rec.get("signal"):
        return f"signal {rec['signal']}"
    if rec.get("exit_code") is not None:
        return str(rec["exit_code"])
    return rec.get("reason") or "-"


def status(data: dict) -> None:
    con = console()
    table = Table(title="jobs", title_justify="left")
    for col in ("job", "state", "workspace", "claim", "cpus", "waiting_on", "queue_wait", "command"):
        table.add_column(col)
    rows = list(data.get("running") or []) + list(data.get("queued") or [])
    for rec in rows:
        waiting = rec.get("waiting_on") or "-"
        if rec.get("waiting_on_job"):
            waiting += f" ({rec['waiting_on_job']})"
        table.add_row(
            Text(str(rec.get("job_id", "?"))), Text(str(rec.get("state", "?"))),
            Text(str(rec.get("workspace", "-"))), Text(str(rec.get("claim", "-"))),
            Text(cpus(rec.get("cpus"))), Text(waiting),
            Text(duration_ms(rec.get("queue_wait_ms"))), Text(command(rec.get("command"))),
        )
    if rows:
        con.print(table)
    else:
        con.print("no queued or running jobs")
    capacity = data.get("capacity")
    if isinstance(capacity, dict) and capacity:
        con.print(Text("capacity: " + "  ".join(f"{k}={v}" for k, v in capacity.items())))


def jobs(records: list[dict]) -> None:
    con = console()
    if not records:
        con.print("no retained jobs")
        return
    table = Table()
    for col in ("job", "state", "workspace", "kind", "claim", "exit", "accepted", "command"):
        table.add_column(col)
    for rec in records:
        table.add_row(
            Text(str(rec.get("job_id", "?"))), Text(str(rec.get("state", "?"))),
            Text(str(rec.get("workspace", "-"))), Text(str(rec.get("kind", "-"))),
            Text(str(rec.get("claim", "-"))), Text(_outcome(rec)),
            Text(when_ms(rec.get("accepted_at_ms"))), Text(command(rec.get("command"))),
        )
    con.print(table)


def _table_of_rows(title: str | None, rows: list[dict]) -> Table:
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(cell(col, row.get(col)) for col in columns))
    return table


def _mapping_table(title: str | None, data: dict) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("key")
    table.add_column("value")
    for key, value in data.items():
        table.add_row(Text(str(key)), cell(str(key), value))
    return table


def health(data: dict) -> None:
    con = console()
    scalars = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    if scalars:
        con.print(_mapping_table("health", scalars))
    for key, value in data.items():
        if isinstance(value, dict):
            if value and all(isinstance(v, dict) for v in value.values()):
                rows = [{"name": k, **v} for k, v in value.items()]
                con.print(_table_of_rows(key, rows))
            elif value:
                con.print(_mapping_table(key, value))
            else:
                con.print(Text(f"{key}: none"))
        elif isinstance(value, list):
            if value and all(isinstance(v, dict) for v in value):
                con.print(_table_of_rows(key, value))
            else:
                con.print(Text(f"{key}: " + (", ".join(map(str, value)) or "none")))


def workspaces(rows: list[dict]) -> None:
    con = console()
    if not rows:
        con.print("no workspaces")
        return
    con.print(_table_of_rows(None, rows))
