"""The host agent daemon's command line: ``meshvisor agent`` and ``python -m mesh._agent``.

It forks its fork server before anything else (so the server stays single-threaded), then runs
a `HostAgent` until it is shut down (SIGTERM) or its owner is gone. The agent imports only what
it runs on, so that it answers sooner: what its procs run on too before forking the fork
server, its own modules (`host_agent`) after, while the fork server imports the procs' runtime
(`warm_start`). It chooses the CURVE keys of a tcp agent, writes the address actually listened
on where asked, joins and leaves its allocation, and removes its run directory when it is its
own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mesh._agent.allocations import add_to_allocation, allocation_keys_dir, remove_from_allocation
from mesh._agent.forkserver import PRELOAD_ENV, ForkServerClient, start_forkserver
from mesh._agent.log_files import LogFileConfig, default_log_dir, prepare_log_dir
from mesh._agent.notices import NoticeWatch, notice_signal
from mesh._agent.rundir import own_run_dir
from mesh._agent.warm_start import import_shared
from mesh._settings import reload_settings
from transport import (
    KEYS_ENV,
    CurveKeys,
    TransportError,
    check_exposure,
    follow_keys_pointer,
    raise_open_file_limit,
    transport_settings,
    use_curve_keys,
)

if TYPE_CHECKING:
    from mesh._agent.host_agent import HostAgent


def main(argv: list[str] | None = None, prog: str = "python -m mesh._agent") -> None:
    """Run a host agent with the options in `argv` until it stops, then exit (status 0)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    raise_open_file_limit()  # each proc costs the agent descriptors; procs inherit it
    if args.keys:
        use_curve_keys(os.path.abspath(args.keys))  # procs inherit it
    address = _listen_address(args, parser)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    notices = _notice_watch(args, parser)  # options that can be refused: before the run dir
    log_files = _log_files(args, parser)
    rundir = args.rundir or own_run_dir()
    if args.owner_pid:  # a client's local agent: it takes up the keys of what it attaches to
        follow_keys_pointer(rundir)
    if args.preload:
        os.environ[PRELOAD_ENV] = args.preload
        reload_settings()  # the fork server preloads what its settings name
    if notices is not None:
        notices.ignore_in_children()  # the scheduler signals procs too: only the agent hears it
    import_shared()  # what the procs run on too: their fork server inherits it
    forkserver = start_forkserver(log_files)
    from mesh._agent.host_agent import HostAgent  # beside the fork server's warm-up

    if notices is not None:
        notices.install()
    agent = HostAgent(
        forkserver,
        address,
        rundir,
        args.owner_pid,
        args.orphan_timeout,
        args.owner_timeout,
        args.parent_pid,
        notices,
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.request_shutdown())
    if args.address_file:
        _write_atomically(args.address_file, agent.address + "\n")
    if args.allocation:
        add_to_allocation(args.allocation, agent.address)
    try:
        agent.serve()
    finally:
        if notices is not None:
            notices.close()
        _clean_up(args, agent, forkserver, rundir)
    sys.exit(0)


def _parser(prog: str) -> argparse.ArgumentParser:
    """The options of ``meshvisor agent`` (`prog` names the command in the help)."""
    parser = argparse.ArgumentParser(prog=prog, description="Run a meshvisor host agent.")
    parser.add_argument(
        "--listen",
        "--address",
        dest="address",
        default="tcp://127.0.0.1:0",
        help="where to listen: tcp://HOST:PORT (port 0 picks one) or ipc://PATH;"
        " default tcp://127.0.0.1:0 (loopback only)",
    )
    parser.add_argument(
        "--rundir", default=None, help="private directory for ipc sockets (default: a new one)"
    )
    parser.add_argument(
        "--address-file", default=None, help="write the address actually listened on to this file"
    )
    parser.add_argument(
        "--owner-pid",
        type=int,
        default=None,
        help="local owner process: when it exits, stop everything and exit",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="a daemon that must not outlive this process (e.g. a test harness); its owners "
        "are still the clients that spawn procs on it",
    )
    parser.add_argument(
        "--orphan-timeout",
        type=float,
        default=0.0,
        help="seconds procs get to stop gracefully once the owner is gone, then SIGKILL",
    )
    parser.add_argument(
        "--owner-timeout",
        type=float,
        default=3.0,
        help="a network owner silent this long is considered gone",
    )
    parser.add_argument(
        "--keys",
        default=None,
        help="directory of the allocation's CURVE keys (meshvisor keys DIR): authenticate and "
        "encrypt every tcp connection, refusing peers without them. Default on tcp: "
        "$MESHVISOR_CURVE_KEYS, else keys made for the allocation (or address file) F in F.keys",
    )
    parser.add_argument(
        "--allocation",
        default=None,
        help="add this agent's address to the named allocation (or file)",
    )
    parser.add_argument(
        "--preload",
        default=None,
        help="modules (comma-separated) for the fork server to import before it forks procs, "
        "so that they start with them loaded (e.g. torch)",
    )
    parser.add_argument(
        "--notice-signal",
        default=None,
        help="a signal (e.g. USR1) that warns of a preemption or time limit: the owner of each "
        'proc here gets a "preempting" supervision event (procs themselves ignore the signal)',
    )
    parser.add_argument(
        "--time-left-command",
        default=None,
        help="a command printing the seconds left (a plain number) when the notice comes, for "
        "the event's time_left_s",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="where procs' per-rank log files go (default: a directory per run or allocation "
        "under $MESHVISOR_LOG_DIR, else ~/.meshvisor/logs; see docs/logs.md)",
    )
    parser.add_argument(
        "--remove-rundir",
        action="store_true",
        help="remove the run directory if the owner dies without cleaning up",
    )
    return parser


def _notice_watch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> NoticeWatch | None:
    """The watch of --notice-signal, or None without one; a bad signal name ends the program."""
    if args.notice_signal is None:
        return None
    try:
        return NoticeWatch(notice_signal(args.notice_signal), args.time_left_command)
    except ValueError as error:
        parser.error(f"--notice-signal: {error}")


def _log_files(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LogFileConfig | None:
    """Where the fork server keeps the procs' log files (created private now), None when the
    environment asks for none. A bad setting or an unusable --log-dir ends the program; an
    unusable default directory only costs the log files (said on stderr)."""
    directory = Path(args.log_dir or default_log_dir(args.owner_pid, args.allocation))
    try:
        config = LogFileConfig.from_env(str(directory.absolute()))
    except (ValueError, TypeError) as error:
        parser.error(f"cannot keep the procs' log files: {error}")
    if config.max_files == 0:
        return None
    try:
        prepare_log_dir(directory)
    except OSError as error:
        if args.log_dir:
            parser.error(f"--log-dir {args.log_dir}: cannot create it: {error}")
        print(f"meshvisor agent: procs' output is kept in no log file: {error}", file=sys.stderr)
        return None
    return config


def _listen_address(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """Where to listen, in zmq's words (port 0 is ``*``); a tcp address gets CURVE keys and is
    checked for exposure, an error ending the program with the reason."""
    address: str = args.address
    if not address.startswith("tcp://"):
        return address
    address = address.replace(":0", ":*")
    try:
        _use_keys(args)
        check_exposure(address[len("tcp://") :].rsplit(":", 1)[0])
    except TransportError as error:
        parser.error(str(error))
    return address


def _clean_up(
    args: argparse.Namespace, agent: HostAgent, forkserver: ForkServerClient, rundir: str
) -> None:
    """After the agent stopped: leave the allocation, reap the fork server, and remove the
    run directory if it was this agent's own (or the owner died and asked for it)."""
    if args.allocation:
        with contextlib.suppress(OSError):
            remove_from_allocation(args.allocation, agent.address)
    with contextlib.suppress(OSError):
        forkserver.socket.close()
    with contextlib.suppress(ChildProcessError):
        os.waitpid(forkserver.pid, 0)
    if (args.remove_rundir and agent.owner_died) or args.rundir is None:
        shutil.rmtree(rundir, ignore_errors=True)


def _use_keys(args: argparse.Namespace) -> None:
    """Set the CURVE keys this tcp agent and its procs use: --keys, else MESHVISOR_CURVE_KEYS,
    else a key pair made for its allocation (or address file) F, in the private F.keys."""
    if transport_settings().curve_keys:  # from --keys (`main` set it) or from the environment
        return
    if args.allocation:
        directory = allocation_keys_dir(args.allocation).absolute()
    elif args.address_file:
        directory = Path(os.path.abspath(args.address_file) + ".keys")
    else:
        return  # check_exposure explains what to pass
    CurveKeys.create_or_load(directory)
    use_curve_keys(str(directory))
    print(
        f"meshvisor agent: no --keys given: every tcp connection is authenticated with the "
        f"CURVE keys in {directory} (attach() by allocation finds them; elsewhere set "
        f"{KEYS_ENV}={directory})",
        file=sys.stderr,
        flush=True,
    )


def _write_atomically(path: str, text: str) -> None:
    """Write `path` so that readers see all of `text` or no file at all."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)
