"""`BootstrapCommand`: start procs with a command (another Python, a virtualenv, a container
entry point) instead of forking them from the host agent's fork server; `pickled_bootstrap`:
a function each proc runs before it is ready (``spawn_procs(bootstrap=...)``)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from transport import dumps

#: The module a bootstrap command must end up running (``python -m mesh.bootstrap_main``):
#: it reads the proc's configuration from the agent and joins the mesh like a forked proc.
PROC_ENTRY_MODULE = "mesh.bootstrap_main"


@dataclass(frozen=True)
class BootstrapCommand:
    """How the host agent starts each proc of a mesh instead of forking it: it executes
    `program` (found on ``PATH`` if it has no ``/``) with `args` (``argv[0]`` is `arg0`, or
    `program`) and the proc's environment plus `env`. The command must end by running
    ``python -m mesh.bootstrap_main`` (a wrapper script: ``exec "$@"``), with meshvisor
    importable by that Python; `BootstrapCommand.python(executable)` builds the plain one.

    As Monarch's ``BootstrapCommand(program, arg0, args, env)``.
    """

    program: str
    arg0: str | None = None
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        strings = [self.program, *(self.args if _is_sequence(self.args) else [None])]
        if self.arg0 is not None:
            strings.append(self.arg0)
        if not self.program or not all(isinstance(s, str) and "\0" not in s for s in strings):
            raise ValueError(
                f"BootstrapCommand({self.program!r}, args={self.args!r}) is not a command: "
                "program must be a non-empty str and args a list of str, without NUL"
            )
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in self.env.items()
        ):
            raise ValueError(
                f"BootstrapCommand env {self.env!r} cannot be set: it must map non-empty names "
                "without '=' or NUL to str values without NUL"
            )
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", dict(self.env))

    @classmethod
    def python(cls, executable: str, env: Mapping[str, str] | None = None) -> BootstrapCommand:
        """Procs run by the Python interpreter `executable` (e.g. another virtualenv's)."""
        return cls(executable, None, ("-m", PROC_ENTRY_MODULE), env or {})

    def argv(self) -> tuple[str, ...]:
        """(program, argv[0], *args): what the host agent executes."""
        return (self.program, self.arg0 or self.program, *self.args)

    def __str__(self) -> str:
        return shlex.join([self.program, *self.args])


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def pickled_bootstrap(function: Callable[[], object] | None) -> bytes:
    """`spawn_procs(bootstrap=function)` as the bytes each proc unpickles and runs (b"" for
    none); TypeError naming the function if it is not a callable that can be pickled."""
    if function is None:
        return b""
    if not callable(function) or isinstance(function, BootstrapCommand):
        raise TypeError(
            f"bootstrap must be a function each proc runs before it is ready, not {function!r}"
            " (a command that starts procs goes in bootstrap_command=)"
        )
    try:
        body, buffers = dumps(function)
    except Exception as error:
        raise TypeError(f"the bootstrap function {function!r} cannot be pickled: {error}") from None
    if buffers:
        raise TypeError(
            f"the bootstrap function {function!r} captures large buffers; let it load what it "
            "needs in the proc instead"
        )
    return body
