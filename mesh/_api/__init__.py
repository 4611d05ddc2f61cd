"""The user-facing handles: host, proc and actor meshes, endpoint references, attach, fault hooks.

Re-exported by `mesh` and `mesh.testing`; built on `mesh._engine` and `mesh._agent`.
"""
