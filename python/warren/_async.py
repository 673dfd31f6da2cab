"""asyncio HTTP/1.1 transport: a pool of keep-alive stream connections per
client, bounded by a semaphore, so thousands of sandboxes share a few hundred
sockets and no thread."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import AsyncIterator, List, Optional, Tuple

from ._common import (FAILOVER_CONNECT, MAX_HEAD, MAX_BODY, Failover, Request, Response, Target,
                      body_mode, keep_alive, parse_chunk_size, parse_header_line,
                      parse_status_line, stream_lost)
from .errors import ConnectError, ConnectionLost, ProtocolError, Timeout, WarrenError


class _AConn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 where: int = 0) -> None:
        self.r = reader
        self.w = writer
        self.where = where  # index of its host in the transport's list
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
    """Connection pool for one event loop, to one daemon or to the current host
    of a list of gateways (failing over as :class:`Failover` says).
    ``max_connections`` bounds the sockets open at once (requests beyond it
    wait for a free one)."""

    def __init__(self, target: Target, token: Optional[str], max_connections: int = 256,
                 max_idle: Optional[int] = None) -> None:
        self.target = target
        self.targets = target.all()
        self._cur = 0  # the host requests go to; moves on failure only
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

    @property
    def current(self) -> Target:
        return self.targets[self._cur]

    def _advance(self, frm: int) -> None:
        """Leave host frm for the next one (unless another task already did)."""
        if self._cur == frm:
            self._cur = (frm + 1) % len(self.targets)

    async def _connect(self, where: int) -> _AConn:
        t = self.targets[where]
        try:
            if t.unix_path:
                opening = asyncio.open_unix_connection(t.unix_path, limit=MAX_HEAD * 4)
            else:
                opening = asyncio.open_connection(t.host, t.port, limit=MAX_HEAD * 4)
            if len(self.targets) > 1:  # one silent host must not eat the deadline
                r, w = await asyncio.wait_for(opening, FAILOVER_CONNECT)
            else:
                r, w = await opening
            if not t.unix_path:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except asyncio.TimeoutError:
            raise ConnectError(f"connecting to {t} timed out") from None
        except OSError as e:
            raise ConnectError(f"cannot connect to warrend at {t}: {e.strerror or e}") from None
        self.opened += 1
        return _AConn(r, w, where)

    async def _get(self, where: int) -> _AConn:
        if self._closed:
            raise ConnectError("the client is closed")
        while self._idle:
            c = self._idle.pop()
            if c.where != where or c.stale():
                c.close()
                continue
            return c
        return await self._connect(where)

    def _put(self, c: _AConn) -> None:
        if not self._closed and len(self._idle) < self.max_idle and not c.stale() \
                and c.where == self._cur:
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

    async def _start(self, req: Request, fo: Failover) -> Tuple[_AConn, int, dict]:
        while True:
            where = self._cur
            t = self.targets[where]
            try:
                c = await self._get(where)
            except ConnectError:
                if fo.connect_failed():
                    self._advance(where)
                    continue
                raise
            head = req.head(self.token, "localhost" if t.unix_path else f"{t.host}:{t.port}")
            try:
                try:
                    c.w.write(head + req.body if req.body else head)
                    await c.w.drain()
                    status, headers = await _read_head(c)
                    return c, status, headers
                except (ConnectionLost, OSError) as e:
                    c.close()
                    step = fo.lost(c.got_bytes)
                    if step == "same":
                        continue
                    if step == "next":
                        self._advance(where)
                        continue
                    if isinstance(e, WarrenError) and c.got_bytes:
                        raise
                    raise ConnectionLost(fo.lost_message(t) + f" ({e})") from None
            except BaseException:
                # cancelled or failed mid-request: the connection's state is unknown
                c.close()
                raise

    async def call(self, req: Request) -> object:
        """Run one request to completion under its deadline."""
        sem = self._semaphore()
        fo = Failover(req, len(self.targets))
        deadline = time.monotonic() + req.timeout
        while True:
            where = self._cur
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    async with sem:
                        c, status, headers = await self._start(req, fo)
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
            resp = Response(status, headers, bytes(body))
            step = fo.answered(resp, deadline, time.monotonic())
            if step == "next":
                self._advance(where)
                continue
            if step is not None:
                await asyncio.sleep(step)
                continue
            return req.result(resp)

    async def stream(self, req: Request) -> "AsyncStream":
        """Start a streaming request; holds a connection slot until closed."""
        sem = self._semaphore()
        deadline = time.monotonic() + req.timeout
        try:
            async with asyncio.timeout(req.timeout):
                await sem.acquire()
                try:
                    c, status, headers = await self._start(req, Failover(req, len(self.targets)))
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
                    raise stream_lost(e) from None
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
