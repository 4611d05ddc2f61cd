"""The host agent: a daemon per host that spawns procs through its fork server and watches them.

Runs as its own process (``meshvisor agent`` or ``python -m mesh._agent``):

- `daemon`: the command line and the daemon's life (keys, address file, allocation, clean-up);
- `host_agent`: `HostAgent`, the loop that serves requests and fork-server reports;
- `procs`: the table of procs the agent runs, and their exit reports;
- `watchdog` and `liveness`: heartbeat deadlines, and whether a silent proc is hung or busy;
- `evidence`, `stacks` and `oom_kills`: why a proc died: the stacks it dumped (a hung one is
  asked to), ordered for reading, and whether it ran out of memory;
- `spawning`: a new proc's address, configuration and output prefix;
- `forkserver`: the single-threaded process that forks procs (a request's procs in one batch);
  `warm_start` keeps each fork cheap; `proc_main` is what each runs; `death_watch` sees a proc
  killed before the kernel has freed its memory, from a waiter process (`death_waiter`);
- `rundir`: the run directory of the procs' ipc sockets;
- `allocations`: the allocation files agents join and clients attach to.
"""
