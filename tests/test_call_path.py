"""Every call ends, whatever breaks on its way: a result too large or too deep to send, an
exception that cannot describe itself, a malformed address, a call from a forked child, or
running out of file descriptors (reply inboxes of ended threads are released) all give an error
that names why, never a hang or an abort."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import textwrap
import threading
from typing import Any

import actors
import failing_actors as fa
import pytest
from conftest import RUN_BASE
from polling import wait_gone, wait_until
from test_mesh import run_client_script

import mesh.testing
import transport
from mesh import ProcMesh
from mesh.testing import wire
from supervision import ActorError
from transport import Outbox, Payload, SerializationError, TransportError, encode

T = 30  # seconds: the bound on every wait in this module (never reached when things work)


# -- the reply path ------------------------------------------------------------------------------

OVERSIZED_REPLY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import failing_actors as fa
    import mesh.testing
    from mesh import this_host
    from supervision import ActorError
    from transport import MessageTooLarge

    procs = this_host().spawn_procs(per_host={{"gpus": 1}})
    actor = procs.spawn("bad", fa.BadReplies)
    try:
        actor.sized.call_one(100_000).get(timeout=30)
        print("RESULT no error", flush=True)
    except ActorError as exc:
        print("RESULT", isinstance(exc, MessageTooLarge), exc, flush=True)
    except TimeoutError:
        print("RESULT timeout", flush=True)
    print("AFTER", actor.sized.call_one(10).get(timeout=30), flush=True)
    mesh.testing.shutdown()
""")


def test_a_result_over_the_size_limit_fails_the_call_with_size_and_limit(tmp_path: Any) -> None:
    result = run_client_script(
        tmp_path, OVERSIZED_REPLY_SCRIPT, MESHVISOR_MAX_MESSAGE_BYTES="65536"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT"))
    assert line.startswith("RESULT True "), line
    assert "'sized'" in line and "65536" in line and "MESHVISOR_MAX_MESSAGE_BYTES" in line, line
    assert re.search(r"message of 1000\d\d bytes exceeds the limit of 65536", line), line
    assert "AFTER b'xxxxxxxxxx'" in result.stdout, result.stdout


def test_a_result_too_deep_to_serialize_fails_the_call(procs: ProcMesh) -> None:
    actor = procs.spawn("bad", fa.BadReplies)
    with pytest.raises(ActorError) as info:
        actor.slice(gpus=0).nested.call_one(100_000).get(timeout=T)
    assert isinstance(info.value, SerializationError)
    assert "could not be serialized" in str(info.value), str(info.value)
    assert "recursion" in str(info.value).lower(), str(info.value)
    assert actor.ping.call().get(timeout=T).values() == (0, 1)


def test_an_exception_whose_str_raises_reaches_the_caller(procs: ProcMesh) -> None:
    actor = procs.spawn("bad", fa.BadReplies)
    with pytest.raises(ActorError) as info:
        actor.slice(gpus=1).raise_unprintable.call_one().get(timeout=T)
    assert isinstance(info.value, fa.UnprintableError)
    assert "UnprintableError" in str(info.value)
    assert "str() failed" in str(info.value) and "RuntimeError" in str(info.value)
    assert actor.ping.call().get(timeout=T).values() == (0, 1)


# -- malformed addresses -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", [12345, None, b"ipc:///tmp/x", "no-scheme", ""])
def test_an_invalid_address_is_refused_without_leaking_a_socket(address: Any) -> None:
    """An address that is not a zmq endpoint string raises TransportError naming it, and
    leaves no socket behind: the context still terminates (a leaked socket hangs term())."""
    context = transport.new_context()
    outbox = Outbox(context)
    try:
        with pytest.raises(TransportError, match="cannot send to"):
            outbox.send(address, encode(wire.CallActor(1, None, "a", "e", (), (), 0)))
    finally:
        outbox.close(linger_ms=0)
    terminated = threading.Thread(target=transport.close_context, args=(context,), daemon=True)
    terminated.start()
    terminated.join(T)
    assert not terminated.is_alive(), "zmq context.term() hangs: a socket was leaked"


def test_a_call_with_a_non_string_reply_address_leaves_the_proc_working(
    make_procs: Any, no_failure_reaches_the_root: None
) -> None:
    """A malformed call (reply_to is an int) to an async endpoint must not break the proc:
    it answers the next message from the same sender, and later stops gracefully (before,
    the error left a socket open and the proc hung at exit, in zmq's context.term())."""
    procs = make_procs({"gpus": 1})
    pid, address, actor_id = procs.spawn("target", actors.Exposed).reach.call_one().get(T)
    folder = tempfile.mkdtemp(prefix="raw-", dir=RUN_BASE)  # removed with it, even on failure
    context = transport.new_context()
    inbox = transport.Inbox(context, f"ipc://{folder}/inbox")
    outbox = Outbox(context)
    try:
        for reply_to in (12345, inbox.address):  # FIFO: the bad call is handled first
            header = wire.CallActor(1, reply_to, actor_id, "aping", ("gpus",), (1,), 0)
            outbox.send(address, encode(header, Payload.dump(((), {}))))
        assert inbox.poll(T * 1000), "the proc did not answer after the malformed call"
        reply = inbox.receive_nowait()
        assert reply is not None and reply.payload is not None and reply.payload.load() == 0
    finally:
        outbox.close(linger_ms=0)
        inbox.close()
        transport.close_context(context)
        shutil.rmtree(folder, ignore_errors=True)
    procs.stop(grace_s=120.0)  # graceful, long before the agent would SIGKILL it
    wait_gone([pid], timeout=60)


AGENT_SCRIPT = textwrap.dedent("""
    import subprocess, sys, zmq
    import mesh.testing
    from mesh import this_host
    from mesh.testing import wire
    from transport import encode

    this_host()
    agent = mesh.testing.local_agent()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 5000)
    raw.connect(agent.address)
    raw.send_multipart(encode(wire.StopProcs(("nobody",), 0.0, 12345)))  # reply_to is no address
    raw.send_multipart(encode(wire.ShutdownAgent(5.0)))
    try:
        print("AGENT EXIT", agent.process.wait(30), flush=True)
    except subprocess.TimeoutExpired:
        print("AGENT HANGS", flush=True)
        agent.process.kill()
        agent.process.wait()
    raw.close()
    mesh.testing.shutdown()
""")


def test_an_agent_survives_a_non_string_reply_address(tmp_path: Any) -> None:
    """The agent logs the bad address, serves the next request and exits cleanly."""
    result = run_client_script(tmp_path, AGENT_SCRIPT)
    assert "AGENT EXIT 0" in result.stdout, result.stdout + result.stderr
    assert "message_rejected" in result.stderr and "reply_to" in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr


# -- forked children ---------------------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent("""
    import os, sys, time, warnings
    sys.path.insert(0, {tests!r})
    import failing_actors as fa
    import mesh.testing
    from mesh import this_host

    procs = this_host().spawn_procs(per_host={{"gpus": 1}})
    actor = procs.spawn("target", fa.Fragile)
    print("PARENT", actor.ping.call_one().get(timeout=30), flush=True)
    pending = actor.park.call_one(1.0)  # made before the fork, awaited in the child
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
    child = os.fork()
    if child == 0:
        for name, attempt in [
            ("call", lambda: actor.ping.call_one().get(timeout=5)),
            ("get", lambda: pending.get(timeout=5)),
            ("this_host", this_host),
        ]:
            try:
                attempt()
                print("CHILD", name, "no error", flush=True)
            except RuntimeError as exc:
                print("CHILD", name, "RuntimeError", exc, flush=True)
            except BaseException as exc:
                print("CHILD", name, "other", type(exc).__name__, exc, flush=True)
        sys.exit(0)  # runs atexit handlers: they must leave the parent's session alone
    deadline = time.monotonic() + 20
    while os.waitpid(child, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            print("CHILD HUNG", flush=True)
            os.kill(child, 9)
            os.waitpid(child, 0)
            break
        time.sleep(0.05)
    print("PENDING", pending.get(timeout=30), flush=True)
    print("PARENT AGAIN", actor.ping.call_one().get(timeout=30), flush=True)
    mesh.testing.shutdown()
""")


def test_a_forked_child_of_the_client_gets_a_clear_error(tmp_path: Any) -> None:
    """A forked child cannot use its parent's meshvisor: every use raises RuntimeError at
    once, naming both pids; and the child's exit leaves the parent's session working."""
    result = run_client_script(tmp_path, FORK_SCRIPT)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "CHILD HUNG" not in out, out + result.stderr
    lines = [line for line in out.splitlines() if line.startswith("CHILD ")]
    assert [line.split()[1:3] for line in lines] == [
        ["call", "RuntimeError"],
        ["get", "RuntimeError"],
        ["this_host", "RuntimeError"],
    ], out
    assert all("forked child" in line and "spawn" in line for line in lines), out
    assert "PENDING 0" in out and "PARENT AGAIN 0" in out, out


# -- reply inboxes of threads ------------------------------------------------------------------


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _reply_socket_files() -> list[str]:
    rundir = mesh.testing.run_dir()
    return [name for name in os.listdir(rundir) if re.fullmatch(r".*-r\d+", name)]


def test_reply_inboxes_of_finished_threads_are_released(make_procs: Any) -> None:
    """Each thread that makes calls gets a reply inbox; once the thread ends, its inbox, its
    socket file and the procs' connections to it go too (300 threads must not cost ~1,200
    descriptors in the client, and ~600 in the proc they called)."""
    actor = make_procs({"gpus": 1}).spawn("target", fa.BadReplies)
    pid = actor.pid.call_one().get(timeout=T)
    errors: list[BaseException] = []

    def one_call() -> None:
        try:
            actor.ping.call_one().get(timeout=T)
        except BaseException as exc:
            errors.append(exc)

    def in_threads(count: int, at_once: int) -> None:
        for _ in range(count // at_once):
            threads = [threading.Thread(target=one_call) for _ in range(at_once)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(T)

    in_threads(10, 10)  # warm up: the connections every call needs exist from now on
    wait_until(lambda: len(_reply_socket_files()) <= 1, what="the warm-up inboxes to go")
    client_fds, proc_fds = _open_fds(os.getpid()), _open_fds(pid)
    in_threads(300, 10)
    assert not errors, errors
    wait_until(
        lambda: _open_fds(os.getpid()) < client_fds + 40 and _open_fds(pid) < proc_fds + 40,
        what=f"descriptors to be released (client {_open_fds(os.getpid())} of {client_fds} "
        f"before, proc {_open_fds(pid)} of {proc_fds})",
    )
    wait_until(lambda: len(_reply_socket_files()) <= 1, what="the socket files to go")
    assert actor.ping.call_one().get(timeout=T) == 0


# -- file descriptors --------------------------------------------------------------------------

FD_LIMIT_SCRIPT = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {tests!r})
    import failing_actors as fa
    import mesh.testing
    from mesh import this_host
    from transport import TransportError

    mode = sys.argv[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))  # no room to raise it
    meshes = []
    try:
        if mode == "at_once":
            meshes.append(this_host().spawn_procs(per_host={{"gpus": 40}}))
        for _ in range(40):  # "a_few_at_a_time", with calls, until the limit is near
            actors = this_host().spawn_procs(per_host={{"gpus": 2}}).spawn("a", fa.BadReplies)
            meshes.append(actors)
            actors.ping.call().get(timeout=30)
        print("RESULT never refused", flush=True)
    except TransportError as exc:
        print("REFUSED", len(meshes), exc, flush=True)
    if not meshes:  # refused at once: a mesh that fits still can be spawned
        meshes.append(this_host().spawn_procs(per_host={{"gpus": 2}}).spawn("a", fa.BadReplies))
    print("STILL WORKS", meshes[-1].ping.call().get(timeout=30).values(), flush=True)
    mesh.testing.shutdown()
""")


@pytest.mark.parametrize("mode", ["at_once", "a_few_at_a_time"])
def test_running_out_of_file_descriptors_is_a_clear_error(tmp_path: Any, mode: str) -> None:
    """More procs than the descriptor limit allows: a TransportError that says so, before
    libzmq would abort the client (SIGABRT, no report); what was spawned keeps working."""
    script = FD_LIMIT_SCRIPT.replace("sys.argv[1]", repr(mode))
    result = run_client_script(tmp_path, script)
    out = result.stdout
    assert result.returncode == 0, f"exit status {result.returncode}\n{out}{result.stderr}"
    refused = next((line for line in out.splitlines() if line.startswith("REFUSED")), "")
    assert "too many open files" in refused and "ulimit -n" in refused, out + result.stderr
    assert "limit of 160" in refused, refused
    assert "STILL WORKS" in out, out + result.stderr


RAISED_LIMIT_SCRIPT = textwrap.dedent("""
    import resource
    import mesh.testing
    from mesh import this_host

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    this_host()
    print("LIMIT", resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, flush=True)
    mesh.testing.shutdown()
""")


def test_the_client_raises_its_soft_descriptor_limit_to_the_hard_one(tmp_path: Any) -> None:
    result = run_client_script(tmp_path, RAISED_LIMIT_SCRIPT)
    assert result.returncode == 0, result.stderr
    soft, hard = next(x for x in result.stdout.splitlines() if x.startswith("LIMIT")).split()[1:]
    assert soft == hard, result.stdout
