"""The messages between actors per job, and which of them waited, counted not timed.

    python bench/messages.py [--n 100] [--isolation affinity] [--baseline-root DIR]

An embedded runner (`motor.open_runner`, `max_weight=2`, claims of 1, `true` over four
workspaces, as bench/job_cost.py submits them) in a fresh process: after 10 warm-up jobs,
N jobs are submitted and followed to their end, and every message an actor handles is
counted by (actor, message type, call or cast, where it was handled, whether its handler
waited). A probe around `handle` and `handle_now` records them: `here` is a message
handled in the actor's own task (it went through the inbox: two task switches for a call,
one for a cast), `at-once` one handled in the sender's task (an immediate message to an
idle actor, docs/actors.md); `waited` says the handler suspended at least once. One line
per kind in the peers' format (`value` = messages per job), then the totals per job.
`--baseline-root DIR` counts the motor package in DIR too (peer=motor-baseline), e.g. the
code before immediate messages, where every message is handled `here`.
"""

from __future__ import annotations

from pathlib import Path

from benchlib import BURST, ab_parser, load1, run_round
from benchlib import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent

ROUND = BURST + r"""
import collections, json, sys, types
import trio
import actors._actor as A

iso, n = sys.argv[1], int(sys.argv[2])
counts = collections.Counter()
on = [False]

@types.coroutine
def _drive(coro):
    # run a coroutine to its end in the current task; (waited, value)
    try:
        step = coro.send(None)
    except StopIteration as stop:
        return False, stop.value
    while True:
        try:
            sent = yield step
        except BaseException as exc:
            try:
                step = coro.throw(exc)
            except StopIteration as stop:
                return True, stop.value
        else:
            try:
                step = coro.send(sent)
            except StopIteration as stop:
                return True, stop.value

def _note(actor, env, where, waited):
    if on[0]:
        name = actor.name.split("-")[0] if actor.name.startswith("job-") else actor.name
        counts[(name, type(env.msg).__name__, "call" if env.reply is not None else "cast",
                where, "waited" if waited else "no-wait")] += 1

real_dispatch = A.Actor._dispatch
async def _dispatch(self, env):
    real = self.handle
    async def handle(msg):
        waited, value = await _drive(real(msg))
        _note(self, env, "here", waited)
        return value
    real_now = getattr(self, "handle_now", None)
    def handle_now(msg):
        value = real_now(msg)
        if value is not getattr(A, "LATER", None):
            _note(self, env, "here", False)
        return value
    self.handle = handle
    if real_now is not None:
        self.handle_now = handle_now
    try:
        await real_dispatch(self, env)
    finally:
        del self.handle
        if real_now is not None:
            del self.handle_now

real_here = getattr(A.Actor, "_handle_here", None)
if real_here is not None:
    def _handle_here(self, env):
        value = real_here(self, env)
        if value is not A.LATER:
            _note(self, env, "at-once", False)
        return value
    A.Actor._handle_here = _handle_here
A.Actor._dispatch = _dispatch

async def main():
    async with warm_runner(iso, n + 20) as runner:
        await burst(runner, 10)
        on[0] = True
        await burst(runner, n)
        on[0] = False

trio.run(main)
print(json.dumps({"|".join(k): v / n for k, v in counts.items()}))
"""


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--n", type=int, default=100)
    args = ap.parse_args()
    print(f"# messages: n={args.n} isolation={args.isolation} load1={load1()}", flush=True)
    totals = {}
    for peer, root in bench_peers(ROOT, args.baseline_root):
        got = run_round(ROUND, root, args.isolation, str(args.n))
        for key, value in sorted(got.items(), key=lambda kv: -kv[1]):
            actor, kind, how, where, waited = key.split("|")
            print(f"peer={peer} metric=messages_per_job value={value:.2f} unit=count "
                  f"actor={actor} message={kind} via={how} handled={where} handler={waited} "
                  f"n={args.n} isolation={args.isolation} load1={load1()}", flush=True)
        queued = sum(v for k, v in got.items() if k.split("|")[3] == "here")
        totals[peer] = (sum(got.values()), queued)
    for peer, (total, queued) in totals.items():
        print(f"# {peer:15s} messages per job {total:6.2f}, through the inbox {queued:6.2f}")


if __name__ == "__main__":
    main()
