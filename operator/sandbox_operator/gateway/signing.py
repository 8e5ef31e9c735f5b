"""Scoped tokens and signed URLs: HMAC-SHA256 with keys that rotate.

Keys are files in one directory (a mounted Secret), the file name being the
key id. The newest key signs; every key present verifies, so a new key is
added, becomes the signer, and the old one is removed once what it signed has
expired: no downtime, no invalidated URLs. The directory is read again when
it changes (Secret updates reach mounted files within a minute).

A scoped token: `sbxt1.<claims, base64url JSON>.<full HMAC, base64url>`, bound
to one Sandbox object by UID (a deleted and recreated namesake refuses it),
a set of operations and an expiry. A signed URL carries `exp`, `kid` and `sig`
over the method, the sandbox (UID included), the path and the expiry.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "sbxt1."
RELOAD_SECONDS = 5.0
# The only shape a scoped token has: checked whole before anything is decoded,
# so a token with trailing bytes, a padded or altered signature, or a payload
# built to exhaust the JSON parser is refused as malformed.
_TOKEN = re.compile(r"sbxt1\.[A-Za-z0-9_-]{1,2048}\.[A-Za-z0-9_-]{43}")


class SigningError(Exception):
    """A token or URL that does not verify, or no key to sign with."""


@dataclass(frozen=True)
class Claims:
    namespace: str
    name: str
    uid: str
    operations: tuple[str, ...]
    expires: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Keys:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.keys: dict[str, bytes] = {}
        self.signer: str | None = None
        self._stamp: tuple[float, ...] | None = None
        self._checked = 0.0
        self.reload()

    @staticmethod
    def is_scoped(token: str) -> bool:
        return token.startswith(PREFIX)

    def reload(self) -> None:
        """Read the keys again when the directory changed (cheap to call often)."""
        now = time.monotonic()
        if now - self._checked < RELOAD_SECONDS and self._stamp is not None:
            return
        self._checked = now
        try:
            files = sorted(
                p for p in self.directory.iterdir() if p.is_file() and not p.name.startswith(".")
            )
        except OSError:
            files = []
        stamp = (*(p.stat().st_mtime for p in files), len(files))
        if stamp == self._stamp:
            return
        keys = {p.name: p.read_bytes().strip() for p in files}
        self.keys = {kid: key for kid, key in keys.items() if len(key) >= 32}
        # Key ids sort by age (the chart names them by date): the last one signs.
        self.signer = max(self.keys) if self.keys else None
        self._stamp = stamp

    def _key(self, kid: str) -> bytes:
        self.reload()
        key = self.keys.get(kid)
        if key is None:
            raise SigningError(f"unknown key id {kid!r} (rotated away?)")
        return key

    def _signing_key(self) -> tuple[str, bytes]:
        self.reload()
        if self.signer is None:
            raise SigningError(f"no signing key in {self.directory} (32 bytes or more each)")
        return self.signer, self.keys[self.signer]

    # -- scoped tokens ---------------------------------------------------------------

    def mint_token(self, claims: Claims) -> str:
        kid, key = self._signing_key()
        payload = {
            "ns": claims.namespace,
            "name": claims.name,
            "uid": claims.uid,
            "ops": list(claims.operations),
            "exp": claims.expires,
            "kid": kid,
        }
        body = PREFIX + _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{body}.{_b64(hmac.new(key, body.encode(), hashlib.sha256).digest())}"

    def verify_token(self, token: str) -> Claims:
        if not _TOKEN.fullmatch(token):
            raise SigningError("a malformed token")
        body, _, signature = token.rpartition(".")
        try:
            payload = json.loads(_unb64(body.removeprefix(PREFIX)))
            kid = str(payload["kid"])
            expected = hmac.new(self._key(kid), body.encode(), hashlib.sha256).digest()
            # Compared as text: one signature, one spelling.
            if not hmac.compare_digest(_b64(expected), signature):
                raise SigningError("the token's signature does not match")
            claims = Claims(
                namespace=str(payload["ns"]),
                name=str(payload["name"]),
                uid=str(payload["uid"]),
                operations=tuple(str(op) for op in payload["ops"]),
                expires=int(payload["exp"]),
            )
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise SigningError("a malformed token") from exc
        if claims.expires < time.time():
            raise SigningError("the token has expired")
        return claims

    # -- signed URLs ------------------------------------------------------------------

    @staticmethod
    def _message(method: str, namespace: str, name: str, uid: str, path: str, exp: int) -> bytes:
        return "\n".join((method, namespace, name, uid, path, str(exp))).encode()

    def sign_url(
        self, method: str, namespace: str, name: str, uid: str, path: str, expires: int
    ) -> dict[str, str]:
        """The query parameters that make a URL for `path` valid until `expires`."""
        kid, key = self._signing_key()
        message = self._message(method, namespace, name, uid, path, expires)
        sig = _b64(hmac.new(key, message, hashlib.sha256).digest())
        return {"exp": str(expires), "kid": kid, "sig": sig}

    def verify_url(
        self, method: str, namespace: str, name: str, uid: str, path: str, query: dict[str, str]
    ) -> None:
        """SigningError unless the query signs exactly this. `uid` "" (no such
        sandbox) fails as a wrong signature does, after the same checks, so the
        answer tells nothing about what exists."""
        try:
            exp = int(query["exp"])
            key = self._key(query["kid"])
            given = query["sig"]
        except (KeyError, ValueError) as exc:
            raise SigningError("not a signed URL (exp, kid and sig are needed)") from exc
        expected = hmac.new(
            key, self._message(method, namespace, name, uid, path, exp), hashlib.sha256
        ).digest()
        if not uid or not given.isascii() or not hmac.compare_digest(_b64(expected), given):
            raise SigningError("the URL's signature does not match")
        if exp < time.time():
            raise SigningError("the URL has expired")


def new_key() -> bytes:
    """A fresh random key, base64 text as stored in a Secret's file."""
    return base64.b64encode(os.urandom(48))
