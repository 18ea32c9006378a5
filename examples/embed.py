"""Embedding motor: the same actors `motor serve` runs, driven from Python.

Run: python examples/embed.py   (uses a temporary state dir; isolation "none")
docs/embedding.md walks through it; tests/test_examples.py runs it.
"""

import sys
import tempfile

import trio

import motor


async def main() -> int:
    with tempfile.TemporaryDirectory() as state:
        config = motor.RunnerConfig(state_dir=state, max_weight=2, isolation="none",
                                    free_space_floor_bytes=0)
        async with motor.open_runner(config) as runner:
            job = await runner.submit(motor.JobRequest(
                command=["sh", "-c", "echo built $MOTOR_VCPUS vCPUs"], workspace="app",
                weight_hint=1))
            async for event in runner.events(job.job_id):
                if event.__struct_config__.tag == "output":
                    print(event.data, end="")
                elif event.__struct_config__.tag == "terminal":
                    print("state:", event.record["state"], "exit:", event.record["exit_code"])
            record = await runner.get(job.job_id)
            print("recorded:", record.state, "on cpus", record.cpus)
            try:  # a claim above max_weight can never run: refused at once
                await runner.submit(motor.JobRequest(command=["make"], weight_hint=8))
            except motor.RefusedError as exc:
                print("refused:", exc.refusal.code)
            health = await runner.health()
            print("held permits after the job:", health["capacity"]["held_permits"])
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
