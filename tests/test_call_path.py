"""Every call ends: what breaks on the way back (a result too large or too deep to send, an
exception that cannot describe itself) reaches the caller as an error naming why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import failing_actors as fa
import pytest

from mesh import ProcMesh
from supervision import ActorError
from transport import SerializationError

T = 30  # seconds: the bound on every wait in this module (never reached when things work)


def run_client_script(tmp_path: Any, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `script` (formatted with ``tests``, this directory) as a client of its own."""
    path = tmp_path / f"client-{uuid.uuid4().hex[:6]}.py"
    path.write_text(script.format(tests=os.path.dirname(fa.__file__)))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MESHVISOR_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, str(path)], env=environ, capture_output=True, text=True, timeout=90
    )


# -- the reply path ------------------------------------------------------------------------------

OVERSIZED_REPLY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import failing_actors as fa
    import mesh._session
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
    mesh._session.shutdown_session()
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
