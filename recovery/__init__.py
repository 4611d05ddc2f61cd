"""TorchFT-style replica recovery on a persistent allocation (needs torch).

`ReplicaGroup` trains N data-parallel replicas, each a proc mesh holding a `Replica` actor;
a replica that dies is re-spawned in place, heals from a live peer and rejoins, or a hot spare
takes its place (`spares=K`). A training loop of your own gets the same from `Manager` inside
it and `LoopGroup` to launch it. Built only on the public `mesh` API.
"""

from ._arithmetic import digest as parameter_digest
from ._exchange import average as fixed_order_average
from ._exchange import bucket_bounds as bucket_bounds
from ._exchange import exchange_average as exchange_average
from ._exchange import segment_bounds as segment_bounds
from ._follow import Takeover as Takeover
from ._follow import UpdateLog as UpdateLog
from ._group import ReplicaGroup as ReplicaGroup
from ._heal import HealReport as HealReport
from ._loop_group import LoopGroup as LoopGroup
from ._loop_manager import Manager as Manager
from ._members import TENSOR_MALLOC as TENSOR_MALLOC
from ._outcomes import ExchangeAborted as ExchangeAborted
from ._outcomes import Recovery as Recovery
from ._outcomes import ReplicaGroupError as ReplicaGroupError
from ._outcomes import StepOutcome as StepOutcome
from ._replay import replay_training as replay_training
from ._replica import Replica as Replica

__all__ = (
    "TENSOR_MALLOC",
    "ExchangeAborted",
    "HealReport",
    "LoopGroup",
    "Manager",
    "Recovery",
    "Replica",
    "ReplicaGroup",
    "ReplicaGroupError",
    "StepOutcome",
    "Takeover",
    "UpdateLog",
    "bucket_bounds",
    "exchange_average",
    "fixed_order_average",
    "parameter_digest",
    "replay_training",
    "segment_bounds",
)
