"""Blocking HTTP/1.1 transport: a thread-safe pool of keep-alive connections
over a unix socket or TCP, with per-call deadlines."""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Iterator, List, Optional, Tuple

from ._common import (FAILOVER_CONNECT, MAX_HEAD, Failover, Request, Response, Target, body_mode,
                      keep_alive, parse_chunk_size, parse_header_line, parse_status_line,
                      stream_lost)
from .errors import ConnectError, ConnectionLost, ProtocolError, Timeout, WarrenError


class _Conn:
    """One socket with a read buffer; every read honours the call's deadline."""

    def __init__(self, sock: socket.socket, where: int = 0) -> None:
        self.sock = sock
        self.where = where       # index of its host in the transport's list
        self.buf = bytearray()
        self.got_bytes = False   # any response byte seen for the current request
        self.reused = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def stale(self) -> bool:
        """An idle keep-alive connection is readable only if the daemon closed
        it (or sent garbage): either way it must not carry a request."""
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(r) or bool(self.buf)

    def _settimeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout("the call's deadline passed")
        self.sock.settimeout(left)

    def send(self, data: bytes, deadline: float) -> None:
        self._settimeout(deadline)
        self.sock.sendall(data)

    def _fill(self, deadline: float) -> None:
        self._settimeout(deadline)
        data = self.sock.recv(256 * 1024)
        if not data:
            raise ConnectionLost("the daemon closed the connection"
                                 + (" mid-response" if self.got_bytes else " before answering"))
        self.got_bytes = True
        self.buf += data

    def readline(self, deadline: float, limit: int = MAX_HEAD) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                return line
            if len(self.buf) > limit:
                raise ProtocolError("response line too long")
            self._fill(deadline)

    def read(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read_some(self, deadline: float) -> bytes:
        if not self.buf:
            try:
                self._fill(deadline)
            except ConnectionLost:
                return b""
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _read_head(c: _Conn, deadline: float) -> Tuple[int, dict]:
    while True:
        status = parse_status_line(c.readline(deadline))
        headers: dict = {}
        size = 0
        while True:
            line = c.readline(deadline)
            if line in (b"\r\n", b"\n"):
                break
            size += len(line)
            if size > MAX_HEAD:
                raise ProtocolError("response headers too large")
            parse_header_line(line, headers)
        if status != 100:
            return status, headers


def _body_chunks(c: _Conn, method: str, status: int, headers: dict,
                 deadline: float) -> Iterator[bytes]:
    mode, n = body_mode(method, status, headers)
    if mode == "length":
        while n > 0:
            part = c.read(min(n, 1 << 20), deadline)
            n -= len(part)
            yield part
    elif mode == "chunked":
        while True:
            size = parse_chunk_size(c.readline(deadline))
            if size == 0:
                while c.readline(deadline) not in (b"\r\n", b"\n"):
                    pass
                return
            yield c.read(size, deadline)
            if c.read(2, deadline) != b"\r\n":
                raise ProtocolError("malformed chunk terminator")
    elif mode == "close":
        while True:
            part = c.read_some(deadline)
            if not part:
                return
            yield part


class SyncTransport:
    """Pool of keep-alive connections to one daemon, or to the current host of
    a list of gateways (failing over as :class:`Failover` says), safe to
    share by threads."""

    def __init__(self, target: Target, token: Optional[str], max_idle: int = 16) -> None:
        self.target = target
        self.targets = target.all()
        self.token = token
        self.max_idle = max_idle
        self._idle: List[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self._cur = 0  # the host requests go to; moves on failure only

    @property
    def current(self) -> Target:
        return self.targets[self._cur]

    def _advance(self, frm: int) -> None:
        """Leave host frm for the next one (unless another thread already did)."""
        with self._lock:
            if self._cur == frm:
                self._cur = (frm + 1) % len(self.targets)

    def _connect(self, deadline: float, where: int) -> _Conn:
        t = self.targets[where]
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout("the call's deadline passed before connecting")
        if len(self.targets) > 1:
            left = min(left, FAILOVER_CONNECT)  # one silent host must not eat the deadline
        try:
            if t.unix_path:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(left)
                try:
                    s.connect(t.unix_path)
                except BaseException:
                    s.close()
                    raise
            else:
                s = socket.create_connection((t.host, t.port), timeout=left)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except socket.timeout:
            if len(self.targets) > 1:
                raise ConnectError(f"connecting to {t} timed out") from None
            raise Timeout(f"connecting to {t} timed out") from None
        except OSError as e:
            raise ConnectError(f"cannot connect to warrend at {t}: {e.strerror or e}") from None
        return _Conn(s, where)

    def _get(self, deadline: float, where: int) -> _Conn:
        with self._lock:
            if self._closed:
                raise ConnectError("the client is closed")
            while self._idle:
                c = self._idle.pop()
                if c.where != where or c.stale():
                    c.close()
                    continue
                c.reused = True
                return c
        return self._connect(deadline, where)

    def _put(self, c: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle and not c.buf \
                    and c.where == self._cur:
                c.got_bytes = False
                self._idle.append(c)
                return
        c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _start(self, req: Request, deadline: float, fo: Failover) -> Tuple[_Conn, int, dict]:
        """Send the request and read the response head, on the current host
        or the next ones as fo decides."""
        while True:
            where = self._cur
            t = self.targets[where]
            try:
                c = self._get(deadline, where)
            except ConnectError:
                if fo.connect_failed():
                    self._advance(where)
                    continue
                raise
            head = req.head(self.token, "localhost" if t.unix_path else f"{t.host}:{t.port}")
            try:
                try:
                    if req.body and len(req.body) < 65536:
                        c.send(head + req.body, deadline)
                    else:
                        c.send(head, deadline)
                        if req.body:
                            c.send(req.body, deadline)
                    status, headers = _read_head(c, deadline)
                    return c, status, headers
                except socket.timeout:
                    raise Timeout(f"{req.method} {req.path.split('?')[0]}: no answer before the deadline") from None
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
                c.close()
                raise

    def call(self, req: Request) -> object:
        """Run one request to completion and return its parsed result."""
        deadline = time.monotonic() + req.timeout
        fo = Failover(req, len(self.targets))
        while True:
            where = self._cur
            c, status, headers = self._start(req, deadline, fo)
            try:
                body = bytearray()
                for part in _body_chunks(c, req.method, status, headers, deadline):
                    body += part
                    if len(body) > 256 * 1024 * 1024:
                        raise ProtocolError("response body too large")
            except socket.timeout:
                c.close()
                raise Timeout(f"{req.method} {req.path.split('?')[0]}: response not complete before the deadline") from None
            except OSError as e:
                c.close()
                raise ConnectionLost(f"{req.method} {req.path.split('?')[0]}: {e}") from None
            except BaseException:
                c.close()
                raise
            if keep_alive(headers) and body_mode(req.method, status, headers)[0] != "close":
                self._put(c)
            else:
                c.close()
            resp = Response(status, headers, bytes(body))
            step = fo.answered(resp, deadline, time.monotonic())
            if step == "next":
                self._advance(where)
                continue
            if step is not None:
                time.sleep(step)
                continue
            return req.result(resp)

    def stream(self, req: Request) -> "SyncStream":
        """Start a streaming request; the caller iterates the body chunks."""
        deadline = time.monotonic() + req.timeout
        c, status, headers = self._start(req, deadline, Failover(req, len(self.targets)))
        return SyncStream(self, req, c, status, headers, deadline)


class SyncStream:
    """An open streaming response. Iterate :meth:`chunks`; :meth:`close`
    drops the connection unless the body was read to its end."""

    def __init__(self, t: SyncTransport, req: Request, c: _Conn, status: int, headers: dict,
                 deadline: float) -> None:
        self.t, self.req, self.c = t, req, c
        self.status, self.headers, self.deadline = status, headers, deadline
        self.done = False

    def error_body(self) -> bytes:
        return b"".join(self.chunks())

    def chunks(self) -> Iterator[bytes]:
        if self.c is None:
            return
        try:
            for part in _body_chunks(self.c, self.req.method, self.status, self.headers,
                                     self.deadline):
                yield part
        except socket.timeout:
            self.close()
            raise Timeout("the stream did not finish before the deadline") from None
        except OSError as e:
            self.close()
            raise stream_lost(e) from None
        self.done = True
        if keep_alive(self.headers) and body_mode(self.req.method, self.status, self.headers)[0] != "close":
            c, self.c = self.c, None
            if c is not None:
                self.t._put(c)
        else:
            self.close()

    def close(self) -> None:
        c, self.c = self.c, None
        if c is not None:
            c.close()
