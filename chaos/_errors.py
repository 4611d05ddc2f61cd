"""The errors chaos injects into endpoints (importable by every proc, so they unpickle)."""


class InjectedFault(BaseException):
    """Raised in an endpoint by a fatal "raise" fault: like any BaseException, it fails the
    actor, and its owner gets an "exception" event."""


class InjectedError(Exception):
    """Raised in an endpoint by a non-fatal "raise" fault: only that call fails (the caller
    gets an `ActorError`); the actor goes on."""


class ChaosSetupError(RuntimeError):
    """The chaos run could not start: the workload, the allocation or the options are wrong."""
