"""Chaos engineering for meshvisor jobs: seeded fault injection, invariants and reports.

The fault injectors, schedules and reports are tracked in the project's issues; this package
currently exports nothing.
"""

__all__: tuple[str, ...] = ()
