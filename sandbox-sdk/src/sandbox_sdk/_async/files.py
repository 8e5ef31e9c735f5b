"""Files: a sandbox's workspace (`sandbox.files`), and watches of its directories."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import httpx

from sandbox_sdk import _lazy
from sandbox_sdk._wire import FileContent
from sandbox_sdk.errors import ConfigError, Invalid, NotFound, NotReady, ServerError
from sandbox_sdk.types import Progress

if TYPE_CHECKING:
    from sandbox_sdk._async.sandbox import AsyncSandbox
    from sandbox_sdk.models import agent
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    agent = _lazy.module("sandbox_sdk.models.agent")

JSON = dict[str, Any]
CHUNK = 1 << 16
# A watch's stream carries a keepalive line every 15 s while nothing changes:
# this long without a line, the connection is taken for dead.
WATCH_READ_TIMEOUT = 120.0


def _extract(tar: tarfile.TarFile, target: Path) -> None:
    """Extract what stays inside `target`: tarfile's "data" filter where this
    Python has it (3.11.4 and later), else the same refusals by hand."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(target, filter="data")
        return
    root = target.resolve()
    for member in tar.getmembers():
        where = (root / member.name).resolve()
        link = (where.parent / member.linkname).resolve() if member.issym() else root
        if member.islnk():
            link = (root / member.linkname).resolve()
        inside = all(p == root or root in p.parents for p in (where, link))
        if not inside or not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise Invalid(f"the archive's entry {member.name!r} would leave {target}")
        member.mode &= 0o777
    tar.extractall(target)


class AsyncFiles:
    """The sandbox's workspace (paths relative to it; escapes are refused)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    async def read(
        self, path: str, *, start_line: int | None = None, line_count: int | None = None
    ) -> str:
        """A text file, whole or the lines from `start_line` (1-based), `line_count` of them."""
        params = {"path": path}
        if start_line is not None:
            params["startLine"] = str(start_line)
            if line_count is None:
                line_count = 1 << 30
        if line_count is not None:
            params["lineCount"] = str(line_count)
            params.setdefault("startLine", "1")
        answer = await self.sandbox._request("GET", "files/content", params=params)
        return answer.content.decode(errors="replace")

    async def read_bytes(
        self, path: str, *, offset: int | None = None, length: int | None = None
    ) -> bytes:
        """A file's bytes, whole or `length` bytes from `offset`."""
        params = {"path": path}
        if offset is not None:
            params["offset"] = str(offset)
        if length is not None:
            params["length"] = str(length)
        return (await self.sandbox._request("GET", "files/content", params=params)).content

    async def write(
        self, path: str, content: FileContent, *, mode: str | None = None
    ) -> agent.FileInfo:
        """Write a file atomically (parent directories are made)."""
        params = {"path": path, "parents": "true"}
        if mode:
            params["mode"] = mode
        data = content.encode() if isinstance(content, str) else content
        answer = await self.sandbox._request("PUT", "files/content", params=params, content=data)
        return agent.FileInfo.model_validate(answer.json())

    async def write_many(self, files: Mapping[str, FileContent], *, path: str = ".") -> int:
        """Write several files in one request (a tar extracted under `path`);
        returns how many were written."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, content in files.items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(name.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        await self.sandbox._request(
            "PUT", "files/archive", params={"path": path}, content=buffer.getvalue()
        )
        return len(files)

    async def list(
        self, path: str = ".", *, depth: int = 1, hidden: bool = True
    ) -> builtins.list[agent.FileInfo]:
        """Entries of a directory (`depth` levels down)."""
        answer = await self.sandbox._request(
            "GET",
            "files/list",
            params={"path": path, "depth": str(depth), "hidden": str(hidden).lower()},
        )
        return agent.FileList.model_validate(answer.json()).entries

    async def stat(self, path: str) -> agent.FileInfo:
        answer = await self.sandbox._request("GET", "files/stat", params={"path": path})
        return agent.FileInfo.model_validate(answer.json())

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True, exist_ok: bool = True) -> None:
        await self.sandbox._request(
            "POST",
            "files/mkdir",
            json_body={"path": path, "parents": parents, "existOk": exist_ok},
        )

    async def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> bool:
        """Remove a file or (with `recursive`) a directory; whether it existed."""
        answer = await self.sandbox._request(
            "POST",
            "files/remove",
            json_body={"path": path, "recursive": recursive, "missingOk": missing_ok},
        )
        return bool(answer.json().get("removed"))

    async def move(self, source: str, destination: str, *, overwrite: bool = False) -> None:
        await self.sandbox._request(
            "POST",
            "files/move",
            json_body={
                "source": source,
                "destination": destination,
                "overwrite": overwrite,
                "parents": True,
            },
        )

    async def grep(
        self,
        pattern: str,
        path: str = ".",
        *,
        glob: str | None = None,
        ignore_case: bool = False,
        fixed: bool = False,
        max_results: int | None = None,
    ) -> agent.SearchResult:
        """Search file contents by regular expression (or `fixed` string)."""
        body: JSON = {
            "pattern": pattern,
            "path": path,
            "ignoreCase": ignore_case,
            "fixedString": fixed,
        }
        if glob:
            body["glob"] = glob
        if max_results:
            body["maxResults"] = max_results
        answer = await self.sandbox._request("POST", "files/search", json_body=body)
        return agent.SearchResult.model_validate(answer.json())

    async def find(
        self,
        pattern: str,
        path: str = ".",
        *,
        kind: str | None = None,
        max_depth: int | None = None,
    ) -> builtins.list[str]:
        """Paths matching a glob (`kind`: file or directory)."""
        body: JSON = {"pattern": pattern, "path": path}
        if kind:
            body["type"] = kind
        if max_depth is not None:
            body["maxDepth"] = max_depth
        answer = await self.sandbox._request("POST", "files/find", json_body=body)
        return agent.FindResult.model_validate(answer.json()).paths

    async def apply_patch(
        self, patch: str, *, strip: int = 1, dry_run: bool = False
    ) -> agent.PatchResult:
        """Apply a unified diff over any number of files: all hunks or none
        (Conflict naming the hunk that does not apply)."""
        answer = await self.sandbox._request(
            "POST", "files/patch", json_body={"patch": patch, "strip": strip, "dryRun": dry_run}
        )
        return agent.PatchResult.model_validate(answer.json())

    async def replace(
        self,
        path: str,
        find: str,
        replace: str,
        *,
        all: bool = False,
        regex: bool = False,
        expected_count: int | None = None,
    ) -> int:
        """Find and replace in one file; how many replacements. Conflict when
        nothing matches, or several do and `all` is not set."""
        body: JSON = {"path": path, "find": find, "replace": replace, "all": all, "regex": regex}
        if expected_count is not None:
            body["expectedCount"] = expected_count
        answer = await self.sandbox._request("POST", "files/replace", json_body=body)
        return int(answer.json()["replacements"])

    def watch(
        self, path: str = ".", *, recursive: bool = False, timeout: float | None = None
    ) -> AsyncWatch:
        """Watch a directory's changes, as they happen:

            with sandbox.files.watch("src", recursive=True) as changes:
                for event in changes:
                    print(event.type, event.path)  # create, write, remove, rename, chmod

        Inside the `with` the watch is in place: every later change is seen.
        `recursive`: subdirectories too, and those made later. `timeout`:
        seconds after which the stream ends (None: when closed). An `overflow`
        event says changes were dropped (more came than the agent holds for a
        slow reader): rescan what you track. Watching is not activity: it does
        not keep the sandbox from its idle timeout."""
        return AsyncWatch(self.sandbox, path, recursive, timeout)

    async def download_url(self, path: str, *, ttl: int = 600) -> str:
        """A URL that downloads `path` (a directory: as tar) without credentials
        until it expires (a signed URL of the gateway): on the gateway's external
        URL when the chart sets one (`gateway.externalURL`), else at the address
        this client reaches the gateway by. ConfigError when that is the API
        server's proxy, which no request without Kubernetes credentials passes."""
        location = await self.sandbox.client.gateway.locate()
        body = {"path": path, "ttlSeconds": ttl}
        answer = (await self.sandbox._request("POST", "urls", json_body=body)).json()
        if answer.get("external"):
            return str(answer["url"])
        if location.via_api_server:
            raise ConfigError(
                "the gateway is reached through the API server's proxy, which needs"
                " Kubernetes credentials: a link that works without them needs the"
                " gateway's own address (the chart's gateway.externalURL, or"
                " gateway_url= or $SANDBOX_GATEWAY_URL here; e.g. an Ingress to the gateway)"
            )
        return location.base + str(answer["path"])

    async def download_tar(
        self,
        path: str,
        destination: str | os.PathLike[str] | IO[bytes],
        *,
        gzip: bool = False,
        progress: Progress | None = None,
    ) -> int:
        """Stream `path` (a directory) as a tar into a file; the bytes written."""
        own = isinstance(destination, str | os.PathLike)
        out: IO[bytes] = (
            open(destination, "wb")  # noqa: SIM115 -- closed in the finally below
            if isinstance(destination, str | os.PathLike)
            else destination
        )
        done = 0
        try:
            async with self.sandbox.client.gateway.stream(
                self.sandbox.namespace,
                self.sandbox.name,
                "GET",
                "files/archive",
                params={"path": path, "gzip": str(gzip).lower()},
            ) as response:
                async for chunk in response.aiter_bytes(CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, None)
        finally:
            if own:
                out.close()
        return done

    async def download_dir(
        self, path: str, local: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> Path:
        """Download a directory of the sandbox into `local` (made if missing)."""
        target = Path(local)
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as spool:
            await self.download_tar(path, spool, progress=progress)
            spool.seek(0)
            with tarfile.open(fileobj=spool, mode="r:") as tar:
                _extract(tar, target)
        return target

    async def upload_dir(
        self,
        local: str | os.PathLike[str],
        path: str = ".",
        *,
        progress: Progress | None = None,
    ) -> agent.ArchiveResult:
        """Upload a local directory's contents into `path`, as a streamed tar."""
        source = Path(local)
        if not source.is_dir():
            raise Invalid(f"{source} is not a directory")
        with tempfile.TemporaryFile() as spool:
            with tarfile.open(fileobj=spool, mode="w") as tar:
                for entry in sorted(source.iterdir()):
                    tar.add(entry, arcname=entry.name)
            total = spool.tell()
            spool.seek(0)
            answer = await self._upload(path, spool, total, progress)
        return agent.ArchiveResult.model_validate(answer)

    async def upload_tar(
        self,
        archive: IO[bytes],
        path: str = ".",
        *,
        size: int | None = None,
        progress: Progress | None = None,
    ) -> agent.ArchiveResult:
        """Extract a tar (optionally compressed) read from `archive` into `path`."""
        return agent.ArchiveResult.model_validate(await self._upload(path, archive, size, progress))

    async def _upload(
        self, path: str, source: IO[bytes], total: int | None, progress: Progress | None
    ) -> JSON:
        async def chunks() -> AsyncIterator[bytes]:
            done = 0
            while True:
                chunk = source.read(CHUNK)
                if not chunk:
                    return
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
                yield chunk

        headers = {"Content-Length": str(total)} if total is not None else None
        async with self.sandbox.client.gateway.stream(
            self.sandbox.namespace,
            self.sandbox.name,
            "PUT",
            "files/archive",
            params={"path": path},
            content=chunks(),
            headers=headers,
        ) as response:
            await response.aread()
            answer: JSON = response.json()
            return answer


class AsyncWatch:
    """A directory watch (`files.watch()`): a context manager, and an iterator
    of `WatchEvent`s (`type` create, write, remove, rename, chmod or overflow;
    `path` relative to the workspace; `file_type` file or directory; `time`;
    `old_path` and `move` for a rename). The iteration ends when the watched
    directory is removed or moved, when the timeout passes (`end_reason` says
    which), or at `close()`. A stream cut off (the sandbox paused, an agent or
    gateway restart) raises ServerError: changes since may be missed."""

    def __init__(
        self, sandbox: AsyncSandbox, path: str, recursive: bool, timeout: float | None
    ) -> None:
        self.sandbox = sandbox
        self.path = path
        self.recursive = recursive
        self.timeout = timeout
        self.started: agent.WatchEvent | None = None
        self.end_reason: str | None = None
        self.closed = False
        self._stream: AbstractAsyncContextManager[httpx.Response] | None = None
        self._lines: AsyncIterator[str] | None = None

    def __repr__(self) -> str:
        return f"<AsyncWatch {self.sandbox.name}:{self.path} recursive={self.recursive}>"

    async def __aenter__(self) -> AsyncWatch:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncWatch:
        return self

    async def open(self) -> None:
        """Start watching (done by `with` and by the first iteration); returns
        once the watch is in place."""
        if self._lines is not None or self.closed:
            return
        params = {"path": self.path, "recursive": str(self.recursive).lower()}
        if self.timeout is not None:
            params["timeoutSeconds"] = str(self.timeout)
        for attempt in range(3):
            stream = self.sandbox.client.gateway.stream(
                self.sandbox.namespace,
                self.sandbox.name,
                "GET",
                "files/watch",
                params=params,
                read_timeout=WATCH_READ_TIMEOUT,
            )
            try:
                response = await stream.__aenter__()
            except (NotReady, NotFound) as exc:
                if attempt == 2 or not await self.sandbox._worth_waiting(exc):
                    raise
                continue
            self._stream, self._lines = stream, response.aiter_lines()
            break
        first = await self._event()
        if first is None or first.type != "started":
            await self.aclose()
            raise ServerError(f"the watch did not start: {first}")
        self.started = first

    async def _event(self) -> agent.WatchEvent | None:
        """The next event of the stream, keepalives skipped; None at its end."""
        while self._lines is not None:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                return None
            except httpx.TransportError as exc:
                await self.aclose()
                raise ServerError(f"the watch of {self.path} broke off: {exc}") from exc
            if line:
                event = agent.WatchEvent.model_validate_json(line)
                if event.type != "keepalive":
                    return event
        return None

    async def __anext__(self) -> agent.WatchEvent:
        await self.open()
        event = await self._event()
        if event is None or event.type == "finished":
            self.end_reason = event.reason if event is not None else self.end_reason
            await self.aclose()
            raise StopAsyncIteration
        if event.type == "interrupted":
            await self.aclose()
            why = event.error.message if event.error is not None else "no reason given"
            raise ServerError(f"the watch of {self.path} was interrupted: {why}")
        return event

    async def aclose(self) -> None:
        """Stop watching (the agent removes its watches at once)."""
        self.closed = True
        stream, self._stream, self._lines = self._stream, None, None
        if stream is not None:
            with contextlib.suppress(httpx.HTTPError, OSError):
                await stream.__aexit__(None, None, None)
