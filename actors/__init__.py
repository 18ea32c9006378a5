"""A small embeddable actor runtime on trio, with Erlang/OTP-style supervisors.

See docs/actors.md. This package must not import anything from ``motor``.
"""

from ._actor import LATER, Actor, ActorRef, ActorStatistics, DeferredReply
from ._budget import RestartBudget
from ._errors import ActorDead, CallTimeout, DuplicateChild, InboxFull, SupervisorEscalation
from ._supervisor import ChildSpec, Supervisor, open_supervisor

__all__ = [
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
