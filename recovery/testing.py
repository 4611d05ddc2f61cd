"""Helpers for testing replica recovery without processes (as `mesh.testing` is for meshes).

`LoopRounds` is the decision logic of a `LoopGroup` (quorum, heals, votes) on its own: a test
drives it with the loop messages of `loop_wire` (`AskQuorum`, `Healed`, `Vote`, and the answers
`HealFrom`, `Go`, `Retry`, `Finished`, `Decision`) as real loops would, and checks its answers.
`flatten_gradients` and `use_average` are the gradient arithmetic of `Manager`'s exchange;
`digest_part` and `combine_digest` split a parameter digest over replicas and join the shares.
`form_groups` is a replica's side of forming standing groups; `AbortNotices` and `AbortWatch`
mark and read the abort notices of process groups in a store; `QuorumKeys` deletes the keys of
the quorums no one needs any more; `abort_key` and `quorum_prefix` name those keys.
`StoreServer` and `StoreClient` are a replica group's key-value store (served by its controller)
and a connection to it, a `torch.distributed.Store`.
`open_group` and `wait_unless_aborted` are a replica's waits in gloo (its rendezvous, its
collectives), for tests that leave them in flight. `Prefault` populates a heal's target memory
ahead of the copy (`PREFAULT_STRIDE_BYTES` at a time).
"""

from __future__ import annotations

from . import _loop_protocol as loop_wire
from ._aborts import AbortNotices, AbortWatch, QuorumKeys, abort_key, quorum_prefix
from ._arithmetic import combine_digest, digest_part, flatten_gradients, use_average
from ._exchange import form_groups, open_group, wait_unless_aborted
from ._loop_rounds import Rounds as LoopRounds
from ._prefault import STRIDE_BYTES as PREFAULT_STRIDE_BYTES
from ._prefault import Prefault
from ._store_client import StoreClient
from ._store_server import StoreServer

__all__ = (
    "PREFAULT_STRIDE_BYTES",
    "AbortNotices",
    "AbortWatch",
    "LoopRounds",
    "Prefault",
    "QuorumKeys",
    "StoreClient",
    "StoreServer",
    "abort_key",
    "combine_digest",
    "digest_part",
    "flatten_gradients",
    "form_groups",
    "loop_wire",
    "open_group",
    "quorum_prefix",
    "use_average",
    "wait_unless_aborted",
)
