"""Readable tables for status, jobs, health and workspaces (rich; plain when not a TTY)."""

from __future__ import annotations

import datetime as _dt
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from motor.cli.text import printable


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
    text = printable(text)
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
        return Text(printable(",".join(str(v) for v in value)) or "-")
    if isinstance(value, (dict, list)):
        import msgspec

        return Text(msgspec.json.encode(value).decode())  # JSON escapes control characters
    return Text(printable(str(value)))


def _outcome(rec: dict) -> str:
    if rec.get("signal"):
        return f"signal {rec['signal']}"
    if rec.get("exit_code") is not None:
        return str(rec["exit_code"])
    return printable(str(rec.get("reason") or "-"))


def _capacity_line(capacity: Any) -> Text | None:
    if not isinstance(capacity, dict) or not capacity:
        return None
    known = ("held_permits", "max_weight", "setup_permits", "pending_jobs", "max_queue_depth",
             "claim_limit")
    if all(k in capacity for k in known):
        line = (f"permits {capacity['held_permits']}/{capacity['max_weight']} held"
                f" ({capacity['setup_permits']} in setup)  pending {capacity['pending_jobs']}"
                f"/{capacity['max_queue_depth']}  claim limit {capacity['claim_limit']}")
        extra = {k: v for k, v in capacity.items() if k not in known}
        if extra:
            line += "  " + "  ".join(f"{k}={v}" for k, v in extra.items())
        return Text(line)
    return Text("capacity: " + "  ".join(f"{k}={v}" for k, v in capacity.items()))


def status(data: dict, con: Console | None = None) -> None:
    con = con or console()
    table = Table(title="jobs", title_justify="left")
    for col in ("job", "state", "workspace", "claim", "cpus", "waiting_on", "queue_wait", "command"):
        table.add_column(col)
    rows = list(data.get("running") or []) + list(data.get("queued") or [])
    for rec in rows:
        waiting = rec.get("waiting_on") or "-"
        if rec.get("waiting_on_job"):
            waiting += f" ({rec['waiting_on_job']})"
        if rec.get("waiting_detail"):
            waiting += f": {rec['waiting_detail']}"
        waiting = printable(waiting)
        table.add_row(
            Text(str(rec.get("job_id", "?"))), Text(str(rec.get("state", "?"))),
            Text(printable(str(rec.get("workspace", "-")))), Text(str(rec.get("claim", "-"))),
            Text(cpus(rec.get("cpus"))), Text(waiting),
            Text(duration_ms(rec.get("queue_wait_ms"))), Text(command(rec.get("command"))),
        )
    if rows:
        con.print(table)
    else:
        con.print("no queued or running jobs")
    line = _capacity_line(data.get("capacity"))
    if line is not None:
        con.print(line)


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
            Text(printable(str(rec.get("workspace", "-")))), Text(str(rec.get("kind", "-"))),
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
        table.add_row(Text(printable(str(key))), cell(str(key), value))
    return table


def _generic(con: Console, data: dict) -> None:
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
                con.print(Text(printable(f"{key}: " + (", ".join(map(str, value)) or "none"))))


def _isolation(value: Any) -> str:
    if isinstance(value, dict):
        name = value.get("backend") or value.get("name") or "?"
        enforces = value.get("enforces")
        return f"{name}" + (f" (enforces {', '.join(map(str, enforces))})" if enforces else "")
    return "-" if value is None else str(value)


def health(data: dict) -> None:
    """The health report as a readable summary: capacity, disk, host, refusals, repositories,
    hourly queue wait, underused reservations (`--json` prints the raw report)."""
    con = console()
    shown = {"status", "degraded", "isolation", "capacity", "cpus", "disk", "host", "admission_refusals", "finished",
             "repositories", "queue_wait_hourly", "underused", "active", "retained_terminal_jobs"}
    if data.get("status") == "degraded":  # first: what needs the operator
        con.print(Text("status: DEGRADED", style="bold red"))
        for trouble in data.get("degraded") or []:
            con.print(Text(printable(f"  {trouble.get('subsystem')}: {trouble.get('cause')}"),
                           style="red"))
    con.print(Text(f"isolation: {_isolation(data.get('isolation'))}"))
    line = _capacity_line(data.get("capacity"))
    if line is not None:
        con.print(line)
    active = data.get("active")
    if isinstance(active, dict):
        con.print(Text(f"running: {active.get('jobs', 0)} jobs on {active.get('vcpus', 0)} vCPUs;"
                       f" retained terminal records: {data.get('retained_terminal_jobs', '-')}"))
    cpu = data.get("cpus")
    if isinstance(cpu, dict):
        held = sorted(c for cs in (cpu.get("jobs") or {}).values() for c in cs)
        con.print(Text(f"cpus: online {cpus(cpu.get('online'))}  allowed {cpus(cpu.get('allowed'))}"
                       f"  kept back {cpus(cpu.get('kept_back'))}  held {cpus(held)}"))
    disk = data.get("disk")
    if isinstance(disk, dict):
        con.print(Text(f"disk: free {size(disk.get('free_bytes'))}"
                       + (f" of {size(disk.get('total_bytes'))}" if disk.get("total_bytes") else "")
                       + f"  floor {size(disk.get('floor_bytes'))}  goal {size(disk.get('goal_bytes'))}"))
        if disk.get("total_inodes"):
            con.print(Text(f"inodes: free {disk.get('free_inodes')} of {disk.get('total_inodes')}"
                           f"  floor {disk.get('floor_inodes')}  goal {disk.get('goal_inodes')}"))
    host = data.get("host")
    if isinstance(host, dict) and host:
        parts = []
        if "load1" in host:
            parts.append(f"load {host.get('load1')} {host.get('load5')} {host.get('load15')}")
        if "logical_cpus" in host:
            parts.append(f"{host['logical_cpus']} logical CPUs")
        if "available_memory_bytes" in host:
            parts.append(f"{size(host['available_memory_bytes'])} memory available")
        con.print(Text("host: " + ", ".join(parts)))
    refusals = data.get("admission_refusals") or {}
    con.print(Text("admission refusals: " + (
        "  ".join(f"{k}={v}" for k, v in refusals.items()) if refusals else "none")))
    finished = data.get("finished") or {}
    if finished:
        con.print(Text("ended since start: " + "  ".join(f"{k}={v}" for k, v in finished.items())))

    repos = data.get("repositories") or {}
    if repos:
        table = Table(title="repositories (rolling 24 h)", title_justify="left")
        for col in ("repository", "vCPU-seconds", "finished", "jobs by vCPUs", "queue-wait refusals"):
            table.add_column(col)
        for name, t in repos.items():
            by = t.get("jobs_by_vcpus") or {}
            table.add_row(Text(printable(str(name))), Text(f"{t.get('reserved_vcpu_seconds', 0):g}"),
                          Text(str(t.get("finished_jobs", 0))),
                          Text("  ".join(f"{k}:{v}" for k, v in by.items()) or "-"),
                          Text(str(t.get("queue_wait_refusals", 0))))
        con.print(table)
    else:
        con.print(Text("repositories: none in the last 24 h"))

    hourly = data.get("queue_wait_hourly") or []
    busy = [b for b in hourly if b.get("started") or b.get("refusals")]
    if hourly:
        rows = busy if busy and busy[-1] is hourly[-1] else busy + [hourly[-1]]
        table = Table(title="queue wait per hour (capacity wait, nearest rank)",
                      title_justify="left")
        for col in ("hour", "started", "p50", "p90", "refusals"):
            table.add_column(col)
        for b in rows:
            table.add_row(Text(when_ms(b.get("hour_start_ms"))), Text(str(b.get("started", 0))),
                          Text(duration_ms(b.get("p50_ms"))), Text(duration_ms(b.get("p90_ms"))),
                          Text(str(b.get("refusals", 0))))
        con.print(table)

    underused = data.get("underused") or []
    if underused:
        table = Table(title="underused reservations (over 10 min below 25%)", title_justify="left")
        for col in ("job", "repository", "claim", "wall", "cpu", "use"):
            table.add_column(col)
        for u in underused:
            table.add_row(Text(str(u.get("job_id"))), Text(printable(str(u.get("repository", "-")))),
                          Text(str(u.get("claim"))), Text(duration_ms(u.get("wall_time_ms"))),
                          Text(duration_ms(u.get("cpu_time_ms"))),
                          Text(f"{(u.get('average_use_ppm') or 0) / 10_000:.1f}%"))
        con.print(table)
    else:
        con.print(Text("underused reservations: none"))

    rest = {k: v for k, v in data.items() if k not in shown}
    if rest:
        _generic(con, rest)


def workspaces(rows: list[dict]) -> None:
    """The catalog; `measured` is the age of the cached sizes ("4m10s ago", "never")."""
    con = console()
    if not rows:
        con.print("no workspaces")
        return
    shown = []
    for row in rows:
        row = dict(row)
        row.pop("measured_ms", None)  # a wall time: shown as its age instead
        age = row.pop("measured_age_ms", None)
        out = {}
        for key, value in row.items():
            out[key] = value
            if key == "complete":
                out["measured"] = "never" if age is None else f"{duration_ms(age)} ago"
        out.setdefault("measured", "never" if age is None else f"{duration_ms(age)} ago")
        shown.append(out)
    con.print(_table_of_rows(None, shown))
