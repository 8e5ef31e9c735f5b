"""Small state files of the local cluster: typed JSON records, atomic writes, locks.

Every record here (a component's PID file, cluster.json, a pod network, an
image's build metadata, ...) is read by processes other than the one that
wrote it: the CLI's `down` after `up` exited, the next test session after a
crash, another session on the same machine. So records are written
atomically (a reader never sees half a file) and read back into frozen
dataclasses by one decoder that checks every field's type, instead of each
caller picking keys out of a dict and converting them its own way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class RecordError(ValueError):
    """A record file is not what its dataclass describes (missing key, wrong type)."""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (parallel test runs, CLI and tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Write `path` through a temporary file and a rename: a crash or a
    concurrent reader never sees half a file (a half-written key or record
    would be taken for a broken one by the next run). `mode` is set before
    any data is in the file (keys, kubeconfigs)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plain(value: object) -> object:
    """`value` as JSON data: dataclasses as objects, tuples as lists, Paths and
    other classes as their str() (what `decode` rebuilds them from)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def encode(record: Any) -> dict[str, object]:
    """A dataclass record as JSON data. Keys whose value is None are left out
    (`decode` reads a missing optional key as None): older writers never
    wrote nulls, and readers of other versions may share these files."""
    data = plain(record)
    if not isinstance(data, dict):
        raise TypeError(f"not a dataclass record: {record!r}")
    return {key: value for key, value in data.items() if value is not None}


def save(record: Any, path: Path) -> None:
    write_atomic(path, json.dumps(encode(record), indent=2) + "\n")


def load(cls: type[T], path: Path) -> T:
    """The record in `path`. FileNotFoundError if there is none, RecordError
    (a ValueError) if it is not valid JSON of the shape `cls` describes."""
    try:
        data = json.loads(path.read_bytes())
    except ValueError as error:
        raise RecordError(f"{path}: {error}") from error
    try:
        return decode(cls, data)
    except RecordError as error:
        raise RecordError(f"{path}: {error}") from error


def decode(cls: type[T], data: object) -> T:
    """`data` (parsed JSON) as an instance of the dataclass `cls`, every field
    converted to and checked against its annotation: str, int, float, Path
    (and other classes built from a string, e.g. IPv4Network), lists, tuples,
    dicts, nested dataclasses and `X | None`. A missing key takes the field's
    default; one without a default is an error."""
    if not isinstance(data, dict):
        raise RecordError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in data:
            values[field.name] = _value(hints[field.name], data[field.name], field.name)
        elif _optional(hints[field.name]):
            if _has_default(field):
                continue
            values[field.name] = None
        elif not _has_default(field):
            raise RecordError(f"{cls.__name__}: missing {field.name!r}")
    return cls(**values)


def _has_default(field: dataclasses.Field[Any]) -> bool:
    return (
        field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    )


def _optional(hint: object) -> bool:
    return _is_union(hint) and type(None) in typing.get_args(hint)


def _is_union(hint: object) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _value(hint: Any, value: object, where: str) -> object:
    if _is_union(hint):
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) != 1:
            raise RecordError(f"{where}: unions other than `X | None` are not supported")
        return _value(options[0], value, where)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {value!r}")
        items = [_value(args[0], item, f"{where}[]") for item in value]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {value!r}")
        return {str(key): _value(args[1], item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return decode(hint, value)
    if hint is int:
        # bool is an int in Python, but never what a record means by one.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecordError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise RecordError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise RecordError(f"{where}: expected a string, got {value!r}")
    if isinstance(hint, type) and isinstance(value, str):
        # Path, IPv4Network, ...: written as their str(), rebuilt from it.
        try:
            return hint(value)
        except (TypeError, ValueError) as error:
            raise RecordError(f"{where}: {error}") from error
    raise RecordError(f"{where}: cannot read {value!r} as {hint!r}")
