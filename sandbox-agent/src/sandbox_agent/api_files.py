"""The files API over HTTP: parameters in, files.* / patch / archive, bytes or JSON out."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncGenerator, Callable
from typing import IO, Any

from starlette.requests import Request
from starlette.responses import Response

from . import archive, files, metrics, models, patch, watch, watchpoll
from .errors import Busy, Invalid, TooLarge
from .paths import Workspace
from .routing import Args, Handler
from .state import AgentState, state_of
from .web import OCTET, TAR, Stream, body_as, event_stream, ok, one_of, spool_upload

LINE_RANGE_BYTES = 16 << 20
READ_BLOCK = 512 << 10  # streamed reads go in blocks of this size


def file_op(op: str) -> None:
    metrics.FILE_OPS.labels(op, "ok").inc()


def _bytes_out(data: bytes) -> bytes:
    metrics.FILE_BYTES.labels("out").inc(len(data))
    return data


async def file_read(request: Request, args: Args) -> Response:
    """Read a file (whole, byte range or line range)"""
    st = state_of(request)
    s = st.settings
    rel = args.need("path", str)
    offset = args.get("offset", int)
    length = args.get("length", int)
    start_line = args.get("startLine", int)
    line_count = args.get("lineCount", int)
    if (offset is not None or length is not None) and (
        start_line is not None or line_count is not None
    ):
        raise Invalid("invalid_request", "use either a byte range or a line range, not both")
    st.touch()
    fd, size = await asyncio.to_thread(files.open_for_read, st.workspace, rel)
    headers = {"X-File-Size": str(size)}
    if start_line is not None or line_count is not None:
        try:
            # Line ranges are assembled in memory: a far tighter cap than
            # streamed reads, checked as the lines are read.
            data = await asyncio.to_thread(
                files.read_lines,
                fd,
                start_line or 1,
                line_count,
                min(s.max_read_bytes, LINE_RANGE_BYTES),
                s.max_read_bytes,
            )
        finally:
            os.close(fd)
        file_op("read")
        return Response(_bytes_out(data), media_type=OCTET, headers=headers)
    start = min(offset or 0, size)
    end = size if length is None else min(size, start + length)
    if end - start > s.max_read_bytes:
        os.close(fd)
        raise TooLarge("read_too_large", f"reads are limited to {s.max_read_bytes} bytes")
    if end - start <= 1 << 20:
        try:
            data = os.pread(fd, end - start, start)
        finally:
            os.close(fd)
        # What was read, not what fstat said: a file rewritten meanwhile (a
        # shell's `echo > f` truncates first) is shorter, and a length promised
        # but not sent is a broken answer, not a short file.
        headers["Content-Length"] = str(len(data))
        headers["X-Range"] = f"{start}-{start + len(data)}"
        file_op("read")
        return Response(_bytes_out(data), media_type=OCTET, headers=headers)
    headers["Content-Length"] = str(end - start)
    headers["X-Range"] = f"{start}-{end}"

    async def chunks() -> AsyncGenerator[bytes, None]:
        pos = start
        try:
            while pos < end:
                # What a reader that stops reading leaves in memory: the block
                # sent and the next one.
                data = await asyncio.to_thread(os.pread, fd, min(READ_BLOCK, end - pos), pos)
                if not data:
                    break  # file shrank: the client sees a short body
                pos += len(data)
                yield _bytes_out(data)
        finally:
            os.close(fd)

    file_op("read")
    return Stream(chunks(), media_type=OCTET, headers=headers)


async def file_write_raw(request: Request, args: Args) -> Response:
    """Write a file atomically from the raw body"""
    st = state_of(request)
    rel = args.need("path", str)
    mode = files.parse_mode(args.get("mode", str))  # the route bounds its syntax
    parents = args.need("parents", bool)
    st.touch()
    w = await asyncio.to_thread(files.AtomicWriter, st.workspace, rel, mode, parents)
    try:
        total = await spool_upload(
            request, lambda b: asyncio.to_thread(w.write_chunks, b), st.settings.max_upload_bytes
        )
        result = await asyncio.to_thread(w.commit)
    except BaseException:
        w.abort()
        raise
    metrics.FILE_BYTES.labels("in").inc(total)
    file_op("write")
    return ok(result)


async def _in_thread(request: Request, op: str, call: Callable[[], Any]) -> Response:
    """Count the call as activity, run the file operation off the event loop, answer JSON."""
    state_of(request).touch()
    result = await asyncio.to_thread(call)
    file_op(op)
    return ok(result)


async def file_write_json(request: Request, args: Args) -> Response:
    """Write a file atomically from JSON"""
    st = state_of(request)
    req = await body_as(request, models.WriteRequest)
    data = one_of(req.content, req.content_base64, ("content", "contentBase64")) or b""
    metrics.FILE_BYTES.labels("in").inc(len(data))
    mode = files.parse_mode(req.mode)
    return await _in_thread(
        request, "write", lambda: files.write_bytes(st.workspace, req.path, data, mode, req.parents)
    )


async def file_stat(request: Request, args: Args) -> Response:
    """Stat a path (a final symlink is described itself unless follow=true)"""
    st = state_of(request)
    path, follow = args.need("path", str), args.need("follow", bool)
    return await _in_thread(request, "stat", lambda: files.stat(st.workspace, path, follow))


async def file_list(request: Request, args: Args) -> Response:
    """List a directory"""
    st = state_of(request)
    path, depth, hidden = args.need("path", str), args.need("depth", int), args.need("hidden", bool)
    limit = st.settings.list_max_entries
    return await _in_thread(
        request, "list", lambda: files.list_dir(st.workspace, path, depth, hidden, limit)
    )


SCAN_WAIT = 10.0  # seconds a scan waits for a slot before 429 files_busy


def _json_file_op(
    op: str,
    summary: str,
    typ: type[Any],
    fn: Callable[[AgentState, Any], Any],
    scan: bool = False,
) -> Handler:
    """A handler for a JSON-bodied file operation: decode ``typ``, run ``fn`` in a
    thread; a `scan` (reads whole files) first takes one of the scan slots."""

    async def handler(request: Request, args: Args) -> Response:
        st = state_of(request)
        req = await body_as(request, typ)
        if not scan:
            return await _in_thread(request, op, lambda: fn(st, req))
        try:
            async with asyncio.timeout(SCAN_WAIT):
                await st.file_scans.acquire()
        except TimeoutError:
            raise Busy(
                "files_busy",
                f"{st.settings.max_file_scans} searches, patches or replaces are running"
                " (SANDBOX_AGENT_MAX_FILE_SCANS); retry later",
            ) from None
        try:
            return await _in_thread(request, op, lambda: fn(st, req))
        finally:
            st.file_scans.release()

    handler.__name__ = f"file_{op}"
    handler.__doc__ = summary
    return handler


# The JSON-bodied operations: name, summary, request type, the call into the domain.
# fmt: off
file_mkdir = _json_file_op("mkdir", "Create a directory", models.MkdirRequest,
                           lambda st, r: files.mkdir(st.workspace, r))
file_remove = _json_file_op("remove", "Remove a file, link or directory", models.RemoveRequest,
                            lambda st, r: files.remove(st.workspace, r))
file_move = _json_file_op("move", "Move / rename", models.MoveRequest,
                          lambda st, r: files.move(st.workspace, r))
file_search = _json_file_op("search", "Search file contents by regex", models.SearchRequest,
                            lambda st, r: files.search(st.workspace, r, st.settings), scan=True)
file_find = _json_file_op("find", "Find paths by glob", models.FindRequest,
                          lambda st, r: files.find(st.workspace, r, st.settings), scan=True)
file_patch = _json_file_op("patch", "Apply a unified diff (all or nothing)", models.PatchRequest,
                           lambda st, r: patch.apply(st.workspace, r, st.settings), scan=True)
file_replace = _json_file_op("replace", "Find and replace in one file", models.ReplaceRequest,
                             lambda st, r: files.replace(st.workspace, r, st.settings), scan=True)
# fmt: on


async def archive_download(request: Request, args: Args) -> Response:
    """Download a directory as tar (or tar.gz)"""
    st = state_of(request)
    rel = args.need("path", str)
    gz = args.need("gzip", bool)
    st.touch()
    # Validate before the 200 goes out; errors inside the stream can only cut it short.
    stream = await asyncio.to_thread(archive.TarStream, st.workspace, rel, gz)

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            while True:
                chunk = await asyncio.to_thread(stream.next_chunk)
                if chunk is None:
                    return
                yield _bytes_out(chunk)
        finally:
            stream.close()  # also on a client disconnect: the producer thread ends

    file_op("archive_download")
    name = (stream.top.rsplit("/", 1)[-1] if stream.top != "." else "") or "workspace"
    name = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name)
    return Stream(
        body(),
        media_type="application/gzip" if gz else TAR,
        headers={"Content-Disposition": f'attachment; filename="{name}.tar{".gz" if gz else ""}"'},
    )


def _spool(ws: Workspace) -> IO[bytes]:
    """A file for an archive upload while it arrives: unnamed (O_TMPFILE) in the
    workspace, where its contents will land anyway, not in the agent's small
    /tmp volume (filling that would get the pod evicted)."""
    try:
        root = ws.open_root()
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=root)
        finally:
            os.close(root)
    except OSError:  # a filesystem without O_TMPFILE
        return tempfile.TemporaryFile(prefix="sandbox-agent-upload-")
    return os.fdopen(fd, "w+b")


async def archive_upload(request: Request, args: Args) -> Response:
    """Upload a tar (optionally gzip/bz2/xz) and extract it into a directory"""
    st = state_of(request)
    rel = args.need("path", str)
    st.workspace.clean(rel)
    st.touch()
    with _spool(st.workspace) as spool:

        async def sink(chunks: list[bytes]) -> None:
            await asyncio.to_thread(spool.writelines, chunks)

        total = await spool_upload(request, sink, st.settings.max_upload_bytes)
        metrics.FILE_BYTES.labels("in").inc(total)
        spool.seek(0)
        result = await asyncio.to_thread(archive.extract, st.workspace, rel, spool, st.settings)
    file_op("archive_upload")
    return ok(result)


def _stream(st: AgentState, rel: str, recursive: bool) -> watch.Stream:
    """A watch of `rel`, not yet open: inotify, or polling where inotify cannot see
    the sandbox container's changes."""
    s = st.settings
    limits = watch.Limits(
        queue=s.watch_queue,
        directories=s.watch_max_directories,
        entries=s.watch_poll_max_entries,
    )
    if watchpoll.choose_mode(s.watch_mode, st.workspace.root) == "poll":
        return watchpoll.Poller(st.workspace, rel, recursive, limits, s.watch_poll_interval)
    return watch.Watcher(st.workspace, rel, recursive, limits)


async def file_watch(request: Request, args: Args) -> Response:
    """Watch a directory: its changes as a stream of events (ndjson, or SSE)

    The first event, `started`, comes once every watch is in place: a change
    made after it is seen. Then `create`, `write`, `remove`, `rename` and
    `chmod`, each with its path (relative to the workspace, under the path as
    named here), `fileType` and `time`; `keepalive` after
    SANDBOX_AGENT_WATCH_KEEPALIVE seconds (15) of quiet. `recursive` watches the
    subdirectories too, and those made or moved in later (what a new directory
    already holds is reported as `create`, possibly twice). Symlinks are
    reported, never followed. Writes and chmods of one file collapse while one
    for it is still unsent. When more changes wait than
    SANDBOX_AGENT_WATCH_QUEUE, the rest are dropped and one `overflow` event
    says so (and how many): rescan what you track. The stream ends with
    `finished` when the directory is removed or moved, or after
    `timeoutSeconds`; leaving ends it too. Opening one counts as activity, the
    stream itself does not: a watch alone does not keep a sandbox from its
    idle timeout. `started` says how changes are found (`mode`): inotify, or
    poll where inotify cannot see the sandbox container's changes (under
    gVisor: each container mounts the workspace as a filesystem of its own),
    comparing scans every `pollInterval` seconds: what was made and removed
    between two scans is not reported, and a rename is told by inode. 429:
    `too_many_watches` (SANDBOX_AGENT_MAX_WATCHES streams open),
    `too_many_watched_directories` (a recursive tree over
    SANDBOX_AGENT_WATCH_MAX_DIRECTORIES), `too_many_watched_entries` (poll: over
    SANDBOX_AGENT_WATCH_POLL_MAX_ENTRIES), `inotify_limit` (the kernel's).
    """
    st = state_of(request)
    s = st.settings
    rel, recursive = args.need("path", str), args.need("recursive", bool)
    timeout = args.need("timeoutSeconds", float)
    if sum(1 for w in st.watchers if not w.closed) >= s.max_watches:
        raise Busy(
            "too_many_watches",
            f"{s.max_watches} watches are open (SANDBOX_AGENT_MAX_WATCHES): close one first",
        )
    w = _stream(st, rel, recursive)
    st.watchers.add(w)  # holds its slot while the watches are added
    with files.os_errors(rel):  # a missing parent directory: 404, as for every file call
        await asyncio.to_thread(w.open)  # closes itself on failure
    # Opening a watch is a file call like any other; what it streams afterwards
    # is not activity (see the docstring).
    st.touch()
    file_op("watch")
    return event_stream(watch.events(w, s.watch_keepalive, timeout), request, {})


async def watcher_create(request: Request, args: Args) -> Response:
    """Watch a directory, the changes kept by the agent for fetching later

    For a client that cannot keep a watch stream open: the same watch, held
    under an id. GET .../events returns what it saw since the previous fetch
    (the changes the kernel has queued by then included), DELETE ends it. At
    most SANDBOX_AGENT_MAX_WATCHERS (8) at once (429 `too_many_watchers`); one
    nobody fetched from for SANDBOX_AGENT_WATCHER_IDLE_TIMEOUT seconds (600) is
    removed. Changes past SANDBOX_AGENT_WATCH_QUEUE wait are dropped, and one
    `overflow` event says how many. Creating one counts as activity; fetching
    does not.
    """
    st = state_of(request)
    req = await body_as(request, models.WatcherRequest)
    st.polled.check_room()
    w = _stream(st, req.path, req.recursive)
    with files.os_errors(req.path):
        await asyncio.to_thread(w.open)  # closes itself on failure
    try:
        made = st.polled.add(w)
    except BaseException:
        w.close()
        raise
    st.touch()
    file_op("watcher")
    return ok(made, 201)


async def watcher_list(request: Request, args: Args) -> Response:
    """The watchers the agent keeps"""
    return ok(state_of(request).polled.list())


async def watcher_events(request: Request, args: Args) -> Response:
    """The changes a watcher saw since the previous fetch"""
    return ok(state_of(request).polled.events(args.need("id", str)))


async def watcher_delete(request: Request, args: Args) -> Response:
    """End a watcher"""
    state_of(request).polled.remove(args.need("id", str))
    return Response(status_code=204)
