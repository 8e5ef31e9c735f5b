"""Sandbox agent: the in-pod HTTP sidecar and the stdlib runner it relays to."""

from .runner import __version__

__all__ = ["__version__"]
