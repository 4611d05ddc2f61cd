"""``meshvisor meshes``: the detached meshes of an allocation, listed and stopped from a shell."""

from __future__ import annotations

import argparse
import sys

from mesh import DetachedMeshInfo, attach


def main(argv: list[str], prog: str = "meshvisor meshes") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="list the detached meshes of an allocation")
    listing.add_argument("allocation", help="allocation name or file (as for attach())")
    stop = verbs.add_parser("stop", help="stop a detached mesh, whoever owns it")
    stop.add_argument("allocation", help="allocation name or file (as for attach())")
    stop.add_argument("name", help="the detached mesh's name")
    stop.add_argument("--grace", type=float, default=5.0, help="seconds before SIGKILL")
    args = parser.parse_args(argv)

    try:
        hosts = attach(args.allocation)
        if args.verb == "stop":
            count = hosts.stop_detached(args.name, args.grace)
            print(f"stopping detached mesh {args.name!r}: {count} procs")
            return 0
        _print_table(hosts.detached_meshes())
    except (LookupError, ValueError, TimeoutError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    return 0


def _print_table(meshes: list[DetachedMeshInfo]) -> None:
    rows = [("NAME", "PROCS", "HOSTS", "OWNER", "KEPT FAILURES", "TTL")]
    for mesh in meshes:
        rows.append(
            (
                mesh.name,
                f"{mesh.alive}/{mesh.procs}",
                str(len(mesh.hosts)),
                mesh.owner_words(),
                str(mesh.kept_failures),
                "-" if mesh.ttl_s is None else f"{mesh.ttl_s:g} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
