"""A heal that commits overtake keeps what it fetched, and replays the update on that part only.

A commit changes a donor's state in place, so a heal it overtook holds some tensors of the step
it began at and can fetch the rest only at the newest step. Rather than fetch everything again,
or have the donors copy their state as they commit, the heal fetches the rest at the newest
step and then applies the committed updates to the parameters it holds at an older step, with
their optimizer state (`replay`): an optimizer step skips a parameter without a gradient, and
a per-parameter optimizer (Adam, SGD) computes each parameter's step from its own gradient and
state alone, so the bits are those the donors computed. The tensors are fetched a parameter at
a time, its optimizer state right after it (`TensorGroups.order`), so that an overtaken heal
holds whole parameters but one. An optimizer whose step mixes parameters would come out
different: the group compares the replacement's digest with its own and heals it whole then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._follow import fetch_updates
from ._heal_state import TensorSpec

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh

#: Elements (start, stop) of the committed update of a step, or None if no peer keeps it.
FetchUpdate = Callable[[int, tuple[int, int]], "torch.Tensor | None"]


class TensorGroups:
    """The tensors of a heal's layout grouped by parameter (the parameter, then its optimizer
    state); a buffer, or optimizer state of no parameter, is a group of its own that no
    update brings forward (fetched again at the newest step)."""

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        names = {id(p): name for name, p in model.named_parameters()}
        flat = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
        self.group = [_group_of(spec.key, set(names.values()), flat) for spec in specs]
        self.members: dict[str, list[int]] = {}
        for index, group in enumerate(self.group):
            self.members.setdefault(group, []).append(index)
        self.order = [index for members in self.members.values() for index in members]
        self._params = set(names.values())

    def kept(
        self, at: dict[int, int], newest: int, behind: int
    ) -> tuple[list[int], dict[str, int]]:
        """Of the tensors fetched whole (`at`: index -> the step of their bytes), the groups
        a replay can bring to `newest` (at most `behind` steps older, parameters): their step
        by parameter name. Returns the tensors to fetch at `newest` (the others, in order),
        and those groups; `at` loses the tensors to fetch again."""
        fetch, older = [], {}
        for group, members in self.members.items():
            steps = {at.get(index, -1) for index in members}
            step = steps.pop() if len(steps) == 1 else -1
            if step == newest or (group in self._params and 0 <= newest - step <= behind):
                if step != newest:
                    older[group] = step
                continue
            fetch.extend(members)
            for index in members:
                at.pop(index, None)
        return [index for index in self.order if index in set(fetch)], older


def _group_of(key: str, params: set[str], flat: list[str | None]) -> str:
    """The group of the layout's tensor `key`: the parameter it is or belongs to, else itself."""
    if key.startswith("model.") and key.removeprefix("model.") in params:
        return key.removeprefix("model.")
    parts = key.split(".")
    if len(parts) > 3 and parts[:2] == ["optimizer", "state"] and parts[2].isdigit():
        index = int(parts[2])
        name = flat[index] if index < len(flat) else None
        if name is not None:
            return name
    return key


def replay(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    older: dict[str, int],
    newest: int,
    fetch: FetchUpdate | None,
) -> int:
    """Apply the committed updates up to `newest` to the parameters held at the `older` steps
    (by name), each to those older than it; returns how many, or -1 if one was not kept. Only
    the elements of the update those parameters need are fetched."""
    if not older:
        return 0
    if fetch is None:
        return -1
    first = min(older.values()) + 1
    for step in range(first, newest + 1):
        stale = {name for name, held in older.items() if held < step}
        spans, (low, high) = _spans(model, stale)
        update = fetch(step, (low, high))
        if update is None:
            return -1
        for param, span in spans:  # a parameter without a gradient: the step skips it
            part = None if span is None else update[span[0] - low : span[1] - low]
            param.grad = None if part is None else part.view_as(param).to(param.dtype)
        optimizer.step()
    for param in model.parameters():
        param.grad = None
    return newest - first + 1


def _spans(
    model: torch.nn.Module, names: set[str]
) -> tuple[list[tuple[torch.Tensor, tuple[int, int] | None]], tuple[int, int]]:
    """Each parameter with its elements in the flat update if it is one of `names` (else
    None), and the span of the update that covers them all."""
    spans: list[tuple[torch.Tensor, tuple[int, int] | None]] = []
    offset, low, high = 0, -1, 0
    for name, param in model.named_parameters():
        end = offset + param.numel()
        spans.append((param, (offset, end) if name in names else None))
        if name in names:
            low, high = offset if low < 0 else low, end
        offset = end
    return spans, (max(low, 0), high)


def update_fetcher(
    ranks: Sequence[ActorMesh[Any]], model: torch.nn.Module, timeout_s: float
) -> FetchUpdate:
    """Fetches elements of a committed update from the first of `ranks` (a peer's rank each)
    that keeps it."""

    def fetch(step: int, span: tuple[int, int]) -> torch.Tensor | None:
        updates = fetch_updates(ranks, step, step, span[1] - span[0], timeout_s, span)
        return updates[0] if updates else None

    return fetch
