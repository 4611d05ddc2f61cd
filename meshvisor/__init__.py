"""The ``meshvisor`` command line and its demo; the one package that may import all the others."""

__all__ = ()
