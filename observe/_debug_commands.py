"""The commands of the debug prompt, with Monarch's names so that its users feel at home:
``list``, ``attach ACTOR RANK``, ``cast ACTOR ranks(...) PDB-COMMAND``, ``continue``, ``help``,
``quit``. `parse_command` turns a line into one of the frozen values below, or raises a
ValueError that says what is wrong and what would be right.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HELP = """\
commands (at the meshvisor_dbg> prompt):
  list                              the calls paused in breakpoint(): actor mesh, rank, where
  attach ACTOR RANK                 debug one of them: type pdb commands (where, p x, step,
                                    next, list, continue...); `detach` comes back here
  cast ACTOR ranks(0,1) COMMAND     run one pdb command in several ranks at once; ranks are
                                    ranks(0,2,5), ranks(0:4), ranks(0:8:2) or all
  continue                          let every paused call go on
  help                              this text
  quit                              leave the debugger; paused calls stay paused
"""


@dataclass(frozen=True)
class ListPaused:
    """``list``"""


@dataclass(frozen=True)
class Attach:
    """``attach ACTOR RANK``"""

    actor: str
    rank: int


@dataclass(frozen=True)
class Cast:
    """``cast ACTOR ranks(...) COMMAND``: `ranks` None means all."""

    actor: str
    ranks: frozenset[int] | None
    command: str


@dataclass(frozen=True)
class ContinueAll:
    """``continue``"""


@dataclass(frozen=True)
class Help:
    """``help``"""


@dataclass(frozen=True)
class Quit:
    """``quit``"""


Command = ListPaused | Attach | Cast | ContinueAll | Help | Quit

_SIMPLE: dict[str, Command] = {
    **dict.fromkeys(("list", "l", "ls"), ListPaused()),
    **dict.fromkeys(("continue", "c", "cont"), ContinueAll()),
    **dict.fromkeys(("help", "h", "?"), Help()),
    **dict.fromkeys(("quit", "q", "exit"), Quit()),
}
_CAST = re.compile(r"cast\s+(\S+)\s+(ranks\([^)]*\)|all)\s+(\S.*)")


def parse_command(line: str) -> Command | None:
    """The command on `line`, None for an empty line; a ValueError explains a bad one."""
    words = line.split()
    if not words:
        return None
    simple = _SIMPLE.get(line.strip())
    if simple is not None:
        return simple
    if words[0] == "attach":
        if len(words) != 3 or not words[2].isdigit():
            raise ValueError(
                "usage: attach ACTOR RANK (an actor mesh name and a rank: attach trainers 0)"
            )
        return Attach(words[1], int(words[2]))
    if words[0] == "cast":
        found = _CAST.fullmatch(line.strip())
        if found is None:
            raise ValueError("usage: cast ACTOR ranks(0,1) COMMAND (or ranks(0:2), or all)")
        return Cast(found.group(1), parse_ranks(found.group(2)), found.group(3))
    raise ValueError(f"unknown command {words[0]!r}; `help` lists the commands")


def parse_ranks(text: str) -> frozenset[int] | None:
    """``ranks(0,2)``, ``ranks(0:4)``, ``ranks(1:9:2)`` or a mix of them: the ranks named;
    ``all`` (or ``ranks(*)``): None."""
    if text == "all":
        return None
    found = re.fullmatch(r"ranks\((.*)\)", text.strip())
    if found is None:
        raise ValueError(f"{text!r} is not ranks(...): write ranks(0,1), ranks(0:2) or all")
    inner = found.group(1).strip()
    if inner == "*":
        return None
    ranks: set[int] = set()
    for part in inner.split(","):
        ranks.update(_ranks_of(part.strip(), text))
    return frozenset(ranks)


def _ranks_of(part: str, text: str) -> range:
    if re.fullmatch(r"\d+", part):
        return range(int(part), int(part) + 1)
    found = re.fullmatch(r"(\d+):(\d+)(?::(\d+))?", part)
    if found is None or (found.group(3) is not None and int(found.group(3)) == 0):
        raise ValueError(
            f"{part!r} in {text!r} is not a rank (3) nor a range START:STOP[:STEP] (0:4, 0:8:2)"
        )
    start, stop = int(found.group(1)), int(found.group(2))
    return range(start, stop, int(found.group(3) or 1))
