"""Errors raised by the transport layer.

Exception tree::

    TransportError                  base of everything below
    ├── SerializationError          a value cannot be pickled (raised at the sender)
    ├── MessageTooLarge             a message exceeds the size limit
    └── MalformedMessage            received frames that are not a valid message
        └── WireVersionMismatch     a message of another wire version (another meshvisor)

A `zmq.ZMQError` never reaches a user: it is translated into a `TransportError`
raised ``from`` the original.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by `transport`."""


class SerializationError(TransportError, TypeError):
    """A value could not be serialized for sending (an unpicklable argument or result)."""


class MessageTooLarge(TransportError, ValueError):
    """A message is larger than the configured size limit."""


class MalformedMessage(TransportError, ValueError):
    """Frames were received that do not form a valid meshvisor message."""


class WireVersionMismatch(MalformedMessage):
    """A message framed by a peer that speaks another wire version (another meshvisor)."""


def safe_str(exc: BaseException | None) -> str:
    """``str(exc)``, or why it cannot be had: an exception whose ``__str__`` raises must
    still be reportable (a broken description must never lose the error it describes)."""
    try:
        return str(exc)
    except Exception as error:
        try:
            why = f"{type(error).__name__}: {error}"
        except Exception:
            why = type(error).__name__
        return f"<exception str() failed: {why}>"
