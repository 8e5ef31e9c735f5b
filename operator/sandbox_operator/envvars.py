"""Environment variables as values: literal ones as they are, Secret keys read now."""

from __future__ import annotations

import base64
from collections.abc import Sequence

from sandbox_operator.api.common import EnvVar
from sandbox_operator.kube import Api
from sandbox_operator.resources import SECRETS


class MissingSecret(Exception):
    """A variable's Secret, or the key in it, is not there (yet)."""


async def resolve(kube: Api, namespace: str, variables: Sequence[EnvVar]) -> dict[str, str]:
    """name -> value; raises MissingSecret naming the variable and what is missing.
    Each Secret is read once, however many variables it feeds."""
    secrets: dict[str, dict[str, str] | None] = {}
    resolved: dict[str, str] = {}
    for var in variables:
        if var.value is not None or var.value_from is None:
            resolved[var.name] = var.value or ""
            continue
        ref = var.value_from.secret_key_ref
        if ref.name not in secrets:
            secret = await kube.get(SECRETS.path(namespace, ref.name))
            secrets[ref.name] = None if secret is None else dict(secret.get("data") or {})
        data = secrets[ref.name]
        if data is None:
            raise MissingSecret(f"env {var.name}: secret {ref.name!r} not found")
        if ref.key not in data:
            raise MissingSecret(f"env {var.name}: secret {ref.name!r} has no key {ref.key!r}")
        resolved[var.name] = base64.b64decode(data[ref.key]).decode(errors="replace")
    return resolved
