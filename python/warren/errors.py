"""Exceptions raised by the Warren SDK.

Every error the daemon sends (``{"error": {"code", "message"}}``, see
docs/api.md) becomes an instance of the :class:`WarrenError` subclass for its
``code``; the HTTP status is kept in :attr:`WarrenError.status`. Failures on
the client side (cannot connect, connection lost, malformed response, the
call's own deadline) use the same hierarchy with ``status == 0``.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "WarrenError", "InvalidArgument", "Unauthorized", "NotFound", "Conflict", "Gone",
    "PayloadTooLarge", "ResourceExhausted", "InternalError", "Unsupported", "Unavailable",
    "Timeout", "ConnectError", "ConnectionLost", "ProtocolError", "error_from_response",
    "error_from_stream",
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

    def __init__(self, message: str, *, code: Optional[str] = None, status: int = 0):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.status = status

    def __str__(self) -> str:
        where = f"HTTP {self.status} " if self.status else ""
        return f"{self.message} ({where}{self.code})"


class InvalidArgument(WarrenError, ValueError):
    """400: malformed request, wrong field type, bad path or value."""
    code = "invalid_argument"


class Unauthorized(WarrenError, PermissionError):
    """401: missing or wrong bearer token (TCP)."""
    code = "unauthorized"


class Forbidden(WarrenError, PermissionError):
    """403: the token does not grant this (host paths over TCP, docs/operations.md)."""
    code = "forbidden"


class NotFound(WarrenError, LookupError):
    """404: unknown sandbox, image, file or route."""
    code = "not_found"


class Conflict(WarrenError):
    """409: name or state conflict (e.g. exec in a paused sandbox)."""
    code = "conflict"


class Gone(WarrenError):
    """410: the sandbox was destroyed or its agent died."""
    code = "gone"


class PayloadTooLarge(WarrenError):
    """413: request body over the daemon's limit."""
    code = "payload_too_large"


class ResourceExhausted(WarrenError):
    """429: queue or quota full; retry later."""
    code = "resource_exhausted"


class InternalError(WarrenError):
    """500: a daemon bug or a host failure."""
    code = "internal"


class Unsupported(WarrenError, NotImplementedError):
    """501: backend or feature not available on this node."""
    code = "unsupported"


class Unavailable(WarrenError):
    """503: the daemon is shutting down or the backend is not ready."""
    code = "unavailable"


class Timeout(WarrenError, TimeoutError):
    """504 from the daemon, or the call's own deadline passed (status 0)."""
    code = "timeout"


class ConnectError(WarrenError, ConnectionError):
    """The daemon could not be reached; nothing was sent."""
    code = "connect_failed"


class ConnectionLost(WarrenError, ConnectionError):
    """The connection broke after the request was (possibly) sent.

    For non-idempotent requests (POST) the daemon may or may not have acted on
    it; the SDK never re-sends them on its own.
    """
    code = "connection_lost"


class ProtocolError(WarrenError):
    """The daemon's response was malformed, truncated or oversized."""
    code = "protocol_error"


_BY_CODE = {c.code: c for c in (InvalidArgument, Unauthorized, Forbidden, NotFound, Conflict, Gone,
                                PayloadTooLarge, ResourceExhausted, InternalError, Unsupported,
                                Unavailable, Timeout)}
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
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status, WarrenError)
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
