"""The task client (`motor task ...`): task turns spread over a fleet of motor runners with
a bounded number of runner processes (seed 000, runner slot reservation).  See docs/tasks.md.

- `motor.tasks.records`: the durable records (QueueEntry, RunnerSlotReservation, ...).
- `motor.tasks.core`: the pure decisions (occupancy, reserve/bind/complete/release, FIFO).
- `motor.tasks.store`: the client dir and the QueueLock (fcntl) critical section.
- `motor.tasks.actor`: the queue actor, TaskClient operations and the TurnRunner actor.
"""
