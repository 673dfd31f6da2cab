"""Warren Python SDK: sync (:class:`Client`) and asyncio (:class:`AsyncClient`)
clients of the warrend HTTP API (docs/api.md), standard library only.

>>> import warren
>>> with warren.Client() as client, client.create(image="busybox:latest") as sb:
...     print(sb.exec(["echo", "hi"]).stdout)
"""

from .aio import AsyncClient, AsyncExecStream, AsyncImages, AsyncSandbox
from .client import Client, ExecStream, Images, Sandbox
from .errors import (Conflict, ConnectError, ConnectionLost, Forbidden, Gone, InfraError,
                     InternalError, InvalidArgument, NodeLost, NotFound, PayloadTooLarge,
                     ProtocolError, ResourceExhausted, TaskError, Timeout, Unauthorized, Unavailable,
                     Unsupported, WarrenError)
from .types import ExecResult, ExecUsage, FileStat, Image, OutputChunk, SandboxInfo

from ._version import __version__  # noqa: E402

__all__ = [
    "Client", "Sandbox", "Images", "ExecStream",
    "AsyncClient", "AsyncSandbox", "AsyncImages", "AsyncExecStream",
    "ExecResult", "ExecUsage", "OutputChunk", "SandboxInfo", "FileStat", "Image",
    "WarrenError", "InvalidArgument", "Unauthorized", "Forbidden", "NotFound", "Conflict", "Gone",
    "PayloadTooLarge", "ResourceExhausted", "InternalError", "Unsupported", "Unavailable",
    "Timeout", "ConnectError", "ConnectionLost", "ProtocolError", "InfraError", "TaskError",
    "NodeLost",
]
