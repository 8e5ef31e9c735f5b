"""Shared building blocks of the CRD models: base class, durations, quantities."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Self

from kubernetes.utils.quantity import parse_quantity
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

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

    def evolve(self, **changes: Any) -> Self:
        """A copy with `changes` (by field name; None clears a field), validated: a
        field that does not exist, or a value of the wrong type, fails here."""
        unknown = changes.keys() - type(self).model_fields.keys()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {', '.join(sorted(unknown))}")
        return type(self).model_validate({**dict(self), **changes})


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


def quantity_value(value: str) -> Decimal:
    return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Bounds:
    """Field metadata: a quantity or duration field must lie within [low, high].

    The same bounds are checked twice on purpose: by the API server (a CEL rule
    in the generated CRD), so a bad manifest is refused at admission with this
    message, and by the model, so an object built in code fails the same way.
    `Annotated[Quantity | None, Bounds.quantity("cpu", "10m", "512")]`."""

    field: str
    low: str
    high: str | None
    kind: str  # "quantity" or "duration"

    @classmethod
    def quantity(cls, field: str, low: str, high: str) -> Bounds:
        return cls(field, low, high, "quantity")

    @classmethod
    def duration(cls, field: str, low: str, high: str | None = None) -> Bounds:
        return cls(field, low, high, "duration")

    @property
    def message(self) -> str:
        span = f"from {self.low} to {self.high}" if self.high else f"at least {self.low}"
        noun = "a quantity " if self.kind == "quantity" else ""
        return f"{self.field} must be {noun}{span}"

    @property
    def rule(self) -> str:
        if self.kind == "quantity":
            # string(self): the value may be an int (`cpu: 2`) or a string (`cpu: 500m`).
            value = "quantity(string(self))"
            rule = f"isQuantity(string(self)) && {value}.compareTo(quantity('{self.low}')) >= 0"
            if self.high:
                rule += f" && {value}.compareTo(quantity('{self.high}')) <= 0"
            return rule
        rule = f"duration(self) >= duration('{self.low}')"
        if self.high:
            rule += f" && duration(self) <= duration('{self.high}')"
        return rule

    def _value(self, text: str) -> Decimal:
        if self.kind == "quantity":
            return quantity_value(text)
        return Decimal(parse_duration(text).total_seconds())

    def check(self, text: str | None) -> str | None:
        if text is None:
            return None
        value = self._value(text)
        if value < self._value(self.low) or (self.high and value > self._value(self.high)):
            raise ValueError(self.message)
        return text

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema: JsonSchemaValue = handler(schema)
        rules = json_schema.setdefault("x-kubernetes-validations", [])
        rules.append(cel(self.rule, self.message))
        return json_schema


def total_size_rule(limit: int, parts: dict[str, str], what: str) -> dict[str, str]:
    """A CEL rule bounding the combined size of a spec's large text fields.

    `parts` maps a field to a CEL expression of its size in characters (0 when
    unset). Kept well under the API server's 256 KiB limit on annotations,
    because `kubectl apply` copies the whole object into one."""
    total = " + ".join(f"({expr})" for expr in parts.values())
    return cel(
        f"{total} <= {limit}",
        f"{what} ({', '.join(parts)}) may hold at most {limit} characters together;"
        " put larger inputs into the workspace through the agent API",
    )


DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# A moment as RFC 3339 writes it (what Kubernetes' date-time format accepts).
RFC3339_PATTERN = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}"
    r"(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})$"
)
# An absolute path of plain segments (none is `.` or `..`: a segment starts with no dot).
MOUNT_PATH_PATTERN = r"^(/[A-Za-z0-9_][A-Za-z0-9._-]*)+$"
# Directories of the image or the pod that a workspace must not hide.
RESERVED_MOUNT_PATTERN = r"^/(proc|sys|dev|etc|tmp|run|usr|bin|sbin|lib|lib64|var|sandbox)(/|$)"

ObjectName = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]

# The characters a command's inputs (script or command, stdin, files, env values)
# may hold together (see api.common.total_size_rule).
MAX_INPUT_CHARACTERS = 131072


# Paths are relative to the workspace; the agent refuses escapes at run time,
# the schema refuses the obvious ones at admission.
RelativePath = Annotated[
    str,
    Field(
        min_length=1,
        max_length=4096,
        json_schema_extra=validations(
            cel(
                "!self.startsWith('/') && !self.split('/').exists(p, p == '..')",
                "must be a path relative to the workspace, without '..'",
            )
        ),
    ),
]


class InputFile(Model):
    """A file written into the workspace (before a command starts, or before a sandbox is
    Ready)."""

    path: RelativePath = Field(description="Where, relative to /workspace.")
    content: Annotated[str, Field(max_length=MAX_INPUT_CHARACTERS)] = Field(
        description="The file's text."
    )
    mode: Annotated[int | None, Field(ge=0, le=0o777)] = Field(
        default=None, description="File mode as a decimal integer, e.g. 493 for 0755."
    )


class LocalObjectReference(Model):
    """A reference to an object of a known kind in the same namespace."""

    name: ObjectName = Field(description="The object's name, in the same namespace.")


class SecretKeySelector(Model):
    """One key of a Secret in the same namespace."""

    name: ObjectName = Field(description="The Secret's name.")
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")] = Field(
        description="The key in the Secret's data."
    )


class EnvVarSource(Model):
    """Where a variable's value comes from."""

    secret_key_ref: SecretKeySelector = Field(description="A key of a Secret.")


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

    name: Annotated[str, Field(pattern=ENV_NAME_PATTERN, min_length=1, max_length=256)] = Field(
        description="The variable's name."
    )
    value: Annotated[str | None, Field(max_length=32768)] = Field(
        default=None, description="A literal value."
    )
    value_from: EnvVarSource | None = Field(
        default=None, description="A value read from a Secret when the command starts."
    )


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """A status condition in the shape of metav1.Condition."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="The condition's type, e.g. Ready.")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field(description="Why, in one CamelCase word that scripts can match.")
    message: str = Field(default="", description="Why, for people.")
    last_transition_time: str | None = Field(
        default=None, description="When the status last changed."
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation the condition was computed from."
    )


def readable(error: ValidationError, root: str = "spec") -> str:
    """A pydantic error as one line per problem, with the field path as users write it."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"{root}.{where}: {item['msg']}")
    return "; ".join(parts)
