"""Typed models: the custom resources (`resources`, from crds/) and the agent's
wire shapes (`agent`, from sandbox-agent/openapi.json), both generated, and
the agent's error codes (`agent_codes`, from the same document: no pydantic).

The two modules (and pydantic under them) are imported on first use (PEP 562):
building their classes is most of the SDK's import time, and a command such as
`kubectl sandbox exec` never reads a custom resource."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandbox_sdk.models import agent, agent_codes, resources
    from sandbox_sdk.models._base import WireModel

__all__ = ["WireModel", "agent", "agent_codes", "resources"]


def __getattr__(name: str) -> ModuleType | type[WireModel]:
    if name == "WireModel":
        base: type[WireModel] = importlib.import_module(f"{__name__}._base").WireModel
        return base
    if name not in ("agent", "agent_codes", "resources"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
