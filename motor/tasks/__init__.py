"""The task client (`motor task ...`): task turns spread over a fleet of motor runners with
a bounded number of runner processes (seed 000, runner slot reservation).  See docs/tasks.md.

- `motor.tasks.records`: the durable records (QueueEntry, RunnerSlotReservation, ...).
- `motor.tasks.core`: the pure queue decisions (occupancy, reserve/bind/complete/release, FIFO).
- `motor.tasks.rules`: the pure turn rules (route, candidates, reconcile's plan, cancel, outcome).
- `motor.tasks.sections`: the QueueLock critical-section bodies (rules applied, writes in order).
- `motor.tasks.store`, `context`, `host`, `remote`: I/O (client dir and flock; saved project
  context; processes, bundle, turn files; worker HTTP).
- `motor.tasks.queue`, `client`, `turn`, `detached`: the shells (QueueActor, TaskClient, the
  TurnRunner actor, hosting it).
"""
