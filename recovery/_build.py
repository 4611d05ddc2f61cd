"""How a replacement replica builds its model: with the random initialisations skipped.

A replacement heals every tensor of its state from a live peer, so the values `build()` draws
for it are never read; drawing them costs seconds at model scale (about 2 s for 84 M
parameters on one thread). Inside `random_init_skipped`, torch's random fills
(``torch.nn.init``'s and the tensor methods they use) leave the tensors as allocated; what
`build` computes otherwise (shapes, deterministic buffers) is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
