"""Typed models: the custom resources (`resources`, from crds/) and the agent's
wire shapes (`agent`, from sandbox-agent/openapi.json), both generated."""

from sandbox_sdk.models import agent, resources
from sandbox_sdk.models._base import WireModel

__all__ = ["WireModel", "agent", "resources"]
