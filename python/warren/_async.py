"""asyncio HTTP/1.1 transport: a pool of keep-alive stream connections per
client, bounded by a semaphore, so thousands of sandboxes share a few hundred
sockets and no thread."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import AsyncIterator, List, Optional, Tuple

from ._common import (MAX_HEAD, MAX_BODY, Request, Response, Target, body_mode, keep_alive,
                      parse_chunk_size, parse_header_line, parse_status_line)
from .errors import ConnectError, ConnectionLost, ProtocolError, Timeout, WarrenError


class _AConn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r = reader
        self.w = writer
        self.got_bytes = False

    def close(self) -> None:
        try:
            self.w.close()
        except (OSError, RuntimeError):
            pass

    def stale(self) -> bool:
        return self.r.at_eof() or self.w.is_closing() or bool(getattr(self.r, "_buffer", b""))

    async def readline(self) -> bytes:
        try:
            line = await self.r.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            if e.partial:
                self.got_bytes = True
            raise ConnectionLost("the daemon closed the connection"
                                 + (" mid-response" if self.got_bytes else " before answering")) from None
        except asyncio.LimitOverrunError:
            raise ProtocolError("response line too long") from None
        self.got_bytes = True
        return line

    async def read(self, n: int) -> bytes:
        try:
            data = await self.r.readexactly(n)
        except asyncio.IncompleteReadError:
            raise ConnectionLost("the daemon closed the connection mid-response") from None
        self.got_bytes = True
        return data


async def _read_head(c: _AConn) -> Tuple[int, dict]:
    while True:
        status = parse_status_line(await c.readline())
        headers: dict = {}
        size = 0
        while True:
            line = await c.readline()
            if line in (b"\r\n", b"\n"):
                break
            size += len(line)
            if size > MAX_HEAD:
                raise ProtocolError("response headers too large")
            parse_header_line(line, headers)
        if status != 100:
            return status, headers


async def _body_chunks(c: _AConn, method: str, status: int, headers: dict) -> AsyncIterator[bytes]:
    mode, n = body_mode(method, status, headers)
    if mode == "length":
        while n > 0:
            part = await c.read(min(n, 1 << 20))
            n -= len(part)
            yield part
    elif mode == "chunked":
        while True:
            size = parse_chunk_size(await c.readline())
            if size == 0:
                while await c.readline() not in (b"\r\n", b"\n"):
                    pass
                return
            yield await c.read(size)
            if await c.read(2) != b"\r\n":
                raise ProtocolError("malformed chunk terminator")
    elif mode == "close":
        while True:
            part = await c.r.read(1 << 20)
            if not part:
                return
            yield part


def _short(req: Request) -> str:
    return f"{req.method} {req.path.split('?')[0]}"


class AsyncTransport:
    """Connection pool for one event loop. ``max_connections`` bounds the
    sockets open at once (requests beyond it wait for a free one)."""

    def __init__(self, target: Target, token: Optional[str], max_connections: int = 256,
                 max_idle: Optional[int] = None) -> None:
        self.target = target
        self.token = token
        self.max_connections = max_connections
        self.max_idle = max_idle if max_idle is not None else max_connections
        self._idle: List[_AConn] = []
        self._sem: Optional[asyncio.Semaphore] = None
        self._closed = False
        self.opened = 0  # connections ever opened (tests check reuse)

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_connections)
        return self._sem

    async def _connect(self) -> _AConn:
        try:
            if self.target.unix_path:
                r, w = await asyncio.open_unix_connection(self.target.unix_path, limit=MAX_HEAD * 4)
            else:
                r, w = await asyncio.open_connection(self.target.host, self.target.port,
                                                     limit=MAX_HEAD * 4)
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise ConnectError(f"cannot connect to warrend at {self.target}: {e.strerror or e}") from None
        self.opened += 1
        return _AConn(r, w)

    async def _get(self) -> _AConn:
        if self._closed:
            raise ConnectError("the client is closed")
        while self._idle:
            c = self._idle.pop()
            if c.stale():
                c.close()
                continue
            return c
        return await self._connect()

    def _put(self, c: _AConn) -> None:
        if not self._closed and len(self._idle) < self.max_idle and not c.stale():
            c.got_bytes = False
            self._idle.append(c)
        else:
            c.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        for c in idle:
            try:
                await c.w.wait_closed()
            except (OSError, RuntimeError):
                pass

    async def _start(self, req: Request) -> Tuple[_AConn, int, dict]:
        attempts = 2 if req.retryable else 1
        head = req.head(self.token, "localhost" if self.target.unix_path else
                        f"{self.target.host}:{self.target.port}")
        for attempt in range(attempts):
            c = await self._get()
            try:
                try:
                    c.w.write(head + req.body if req.body else head)
                    await c.w.drain()
                    status, headers = await _read_head(c)
                    return c, status, headers
                except (ConnectionLost, OSError) as e:
                    if attempt + 1 < attempts and not c.got_bytes:
                        c.close()
                        continue
                    if isinstance(e, WarrenError):
                        raise
                    raise ConnectionLost(f"{_short(req)}: {e}") from None
            except BaseException:
                # cancelled or failed mid-request: the connection's state is unknown
                c.close()
                raise
        raise AssertionError("unreachable")

    async def call(self, req: Request) -> object:
        """Run one request to completion under its deadline."""
        sem = self._semaphore()
        try:
            async with asyncio.timeout(req.timeout):
                async with sem:
                    c, status, headers = await self._start(req)
                    try:
                        body = bytearray()
                        async for part in _body_chunks(c, req.method, status, headers):
                            body += part
                            if len(body) > MAX_BODY:
                                raise ProtocolError("response body too large")
                    except OSError as e:
                        c.close()
                        raise ConnectionLost(f"{_short(req)}: {e}") from None
                    except BaseException:
                        c.close()
                        raise
                    if keep_alive(headers) and body_mode(req.method, status, headers)[0] != "close":
                        self._put(c)
                    else:
                        c.close()
        except TimeoutError as e:
            if isinstance(e, WarrenError):
                raise
            raise Timeout(f"{_short(req)}: no complete answer within {req.timeout:g}s") from None
        return req.result(Response(status, headers, bytes(body)))

    async def stream(self, req: Request) -> "AsyncStream":
        """Start a streaming request; holds a connection slot until closed."""
        sem = self._semaphore()
        deadline = time.monotonic() + req.timeout
        try:
            async with asyncio.timeout(req.timeout):
                await sem.acquire()
                try:
                    c, status, headers = await self._start(req)
                except BaseException:
                    sem.release()
                    raise
        except TimeoutError as e:
            if isinstance(e, WarrenError):
                raise
            raise Timeout(f"{_short(req)}: no answer within {req.timeout:g}s") from None
        return AsyncStream(self, req, c, status, headers, deadline)


class AsyncStream:
    """An open streaming response; iterate :meth:`chunks`, then :meth:`close`."""

    def __init__(self, t: AsyncTransport, req: Request, c: _AConn, status: int, headers: dict,
                 deadline: float) -> None:
        self.t, self.req, self.c = t, req, c
        self.status, self.headers, self.deadline = status, headers, deadline
        self.done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.c is None:
            return
        it = _body_chunks(self.c, self.req.method, self.status, self.headers)
        try:
            while True:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise Timeout("the stream did not finish before the deadline")
                try:
                    async with asyncio.timeout(left):
                        part = await it.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError as e:
                    if isinstance(e, WarrenError):
                        raise
                    raise Timeout("the stream did not finish before the deadline") from None
                except OSError as e:
                    raise ConnectionLost(f"stream broken: {e}") from None
                yield part
        except BaseException:
            self.close()
            raise
        self.done = True
        c, self.c = self.c, None
        if c is not None:
            if keep_alive(self.headers) and body_mode(self.req.method, self.status, self.headers)[0] != "close":
                self.t._put(c)
            else:
                c.close()
            self.t._semaphore().release()

    def close(self) -> None:
        """Drop the connection (the daemon kills a streaming exec whose client left)."""
        c, self.c = self.c, None
        if c is not None:
            c.close()
            self.t._semaphore().release()
