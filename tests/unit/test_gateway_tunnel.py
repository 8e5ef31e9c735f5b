"""The gateway's WebSocket relay (gateway/tunnel.py): the upstream's side, on
real loopback sockets (an upstream that answers the handshake, and a sink
standing for the caller's connection)."""

from __future__ import annotations

import asyncio

from sandbox_operator.gateway import tunnel

SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"


def test_what_comes_right_behind_the_101_is_relayed_whole() -> None:
    """A terminal's replay can follow the 101 at once, more than the handshake's
    buffer holds: reading pauses until the relay starts, then all of it and
    what comes after reaches the caller."""

    async def test() -> None:
        replay, later = b"r" * (1 << 20), b"and then some"
        go_on = asyncio.Event()

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(SWITCH + replay)
            await go_on.wait()
            writer.write(later)
            await writer.drain()

        received = bytearray()
        whole = asyncio.Event()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1 << 16):
                received.extend(data)
                if len(received) == len(replay) + len(later):
                    whole.set()

        up_server = await asyncio.start_server(answer, "127.0.0.1", 0)
        sink_server = await asyncio.start_server(sink, "127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(
            tunnel.Upstream, "127.0.0.1", up_server.sockets[0].getsockname()[1]
        )
        assert upstream.transport is not None
        upstream.transport.write(b"GET /attach HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await upstream.head()).startswith(b"HTTP/1.1 101")
        await asyncio.sleep(0.3)  # the replay arrives before the relay starts
        caller, _ = await loop.create_connection(
            asyncio.Protocol, "127.0.0.1", sink_server.sockets[0].getsockname()[1]
        )
        upstream.relay(caller)
        go_on.set()
        await asyncio.wait_for(whole.wait(), 10)
        assert bytes(received) == replay + later
        upstream.close()
        caller.close()
        up_server.close()
        sink_server.close()

    asyncio.run(asyncio.wait_for(test(), 30))
