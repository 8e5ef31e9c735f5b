"""The gateway's lean client for calls to agents (gateway/upstream.py), against
a real TCP server on loopback that answers as each test scripts it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sandbox_operator.gateway import upstream
from sandbox_operator.gateway.upstream import MAX_HEAD, BrokenAnswer, Pool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Upstream:
    """A server that runs `script` for each connection, and counts them."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection saw its peer close
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
            if await reader.read() == b"":
                self.closed.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed.set()
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """One request: its head, and its body by Content-Length."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        whole = head + await reader.readexactly(length)
        self.requests.append(whole)
        return whole


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


def test_a_request_is_one_write_and_its_connection_is_kept() -> None:
    async def test() -> None:
        async def answer_twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(2):
                await up.request(reader)
                writer.write(OK)

        async with Upstream(answer_twice) as up:
            pool = Pool(5.0)
            headers = {"Authorization": "Bearer t", "Expect": "100-continue", "X-A": "b"}
            for _ in range(2):
                answer = await pool.request(
                    "POST", f"{up.url}/v1/code/run", {"path": "a b/ü&x"}, headers, b'{"code":1}'
                )
                assert (answer.status, answer.content_length) == (200, 2)
                assert answer.headers["Content-Type"] == "application/json"
                assert await answer.read() == b"{}"
                answer.release()
            assert up.connections == 1
            head, _, body = up.requests[0].partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            assert lines[0] == b"POST /v1/code/run?path=a+b/%C3%BC%26x HTTP/1.1"
            assert f"Host: {up.url[7:]}".encode() in lines
            assert b"Authorization: Bearer t" in lines
            assert b"X-A: b" in lines
            assert b"Content-Length: 10" in lines
            assert body == b'{"code":1}'
            # The body is whole: nothing may wait for a 100 Continue.
            assert not any(line.lower().startswith(b"expect") for line in lines)
            pool.close()

    run(test)


def test_a_streamed_body_comes_as_it_is_sent() -> None:
    async def test() -> None:
        more = asyncio.Event()

        async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
            await more.wait()
            writer.write(b"3\r\ntwo\r\n0\r\n\r\n")

        async with Upstream(stream) as up:
            pool = Pool(5.0)
            answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            assert answer.content_length is None
            pieces = answer.content.iter_any()
            assert await anext(pieces) == b"one"
            assert not answer.content.at_eof()
            more.set()
            assert await anext(pieces) == b"two"
            assert answer.content.at_eof()
            answer.release()
            pool.close()

    run(test)


def test_an_answer_that_closes_its_connection_is_not_kept() -> None:
    async def test() -> None:
        async def close_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")

        async with Upstream(close_after) as up:
            pool = Pool(5.0)
            for _ in range(2):
                answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
                assert await answer.read() == b""
                answer.release()
            assert up.connections == 2
            pool.close()

    run(test)


def test_informational_answers_are_passed_over() -> None:
    async def test() -> None:
        async def hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
            writer.write(OK)

        async with Upstream(hints) as up:
            pool = Pool(5.0)
            answer = await pool.request("POST", f"{up.url}/v1/x", None, {}, b"{}")
            assert answer.status == 200
            assert "link" not in answer.headers
            assert await answer.read() == b"{}"
            answer.release()
            pool.close()

    run(test)


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * MAX_HEAD + b"\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
    ],
    ids=["not-http", "head-too-long", "unasked-upgrade"],
)
def test_what_is_not_an_answer_is_refused(reply: bytes) -> None:
    async def test() -> None:
        async def bad(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(reply)

        async with Upstream(bad) as up:
            pool = Pool(5.0)
            with pytest.raises(BrokenAnswer, match=r"not valid HTTP/1\.1|longer than"):
                await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            pool.close()

    run(test)


def test_an_answer_cut_off_is_an_error_after_what_came() -> None:
    async def test() -> None:
        async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
            await writer.drain()
            writer.transport.abort()

        async with Upstream(cut) as up:
            pool = Pool(5.0)
            answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            pieces = answer.content.iter_any()
            assert await anext(pieces) == b"part"
            with pytest.raises(BrokenAnswer, match="before its answer ended"):
                await anext(pieces)
            answer.close()
            pool.close()

    run(test)


def test_a_caller_that_leaves_closes_the_upstream_connection() -> None:
    async def test() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            if up.connections == 1:  # the second call gets no answer at all
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")

        async with Upstream(silent) as up:
            pool = Pool(5.0)
            answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            answer.close()  # before the end, as proxy.py does when its caller left
            await asyncio.wait_for(up.closed.wait(), 5)
            # and one cancelled while it waits for the head
            up.closed.clear()
            waiting = asyncio.create_task(pool.request("GET", f"{up.url}/v1/x", None, {}, None))
            await asyncio.sleep(0.2)
            assert up.connections == 2
            assert not waiting.done()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.wait_for(up.closed.wait(), 5)
            pool.close()

    run(test)


def test_calls_to_one_upstream_wait_for_a_slot() -> None:
    async def test() -> None:
        async def answer_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await up.request(reader)
                writer.write(OK)

        async with Upstream(answer_all) as up:
            pool = Pool(5.0, per_upstream=1)
            first = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            second = asyncio.create_task(pool.request("GET", f"{up.url}/v1/y", None, {}, None))
            await asyncio.sleep(0.2)
            assert not second.done()
            assert len(up.requests) == 1
            assert await first.read() == b"{}"
            first.release()
            answer = await second
            assert await answer.read() == b"{}"
            answer.release()
            assert up.connections == 1  # the slot's connection, kept and used again
            pool.close()

    run(test)


def test_a_kept_connection_that_speaks_unasked_is_not_used_again() -> None:
    async def test() -> None:
        async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(OK)
            await asyncio.sleep(0.1)
            writer.write(OK)  # an answer nobody asked for
            await up.request(reader)

        async with Upstream(chatty) as up:
            pool = Pool(5.0)
            answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            assert await answer.read() == b"{}"
            answer.release()
            await asyncio.sleep(0.3)
            answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
            assert await answer.read() == b"{}"
            answer.release()
            assert up.connections == 2
            pool.close()

    run(test)


def test_kept_connections_are_let_go_when_they_close_or_wait_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod that goes away leaves nothing in the pool: its connections end at
    the upstream's close, or after KEEP_SECONDS when nothing says so."""
    monkeypatch.setattr(upstream, "KEEP_SECONDS", 0.3)

    async def test() -> None:
        async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(OK)
            if up.connections == 1:
                await asyncio.sleep(0.05)
                writer.close()  # the agent's own idle timeout, say

        async with Upstream(once) as up:
            pool = Pool(5.0)
            for _ in range(2):
                answer = await pool.request("GET", f"{up.url}/v1/x", None, {}, None)
                assert await answer.read() == b"{}"
                answer.release()
                assert pool.idle() == 1
                up.closed.clear()
                # the first: closed by the upstream; the second: by the pool, later
                for _ in range(40):
                    if not pool.idle():
                        break
                    await asyncio.sleep(0.05)
                assert pool.idle() == 0
            await asyncio.wait_for(up.closed.wait(), 5)
            assert up.connections == 2
            pool.close()

    run(test)


def test_a_large_body_is_handed_on_in_pieces() -> None:
    """A bulk copy yields to short calls per piece: a piece is never more than
    PIECE bytes, however much one read brought."""

    async def test() -> None:
        body = bytes(range(256)) * 2000  # 512,000 bytes

        async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await up.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

        async with Upstream(large) as up:
            pool = Pool(5.0)
            answer = await pool.request("GET", f"{up.url}/v1/files/content", None, {}, None)
            await asyncio.sleep(0.2)  # all of it in, in few reads
            pieces = [piece async for piece in answer.content.iter_any()]
            assert max(len(piece) for piece in pieces) <= upstream.PIECE
            assert b"".join(pieces) == body
            answer.release()
            pool.close()

    run(test)
