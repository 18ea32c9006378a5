"""The job lifecycle table (motor/lifecycle.py): every legal move, illegal moves named
precisely, and the docs' state diagram checked against the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from motor import lifecycle as lc
from motor.clock import uuid7, uuid7_ms
from motor.records import TERMINAL_STATES, JobRecord, JobState
from typing import get_args

T0 = 1_700_000_000_000
DOC = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"

LEGAL = {
    ("queued", "place"): "setup",
    ("queued", "cancel"): "cancelled",
    ("queued", "withdraw"): "refused_before_start",
    ("setup", "spawn"): "running",
    ("setup", "start_failed"): "queued",
    ("setup", "cancel"): "cancelled",
    ("setup", "refuse"): "refused_before_start",
    ("setup", "fail"): "failed",
    ("running", "exit_ok"): "succeeded",
    ("running", "fail"): "failed",
    ("running", "time_out"): "timed_out",
    ("running", "cancel"): "cancelled",
    ("running", "lose"): "lost",
}


def _record(state: str) -> JobRecord:
    return JobRecord(job_id=uuid7(T0), state=state, workspace="w", command=["true"], claim=1,
                     accepted_at_ms=T0)


def test_the_states_are_the_wire_vocabulary():
    assert set(lc.STATES) == set(get_args(JobState))
    assert {s for s in lc.STATES if not lc.TRANSITIONS[s]} == TERMINAL_STATES
    assert lc.INITIAL == "queued" and lc.ACTIVE_STATES == {"setup", "running"}


@pytest.mark.parametrize(("state", "event"), sorted(LEGAL))
def test_every_legal_move(state, event):
    assert lc.next_state(state, event) == LEGAL[(state, event)]
    moved = lc.advance(_record(state), event, who="test", detail="why")
    assert (moved.state, moved.detail) == (LEGAL[(state, event)], "why")


def test_the_table_holds_exactly_the_legal_moves():
    table = {(s, e): t for s, moves in lc.TRANSITIONS.items() for e, t in moves.items()}
    assert table == LEGAL


@pytest.mark.parametrize("state", lc.STATES)
def test_illegal_moves_raise_naming_state_event_job_and_actor(state):
    record = _record(state)
    for event in lc.EVENTS:
        if (state, event) in LEGAL:
            continue
        with pytest.raises(lc.LifecycleError) as info:
            lc.advance(record, event, who="dispatcher")
        err = info.value
        assert (err.state, err.event, err.job_id, err.who) == (
            state, event, record.job_id, "dispatcher")
        text = str(err)
        assert f"event {event!r}" in text and f"state {state!r}" in text
        assert record.job_id in text and "dispatcher" in text


def test_an_unknown_event_or_state_is_illegal_too():
    with pytest.raises(lc.LifecycleError, match="'explode'.*'running'"):
        lc.next_state("running", "explode")
    with pytest.raises(lc.LifecycleError, match="'place'.*'setting_up'"):
        lc.next_state("setting_up", "place")  # the scheduling core's old word, not a state


def test_terminal_from_status_moves_by_the_table():
    running = _record("running")
    ok = {"exit_code": 0, "signal": None, "reason": None, "ended_at_ms": T0 + 5}
    assert lc.terminal_from_status(running, ok, T0 + 9).state == "succeeded"
    assert lc.terminal_from_status(running, {**ok, "exit_code": 2}, T0 + 9).state == "failed"
    assert lc.terminal_from_status(running, {**ok, "reason": "timed_out"}, T0).state == "timed_out"
    assert lc.terminal_from_status(running, {**ok, "reason": "cancelled"}, T0).state == "cancelled"
    lost = lc.terminal_from_status(running, None, T0 + 9)
    assert (lost.state, lost.reason, lost.ended_at_ms) == ("lost", "keeper_lost", T0 + 9)
    never = {"exit_code": None, "signal": None, "reason": "spawn_failed", "detail": "no keeper"}
    assert lc.terminal_from_status(_record("setup"), never, T0).state == "failed"
    with pytest.raises(lc.LifecycleError, match="'exit_ok'.*'queued'"):
        lc.terminal_from_status(_record("queued"), ok, T0)  # a queued job has no keeper


def test_retain_until_is_24_hours_after_the_later_of_end_and_birth():
    record = _record("succeeded")
    born = uuid7_ms(record.job_id)  # uuid7 is monotonic per process: maybe later than T0
    assert lc.retain_until(record) == born + lc.RETENTION_MS  # no end: from the id's time
    ended = JobRecord(**{**{f: getattr(record, f) for f in record.__struct_fields__},
                         "ended_at_ms": born + 7})
    assert lc.retain_until(ended) == born + 7 + 24 * 3600 * 1000
    assert not lc.history_expired(record.job_id, born + lc.RETENTION_MS - 1)
    assert lc.history_expired(record.job_id, born + lc.RETENTION_MS)


def test_the_one_retention_rule_is_used_everywhere():
    from motor.accounting import core as accounting_core
    from motor.execution import core as execution_core
    from motor.execution import messages as execution_messages  # terminal_save
    from motor.scheduling import machine as scheduling_actor

    for module in (accounting_core, execution_messages, scheduling_actor):
        assert module.retain_until is lc.retain_until, module.__name__
    assert execution_core.terminal_from_status is lc.terminal_from_status


def test_the_docs_diagram_matches_the_table():
    text = DOC.read_text()
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block, "docs/lifecycle.md has no mermaid diagram"
    moves, starts, ends = {}, set(), set()
    for line in block.group(1).splitlines():
        line = line.strip()
        if not line or line.startswith("stateDiagram"):
            continue
        m = re.fullmatch(r"(\[\*\]|\w+) --> (\[\*\]|\w+)(?:: (\w+))?", line)
        assert m, f"unparsed diagram line: {line!r}"
        src, dst, event = m.groups()
        if src == "[*]":
            starts.add(dst)
        elif dst == "[*]":
            ends.add(src)
        else:
            assert event, f"a move without its event: {line!r}"
            assert (src, event) not in moves, f"drawn twice: {line!r}"
            moves[(src, event)] = dst
    table = {(s, e): t for s, t_moves in lc.TRANSITIONS.items() for e, t in t_moves.items()}
    assert moves == table
    assert starts == {lc.INITIAL}
    assert ends == set(TERMINAL_STATES)
