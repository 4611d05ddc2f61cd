"""Fault hooks and helpers for testing meshvisor jobs (as ``trio.testing`` is for trio).

The fault hooks (`probe`, `fail_next_call`, `exit_process`, `break_links`, `heal_links`) are
what the `chaos` package injects faults with; nothing here changes a job that does not call it.
`settings(**overrides)` changes `mesh.configure`'s settings for one block.
"""

from mesh._api.configure import overridden_settings as settings
from mesh._api.faults import Party as Party
from mesh._api.faults import break_links as break_links
from mesh._api.faults import exit_process as exit_process
from mesh._api.faults import fail_next_call as fail_next_call
from mesh._api.faults import heal_links as heal_links
from mesh._api.faults import probe as probe

__all__ = (
    "Party",
    "break_links",
    "exit_process",
    "fail_next_call",
    "heal_links",
    "probe",
    "settings",
)
