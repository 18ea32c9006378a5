"""Idempotency keys in the dispatcher's machine (docs/protocol.md, "Idempotent submits"),
as a Hypothesis property: random submits (keys from a small set, two commands, claims
that fill the runner), disk answers (some refusals), jobs ending, and a store that is
sometimes full, driven through the machine the way its shell drives it. Whatever the
order: every submit is answered exactly once; a key has at most one accepted job; a
submit is answered with a job only if it asked for what that job asked for; submits
without a key never share a job."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from motor.records import JobRecord, JobRequest, Refusal
from motor.scheduling import machine as m
from motor.scheduling.messages import Finished
from scheduling.test_machine import SETTINGS, Shell

COMMANDS = (["make"], ["make", "test"])

ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from([None, "a", "b"]), st.sampled_from([0, 1]),
              st.sampled_from([1, 2, 4])),
    st.tuples(st.just("disk"), st.booleans()),
    st.tuples(st.just("full"), st.booleans()),
    st.tuples(st.just("finish"), st.integers(min_value=0, max_value=7)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_one_job_per_key_and_one_answer_per_submit(ops):
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    stored: dict[str, JobRecord] = {}  # key -> the record of the job accepted with it
    answers: dict[str, list] = {}      # token -> its replies
    asked: dict[str, tuple] = {}       # token -> (key, command)

    def run(event) -> None:
        for effect in shell.run(event):
            if isinstance(effect, m.Reply) and effect.token is not None:
                answers.setdefault(effect.token, []).append(effect.value)
        for save in shell.of(m.SaveRecord):  # what the store now holds (the shell's lookup)
            accepted = save.accepted if save.purpose == "admit" else save.record
            if save.purpose in ("accept", "admit") and not shell.full and accepted.idempotency_key:
                stored.setdefault(accepted.idempotency_key, accepted)

    def answer_disk(refuse: bool) -> None:
        if shell.machine.admitting:  # answered in arrival order (the disk asker's order)
            job_id = next(j for j, a in shell.machine.admitting.items() if a.answer is None)
            run(m.DiskAnswered(job_id, Refusal(code="runner_disk_full", detail="x") if refuse else None))

    n = 0
    for op in ops:
        if op[0] == "submit":
            _, key, variant, weight = op
            n += 1
            token, job_id = f"t{n:03d}", f"j{n:03d}"
            asked[token] = (key, COMMANDS[variant])
            req = JobRequest(command=COMMANDS[variant], workspace=f"w{n % 3}", weight_hint=weight,
                             idempotency_key=key)
            run(m.SubmitReceived(token, req, False, job_id, existing=stored.get(key) if key else None))
        elif op[0] == "disk":
            answer_disk(op[1])
        elif op[0] == "full":
            shell.full = op[1]
        else:
            active = sorted(shell.machine.active)
            if active:
                run(Finished(active[op[1] % len(active)]))
    shell.full = False
    while shell.machine.admitting:
        answer_disk(False)

    assert sorted(answers) == sorted(asked)  # every submit answered ...
    assert all(len(values) == 1 for values in answers.values()), answers  # ... once
    jobs_of_key: dict[str, set[str]] = {}
    owner_of_job: dict[str, set[str]] = {}
    for token, [value] in answers.items():
        key, command = asked[token]
        if isinstance(value, JobRecord):
            assert value.command == command  # never another request's job
            assert value.idempotency_key == key
            owner_of_job.setdefault(value.job_id, set()).add(token)
            if key is not None:
                jobs_of_key.setdefault(key, set()).add(value.job_id)
        else:
            assert value.code in ("runner_full", "runner_disk_full", "idempotency_key_reused"), value
            if value.code == "idempotency_key_reused":
                first = next(iter(jobs_of_key.get(key, ()) or [None]))
                assert key is not None and (first is None or first in value.detail)
    assert all(len(jobs) == 1 for jobs in jobs_of_key.values()), jobs_of_key
    for job_id, tokens in owner_of_job.items():  # a job shared only by submits of one key
        keys = {asked[t][0] for t in tokens}
        assert len(tokens) == 1 or (len(keys) == 1 and None not in keys), (job_id, tokens)
    assert shell.machine.keyed == {} and shell.machine.key_waiters == {}
