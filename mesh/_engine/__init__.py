"""The per-process engine: messaging, calls and replies, supervision, restarts, the actor host.

One `Runtime` per process (the client or a proc). Nothing here imports the user-facing layer
(`mesh._api`, `mesh`, `mesh.testing`); the import-layering contracts in pyproject.toml keep it so.
"""
