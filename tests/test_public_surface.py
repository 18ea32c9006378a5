"""The public surface of `actors` and `motor`, pinned (after httpx's
tests/test_exported_members.py): a name added to or dropped from `__all__` is a
decision, made here too, not an accident of an import."""

from __future__ import annotations

import actors
import motor

ACTORS_ALL = [
    "Actor",
    "ActorDead",
    "ActorRef",
    "ActorStatistics",
    "CallTimeout",
    "ChildSpec",
    "DeferredReply",
    "DuplicateChild",
    "InboxFull",
    "LATER",
    "RestartBudget",
    "Supervisor",
    "SupervisorEscalation",
    "open_supervisor",
]

MOTOR_ALL = [
    "ConfigError",
    "JobRecord",
    "JobRequest",
    "MockWallClock",
    "Refusal",
    "RefusedError",
    "Runner",
    "RunnerConfig",
    "StartupError",
    "WallClock",
    "open_runner",
]


def test_actors_all_is_pinned():
    assert sorted(actors.__all__) == actors.__all__ == ACTORS_ALL
    for name in ACTORS_ALL:
        member = getattr(actors, name)
        # defined in a private module of the package, exported here
        assert member.__module__.startswith("actors._"), (name, member.__module__)


def test_actors_exports_nothing_outside_all():
    # its implementation modules are private (_actor, _supervisor...): every public name of
    # the package is in __all__
    public = [m for m in dir(actors) if not m.startswith("_")]
    assert public == ACTORS_ALL


def test_motor_all_is_pinned_and_every_name_resolves():
    assert sorted(motor.__all__) == motor.__all__ == MOTOR_ALL
    for name in MOTOR_ALL:
        member = getattr(motor, name)  # resolves (eagerly imported or loaded on first use)
        assert member.__module__.startswith("motor."), (name, member.__module__)
        assert member.__name__ == name
