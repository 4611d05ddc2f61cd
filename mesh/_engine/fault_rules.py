"""The receiving side of fault injection: a process applies the fault rules it is sent."""

from __future__ import annotations

from mesh._engine.messages import SetFaultRules
from transport import Envelope, get_logger, network_faults


def apply_fault_rules(envelope: Envelope) -> None:
    """Install (or clear) the rules of a `SetFaultRules` message in this process."""
    header: SetFaultRules = envelope.header
    faults = network_faults()
    if header.clear:
        faults.clear()
    faults.install(header.rules)
    get_logger("chaos").info(
        "fault_rules_set", rules=[rule.label for rule in header.rules], cleared=header.clear
    )
