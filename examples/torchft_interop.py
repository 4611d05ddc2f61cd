"""TorchFT inside meshvisor: the real torchft Manager and Lighthouse, hosted by meshvisor actors.

`examples/replica_training.py` is meshvisor's own TorchFT-style training. This one runs TorchFT
itself (written against torchft 0.2.0, the optional extra ``meshvisor[torchft]``):

- torchft's ``LighthouseServer`` lives in a meshvisor actor on its own proc;
- each of N replicas is a proc mesh of one proc (``this_host().spawn_procs``) whose actor owns
  a torchft ``Manager`` (with torchft's ``ProcessGroupGloo`` and its own ``TCPStore``, as
  torchft requires of a replica group), a small model and an Adam optimizer. Its
  ``train_step`` endpoint is the TorchFT loop by hand: ``start_quorum``, forward and backward on
  a deterministic synthetic batch, ``manager.allreduce`` per gradient (not torchft's DDP
  wrapper, which in 0.2.0 was seen crashing the survivors when a peer died mid-backward), then
  ``optimizer.step()`` only if ``manager.should_commit()``;
- the controller (this script) drives the steps and SIGKILLs a replica's process in the middle
  of chosen steps. The death reaches the controller as a ``SupervisionError`` (an
  ``on_failure`` handler on each replica's proc mesh keeps meshvisor's fail-fast out of it);
  meshvisor re-spawns the proc on the same host agent with ``procs.respawn()``, which rebuilds
  the actor (a fresh Manager), and torchft heals it from a live peer through its own HTTP
  checkpoint transport when it joins a quorum. The survivors train on meanwhile.

At the end every replica must report the same ``manager.current_step()`` and bit-identical
parameters, and every replacement must have committed a step; the exit status is 0 only then.

    pip install -e '.[torch,torchft]'
    python3 examples/torchft_interop.py                  # 3 replicas, 40 steps, 2 kills
    python3 examples/torchft_interop.py --replicas 4 --steps 60 --kills 3 --seed 7
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from mesh import Actor, ActorMesh, Future, ProcMesh, endpoint, this_host
from supervision import ActorError, SupervisionError, SupervisionEvent

#: The torchft version this example was written against.
TORCHFT_VERSION = "0.2.0"

#: torchft's timeouts. A collective whose peer is gone usually fails at once (connection reset)
#: but can also wait for this long: after a death the survivors' gloo rings can desynchronise.
COLLECTIVE_TIMEOUT_S = 3.0
#: Manager RPCs (should_commit), checkpoint transfers, connections.
TORCHFT_TIMEOUT_S = 10.0
QUORUM_TIMEOUT_S = 30.0
#: The lighthouse: a replica is dead to it after this long without a heartbeat (Managers send
#: one every 100 ms), a new quorum waits this long for healthy stragglers, and it re-checks
#: pending quorums at this interval.
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 1000
LIGHTHOUSE_JOIN_TIMEOUT_MS = 2000
LIGHTHOUSE_TICK_MS = 20

#: The controller waits this long for a round (every live replica's step).
ROUND_TIMEOUT_S = 60.0
#: ... and, after the survivors are done, this long for a replacement in its first step: it
#: ends with them if it made their quorum; otherwise it is waiting for the next one.
JOINER_GRACE_S = 0.25
#: A replacement's first step starts this much before the survivors' steps, so that its quorum
#: request usually reaches the lighthouse first (if not, it joins one round later).
JOINER_HEAD_START_S = 0.02


def quiet_torchft() -> None:
    """torchft logs every swallowed collective error with a traceback (a kill makes several),
    and a warning per step about NCCL's flight recorder, which gloo does not have."""
    for name in ("torchft", "torchft_errors", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


class Lighthouse(Actor):
    """torchft's lighthouse (its Rust quorum server), in a meshvisor actor."""

    def __init__(self, min_replicas: int) -> None:
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(
            bind="[::]:0",
            min_replicas=min_replicas,
            join_timeout_ms=LIGHTHOUSE_JOIN_TIMEOUT_MS,
            quorum_tick_ms=LIGHTHOUSE_TICK_MS,
            heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS,
        )

    @endpoint
    def address(self) -> str:
        return self.server.address()

    @endpoint
    def shutdown(self) -> None:
        self.server.shutdown()


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every replica starts from the same weights, hence init_sync=False
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s batch at `step`: synthetic and deterministic."""
    generator = torch.Generator().manual_seed(step * 100_003 + replica)
    inputs = torch.randn(64, 32, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def digest(model: torch.nn.Module) -> str:
    """A hash of the parameters' bytes: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class TorchFTReplica(Actor):
    """One torchft replica group (of one rank): a Manager, a model, an optimizer."""

    def __init__(self, index: int, lighthouse: str, min_replica_size: int, verbose: bool) -> None:
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo

        if not verbose:
            quiet_torchft()
        torch.set_num_threads(1)
        self.index = index
        self.model, self.optimizer = build_model()
        # torchft finds the ranks of a replica group through a TCPStore that the group hosts;
        # with one rank per group, each replica hosts its own.
        self.store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)),
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=min_replica_size,
            replica_id=f"replica_{index}",  # torchft appends a fresh uuid per Manager
            lighthouse_addr=lighthouse,
            store_addr="localhost",
            store_port=self.store.port,
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=TORCHFT_TIMEOUT_S),
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
            connect_timeout=timedelta(seconds=TORCHFT_TIMEOUT_S),
            init_sync=False,
        )

    def _state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def train_step(self) -> tuple[int, bool, float]:
        """One TorchFT step; returns (the Manager's step after it, committed, local loss)."""
        manager = self.manager
        manager.start_quorum()  # asynchronous; a replica behind the others heals in it
        self.optimizer.zero_grad()
        inputs, targets = batch(manager.current_step(), self.index)
        loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
        loss.backward()
        # Average each gradient over the quorum. An error (a peer died) is recorded by the
        # Manager, not raised: should_commit() then says no and the step is discarded.
        works = [manager.allreduce(p.grad) for p in self.model.parameters()]
        for work in works:
            work.wait()
        committed = manager.should_commit()
        if committed:
            self.optimizer.step()
        return manager.current_step(), committed, float(loss.detach())

    @endpoint
    def final_state(self) -> tuple[int, str]:
        return self.manager.current_step(), digest(self.model)

    @endpoint
    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


# -- the controller ------------------------------------------------------------------------------


@dataclass
class Kill:
    round: int
    replica: int
    pid: int
    at: float  # time.monotonic() of the SIGKILL
    detected_at: float | None = None  # the controller's call failed with SupervisionError
    respawned_at: float | None = None  # meshvisor had the new proc up
    committed_at: float | None = None  # the replacement's first committed step came back
    committed_step: int | None = None

    def after(self, t: float | None) -> str:
        return "-" if t is None else f"{t - self.at:.2f} s"


@dataclass
class Replica:
    index: int
    procs: ProcMesh
    actor: ActorMesh[TorchFTReplica]
    pid: Future[int]  # answered once the actor is built
    events: list[SupervisionEvent] = field(default_factory=list)
    call: Future[tuple[int, bool, float]] | None = None  # the train_step in flight
    done_at: float | None = None
    commits: int = 0
    discarded: int = 0
    last: tuple[int, bool, float] | None = None
    joining: Kill | None = None  # killed or re-spawned, first commit still to come
    grace: bool = False  # a replacement whose step may have made this round's quorum

    def issue(self) -> None:
        self.done_at = None
        self.call = self.actor.train_step.call_one()
        self.call.add_done_callback(self._stamp)

    def _stamp(self, _: object) -> None:
        self.done_at = time.monotonic()


def plan_kills(rng: random.Random, steps: int, kills: int) -> list[int]:
    """The rounds at which to kill: spread over the run, away from its ends."""
    if kills <= 0:
        return []
    first, last = 3, max(4, steps - 3)
    span = (last - first) / kills
    return [first + int(span * k + rng.uniform(0, span / 2)) for k in range(kills)]


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    host = this_host()
    started = time.monotonic()

    lighthouse_procs = host.spawn_procs(per_host={"lighthouse": 1}, name="lighthouse")
    lighthouse = lighthouse_procs.spawn("lighthouse", Lighthouse, args.min_replicas)
    replicas: list[Replica] = []
    kills: list[Kill] = []
    rounds = 0
    ok = True
    train_started = time.monotonic()
    try:
        address = lighthouse.address.call_one().get(timeout=60)
        print(f"torchft lighthouse at {address}, in meshvisor proc mesh 'lighthouse'")
        for i in range(args.replicas):
            procs = host.spawn_procs(per_host={"replica": 1}, name=f"replica{i}")
            actor = procs.spawn(
                "trainer", TorchFTReplica, i, address, args.min_replicas, args.verbose
            )
            replica = Replica(i, procs, actor, actor.pid.call_one())
            # Handled: the controller re-spawns it (without a handler, fail-fast would end us).
            procs.on_failure(lambda event, r=replica: r.events.append(event) or True)
            replicas.append(replica)
        pids = [r.pid.get(timeout=60) for r in replicas]
        print(
            f"{args.replicas} torchft replicas up (pids {pids}) "
            f"{time.monotonic() - started:.1f} s after start"
        )
        kill_rounds = plan_kills(rng, args.steps, args.kills)
        deadline = time.monotonic() + args.time_limit
        train_started = time.monotonic()
        while True:
            rounds += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"no consistent finish within {args.time_limit:g} s")
            _issue_round(replicas)
            if kill_rounds and rounds >= kill_rounds[0] and not any(r.joining for r in replicas):
                kill_rounds.pop(0)
                kills.append(_kill(rng, replicas, rounds))
            _wait_round(replicas, rounds)
            if not kill_rounds and _finished(replicas, args.steps):
                break
    except Exception as exc:
        print(f"FAILED in round {rounds}: {exc!r}")
        ok = False
    finally:
        elapsed = time.monotonic() - train_started
        final = _final_states(replicas)
        _stop(replicas, lighthouse, lighthouse_procs)
    return _report(args, replicas, kills, rounds, elapsed, final, ok)


def _issue_round(replicas: list[Replica]) -> None:
    """Start a step on every replica that has none in flight; replacements first."""
    idle = [r for r in replicas if r.call is None]
    first = [r for r in idle if r.joining and r.pid.done()]
    for r in first:
        r.grace = True  # built before the round started: it may make the survivors' quorum
        r.issue()
    if first:
        time.sleep(JOINER_HEAD_START_S)
    for r in idle:
        if r.call is None:
            r.grace = False
            r.issue()


def _kill(rng: random.Random, replicas: list[Replica], rounds: int) -> Kill:
    """SIGKILL a random replica's process in the middle of its step."""
    victim = rng.choice(replicas)
    pid = victim.pid.get(timeout=30)
    time.sleep(rng.uniform(0.0, 0.01))  # a step takes ~10 ms: land anywhere in it
    os.kill(pid, signal.SIGKILL)
    kill = Kill(rounds, victim.index, pid, time.monotonic())
    victim.joining = kill
    print(f"round {rounds}: SIGKILL replica {victim.index} (pid {pid})")
    return kill


def _wait_round(replicas: list[Replica], rounds: int) -> None:
    """Wait until every replica's step is back, handling each answer as it comes. A
    replacement still in its first step is waited for only briefly (`JOINER_GRACE_S`), and only
    if it was built when the round began: otherwise it cannot be in this round's quorum, and
    waiting for it would hold the survivors, whose next quorum it is waiting to join."""
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    grace_until: float | None = None
    while True:
        for r in replicas:
            if r.call is not None and r.call.done():
                _collect(r, rounds)
        if not any(r.call is not None and not r.joining for r in replicas):
            if grace_until is None:
                grace_until = time.monotonic() + JOINER_GRACE_S
            if time.monotonic() > grace_until or not any(
                r.call is not None and r.grace for r in replicas
            ):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {rounds} took longer than {ROUND_TIMEOUT_S:g} s")
        time.sleep(0.001)


def _collect(r: Replica, rounds: int) -> None:
    """Take in `r`'s finished step: a result, a torchft error, or the death of its proc."""
    assert r.call is not None
    call, done_at, r.call = r.call, r.done_at or time.monotonic(), None
    try:
        step, committed, loss = call.get(timeout=5)
    except SupervisionError as err:
        # The proc died (our SIGKILL): meshvisor re-spawns it on the same host agent and
        # rebuilds its actor from the same constructor arguments, with a fresh torchft Manager.
        kill = r.joining
        event = err.event
        print(f"round {rounds}: replica {r.index} lost: {event.kind} {event.signal or ''}")
        r.procs.respawn().get(timeout=60)
        r.pid = r.actor.pid.call_one()
        if kill is not None:
            kill.detected_at, kill.respawned_at = done_at, time.monotonic()
        return
    except ActorError as err:  # torchft raised (a quorum timeout, say): the actor lives on
        print(f"round {rounds}: replica {r.index}'s step raised {err.exception_type}: {err}")
        r.discarded += 1
        return
    r.last = (step, committed, loss)
    if not committed:
        r.discarded += 1
        return
    r.commits += 1
    kill, r.joining = r.joining, None
    if kill is not None:
        kill.committed_at, kill.committed_step = done_at, step
        print(
            f"round {rounds}: replica {r.index}'s replacement committed step {step}, "
            f"{done_at - kill.at:.2f} s after the kill"
        )


def _finished(replicas: list[Replica], steps: int) -> bool:
    """Did every replica commit this round, all at the same step, at least `steps`?"""
    if any(r.call is not None or r.joining or r.last is None for r in replicas):
        return False
    lasts = [r.last for r in replicas if r.last is not None]
    reached = {step for step, _, _ in lasts}
    return all(committed for _, committed, _ in lasts) and len(reached) == 1 and (
        reached.pop() >= steps
    )


def _final_states(replicas: list[Replica]) -> list[tuple[int, str] | None]:
    out: list[tuple[int, str] | None] = []
    for r in replicas:
        try:
            if r.call is not None:
                r.call.get(timeout=ROUND_TIMEOUT_S)
            out.append(r.actor.final_state.call_one().get(timeout=30))
        except Exception as exc:
            print(f"replica {r.index}: no final state ({exc!r})")
            out.append(None)
    return out


def _stop(replicas: list[Replica], lighthouse: ActorMesh[Lighthouse], procs: ProcMesh) -> None:
    """Shut torchft down in every replica and the lighthouse, then stop all the procs."""
    for r in replicas:
        try:
            r.actor.shutdown.call_one().get(timeout=10)
        except Exception as exc:
            print(f"replica {r.index}: torchft shutdown failed ({exc!r})")
    for mesh in [r.procs for r in replicas]:
        try:
            mesh.stop().get(timeout=30)
        except Exception as exc:
            print(f"{mesh}: stop failed ({exc!r})")
    try:
        lighthouse.shutdown.call_one().get(timeout=10)
    except Exception as exc:
        print(f"lighthouse: shutdown failed ({exc!r})")
    procs.stop().get(timeout=30)


def _report(
    args: argparse.Namespace,
    replicas: list[Replica],
    kills: list[Kill],
    rounds: int,
    elapsed: float,
    final: list[tuple[int, str] | None],
    ok: bool,
) -> int:
    from importlib.metadata import version

    print("\nSummary")
    print(f"  torchft: {version('torchft')} (written against {TORCHFT_VERSION})")
    print(f"  rounds: {rounds} in {elapsed:.1f} s")
    for r in replicas:
        print(f"  replica {r.index}: {r.commits} commits, {r.discarded} steps not committed")
    print(f"  kills: {len(kills)}")
    for k in kills:
        print(
            f"    round {k.round}, replica {k.replica} (pid {k.pid}): failure seen "
            f"{k.after(k.detected_at)}, re-spawned {k.after(k.respawned_at)}, replacement's "
            f"first commit {k.after(k.committed_at)} (step {k.committed_step}) after the kill"
        )
    recovered = [k.committed_at - k.at for k in kills if k.committed_at is not None]
    print(
        f"  kill -> replacement's first commit: {', '.join(f'{t:.2f} s' for t in recovered)}"
        f" (recovered {len(recovered)}/{len(kills)})"
    )
    states = [s for s in final if s is not None]
    consistent = len(states) == len(final) and len(set(states)) == 1
    print(f"  final manager steps: {[s[0] if s else None for s in final]}")
    print(f"  final parameter digests: {[s[1] if s else None for s in final]}")
    print(f"  same step and identical parameters: {'yes' if consistent else 'NO'}")
    ok = ok and consistent and len(recovered) == len(kills) == args.kills
    print(f"RESULT {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="train until this step")
    parser.add_argument("--kills", type=int, default=2, help="replicas to SIGKILL, one at a time")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument(
        "--min-replicas", type=int, default=2, help="torchft's min_replica_size (and lighthouse's)"
    )
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds of training")
    parser.add_argument("--verbose", action="store_true", help="show torchft's own logs")
    args = parser.parse_args(argv)
    if not 1 <= args.min_replicas < args.replicas:
        parser.error("need 1 <= --min-replicas < --replicas (the survivors of a kill go on)")
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("this example needs torchft: pip install 'meshvisor[torchft]'", file=sys.stderr)
        return 2
    if not args.verbose:
        quiet_torchft()
    # The fork server imports these once, before it forks any proc, so that a replacement
    # replica starts in milliseconds, not a second and a half (torch.optim imports
    # torch._dynamo on first use). torchft's Rust logger is set up there too, from RUST_LOG.
    os.environ.setdefault("MESHVISOR_PRELOAD", "torch,torch._dynamo,torchft")
    if not args.verbose:
        os.environ.setdefault("RUST_LOG", "warn")  # not a line per quorum and per commit
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
