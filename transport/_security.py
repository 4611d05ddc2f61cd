"""CURVE authentication and encryption for an allocation.

Every process of an allocation (client, agents, procs) shares one CURVE key pair, found in the
directory named by ``MESHVISOR_CURVE_KEYS`` (made by ``meshvisor keys DIR``; agents take
``--keys DIR``, or make a pair per allocation). Every tcp inbox, loopback included, is a CURVE
server that admits only peers holding that key pair and refuses others with a logged reason;
every outgoing tcp connection authenticates with it. Listening or connecting on tcp without
keys is refused: on a shared machine another user can reach loopback too. ipc sockets need no
keys: they live in directories only their user can enter.

Key files are created private (mode 0600 from the first byte, in a directory forced to 0700):
never written first and chmodded afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

from ._errors import TransportError
from ._log import get_logger
from ._settings import ENV_NAMES, transport_settings, use_curve_keys

KEYS_ENV = ENV_NAMES["curve_keys"]
_KEY_NAME = "allocation"
_CERTIFICATE = """#   Generated on {now} by meshvisor: an allocation's ZeroMQ CURVE {what}.
{warning}
metadata
curve
    public-key = "{public}"
{secret}"""


@dataclass(frozen=True)
class CurveKeys:
    """The allocation's CURVE key pair (z85-encoded)."""

    public: bytes
    secret: bytes

    @classmethod
    def create(cls, directory: str | os.PathLike[str]) -> CurveKeys:
        """Make a new key pair in `directory` (made private; refused if it holds one)."""
        path = private_directory(directory)
        keys = cls(*zmq.curve_keypair())
        try:
            _write_new(path / f"{_KEY_NAME}.key_secret", keys._certificate(secret=True), 0o600)
        except FileExistsError:
            raise TransportError(
                f"{path} already holds CURVE keys; use them (--keys {path}, {KEYS_ENV}={path}) "
                "or remove that directory first"
            ) from None
        with contextlib.suppress(FileExistsError):
            _write_new(path / f"{_KEY_NAME}.key", keys._certificate(secret=False), 0o644)
        return keys

    @classmethod
    def create_or_load(cls, directory: str | os.PathLike[str]) -> CurveKeys:
        """The key pair in `directory`, made first if there is none (agents of one allocation
        starting together agree on one pair: the first to write it wins)."""
        path = private_directory(directory)
        if (path / f"{_KEY_NAME}.key_secret").exists():
            return cls.load(path)
        keys = cls(*zmq.curve_keypair())
        staged = path / f".{_KEY_NAME}.key_secret.{os.getpid()}"
        _write_new(staged, keys._certificate(secret=True), 0o600)
        try:
            os.link(staged, path / f"{_KEY_NAME}.key_secret")  # atomic: fails if one exists
        except FileExistsError:
            return cls.load(path)
        finally:
            staged.unlink()
        with contextlib.suppress(FileExistsError):
            _write_new(path / f"{_KEY_NAME}.key", keys._certificate(secret=False), 0o644)
        return keys

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CurveKeys:
        secret_file = Path(directory) / f"{_KEY_NAME}.key_secret"
        try:
            public, secret = zmq.auth.load_certificate(str(secret_file))
        except (OSError, ValueError) as exc:
            raise TransportError(
                f"cannot load the allocation's CURVE keys from {secret_file}: {exc}; create "
                f"them with 'meshvisor keys {directory}'"
            ) from exc
        if secret is None:
            raise TransportError(f"{secret_file} holds no secret key")
        mode = stat.S_IMODE(secret_file.stat().st_mode)
        if mode & 0o077:
            raise TransportError(
                f"refusing to use {secret_file}: other users may read it (mode {mode:o}), and "
                f"anyone who can may join the allocation; make it private (chmod 600 "
                f"{secret_file}) or create new keys"
            )
        return cls(public, secret)

    def _certificate(self, *, secret: bool) -> str:
        return _CERTIFICATE.format(
            now=datetime.datetime.now().isoformat(timespec="seconds"),
            what="secret key: keep it private" if secret else "public key",
            warning="#   Anyone who reads this file can join the allocation.\n" if secret else "",
            public=self.public.decode(),
            secret=f'    secret-key = "{self.secret.decode()}"\n' if secret else "",
        )


def private_directory(directory: str | os.PathLike[str]) -> Path:
    """`directory`, made with mode 0700 or, if it exists, checked to be ours and forced to
    0700; refused if it is a symbolic link or belongs to another user."""
    path = Path(directory)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = "a directory" if stat.S_ISDIR(info.st_mode) else "a link or file"
        raise TransportError(
            f"refusing to keep CURVE keys in {path}: it is {what} of uid {info.st_uid}, not a "
            f"directory of this user (uid {os.getuid()}); choose another directory"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _write_new(path: Path, text: str, mode: int) -> None:
    """Write a file that must not exist yet, created with `mode` from the start."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)


_loaded: dict[str, CurveKeys | None] = {}
#: The file naming the keys to take up if this process has none (`follow_keys_pointer`).
_pointer: Path | None = None
_POINTER_FILE = "curve-keys"


def point_to_keys(rundir: str | os.PathLike[str], directory: str) -> None:
    """Tell the processes started with private run directory `rundir` (a client's local agent
    and its procs), which began without keys, to authenticate with those in `directory` from
    now on: they must reach this process over tcp once it listens there."""
    target = Path(rundir) / _POINTER_FILE
    staged = target.with_name(f".{_POINTER_FILE}.{os.getpid()}")
    staged.unlink(missing_ok=True)
    _write_new(staged, directory, 0o600)
    os.replace(staged, target)  # readers see the old file or the whole new one


def follow_keys_pointer(rundir: str | os.PathLike[str]) -> None:
    """When this process must use CURVE keys and has none, take up those named in `rundir` by
    its owner (`point_to_keys`); the directory is private to this user."""
    global _pointer
    _pointer = Path(rundir) / _POINTER_FILE


def _pointed_keys() -> str | None:
    """The keys directory the owner pointed to, taken up for good (None: none named)."""
    if _pointer is None:
        return None
    try:
        directory = _pointer.read_text().strip()
    except OSError:  # none written (or the run directory is gone): no keys
        return None
    if directory:
        use_curve_keys(directory)  # and the procs this process starts
    return directory or None


def configured_keys() -> CurveKeys | None:
    """The key pair in this process's `TransportSettings.curve_keys` (MESHVISOR_CURVE_KEYS), or
    the one its owner pointed to since (`follow_keys_pointer`), or None when security is not
    configured."""
    directory = transport_settings().curve_keys or _pointed_keys()
    if not directory:
        return None
    if directory not in _loaded:
        _loaded[directory] = CurveKeys.load(directory)
    return _loaded[directory]


def check_exposure(host: str) -> None:
    """Refuse to listen on tcp at `host` (loopback included) without the allocation's keys."""
    if configured_keys() is not None:
        return
    raise TransportError(
        f"refusing to listen on tcp://{host} without authentication: every tcp listener, "
        "loopback included, must be authenticated (any local user can reach loopback and "
        f"would run code here); create keys with 'meshvisor keys DIR' and pass --keys DIR to "
        f"agents and {KEYS_ENV}=DIR to clients, or start agents with --allocation NAME, which "
        "makes keys for that allocation"
    )


def required_keys(address: str) -> CurveKeys:
    """The keys to connect to tcp `address` with; TransportError saying how to get them."""
    keys = configured_keys()
    if keys is None:
        raise TransportError(
            f"cannot connect to {address} without the allocation's CURVE keys: every tcp "
            f"connection is authenticated; set {KEYS_ENV}=DIR (the directory given to the "
            "agents' --keys), or attach by allocation name, which finds the keys made for it"
        )
    return keys


def secure_server(socket: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make `socket` a CURVE server that only admits holders of `keys`."""
    _start_authenticator(socket.context, keys)
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def secure_client(socket: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Authenticate `socket`'s connections with `keys`."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.public


class _AllocationMembers:
    """ZAP credentials check: only the allocation's own public key gets in."""

    def __init__(self, keys: CurveKeys) -> None:
        self._allowed = keys.public
        self._log = get_logger("transport.auth")

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self._allowed:
            return True
        self._log.warning(
            "peer_refused",
            key=key.decode(errors="replace"),
            reason="its CURVE key is not this allocation's",
        )
        return False


_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


def _start_authenticator(context: zmq.Context[Any], keys: CurveKeys) -> None:
    with _lock:
        if id(context) in _authenticators:
            return
        # Imported here: it brings all of asyncio, which only a CURVE-secured process needs.
        from zmq.auth.thread import ThreadAuthenticator

        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback("*", credentials_provider=_AllocationMembers(keys))
        _authenticators[id(context)] = authenticator


def stop_authenticator(context: zmq.Context[Any]) -> None:
    """Stop the ZAP thread of `context` (before terminating it), if one runs."""
    with _lock:
        authenticator = _authenticators.pop(id(context), None)
    if authenticator is not None:
        authenticator.stop()
