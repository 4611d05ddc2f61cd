"""TorchFT inside meshvisor: the real torchft Manager and Lighthouse, hosted by meshvisor actors.

`meshvisor/_demo.py` (`meshvisor demo`) is meshvisor's own TorchFT-style training. This one
runs TorchFT itself (written against torchft 0.2.0, the optional extra ``meshvisor[torchft]``):

- torchft's ``LighthouseServer`` lives in a meshvisor actor on its own proc;
- each of N replicas is a proc mesh of one proc (``this_host().spawn_procs``) whose actor owns
  a torchft ``Manager`` (with torchft's ``ProcessGroupGloo`` and its own ``TCPStore``, as
  torchft requires of a replica group), a small model and an Adam optimizer. Its
  ``train_step`` endpoint is the TorchFT loop by hand: ``start_quorum``, forward and backward on
  a deterministic synthetic batch, ``manager.allreduce`` per gradient (not torchft's DDP
  wrapper, which in 0.2.0 was seen crashing the survivors when a peer died mid-backward), then
  ``optimizer.step()`` only if ``manager.should_commit()``;
- the controller (this script) drives the steps: every replica always has a ``train_step``
  call in flight (the next one goes out as soon as the last one is back; torchft's quorums
  keep the replicas in step). It SIGKILLs a replica's process in the middle of chosen steps.
  The death reaches the controller as a ``SupervisionError`` (an ``on_failure`` handler on
  each replica's proc mesh keeps meshvisor's fail-fast out of it); meshvisor re-spawns the proc
  on the same host agent with ``procs.respawn()``, which rebuilds the actor (a fresh Manager),
  and torchft heals it from a live peer through its own HTTP checkpoint transport when it joins
  a quorum. The survivors train on meanwhile.

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
from mesh.testing import exit_process
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

#: The controller's limit on any one train_step (a quorum can take QUORUM_TIMEOUT_S).
STEP_TIMEOUT_S = 60.0
#: When every replica but some laggards has reached the target step and the laggards' steps
#: have not come back for this long, they are waiting for a quorum: the others take a step more.
LAGGARD_WAIT_S = 0.1


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

    def __init__(
        self,
        index: int,
        lighthouse: str,
        min_replica_size: int,
        compute_s: float = 0.0,
        verbose: bool = False,
    ) -> None:
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo

        if not verbose:
            quiet_torchft()
        torch.set_num_threads(1)
        self.index, self.compute_s = index, compute_s
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
        time.sleep(self.compute_s)  # a real model's backward takes a while: kills land in it
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
class Outage:
    """A replica's process lost: by our SIGKILL, or restarted after torchft raised."""

    cause: str
    step: int  # the furthest committed step when it happened
    replica: int
    at: float  # time.monotonic() of the SIGKILL, or of the error
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
    issued_at: float = 0.0
    done_at: float | None = None
    steps: int = 0
    commits: int = 0
    last: tuple[int, bool, float] | None = None  # (step, committed, loss) of the last step
    outage: Outage | None = None  # down, or back but its first commit is still to come

    def issue(self) -> None:
        self.issued_at, self.done_at = time.monotonic(), None
        self.call = self.actor.train_step.call_one()
        self.call.add_done_callback(self._stamp)

    def _stamp(self, _: object) -> None:
        self.done_at = time.monotonic()

    def on_failure(self, event: SupervisionEvent) -> bool:
        """The proc mesh's failure handler: handled (we re-spawn it), so no fail-fast."""
        self.events.append(event)
        return True

    def at(self, target: int) -> bool:
        """Has it committed `target` (and is it not recovering)?"""
        return self.outage is None and self.last is not None and self.last[:2] == (target, True)


def plan_kills(rng: random.Random, steps: int, kills: int) -> list[int]:
    """The steps after which to kill: spread over the run, away from its ends."""
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
    outages: list[Outage] = []
    target = args.steps
    ok = True
    train_started = time.monotonic()
    try:
        address = lighthouse.address.call_one().get(timeout=60)
        print(f"torchft lighthouse at {address}, in meshvisor proc mesh 'lighthouse'")
        for i in range(args.replicas):
            procs = host.spawn_procs(per_host={"replica": 1}, name=f"replica{i}")
            actor = procs.spawn(
                "trainer",
                TorchFTReplica,
                i,
                address,
                args.min_replicas,
                compute_s=args.compute_ms / 1000,
                verbose=args.verbose,
            )
            replica = Replica(i, procs, actor, actor.pid.call_one())
            procs.on_failure(replica.on_failure)
            replicas.append(replica)
        pids = [r.pid.get(timeout=60) for r in replicas]
        print(
            f"{args.replicas} torchft replicas up (pids {pids}) "
            f"{time.monotonic() - started:.1f} s after start"
        )
        kill_steps = plan_kills(rng, args.steps, args.kills)
        deadline = time.monotonic() + args.time_limit
        train_started = time.monotonic()
        while True:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no consistent finish within {args.time_limit:g} s")
            for r in replicas:
                if r.call is not None and r.call.done():
                    _collect(r, outages)
                elif r.call is not None and now - r.issued_at > STEP_TIMEOUT_S:
                    raise TimeoutError(f"replica {r.index}'s step took over {STEP_TIMEOUT_S:g} s")
            reached = max((r.last[0] for r in replicas if r.last and r.last[1]), default=0)
            for r in replicas:  # the next step, for every replica short of the target
                if r.call is None and not r.at(target):
                    r.issue()
            if (
                kill_steps
                and reached >= kill_steps[0]
                and all(r.call is not None and not r.outage for r in replicas)
            ):  # every replica has just been sent its step: kill one in the middle of it
                kill_steps.pop(0)
                outages.append(_kill(rng, replicas, reached, args.compute_ms / 1000))
            busy = [r for r in replicas if r.call is not None]
            if not busy and not kill_steps:
                break  # all committed `target`
            if not busy:  # the target came before the kills did: train on
                target += 1
            elif len(busy) < len(replicas) and _stalled(busy, now):
                # The others are at the target; the laggards' steps wait for a quorum (a
                # replacement's first, say): one step more for everybody.
                target += 1
            time.sleep(0.001)
    except Exception as exc:
        print(f"FAILED: {exc!r}")
        ok = False
    finally:
        elapsed = time.monotonic() - train_started
        final = _final_states(replicas)
        _stop(replicas, lighthouse, lighthouse_procs)
    return _report(args, replicas, outages, target, elapsed, final, ok)


def _stalled(busy: list[Replica], now: float) -> bool:
    return all(now - r.issued_at > LAGGARD_WAIT_S for r in busy)


def _kill(rng: random.Random, replicas: list[Replica], reached: int, compute_s: float) -> Outage:
    """SIGKILL a random replica's process, in the middle of the step it was just sent."""
    victim = rng.choice(replicas)
    pid = victim.pid.get(timeout=30)
    # The step's quorum takes a few ms; then comes the backward pass, in which a peer's death
    # used to take the survivors down with torchft's DDP wrapper.
    time.sleep(rng.uniform(0.005, 0.005 + compute_s))
    os.kill(pid, signal.SIGKILL)
    victim.outage = Outage(f"SIGKILL (pid {pid})", reached, victim.index, time.monotonic())
    print(f"step {reached}: SIGKILL replica {victim.index} (pid {pid})")
    return victim.outage


def _collect(r: Replica, outages: list[Outage]) -> None:
    """Take in `r`'s finished step: a result, a torchft error, or the death of its proc."""
    assert r.call is not None
    call, done_at, r.call = r.call, r.done_at or time.monotonic(), None
    r.steps += 1
    try:
        step, committed, loss = call.get(timeout=5)
    except SupervisionError as err:
        # The proc died: meshvisor re-spawns it on the same host agent and rebuilds its actor
        # from the same constructor arguments, with a fresh torchft Manager.
        event = err.event
        print(f"replica {r.index} lost: {event.kind} {event.signal or event.exit_code}")
        if r.outage is None:  # not one of ours
            r.outage = Outage(f"unexpected {event.kind}", _reached(r), r.index, done_at)
            outages.append(r.outage)
        r.procs.respawn().get(timeout=60)
        r.pid = r.actor.pid.call_one()
        r.outage.detected_at, r.outage.respawned_at = done_at, time.monotonic()
        return
    except ActorError as err:
        # torchft raised out of the step (a quorum RPC timed out, say). A torchft 0.2.0 Manager
        # does not come back from that: each later start_quorum() raises the same error again.
        # Let it crash: the proc exits, meshvisor reports it, and we re-spawn it as above.
        print(f"replica {r.index}'s step raised {err.exception_type}: {err}")
        if r.outage is None:
            r.outage = Outage(f"torchft raised {err.exception_type}", _reached(r), r.index, done_at)
            outages.append(r.outage)
        exit_process(r.actor, 1)
        return
    r.last = (step, committed, loss)
    if not committed:
        return
    r.commits += 1
    outage = r.outage
    if outage is not None and outage.respawned_at is not None:  # not a step that beat the kill
        r.outage = None
        outage.committed_at, outage.committed_step = done_at, step
        print(
            f"replica {r.index}'s replacement committed step {step}, "
            f"{done_at - outage.at:.2f} s after the {outage.cause.split()[0]}"
        )


def _reached(r: Replica) -> int:
    return r.last[0] if r.last else 0


def _final_states(replicas: list[Replica]) -> list[tuple[int, str] | None]:
    out: list[tuple[int, str] | None] = []
    for r in replicas:
        try:
            if r.call is not None:  # only after a failure
                r.call.get(timeout=QUORUM_TIMEOUT_S)
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
    outages: list[Outage],
    target: int,
    elapsed: float,
    final: list[tuple[int, str] | None],
    ok: bool,
) -> int:
    from importlib.metadata import version

    kills = [o for o in outages if o.cause.startswith("SIGKILL")]
    others = [o for o in outages if o not in kills]
    print("\nSummary")
    print(f"  torchft: {version('torchft')} (written against {TORCHFT_VERSION})")
    print(f"  trained to step {target} (asked: {args.steps}) in {elapsed:.1f} s")
    for r in replicas:
        print(f"  replica {r.index}: {r.steps} train_step calls, {r.commits} committed")
    events = [f"{e.kind} ({e.signal or e.exit_code})" for r in replicas for e in r.events]
    print(f"  supervision events handled: {len(events)}: {', '.join(events) or '-'}")
    print(f"  kills: {len(kills)}, other restarts: {len(others)}")
    for o in outages:
        print(
            f"    at step {o.step}, replica {o.replica}, {o.cause}: failure seen "
            f"{o.after(o.detected_at)}, re-spawned {o.after(o.respawned_at)}, replacement's "
            f"first commit {o.after(o.committed_at)} (step {o.committed_step}) after it"
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
    parser.add_argument(
        "--compute-ms", type=float, default=20.0, help="extra time per backward pass (ms)"
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
    # replica starts in milliseconds, not in a second (torch.optim imports
    # torch._dynamo on first use). torchft's Rust logger is set up there too, from RUST_LOG.
    os.environ.setdefault("MESHVISOR_PRELOAD", "torch,torch._dynamo,torchft")
    if not args.verbose:
        os.environ.setdefault("RUST_LOG", "warn")  # not a line per quorum and per commit
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
