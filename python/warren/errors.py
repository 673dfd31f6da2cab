"""Exceptions raised by the Warren SDK.

Every error the daemon sends (``{"error": {"code", "message"}}``, see
docs/api.md) becomes an instance of the :class:`WarrenError` subclass for its
``code``; the HTTP status is kept in :attr:`WarrenError.status`. Failures on
the client side (cannot connect, connection lost, malformed response, the
call's own deadline) use the same hierarchy with ``status == 0``.

Whose failure (docs/errors.md, "Infra or task"): every class derives from
:class:`InfraError` (the platform failed: agent or node lost, daemon gone
mid-request, out of capacity, the platform's own limits and timeouts,
internal errors; retry, or mask the sample) or from :class:`TaskError` (the
request or the caller: invalid argument, not found, ...), and every error
has :attr:`WarrenError.infra_failure`. A command that ran is never an error:
its exit code, timeout or OOM is the task's result
(``ExecResult.infra_failure`` is False).
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "WarrenError", "InvalidArgument", "Unauthorized", "NotFound", "Conflict", "Gone",
    "PayloadTooLarge", "ResourceExhausted", "InternalError", "Unsupported", "Unavailable",
    "Timeout", "ConnectError", "ConnectionLost", "ProtocolError", "error_from_response",
    "error_from_stream", "InfraError", "TaskError", "NodeLost", "Forbidden",
]


class WarrenError(Exception):
    """Base class of every SDK error.

    Attributes:
        code: the API error code (``"not_found"``, ...) or a client-side code
            (``"connect_failed"``, ``"connection_lost"``, ``"protocol_error"``,
            ``"timeout"``).
        status: HTTP status of the failed response, 0 when none arrived.
        message: human readable explanation from the daemon or the client.
    """

    code: str = "unknown"
    #: the platform's failure (True) or the request's / task's (False)
    infra_failure: bool = False

    def __init__(self, message: str, *, code: Optional[str] = None, status: int = 0):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.status = status

    def __str__(self) -> str:
        where = f"HTTP {self.status} " if self.status else ""
        return f"{self.message} ({where}{self.code})"


class InfraError(WarrenError):
    """The platform failed, not the task: retry it, or mask the sample
    instead of scoring it (``infra_failure`` is True)."""
    infra_failure = True


class TaskError(WarrenError):
    """The request or the caller failed (bad argument, unknown id, ...): the
    platform did what it was asked (``infra_failure`` is False)."""
    infra_failure = False


class InvalidArgument(TaskError, ValueError):
    """400: malformed request, wrong field type, bad path or value."""
    code = "invalid_argument"


class Unauthorized(TaskError, PermissionError):
    """401: missing or wrong bearer token (TCP)."""
    code = "unauthorized"


class Forbidden(TaskError, PermissionError):
    """403: the token does not grant this (host paths over TCP, docs/operations.md)."""
    code = "forbidden"


class NotFound(TaskError, LookupError):
    """404: unknown sandbox, image, file or route."""
    code = "not_found"


class Conflict(TaskError):
    """409: name or state conflict (e.g. a step id reused with another request)."""
    code = "conflict"


class Gone(InfraError):
    """410: the sandbox was destroyed or its agent died."""
    code = "gone"


class PayloadTooLarge(TaskError):
    """413: request body over the daemon's limit."""
    code = "payload_too_large"


class ResourceExhausted(InfraError):
    """429: queue or quota full; retry later."""
    code = "resource_exhausted"


class InternalError(InfraError):
    """500: a daemon bug or a host failure."""
    code = "internal"


class Unsupported(TaskError, NotImplementedError):
    """501: backend or feature not available on this node."""
    code = "unsupported"


class Unavailable(InfraError):
    """503: the daemon is shutting down or the backend is not ready."""
    code = "unavailable"


class Timeout(InfraError, TimeoutError):
    """504 from the daemon, or the call's own deadline passed (status 0)."""
    code = "timeout"


class ConnectError(InfraError, ConnectionError):
    """The daemon could not be reached; nothing was sent."""
    code = "connect_failed"


class ConnectionLost(InfraError, ConnectionError):
    """The connection broke after the request was (possibly) sent.

    For non-idempotent requests (POST) the daemon may or may not have acted on
    it; the SDK never re-sends them on its own.
    """
    code = "connection_lost"


class ProtocolError(InfraError):
    """The daemon's response was malformed, truncated or oversized."""
    code = "protocol_error"


class NodeLost(Unavailable):
    """The cluster gateway lost the sandbox's node (503, or 410 once known lost)."""
    code = "node_lost"


_BY_CODE = {c.code: c for c in (InvalidArgument, Unauthorized, Forbidden, NotFound, Conflict, Gone,
                                PayloadTooLarge, ResourceExhausted, InternalError, Unsupported,
                                Unavailable, Timeout, NodeLost, ConnectError, ConnectionLost,
                                ProtocolError)}
_BY_STATUS = {400: InvalidArgument, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 410: Gone,
              413: PayloadTooLarge, 429: ResourceExhausted, 500: InternalError, 501: Unsupported,
              503: Unavailable, 504: Timeout}


def error_from_response(status: int, obj: object, fallback: str = "") -> WarrenError:
    """Build the exception for an error response (or an NDJSON error line).

    ``obj`` is the decoded JSON body (``{"error": {"code", "message"}}``);
    anything else falls back to the class for the HTTP status.
    """
    code = message = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        e = obj["error"]
        code = e.get("code") if isinstance(e.get("code"), str) else None
        message = e.get("message") if isinstance(e.get("message"), str) else None
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status)
    if cls is None:
        # a code this SDK does not know: the body's own verdict, else the
        # status class (5xx: the platform's)
        infra = obj.get("infra_failure") if isinstance(obj, dict) else None
        cls = InfraError if (infra is True or (infra is None and status >= 500)) else TaskError
    if message is None:
        message = fallback or f"HTTP {status}"
    return cls(message, code=code or cls.code, status=status)


_STATUS_OF = {v.code: k for k, v in _BY_STATUS.items()}


def error_from_stream(obj: object) -> WarrenError:
    """The exception for an error line of a streamed (already 200) response:
    ``status`` is the one the code has in a plain response."""
    code = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        code = obj["error"].get("code")
    return error_from_response(_STATUS_OF.get(code if isinstance(code, str) else "", 500), obj)
