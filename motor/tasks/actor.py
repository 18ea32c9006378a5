"""The task client's shells, by their former single home (kept so `from motor.tasks.actor
import ...` keeps working).  The code lives in one module per part (docs/tasks.md):

- `motor.tasks.queue`: the QueueActor (the one serializing owner of the queue) and its handle;
- `motor.tasks.client`: TaskClient (submit, turn, start, reconcile, cancel);
- `motor.tasks.turn`: the TurnRunner actor; `motor.tasks.detached`: hosting it (run_turn,
  the detached runner's loop);
- `motor.tasks.sections`: the bodies of the QueueLock critical sections;
- `motor.tasks.rules` and `motor.tasks.core`: the pure decisions;
- `motor.tasks.host` (processes, bundle, turn files) and `motor.tasks.remote` (worker HTTP).
"""

from motor.tasks.client import StartResult, TaskClient
from motor.tasks.detached import detached_runner, host_turn, retire, run_turn, start_next_parked, take_over_reserved_slot
from motor.tasks.host import make_bundle, real_spawner, resolve_project
from motor.tasks.queue import QueueActor, QueueHandle, open_queue
from motor.tasks.remote import probe_health
from motor.tasks.sections import (
    Claimed,
    claim_locked,
    complete_locked,
    next_parked_locked,
    reconcile_plan,
    take_over_locked,
    task_facts,
)
from motor.tasks.turn import TurnRunner

__all__ = ["QueueActor", "QueueHandle", "open_queue", "TaskClient", "TurnRunner", "StartResult",
           "run_turn", "detached_runner", "start_next_parked", "take_over_reserved_slot", "real_spawner",
           "make_bundle", "probe_health", "retire", "complete_locked", "take_over_locked",
           "reconcile_plan", "next_parked_locked", "claim_locked", "task_facts", "Claimed", "host_turn",
           "resolve_project"]
