"""The per-process engine: messaging, calls and replies, supervision, restarts, the actor host.

One `Runtime` per process (the client or a proc) puts the parts together: `loop` (event loop,
pumping), `calltable` (calls awaiting replies), `replies` (per-thread reply inboxes),
`ownership` (procs, meshes, owners, handlers), `procs` (proc lifecycle), `agents` (host-agent
liveness), `supervisor`, `restarts`, `host` (actors run here). Each part depends on small
Protocols or callables, not on `Runtime`. Nothing here imports the user-facing layer
(`mesh._api`, `mesh`, `mesh.testing`); the import-layering contracts in pyproject.toml keep it so.
"""
