"""A tiny pipeline on the `actors` runtime (no motor involved).

A producer feeds numbers to a worker that squares them. The worker crashes on
its first message with value 3; its supervisor restarts it (one_for_one) and
the producer retries that item. A collector actor gathers the results.

Run: python examples/actors_pipeline.py
"""

from __future__ import annotations

import logging

import trio

import actors


class Collector(actors.Actor):
    def __init__(self) -> None:
        super().__init__()
        self.results: list[int] = []

    async def handle(self, msg):
        if msg == "results":
            return list(self.results)
        self.results.append(msg)


class FlakyWorker(actors.Actor):
    crashed_once = False  # class-level: survives restarts, so it crashes only once

    async def handle(self, n: int) -> int:
        if n == 3 and not FlakyWorker.crashed_once:
            FlakyWorker.crashed_once = True
            raise RuntimeError(f"worker choked on {n}")
        return n * n


class Producer(actors.Actor):
    def __init__(self, sup_ref) -> None:
        super().__init__()
        self._sup_ref = sup_ref

    async def handle(self, items: list[int]) -> int:
        worker = self._sup_ref("worker")
        collector = self._sup_ref("collector")
        for n in items:
            while True:
                try:
                    result = await worker.call(n, timeout=5)
                    break
                except RuntimeError as exc:
                    print(f"producer: worker failed on {n} ({exc}); retrying")
                except actors.ActorDead:
                    await trio.sleep(0.01)  # worker is being restarted
            await collector.cast(result)
        return len(items)


async def main() -> None:
    holder: dict[str, actors.Supervisor] = {}
    children = [
        actors.ChildSpec("collector", Collector),
        actors.ChildSpec("worker", FlakyWorker),
        actors.ChildSpec("producer", lambda: Producer(lambda name: holder["sup"].ref(name))),
    ]
    async with actors.open_supervisor("pipeline", children, intensity=3, period=5.0) as sup:
        holder["sup"] = sup
        sent = await sup.ref("producer").call([1, 2, 3, 4, 5])
        results = await sup.ref("collector").call("results")
        worker_stats = sup.ref("worker").statistics()
        print(f"sent {sent} items, results: {results}")
        print(f"worker restarts: {worker_stats.restarts}")
    print("pipeline shut down cleanly")


if __name__ == "__main__":
    logging.basicConfig(level=logging.CRITICAL)  # keep the crash traceback out of the demo output
    trio.run(main)
