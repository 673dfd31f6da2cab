"""Transport-independent pieces shared by the sync and asyncio clients: host
resolution, request encoding, response-head parsing and the request
descriptions each API method builds (so both clients speak the same API)."""

from __future__ import annotations

import json
import os
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import ConnectionLost, InvalidArgument, ProtocolError, WarrenError, error_from_response
from .types import encode_field
from ._version import __version__

DEFAULT_SOCKET = "/var/lib/warren/warrend.sock"
DEFAULT_TIMEOUT = 60.0         # seconds, for ordinary calls
SLOW_TIMEOUT = 900.0           # image import/pull/build, pack
EXEC_GRACE = 30.0              # HTTP deadline beyond an exec's own timeout
EXEC_DEFAULT_TIMEOUT = 600.0   # the daemon's default command timeout
MAX_HEAD = 64 * 1024
MAX_BODY = 256 * 1024 * 1024
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})
SDK_LABEL = "sdk_request"

Json = Dict[str, Any]


@dataclass(frozen=True)
class Target:
    """Where the daemon listens: a unix socket path or a TCP host and port.
    A host list is its first entry with the others in ``more`` (gateways of
    one cluster; the transports fail over between them, docs/cluster.md)."""
    unix_path: Optional[str] = None
    host: Optional[str] = None
    port: int = 0
    more: Tuple["Target", ...] = ()

    def __str__(self) -> str:
        one = f"unix:{self.unix_path}" if self.unix_path else f"http://{self.host}:{self.port}"
        return ",".join([one] + [str(t) for t in self.more])

    def all(self) -> List["Target"]:
        """Every host of the list, this one first (each without ``more``)."""
        return [Target(self.unix_path, self.host, self.port)] + [t for t in self.more]


MAX_HOSTS = 16  # as libwarren's WL_MAX_HOSTS


def _one_target(host: str) -> Target:
    if host.startswith("unix:"):
        path = host[5:]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise InvalidArgument(f"bad host {host!r}: empty socket path")
        return Target(unix_path=path)
    if host.startswith("/"):
        return Target(unix_path=host)
    if host.startswith("tcp:"):  # the daemon's --listen syntax
        host = "http://" + host[4:]
    if host.startswith("http://"):
        u = urllib.parse.urlsplit(host)
        if not u.hostname or u.path not in ("", "/"):
            raise InvalidArgument(f"bad host {host!r}: want http://HOST:PORT")
        try:
            port = u.port or 80
        except ValueError:
            raise InvalidArgument(f"bad host {host!r}: bad port") from None
        return Target(host=u.hostname, port=port)
    raise InvalidArgument(f"bad host {host!r}: want unix:/path/sock, http://host:port or tcp:host:port")


def resolve_target(host: Union[None, str, Sequence[str]]) -> Target:
    """``unix:/path``, ``http://host:port``, ``tcp:host:port`` (or a bare
    ``/path``), or several of them as a list or a comma-separated string;
    None -> ``$WARREN_HOST``, else ``unix:$WARREN_ROOT/warrend.sock``, else
    the default socket ``/var/lib/warren/warrend.sock``."""
    if not host:
        host = os.environ.get("WARREN_HOST") or ""
    if not host:
        root = os.environ.get("WARREN_ROOT")
        host = "unix:" + (os.path.join(root, "warrend.sock") if root else DEFAULT_SOCKET)
    entries = host.split(",") if isinstance(host, str) else list(host)
    if not all(isinstance(h, str) and h.strip() for h in entries):
        raise InvalidArgument(f"bad host list {host!r}: empty entry")
    if len(entries) > MAX_HOSTS:
        raise InvalidArgument(f"more than {MAX_HOSTS} hosts in {host!r}")
    targets = [_one_target(h.strip()) for h in entries]
    return Target(targets[0].unix_path, targets[0].host, targets[0].port, tuple(targets[1:]))


def resolve_token(token: Optional[str]) -> Optional[str]:
    if token is None:
        token = os.environ.get("WARREN_TOKEN") or None
    if token is not None and any(c in token for c in "\r\n\0"):
        raise InvalidArgument("the token must not contain CR, LF or NUL")
    return token


@dataclass
class Response:
    status: int
    headers: Dict[str, str]
    body: bytes = b""

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise ProtocolError(f"malformed JSON response (HTTP {self.status}): {e}") from None


@dataclass
class Request:
    """One API call: what to send, which statuses mean success, how to parse."""
    method: str
    path: str
    body: Optional[bytes] = None
    content_type: Optional[str] = None
    timeout: float = DEFAULT_TIMEOUT
    idempotent: Optional[bool] = None
    ok: Tuple[int, ...] = (200,)
    parse: Callable[[Response], Any] = field(default=lambda r: r.json())
    stream: bool = False
    idempotency_key: Optional[str] = None  # a create's; lets it be replayed on another gateway
    idempotency_auto: bool = False  # the SDK made the key up (it may make another)

    @property
    def retryable(self) -> bool:
        return self.method in IDEMPOTENT if self.idempotent is None else self.idempotent

    def head(self, token: Optional[str], host: str) -> bytes:
        lines = [f"{self.method} {self.path} HTTP/1.1", f"Host: {host}",
                 "User-Agent: warren-python/" + __version__]
        if token:
            lines.append(f"Authorization: Bearer {token}")
        if self.body is not None or self.method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(self.body or b'')}")
        if self.content_type:
            lines.append(f"Content-Type: {self.content_type}")
        if self.stream:
            lines.append("Accept: application/x-ndjson")
        if self.idempotency_key:
            lines.append(f"Idempotency-Key: {self.idempotency_key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def result(self, resp: Response) -> Any:
        """Parse a complete response: the value, or raise the mapped error."""
        if resp.status not in self.ok:
            raise_for(resp)
        return self.parse(resp)


IDEM_WAIT = 30.0  # s a replayed create waits for its first attempt (libwarren's WL_IDEM_WAIT_MS)
FAILOVER_CONNECT = 5.0  # s of connect per host when there are several


def error_code(resp: Response) -> Optional[str]:
    try:
        e = json.loads(resp.body).get("error") if resp.body else None
    except (ValueError, AttributeError):
        return None
    return e.get("code") if isinstance(e, dict) else None


class Failover:
    """One request's way through a host list (docs/cluster.md, "Clients and
    failover"); both transports ask it what to do after each attempt.

    - a connect failure (nothing sent): the next host, for any request;
    - the connection closed or reset before any answer: a retryable request
      (idempotent) is tried once more on the same host on a new connection
      (the daemon may have closed an idle keep-alive one); a replayable one (idempotent, or a create with an idempotency
      key when there are several hosts) goes to the next host; any other
      request (exec) fails with :class:`ConnectionLost`, never re-sent;
    - ``503 control_plane_unavailable`` (that gateway lost etcd and did
      nothing): the next host;
    - ``409 conflict`` to a create replayed with its key: the first attempt
      is still being made; ask again with backoff, up to ``IDEM_WAIT``; then
      (the gateway died after claiming the key and before any node made a
      sandbox) a key the SDK made up is replaced once by a fresh one.
    Every host is tried at most once per request; the transport stays on
    the host that answered."""

    def __init__(self, req: Request, nhosts: int) -> None:
        self.req = req
        self.n = nhosts
        self.replayable = req.retryable or (req.idempotency_key is not None and nhosts > 1)
        self.hops = 0
        self.stale_retried = False
        self.replayed = False
        self.waited = 0.0
        self.backoff = 0.025
        self.rekeyed = False

    def connect_failed(self) -> bool:
        """True: try the next host."""
        if self.hops + 1 < self.n:
            self.hops += 1
            return True
        return False

    def lost(self, got_bytes: bool) -> str:
        """After a broken attempt: "same" host again, "next" host, or "fail"."""
        if got_bytes:
            return "fail"
        if self.req.retryable and not self.stale_retried:
            self.stale_retried = True
            return "same"
        if self.replayable and self.hops + 1 < self.n:
            self.hops += 1
            self.replayed = True
            return "next"
        return "fail"

    def lost_message(self, target: object) -> str:
        what = f"{self.req.method} {self.req.path.split('?')[0]}"
        if self.replayable:
            return f"{what}: connection to {target} closed before an answer"
        return (f"{what}: connection to {target} closed before an answer: it may or may not "
                "have run, and is not sent again (an infrastructure failure)")

    def answered(self, resp: Response, deadline: float, now: float) -> Union[None, str, float]:
        """After a complete answer: None (done), "next" host, or seconds to
        wait before asking the same host again."""
        if resp.status == 503 and self.hops + 1 < self.n \
                and error_code(resp) == "control_plane_unavailable":
            self.hops += 1
            return "next"
        if resp.status == 409 and self.replayed and self.req.idempotency_key \
                and error_code(resp) == "conflict":
            if self.waited < IDEM_WAIT and now + self.backoff < deadline:
                delay = self.backoff
                self.waited += delay
                self.backoff = min(self.backoff * 2, 1.0)
                return delay
            if self.req.idempotency_auto and not self.rekeyed:
                self.rekeyed = True
                self.req.idempotency_key = create_key(None)
                return 0.0
        return None


def stream_lost(e: BaseException) -> ConnectionLost:
    """The error for a streamed answer cut off by a lost connection (a gateway
    or node that died): never replayed."""
    why = e.message if isinstance(e, WarrenError) else str(e)
    return ConnectionLost(f"stream broken: {why}: the command may or may not have finished, "
                          "and is not sent again (an infrastructure failure)")


def raise_for(resp: Response) -> None:
    try:
        obj = json.loads(resp.body) if resp.body else None
    except ValueError:
        obj = None
    raise error_from_response(resp.status, obj,
                              resp.body[:200].decode("utf-8", "replace") if resp.body else "")


def parse_status_line(line: bytes) -> int:
    parts = line.rstrip(b"\r\n").split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() \
            or len(parts[1]) != 3:
        raise ProtocolError(f"malformed status line {line[:80]!r}")
    return int(parts[1])


def parse_header_line(line: bytes, headers: Dict[str, str]) -> None:
    k, sep, v = line.rstrip(b"\r\n").partition(b":")
    if not sep or not k or k != k.strip():
        raise ProtocolError(f"malformed header line {line[:80]!r}")
    headers[k.decode("latin-1").lower()] = v.strip().decode("latin-1")


def body_mode(method: str, status: int, headers: Mapping[str, str]) -> Tuple[str, int]:
    """How the body is delimited: ("none"|"length"|"chunked"|"close", length)."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return "none", 0
    te = headers.get("transfer-encoding", "").lower()
    if te:
        if te.split(",")[-1].strip() != "chunked":
            raise ProtocolError(f"unsupported transfer-encoding {te!r}")
        return "chunked", 0
    cl = headers.get("content-length")
    if cl is not None:
        if not cl.isdigit():
            raise ProtocolError(f"bad content-length {cl!r}")
        n = int(cl)
        if n > MAX_BODY:
            raise ProtocolError(f"response body of {n} bytes is over the {MAX_BODY} limit")
        return "length", n
    return "close", 0


def parse_chunk_size(line: bytes) -> int:
    s = line.split(b";", 1)[0].strip()
    try:
        n = int(s, 16)
    except ValueError:
        raise ProtocolError(f"malformed chunk size {line[:40]!r}") from None
    if n < 0 or n > MAX_BODY:
        raise ProtocolError(f"chunk size {n} out of range")
    return n


def keep_alive(headers: Mapping[str, str]) -> bool:
    return "close" not in headers.get("connection", "").lower()


class LineSplitter:
    """Split a byte stream into NDJSON lines."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[bytes]:
        self._buf += data
        if len(self._buf) > MAX_BODY:
            raise ProtocolError("NDJSON line too long")
        out = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                return out
            line = bytes(self._buf[:i]).strip()
            del self._buf[:i + 1]
            if line:
                out.append(line)

    def rest(self) -> Optional[bytes]:
        line = bytes(self._buf).strip()
        self._buf.clear()
        return line or None


# ---- request builders (one per API call; shared by both clients) ----

def quote(s: str) -> str:
    return urllib.parse.quote(s, safe="")


# Sandbox ids: [a-z0-9-]{1,ID_MAX}, the daemon's and libwarren's rule
# (wr_id_valid in src/common/util.c, WR_ID_MAX in src/common/util.h).
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
ID_MAX = 64
# Pauses between label sweeps after a create whose answer was lost (~3 s in all).
REAP_DELAYS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)


def check_id(sid: str) -> str:
    if not isinstance(sid, str) or not sid or len(sid) > ID_MAX or \
            any(c not in _ID_CHARS for c in sid):
        raise InvalidArgument(f"malformed sandbox id {sid!r}")
    return sid


def check_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidArgument(f"sandbox paths must be absolute: {path!r}")
    return path


def json_req(method: str, path: str, body: Optional[Json] = None, **kw: Any) -> Request:
    data = None
    ctype = None
    if body is not None:
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        ctype = "application/json"
    req = Request(method, path, data, ctype, **kw)
    if method == "POST" and path == "/v1/sandboxes":
        req.idempotency_key = create_key(body)
        req.idempotency_auto = not isinstance((body or {}).get("idempotency_key"), str)
    return req


_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def create_key(body: Optional[Json]) -> Optional[str]:
    """Every create carries an idempotency key, the caller's
    (``idempotency_key=`` on create) or a random one, so that a create sent
    again through another gateway never makes a second sandbox."""
    given = (body or {}).get("idempotency_key")
    if isinstance(given, str):
        # a malformed key is the gateway's to refuse; it must not reach the header
        ok = 0 < len(given) <= 128 and all(c in _KEY_CHARS for c in given)
        return given if ok else None
    return "py-" + uuid.uuid4().hex


def exec_body(cmd: Union[None, str, Sequence[str]], shell: Optional[str], env: Optional[Mapping[str, str]],
              cwd: Optional[str], stdin: Union[None, bytes, str], timeout: Optional[float],
              stdout_cap: Optional[int], stderr_cap: Optional[int], step: Optional[str],
              extra: Optional[Mapping[str, Any]] = None) -> Json:
    """The JSON body of an exec/call. A ``str`` cmd is a shell command line."""
    if isinstance(cmd, str):
        if shell is not None:
            raise InvalidArgument("give either cmd or shell, not both")
        cmd, shell = None, cmd
    if (cmd is None) == (shell is None):
        raise InvalidArgument("exactly one of cmd or shell is required")
    body: Json = {}
    if cmd is not None:
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument("cmd must be a non-empty sequence of strings")
        body["cmd"] = argv
    else:
        if not isinstance(shell, str):
            raise InvalidArgument("shell must be a string")
        body["shell"] = shell
    if env is not None:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if stdin is not None:
        encode_field(body, "stdin", stdin)
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgument("timeout must be a positive number of seconds")
        body["timeout_s"] = timeout
    if stdout_cap is not None:
        body["stdout_cap"] = stdout_cap
    if stderr_cap is not None:
        body["stderr_cap"] = stderr_cap
    if step is not None:
        body["step"] = step
    if extra:
        body.update(extra)
    return body


def call_body(cmd: Union[None, str, Sequence[str]], shell: Optional[str], code: Optional[str],
              image: Optional[str], mode: Optional[str], env: Optional[Mapping[str, str]],
              stdin: Union[None, bytes, str], timeout: Optional[float],
              memory_mb: Optional[int], extra: Mapping[str, Any]) -> Json:
    """The body of ``POST /v1/calls``: a command (``cmd``/``shell``) or
    Python source (``code``, run by the pool's zygote)."""
    more: Json = dict(extra)
    for k, v in (("image", image), ("mode", mode), ("memory_mb", memory_mb)):
        if v is not None:
            more[k] = v
    if code is not None:
        if cmd is not None or shell is not None:
            raise InvalidArgument("give either code or cmd/shell, not both")
        if not isinstance(code, str):
            raise InvalidArgument("code must be a string of Python source")
        body = exec_body(None, "", env, None, stdin, timeout, None, None, None, more)
        del body["shell"]
        body.update(lang="python", code=code)
        return body
    return exec_body(cmd, shell, env, None, stdin, timeout, None, None, None, more)


def exec_deadline(body: Json, request_timeout: Optional[float]) -> float:
    if request_timeout is not None:
        return request_timeout
    return float(body.get("timeout_s") or EXEC_DEFAULT_TIMEOUT) + EXEC_GRACE


# CPU QoS classes (docs/containers.md, "Pause that frees memory, idle-pause, CPU QoS")
QOS_CLASSES = ("latency", "best-effort")


def create_body(backend: Optional[str], image: Optional[str], layers: Optional[Sequence[str]],
                memory_mb: Optional[int], cpus: Optional[float], disk_mb: Optional[int],
                pids_max: Optional[int], ttl_s: Optional[float], network: Optional[str],
                env: Optional[Mapping[str, str]], labels: Optional[Mapping[str, str]],
                extra: Optional[Mapping[str, Any]], qos: Optional[str] = None,
                idle_pause_s: Optional[int] = None) -> Json:
    body: Json = {}
    if qos is not None and qos not in QOS_CLASSES:
        raise InvalidArgument(f"qos must be one of {', '.join(QOS_CLASSES)}, not {qos!r}")
    if idle_pause_s is not None and (isinstance(idle_pause_s, bool) or not isinstance(idle_pause_s, int)
                                     or idle_pause_s < 0):
        raise InvalidArgument("idle_pause_s must be a whole number of seconds >= 0 (0: never)")
    for k, v in (("backend", backend), ("image", image), ("memory_mb", memory_mb),
                 ("cpus", cpus), ("disk_mb", disk_mb), ("pids_max", pids_max),
                 ("ttl_s", ttl_s), ("network", network), ("qos", qos),
                 ("idle_pause_s", idle_pause_s)):
        if v is not None:
            body[k] = v
    if layers is not None:
        if isinstance(layers, str):
            raise InvalidArgument("layers must be a list of image references")
        body["layers"] = list(layers)
    if env is not None:
        body["env"] = dict(env)
    body["labels"] = dict(labels or {})
    if extra:
        body.update(extra)
    return body


def files_path(sid: str, path: str, **q: Any) -> str:
    qs = "path=" + quote(check_path(path))
    for k, v in q.items():
        if v is None or v is False:
            continue
        qs += f"&{k}=" + quote("1" if v is True else str(v))
    return f"/v1/sandboxes/{check_id(sid)}/files?{qs}"
