"""CURVE authentication and encryption for an allocation.

Every process of an allocation (client, agents, procs) shares one CURVE key pair, found in the
directory named by ``MESHVISOR_CURVE_KEYS`` (made by ``meshvisor keys DIR``; agents take
``--keys DIR``). When it is set, every inbox is a CURVE server that admits only peers holding
that key pair, and refuses others with a logged reason; every outgoing connection authenticates
with it. Without it, meshvisor only listens on loopback and private ipc directories.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ._errors import TransportError
from ._log import get_logger

KEYS_ENV = "MESHVISOR_CURVE_KEYS"
_KEY_NAME = "allocation"


@dataclass(frozen=True)
class CurveKeys:
    """The allocation's CURVE key pair (z85-encoded)."""

    public: bytes
    secret: bytes

    @classmethod
    def create(cls, directory: str | os.PathLike[str]) -> CurveKeys:
        """Make a new key pair in `directory` (created private)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        zmq.auth.create_certificates(str(path), _KEY_NAME)
        os.chmod(path / f"{_KEY_NAME}.key_secret", 0o600)
        return cls.load(path)

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
        return cls(public, secret)


_loaded: dict[str, CurveKeys | None] = {}


def configured_keys() -> CurveKeys | None:
    """The key pair named by MESHVISOR_CURVE_KEYS, or None when security is not configured."""
    directory = os.environ.get(KEYS_ENV)
    if not directory:
        return None
    if directory not in _loaded:
        _loaded[directory] = CurveKeys.load(directory)
    return _loaded[directory]


def check_exposure(host: str) -> None:
    """Refuse to listen beyond loopback unless the allocation's CURVE keys are configured."""
    if _is_loopback(host) or configured_keys() is not None:
        return
    raise TransportError(
        f"refusing to listen on {host} without authentication: across hosts every connection "
        f"must be authenticated; create keys with 'meshvisor keys DIR' and pass --keys DIR to "
        f"agents and {KEYS_ENV}=DIR to clients (or listen on 127.0.0.1)"
    )


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
