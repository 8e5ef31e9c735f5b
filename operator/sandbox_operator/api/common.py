"""Shared building blocks of the CRD models: base class, durations, quantities."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any

from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "sandbox.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# Not "sandbox": a category named like a kind shadows it (`kubectl get sandbox x` fails).
CATEGORY = "sandbox-all"


def cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    """One `x-kubernetes-validations` entry: a CEL rule the API server enforces."""
    return {"rule": rule, "message": message, **extra}


def immutable(*fields: str) -> dict[str, str]:
    """A transition rule keeping the named (optional) spec fields as they were created."""
    rule = " && ".join(
        f"has(self.{f}) == has(oldSelf.{f}) && (!has(self.{f}) || self.{f} == oldSelf.{f})"
        for f in fields
    )
    return cel(rule, f"{', '.join(fields)}: immutable after creation")


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class Model(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown fields refused.

    Unknown fields are pruned by the API server before the operator sees them
    (structural schemas), so `extra="forbid"` only bites on objects built in code
    and in tests, where a typo should fail loudly.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# Go-style durations ("90s", "30m", "1h30m"): what `kubectl` users already write.
_DURATION_PART = re.compile(r"(\d+)(ms|s|m|h)")
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

Duration = Annotated[
    str,
    Field(
        pattern=DURATION_PATTERN,
        max_length=32,
        description='A duration such as "90s", "30m" or "1h30m" (units: ms, s, m, h).',
    ),
]


def parse_duration(value: str) -> timedelta:
    """Seconds of a Go-style duration; the CRD pattern has already vetted the syntax."""
    if not re.fullmatch(DURATION_PATTERN, value):
        raise ValueError(f"invalid duration {value!r}: expected e.g. 90s, 30m, 1h30m")
    seconds = sum(
        int(number) * _DURATION_UNITS[unit] for number, unit in _DURATION_PART.findall(value)
    )
    return timedelta(seconds=seconds)


# Kubernetes quantities without a sign: negative sizes never pass admission.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE]{_NUMBER}))?$"


def _quantity_text(value: object) -> object:
    # Manifests say `cpu: 2` as often as `cpu: "2"`; keep one form in code.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    Field(pattern=QUANTITY_PATTERN, max_length=32),
    # int-or-string on the wire, like every quantity in Kubernetes. The syntax is
    # checked by the CEL rule of each field (POSITIVE_QUANTITY), whose message
    # reads better than a regular expression.
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": 32,
            "description": 'A Kubernetes quantity such as "500m", 2, "512Mi" or "10Gi".',
        }
    ),
]

# CEL for "strictly positive", for either form of a quantity.
POSITIVE_QUANTITY = (
    "type(self) == int ? self > 0"
    " : (isQuantity(self) ? quantity(self).isGreaterThan(quantity('0')) : false)"
)


def quantity_value(value: str) -> Decimal:
    return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]


DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"

ObjectName = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]


class LocalObjectReference(Model):
    """A reference to an object of a known kind in the same namespace."""

    name: ObjectName


class SecretKeySelector(Model):
    name: ObjectName
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


class EnvVarSource(Model):
    secret_key_ref: SecretKeySelector


class EnvVar(Model):
    """An environment variable: a literal value, or a key of a Secret."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "has(self.value) != has(self.valueFrom)",
                "exactly one of value or valueFrom must be set",
            )
        )
    )

    name: Annotated[str, Field(pattern=ENV_NAME_PATTERN, min_length=1, max_length=256)]
    value: Annotated[str, Field(max_length=32768)] | None = None
    value_from: EnvVarSource | None = None


class Condition(Model):
    """A status condition in the shape of metav1.Condition."""

    model_config = ConfigDict(extra="ignore")

    type: str
    status: str
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None
