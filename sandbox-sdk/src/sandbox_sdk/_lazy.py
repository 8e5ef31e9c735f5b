"""Modules imported when first used rather than where they are named."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _Deferred(ModuleType):
    """Stands for a module until an attribute of it is read, then imports it and
    answers from it. The import goes through importlib's per-module lock, so
    threads that meet it first at the same moment import it once (Python 3.11's
    importlib.util.LazyLoader does not promise that)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, attribute: str) -> Any:  # only for what is not set here
        return getattr(importlib.import_module(self.__name__), attribute)


def module(name: str) -> ModuleType:
    """`name`, imported on its first attribute access.

    The clients name the generated models at the top, but most calls read only
    one of the two modules, and `kubectl sandbox exec` neither: this keeps their
    class building (most of the SDK's import time) off the start-up of every
    call."""
    return _Deferred(name)
