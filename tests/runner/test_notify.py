"""notify.keep_watchdog under a MockClock: a ping each half period while the probe answers,
none while it does not answer in time or fails (a dispatcher between two incarnations),
and the pings resume after; the runner itself never fails for it."""

from __future__ import annotations

import trio

from motor.runner.notify import keep_watchdog


class Sent:
    def __init__(self):
        self.at: list[float] = []

    async def send(self, *lines, timeout):
        assert lines == ("WATCHDOG=1",) and timeout > 0
        self.at.append(trio.current_time())


async def test_the_watchdog_pings_only_while_the_probe_answers_in_time(autojump_clock):
    sent, mode = Sent(), {"now": "answer"}

    async def probe():
        if mode["now"] == "hang":
            await trio.sleep_forever()
        if mode["now"] == "fail":
            raise RuntimeError("actor 'dispatcher' is not running")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_watchdog, sent, 10.0, probe)
        await trio.sleep(12)
        assert sent.at == [0.0, 5.0, 10.0]
        mode["now"] = "hang"
        await trio.sleep(15)  # 12 .. 27: the probe of 15 hangs, and so on
        mode["now"] = "fail"
        await trio.sleep(10)  # 27 .. 37
        assert sent.at == [0.0, 5.0, 10.0]
        mode["now"] = "answer"
        await trio.sleep(9)
        assert len(sent.at) == 5 and sent.at[-1] == 45.0
        nursery.cancel_scope.cancel()
