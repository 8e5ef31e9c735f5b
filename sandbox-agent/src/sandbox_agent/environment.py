"""The environment overlay: variables for commands started from now on.

Changing a Sandbox's env used to replace its pod (killing running commands).
Instead the operator PUTs an overlay; every command started afterwards gets
the runner's own environment, minus ``unset``, plus ``env``, plus the
request's own env (which wins). Running commands keep what they started
with. The overlay lives in the log dir (an emptyDir: it outlives an agent
restart, not the pod) and is identified by a hash the operator can compute
from its own spec to know whether the agent has the current one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
from typing import Any

from . import models
from .errors import Invalid, IOFailure, NoSpace, TooLarge

log = logging.getLogger("sandbox_agent.environment")

NAME = "environment.json"
# All of it rides in every spawn request (1 MiB frames, with the arguments).
MAX_TOTAL_BYTES = 256 << 10


def overlay_hash(env: dict[str, str], unset: list[str]) -> str:
    """Lowercase hex sha256 of the canonical JSON the operator computes too."""
    canonical = json.dumps(
        {"env": env, "unset": sorted(unset)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def check(env: dict[str, str], unset: list[str]) -> None:
    """What the request schema cannot say (names and sizes it checks itself)."""
    seen: set[str] = set()
    for name in unset:
        if name in seen:
            raise Invalid("invalid_environment", f"unset names {name!r} twice", name=name)
        seen.add(name)
    total = sum(len(k.encode()) + len(v.encode()) for k, v in env.items())
    total += sum(len(n.encode()) for n in unset)
    if total > MAX_TOTAL_BYTES:
        raise TooLarge(
            "environment_too_large",
            f"names and values together exceed {MAX_TOTAL_BYTES} bytes",
            maximum=MAX_TOTAL_BYTES,
        )


class Environment:
    def __init__(self, log_dir: str) -> None:
        self.path = os.path.join(log_dir, NAME)
        self.env: dict[str, str] = {}
        self.unset: list[str] = []
        self.hash = overlay_hash({}, [])
        # PUTs write in a worker thread: one at a time, so that the file and the
        # overlay in memory are always the same one.
        self.writing = asyncio.Lock()
        self._load()

    def replace(self, env: dict[str, str], unset: list[str]) -> None:
        """Make (env, unset) the whole overlay, on disk first: never a merge."""
        check(env, unset)
        unset = sorted(unset)
        self._save({"env": env, "unset": unset})
        self.env, self.unset, self.hash = dict(env), unset, overlay_hash(env, unset)

    def view(self) -> models.EnvironmentView:
        return models.EnvironmentView(env=self.env, unset=self.unset, hash=self.hash)

    def _save(self, data: dict[str, Any]) -> None:
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            kind = NoSpace if exc.errno in (errno.ENOSPC, errno.EDQUOT) else IOFailure
            raise kind("environment_not_saved", f"cannot save the overlay: {exc}") from None

    def _load(self) -> None:
        try:
            with open(self.path) as f:
                data = json.load(f)
            env, unset = data["env"], data["unset"]
            if not (
                isinstance(env, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
                and isinstance(unset, list)
                and all(isinstance(n, str) for n in unset)
            ):
                raise TypeError("not an overlay")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # The hash in /v1/info then tells the operator to PUT it again.
            log.warning("ignoring unreadable %s: %s", self.path, exc)
            return
        self.env, self.unset, self.hash = env, sorted(unset), overlay_hash(env, unset)
