"""``meshvisor sync``: copy a local directory to every host of an allocation (only what
changed), for the procs spawned there from now on to import (`HostMesh.sync_workspace`)."""

from __future__ import annotations

import argparse
import sys

from mesh import attach


def main(argv: list[str], prog: str = "meshvisor sync") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("allocation", help="allocation name or file (as for attach())")
    parser.add_argument("directory", help="the local directory to sync")
    parser.add_argument("--name", help="the workspace's name on the hosts (default: the folder's)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per answer")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    try:
        hosts = attach(args.allocation)
        synced = hosts.sync_workspace(
            args.directory, args.name, progress=not args.quiet, timeout_s=args.timeout
        ).get()
    except (LookupError, ValueError, TimeoutError) as error:  # WorkspaceError is a ValueError
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    for host in synced.hosts:
        print(
            f"{host.agent}: {len(host.written)} files written, {len(host.deleted)} removed, "
            f"{host.bytes_written} bytes, in {host.path}"
        )
    return 0
