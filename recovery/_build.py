"""How a replacement replica builds its model (random initialisations skipped) and pays a new
process's first-step costs before its first step.

A replacement heals every tensor of its state from a live peer, so the values `build()` draws
for it are never read; drawing them costs seconds at model scale (about 2 s for 84 M
parameters on one thread). Inside `random_init_skipped`, torch's random fills
(``torch.nn.init``'s and the tensor methods they use) leave the tensors as allocated; what
`build` computes otherwise (shapes, deterministic buffers) is untouched.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._arithmetic import flat_gradient
from ._follow import warm_up_gloo

if TYPE_CHECKING:
    import torch

#: The random fills skipped: the initialisers of ``torch.nn.init`` a module's
#: ``reset_parameters`` calls, and the tensor methods they are built on.
_INIT_NAMES = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "sparse_",
)


#: Set (to "1") in the environment of a spare's procs: a spare heals every tensor before it
#: is used, so it builds without random initialisation too (`will_heal`).
SPARE_ENV = "MESHVISOR_SPARE"


def will_heal() -> bool:
    """Whether the replica actor being built heals its whole state before any value of it is
    read: a replacement (rebuilt after a failure) or a spare (``SPARE_ENV``)."""
    from mesh import context

    return context().restart_count > 0 or os.environ.get(SPARE_ENV) == "1"


@contextmanager
def random_init_skipped() -> Iterator[None]:
    """Within: torch's random initialisations of tensors do nothing (see the module)."""
    import torch
    from torch.overrides import TorchFunctionMode

    skipped: set[Any] = {torch.Tensor.uniform_, torch.Tensor.normal_}
    skipped.update(getattr(torch.nn.init, name) for name in _INIT_NAMES)

    class _SkipRandomInit(TorchFunctionMode):
        def __torch_function__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            if func in skipped:
                return args[0] if args else kwargs["tensor"]
            return func(*args, **kwargs)

    with _SkipRandomInit():
        yield


def warm_up_in_background(
    model: torch.nn.Module,
    stepping: threading.Lock,
    keep_gradient: Callable[[torch.Tensor], None],
    keep_update: Callable[[torch.Tensor], None],
    then: Callable[[], None] = lambda: None,
) -> None:
    """On a thread, holding `stepping` (a step waits for it): gloo's one-time set-up, the flat
    gradient's memory (`keep_gradient` gets it) and the memory its first exchange writes the
    average into (`keep_update`), both written once, which a new process would otherwise pay
    in its first step, where the whole group waits for it (a page fault per 4 KiB page: ~0.2 s
    of CPU each at 1 GB). A replacement does this once healed, while the group finishes the
    step under way. `then` runs after, still holding `stepping`."""

    def run() -> None:
        try:
            warm_up_gloo()
            keep_gradient(flat_gradient(model))
            keep_update(flat_gradient(model))
            then()
        finally:
            stepping.release()

    stepping.acquire()  # held from now on: no step begins before the thread is done
    threading.Thread(target=run, name="replica-warm-up", daemon=True).start()
