"""Typed results returned by the SDK. Every type keeps the daemon's JSON in
``raw`` so fields added by newer daemons stay reachable."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import ProtocolError

__all__ = ["ExecUsage", "ExecResult", "OutputChunk", "SandboxInfo", "FileStat", "Image",
           "decode_field", "encode_field"]


def decode_field(obj: Dict[str, Any], key: str) -> bytes:
    """Bytes of a binary-safe field: ``obj[key]`` is UTF-8 text unless
    ``obj[key + "_encoding"] == "base64"``. A missing field is ``b""``."""
    v = obj.get(key)
    if v is None:
        return b""
    if not isinstance(v, str):
        raise ProtocolError(f"field {key!r} is not a string")
    enc = obj.get(key + "_encoding")
    if enc == "base64":
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ProtocolError(f"field {key!r} is not valid base64: {e}") from None
    if enc not in (None, "utf-8", "utf8"):
        raise ProtocolError(f"field {key!r} has unknown encoding {enc!r}")
    return v.encode("utf-8", "surrogatepass")


def encode_field(obj: Dict[str, Any], key: str, data: "bytes | str") -> None:
    """Set ``obj[key]`` to ``data``: text when it is valid UTF-8 without NUL,
    else base64 with ``obj[key + "_encoding"] = "base64"``."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        text = bytes(data).decode("utf-8")
        if "\0" not in text:
            obj[key] = text
            return
    except UnicodeDecodeError:
        pass
    obj[key] = base64.b64encode(data).decode("ascii")
    obj[key + "_encoding"] = "base64"


def _int(v: Any, default: int = 0) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _float(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass
class ExecUsage:
    """Resources one command used (from the agent's rusage of the process tree)."""
    cpu_user_ms: int = 0
    cpu_system_ms: int = 0
    max_rss_kb: int = 0
    oom_killed: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Any) -> "ExecUsage":
        j = j if isinstance(j, dict) else {}
        return cls(_int(j.get("cpu_user_ms")), _int(j.get("cpu_system_ms")),
                   _int(j.get("max_rss_kb")), j.get("oom_killed") is True, j)


@dataclass
class ExecResult:
    """The outcome of :meth:`Sandbox.exec` or :meth:`Client.call`.

    ``stdout`` / ``stderr`` are text decoded as UTF-8 with invalid bytes
    replaced; ``stdout_bytes`` / ``stderr_bytes`` are the exact bytes.
    ``exit_code`` is -1 when the command was killed by a signal (see
    ``signal``) or timed out (``timed_out``); 127 when it could not start
    (``error`` says why).
    """
    exit_code: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    signal: int = 0
    timed_out: bool = False
    truncated: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: int = 0
    usage: ExecUsage = field(default_factory=ExecUsage)
    error: Optional[str] = None
    #: always False for a result: the command ran, so its exit code, timeout
    #: or OOM is the task's; platform failures raise :class:`InfraError`
    infra_failure: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """True when the command exited 0 (not killed, not timed out)."""
        return self.exit_code == 0 and not self.timed_out and self.signal == 0

    @property
    def replayed(self) -> bool:
        """True when the result was recorded earlier under the same step id
        and answered from the trajectory log instead of running again."""
        return self.raw.get("replayed") is True

    @classmethod
    def from_json(cls, j: Any, stdout: Optional[bytes] = None,
                  stderr: Optional[bytes] = None) -> "ExecResult":
        if not isinstance(j, dict) or not isinstance(j.get("exit_code"), int):
            raise ProtocolError(f"not an exec result: {str(j)[:200]}")
        return cls(
            exit_code=j["exit_code"],
            stdout_bytes=decode_field(j, "stdout") if stdout is None else stdout,
            stderr_bytes=decode_field(j, "stderr") if stderr is None else stderr,
            signal=_int(j.get("signal")),
            timed_out=j.get("timed_out") is True,
            truncated=j.get("truncated") is True,
            stdout_truncated=j.get("stdout_truncated") is True,
            stderr_truncated=j.get("stderr_truncated") is True,
            duration_ms=_int(j.get("duration_ms")),
            usage=ExecUsage.from_json(j.get("usage")),
            error=j.get("error") if isinstance(j.get("error"), str) else None,
            infra_failure=j.get("infra_failure") is True,
            raw=j)


@dataclass
class OutputChunk:
    """One piece of streamed output: ``stream`` is ``"stdout"`` or ``"stderr"``."""
    stream: str
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass
class SandboxInfo:
    """A sandbox as the daemon describes it (``GET /v1/sandboxes/{id}``)."""
    id: str
    state: str = ""
    backend: str = ""
    image: str = ""
    layers: List[str] = field(default_factory=list)
    labels: Dict[str, str] = field(default_factory=dict)
    memory_mb: Optional[int] = None
    cpus: Optional[float] = None
    network: Optional[str] = None
    created_at: Optional[float] = None
    expires_at: Optional[float] = None
    pooled: bool = False
    usage: Optional[Dict[str, Any]] = None
    qos: str = "latency"
    idle_pause_s: int = 0
    #: while paused: memory_before_bytes, memory_after_bytes, freeze_ms, reclaim_ms
    pause: Optional[Dict[str, Any]] = None
    #: after a resume: {"ms": ...}
    resume: Optional[Dict[str, Any]] = None
    #: an allow= sandbox's network: address, gateway, interface, names, group,
    #: denied_packets (docs/network.md)
    net: Optional[Dict[str, Any]] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Any) -> "SandboxInfo":
        if not isinstance(j, dict) or not isinstance(j.get("id"), str):
            raise ProtocolError(f"not a sandbox: {str(j)[:200]}")
        layers = j.get("layers")
        labels = j.get("labels")
        return cls(
            id=j["id"], state=str(j.get("state") or ""), backend=str(j.get("backend") or ""),
            image=str(j.get("image") or ""),
            layers=[x for x in layers if isinstance(x, str)] if isinstance(layers, list) else [],
            labels={k: v for k, v in labels.items() if isinstance(v, str)}
            if isinstance(labels, dict) else {},
            memory_mb=_int(j["memory_mb"]) if _float(j.get("memory_mb")) is not None else None,
            cpus=_float(j.get("cpus")), network=j.get("network"),
            created_at=_float(j.get("created_at")), expires_at=_float(j.get("expires_at")),
            pooled=j.get("pooled") is True,
            usage=j.get("usage") if isinstance(j.get("usage"), dict) else None,
            qos=str(j.get("qos") or "latency"), idle_pause_s=_int(j.get("idle_pause_s")),
            pause=j.get("pause") if isinstance(j.get("pause"), dict) else None,
            resume=j.get("resume") if isinstance(j.get("resume"), dict) else None,
            net=j.get("net") if isinstance(j.get("net"), dict) else None, raw=j)


@dataclass
class FileStat:
    """A file inside a sandbox (``op=stat`` / ``op=list`` entries)."""
    name: str
    type: str
    size: int = 0
    mode: int = 0
    mtime: Optional[float] = None
    uid: int = 0
    gid: int = 0
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def is_dir(self) -> bool:
        return self.type in ("dir", "directory")

    @classmethod
    def from_json(cls, j: Any) -> "FileStat":
        if not isinstance(j, dict):
            raise ProtocolError(f"not a stat object: {str(j)[:200]}")
        return cls(name=str(j.get("name") or ""), type=str(j.get("type") or ""),
                   size=_int(j.get("size")), mode=_int(j.get("mode")),
                   mtime=_float(j.get("mtime")), uid=_int(j.get("uid")), gid=_int(j.get("gid")),
                   raw=j)


@dataclass
class Image:
    """An image in the daemon's store: a name, a digest, its ordered layers
    (bottom first) and its config (env, workdir, ...)."""
    name: str
    digest: str = ""
    layers: List[Any] = field(default_factory=list)
    size: Optional[int] = None
    created_at: Optional[float] = None
    config: Dict[str, Any] = field(default_factory=dict, repr=False)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Any) -> "Image":
        if not isinstance(j, dict) or not isinstance(j.get("name"), str):
            raise ProtocolError(f"not an image: {str(j)[:200]}")
        layers = j.get("layers")
        return cls(name=j["name"], digest=str(j.get("digest") or ""),
                   layers=list(layers) if isinstance(layers, list) else [],
                   size=_int(j["size"]) if _float(j.get("size")) is not None else None,
                   created_at=_float(j.get("created_at")),
                   config=j["config"] if isinstance(j.get("config"), dict) else {}, raw=j)
