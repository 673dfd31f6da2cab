"""Blocking client: :class:`Client`, :class:`Sandbox`, :class:`Images`."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _api
from ._common import (REAP_DELAYS, SDK_LABEL, LineSplitter, Request, Response, call_body, create_body, exec_body,
                      exec_deadline, raise_for, resolve_target, resolve_token)
from ._sync import SyncStream, SyncTransport
from .errors import ConnectError, NotFound, ProtocolError, WarrenError, error_from_stream
from .types import ExecResult, FileStat, Image, OutputChunk, SandboxInfo, decode_field

__all__ = ["Client", "Sandbox", "Images", "ExecStream"]

Cmd = Union[str, Sequence[str], None]
Progress = Callable[[str, int, int], Any]


class Client:
    """A connection pool to one ``warrend``; safe to share between threads.

    Args:
        host: ``unix:/path/sock`` or ``http://host:port``; default
            ``$WARREN_HOST``, else ``unix:$WARREN_ROOT/warrend.sock``, else
            ``unix:/var/lib/warren/warrend.sock``.
        token: bearer token for TCP (default ``$WARREN_TOKEN``).
        timeout: default deadline in seconds of every call that does not run
            a command (exec and call derive theirs from the command timeout).
        max_idle: keep-alive connections kept open between calls.
    """

    def __init__(self, host: Optional[str] = None, *, token: Optional[str] = None,
                 timeout: float = 60.0, max_idle: int = 16) -> None:
        self.target = resolve_target(host)
        self.timeout = timeout
        self._t = SyncTransport(self.target, resolve_token(token), max_idle=max_idle)
        self.images = Images(self)

    def __repr__(self) -> str:
        return f"Client({str(self.target)!r})"

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close pooled connections (sandboxes are left alone)."""
        self._t.close()

    def _call(self, req: Request) -> Any:
        return self._t.call(req)

    def _to(self, timeout: Optional[float]) -> float:
        return self.timeout if timeout is None else timeout

    # ---- sandboxes ----

    def create(self, *, backend: Optional[str] = None, image: Optional[str] = None,
               layers: Optional[Sequence[str]] = None, memory_mb: Optional[int] = None,
               cpus: Optional[float] = None, disk_mb: Optional[int] = None,
               pids_max: Optional[int] = None, ttl_s: Optional[float] = None,
               network: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
               labels: Optional[Mapping[str, str]] = None, qos: Optional[str] = None,
               idle_pause_s: Optional[int] = None, timeout: Optional[float] = None,
               **extra: Any) -> "Sandbox":
        """Create a sandbox (``POST /v1/sandboxes``); use it as a context
        manager to delete it on exit. Unset arguments take the daemon's
        defaults; unknown keyword arguments are passed through to the API.

        If the call is interrupted (KeyboardInterrupt, lost connection, the
        deadline) after the request went out, the sandbox it may have created
        is found by a client-generated label and deleted.
        """
        tag = uuid.uuid4().hex
        body = create_body(backend, image, layers, memory_mb, cpus, disk_mb, pids_max, ttl_s,
                           network, env, dict(labels or {}, **{SDK_LABEL: tag}), extra,
                           qos=qos, idle_pause_s=idle_pause_s)
        try:
            info = self._call(_api.create(body, self._to(timeout)))
        except WarrenError as e:
            if e.status == 0 and not isinstance(e, ConnectError):  # sent, answer lost
                self._reap_label(tag)
            raise
        except BaseException:
            self._reap_label(tag)
            raise
        return Sandbox(self, info)

    def _reap_label(self, tag: str) -> int:
        """Delete the sandbox carrying our create label (best effort), polling
        for a few seconds in case the daemon is still creating it."""
        for delay in (0.0,) + REAP_DELAYS:
            if delay:
                time.sleep(delay)
            try:
                for s in self._call(_api.list_sandboxes(10.0)):
                    if s.labels.get(SDK_LABEL) == tag:
                        try:
                            self._call(_api.delete(s.id, 10.0))
                        except NotFound:
                            pass
                        return 1
            except WarrenError:
                pass
        return 0

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        """A handle on an existing sandbox, without a request."""
        return Sandbox(self, SandboxInfo(id=sandbox_id))

    def get(self, sandbox_id: str, *, timeout: Optional[float] = None) -> "Sandbox":
        """Fetch an existing sandbox (raises :class:`NotFound`)."""
        return Sandbox(self, self._call(_api.get(sandbox_id, self._to(timeout))))

    def log(self, sandbox_id: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The trajectory log of a sandbox, also after it was destroyed (within
        the daemon's ``--log-retention``): ``{"events": [...], ...}``."""
        return self._call(_api.log(sandbox_id, self._to(timeout)))

    def replay(self, sandbox_id: str, *, until: Optional[str] = None,
               timeout: Optional[float] = None) -> "Sandbox":
        """A new sandbox from ``sandbox_id``'s image, fast-forwarded by re-running
        its logged execs and file changes up to step ``until`` (all without it).
        Repeating those steps on the new sandbox returns the recorded results;
        ``info.raw["replay"]`` says how many were re-run and how many diverged."""
        return Sandbox(self, self._call(_api.replay(sandbox_id, until, timeout)))

    def list(self, *, labels: Optional[Mapping[str, str]] = None,
             timeout: Optional[float] = None) -> List[SandboxInfo]:
        """Sandboxes on the node, optionally only those carrying all ``labels``."""
        out = self._call(_api.list_sandboxes(self._to(timeout)))
        if labels:
            out = [s for s in out if all(s.labels.get(k) == v for k, v in labels.items())]
        return out

    def delete(self, sandbox_id: str, *, missing_ok: bool = False,
               timeout: Optional[float] = None) -> None:
        """Destroy a sandbox by id."""
        try:
            self._call(_api.delete(sandbox_id, self._to(timeout)))
        except NotFound:
            if not missing_ok:
                raise

    def call(self, cmd: Cmd = None, *, shell: Optional[str] = None, code: Optional[str] = None,
             image: Optional[str] = None, mode: Optional[str] = None,
             stdin: Union[None, bytes, str] = None, timeout: Optional[float] = None,
             env: Optional[Mapping[str, str]] = None, memory_mb: Optional[int] = None,
             request_timeout: Optional[float] = None, **extra: Any) -> ExecResult:
        """fncall: one stateless job in a warm pool (``POST /v1/calls``).

        ``cmd`` is an argv list, or a ``str`` run by ``/bin/sh -c``; or pass
        ``code=`` (Python source, run by the pool's preloaded interpreter;
        ``mode="fork"`` for a fresh process per call, ``"reuse"`` for a
        long-lived worker). ``timeout`` is the job's own limit."""
        body = call_body(cmd, shell, code, image, mode, env, stdin, timeout, memory_mb, extra)
        return self._call(_api.call(body, exec_deadline(body, request_timeout)))

    # ---- node ----

    def health(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """``GET /healthz``: ``{"status", "sandboxes", "version"}``."""
        return self._call(_api.health(self._to(timeout)))

    def metrics(self, *, timeout: Optional[float] = None) -> str:
        """Prometheus text from ``GET /metrics``."""
        return self._call(_api.metrics(self._to(timeout)))

    def pools(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Warm pool sizes (``GET /v1/pools``)."""
        return self._call(_api.pools(self._to(timeout)))

    def set_pool(self, image: str, size: int, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Keep ``size`` warm sandboxes of ``image`` ready (0 disables)."""
        return self._call(_api.set_pool(image, size, self._to(timeout)))


class Images:
    """``client.images``: the node's image store."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def list(self, *, timeout: Optional[float] = None) -> List[Image]:
        return self._c._call(_api.images_list(self._c._to(timeout)))

    def get(self, ref: str, *, timeout: Optional[float] = None) -> Image:
        """Resolve ``NAME[:TAG]`` or a digest (raises :class:`NotFound`)."""
        return self._c._call(_api.image_get(ref, self._c._to(timeout)))

    def exists(self, ref: str, *, timeout: Optional[float] = None) -> bool:
        try:
            self.get(ref, timeout=timeout)
            return True
        except NotFound:
            return False

    def import_(self, name: str, path: str, *, timeout: Optional[float] = None,
                progress: Optional[Progress] = None, upload: Optional[bool] = None) -> Image:
        """Import a rootfs directory or an archive (tar, tar.gz, tar.zst, OCI
        layout, docker-save) at ``path`` as ``name``. Over the unix socket
        ``path`` is read by the daemon; over TCP (or with ``upload=True``) it
        is a local path, sent through ``/v1/uploads`` (a directory as a tar).
        ``progress(step, done, total)`` is called as the daemon reports."""
        if not self._uploads(upload):
            return self._job(_api.image_import(name, path, timeout, progress is not None),
                             progress)
        uid = self._upload(path, progress)
        return self._job(_api.image_import_upload(name, uid, timeout, progress is not None),
                         progress)

    def pull(self, ref: str, *, name: Optional[str] = None, insecure: bool = False,
             timeout: Optional[float] = None, progress: Optional[Progress] = None) -> Image:
        """Pull ``ref`` (``HOST[:PORT]/REPO[:TAG|@DIGEST]``) from an OCI registry,
        stored as ``name`` if given. ``insecure`` allows plain HTTP."""
        return self._job(_api.image_pull(ref, name, insecure, timeout, progress is not None),
                         progress)

    def push(self, ref: str, target: str, *, insecure: bool = False,
             timeout: Optional[float] = None, progress: Optional[Progress] = None) -> Dict[str, Any]:
        """Push the stored image ``ref`` to ``target`` (``HOST[:PORT]/NAME[:TAG]``):
        its EROFS layers, which Warren nodes pull back as they are. Returns
        ``{"ref", "target", "digest", "uploaded", "skipped", "bytes"}``."""
        return self._job(_api.image_push(ref, target, insecure, timeout, progress is not None),
                         progress)

    def build(self, name: str, spec: str, *, context: Optional[str] = None,
              timeout: Optional[float] = None, progress: Optional[Progress] = None,
              upload: Optional[bool] = None) -> Image:
        """Build ``name`` from a spec text (FROM / RUN / COPY / ENV / WORKDIR);
        ``context`` is the directory COPY reads from: on the daemon's host over
        the unix socket, local over TCP (or with ``upload=True``: sent as a tar
        through ``/v1/uploads``; a tar file is sent as is)."""
        if context is None or not self._uploads(upload):
            return self._job(_api.image_build(name, spec, context, timeout, progress is not None),
                             progress)
        uid = self._upload(context, progress)
        return self._job(_api.image_build_upload(name, spec, uid, timeout, progress is not None),
                         progress)

    def _uploads(self, upload: Optional[bool]) -> bool:
        return self._c.target.unix_path is None if upload is None else bool(upload)

    def _upload(self, path: str, progress: Optional[Progress]) -> str:
        """Send a local file or directory through /v1/uploads; its id."""
        f, size = _api.upload_source(path)
        with f:
            steps = _api.upload_steps(f, size, progress)
            try:
                req = next(steps)
                while True:
                    req = steps.send(self._c._call(req))
            except StopIteration as done:
                return done.value

    def tag(self, source: str, name: str, *, timeout: Optional[float] = None) -> Image:
        """Give the image ``source`` the additional name ``name``."""
        return self._c._call(_api.image_tag(source, name, self._c._to(timeout)))

    def _job(self, req: Request, progress: Optional[Progress]) -> Image:
        if progress is None:
            return self._c._call(req)
        s = self._c._t.stream(req)
        if s.status not in req.ok:
            body = b"".join(s.chunks())
            s.close()
            raise_for(Response(s.status, s.headers, body))
        split = LineSplitter()
        result: Optional[Image] = None
        try:
            for part in s.chunks():
                for line in split.feed(part):
                    result = _api.job_line(line, progress) or result
            tail = split.rest()
            if tail:
                result = _api.job_line(tail, progress) or result
        finally:
            s.close()
        if result is None:
            raise ProtocolError("the stream ended without a result")
        return result

    def delete(self, ref: str, *, timeout: Optional[float] = None) -> None:
        self._c._call(_api.image_delete(ref, self._c._to(timeout)))

    remove = delete


class Sandbox:
    """A live sandbox. Use as a context manager (``with client.create() as
    sb``) or call :meth:`close` to delete it."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.closed = False

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, req: Request) -> Any:
        return self.client._call(req)

    def _to(self, timeout: Optional[float]) -> float:
        return self.client._to(timeout)

    def close(self, *, timeout: Optional[float] = None) -> None:
        """Delete the sandbox; a sandbox already gone is not an error."""
        if self.closed:
            return
        try:
            self._call(_api.delete(self.id, self._to(timeout)))
        except NotFound:
            pass
        self.closed = True

    def refresh(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Re-read the sandbox's state (with ``usage`` when running)."""
        self.info = self._call(_api.get(self.id, self._to(timeout)))
        return self.info

    def exec(self, cmd: Cmd = None, *, shell: Optional[str] = None,
             env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
             stdin: Union[None, bytes, str] = None, timeout: Optional[float] = None,
             stdout_cap: Optional[int] = None, stderr_cap: Optional[int] = None,
             step: Optional[str] = None, request_timeout: Optional[float] = None,
             **extra: Any) -> ExecResult:
        """Run a command and wait for it.

        ``cmd`` is an argv list, or a ``str`` run by ``/bin/sh -c`` (same as
        ``shell=``). ``timeout`` is the command's own limit in seconds (the
        daemon kills the process tree and sets ``timed_out``); the HTTP call
        waits that long plus 30 s unless ``request_timeout`` says otherwise.
        A non-zero exit status is a result, not an exception.

        The command runs over the streaming endpoint and its output is
        collected here, so a call abandoned midway (deadline, Ctrl-C) drops
        the connection and the daemon kills the command instead of leaving
        it running.
        """
        body = exec_body(cmd, shell, env, cwd, stdin, timeout, stdout_cap, stderr_cap, step, extra)
        req = _api.exec_(self.id, body, exec_deadline(body, request_timeout), stream=True)
        return ExecStream(self.client._t.stream(req), collect=True).wait()

    def exec_stream(self, cmd: Cmd = None, *, shell: Optional[str] = None,
                    env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                    stdin: Union[None, bytes, str] = None, timeout: Optional[float] = None,
                    step: Optional[str] = None, request_timeout: Optional[float] = None,
                    collect: bool = False, **extra: Any) -> "ExecStream":
        """Run a command and iterate its output as it is produced::

            with sb.exec_stream("make test") as s:
                for chunk in s:
                    print(chunk.stream, chunk.text, end="")
            print(s.result.exit_code)

        Leaving the ``with`` block before the end drops the connection and
        the daemon kills the command. ``collect=True`` also keeps the output
        in ``s.result.stdout_bytes`` / ``stderr_bytes``.
        """
        body = exec_body(cmd, shell, env, cwd, stdin, timeout, None, None, step, extra)
        req = _api.exec_(self.id, body, exec_deadline(body, request_timeout), stream=True)
        return ExecStream(self.client._t.stream(req), collect)

    def write_file(self, path: str, data: Union[bytes, str], *, mode: Optional[int] = None,
                   append: bool = False, step: Optional[str] = None,
                   timeout: Optional[float] = None) -> int:
        """Write (or with ``append`` extend) a file; returns its size. Parent
        directories must exist (see :meth:`mkdir`). Appends are never retried,
        unless they carry a ``step`` id: a repeated step answers from the
        trajectory log without writing again."""
        return self._call(_api.write_file(self.id, path, data, mode, append, self._to(timeout),
                                          step))

    def log(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """This sandbox's trajectory log (see :meth:`Client.log`)."""
        return self.client.log(self.id, timeout=timeout)

    def read_file(self, path: str, *, timeout: Optional[float] = None) -> bytes:
        """The whole file as bytes (up to 64 MiB)."""
        return self._call(_api.read_file(self.id, path, self._to(timeout)))

    def stat(self, path: str, *, timeout: Optional[float] = None) -> FileStat:
        return self._call(_api.stat(self.id, path, self._to(timeout)))

    def list_dir(self, path: str, *, timeout: Optional[float] = None) -> List[FileStat]:
        """Entries of a directory (not recursive)."""
        return self._call(_api.list_dir(self.id, path, self._to(timeout)))

    def mkdir(self, path: str, *, parents: bool = False, timeout: Optional[float] = None) -> None:
        self._call(_api.mkdir(self.id, path, parents, self._to(timeout)))

    def remove(self, path: str, *, recursive: bool = False,
               timeout: Optional[float] = None) -> None:
        """Remove a file, or a directory tree with ``recursive=True``."""
        self._call(_api.remove(self.id, path, recursive, self._to(timeout)))

    def pause(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Freeze every process of the sandbox and give its memory back
        (into the daemon's zram swap when it has one); ``info.pause`` has
        the memory before and after and the time taken. An exec or file
        request resumes it transparently."""
        self.info = self._call(_api.state(self.id, "pause", self._to(timeout)))
        return self.info

    def resume(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = self._call(_api.state(self.id, "resume", self._to(timeout)))
        return self.info

    def allow(self, rules: str, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Add comma-separated rules to a live ``allow=`` sandbox's network
        policy (docs/network.md); ``info.network`` is the new policy."""
        self.info = self._call(_api.set_network(self.id, {"allow": rules}, self._to(timeout)))
        return self.info

    def deny(self, rules: str, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Remove rules from the sandbox's network policy, at once."""
        self.info = self._call(_api.set_network(self.id, {"deny": rules}, self._to(timeout)))
        return self.info

    def set_network(self, network: str, *,
                    timeout: Optional[float] = None) -> SandboxInfo:
        """Replace the policy: ``"allow=RULE,..."``."""
        self.info = self._call(_api.set_network(self.id, network, self._to(timeout)))
        return self.info

    def pack(self, name: str, *, timeout: Optional[float] = None) -> Image:
        """Snapshot the sandbox's writable layer into the image ``name``."""
        return self._call(_api.pack(self.id, name, timeout))

    def fork(self, count: int, *, timeout: Optional[float] = None,
             **overrides: Any) -> "List[Sandbox]":
        """``count`` new sandboxes starting from this one's current file system
        (docs/api.md, Group fork); keyword overrides (memory_mb, cpus, ttl_s,
        network, env, labels, ...) apply to every child."""
        infos = self._call(_api.fork(self.id, count, overrides, timeout))
        return [Sandbox(self.client, i) for i in infos]

    def checkpoint(self, name: Optional[str] = None, *,
                   timeout: Optional[float] = None) -> str:
        """Snapshot the file system as checkpoint ``name`` (default ckpt-N); returns the name."""
        return self._call(_api.checkpoint(self.id, name, timeout))

    def restore(self, name: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Put the file system back to checkpoint ``name``; processes keep running."""
        return self._call(_api.restore(self.id, name, timeout))

    def diff(self, frm: Optional[str] = None, to: Optional[str] = None, *,
             path: Optional[str] = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """What changed between two states ("image", "now" or a checkpoint name):
        {"changes": [{"path", "kind", "type", "size", "diff"}], "summary": ...}."""
        return self._call(_api.diff(self.id, frm, to, path, timeout))


class ExecStream:
    """Output of a streaming exec; iterate for :class:`OutputChunk`s, then
    read :attr:`result`."""

    def __init__(self, stream: SyncStream, collect: bool = False) -> None:
        self._s = stream
        self._collect = collect
        self._out = bytearray()
        self._err = bytearray()
        self.result: Optional[ExecResult] = None
        if stream.status != 200:
            body = b"".join(stream.chunks())
            stream.close()
            raise_for(Response(stream.status, stream.headers, body))

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; an unfinished command is killed by the daemon."""
        self._s.close()

    def __iter__(self) -> Iterator[OutputChunk]:
        if self.result is not None:
            return
        split = LineSplitter()
        try:
            for part in self._s.chunks():
                for line in split.feed(part):
                    chunk = self._line(line)
                    if chunk is not None:
                        yield chunk
            tail = split.rest()
            if tail:
                chunk = self._line(tail)
                if chunk is not None:
                    yield chunk
        finally:
            if self.result is None:
                self._s.close()
        if self.result is None:
            raise ProtocolError("the stream ended without a result")

    def _line(self, line: bytes) -> Optional[OutputChunk]:
        j = _api.stream_line(line)
        if "stream" in j:
            data = _decode(j)
            if self._collect:
                (self._err if j["stream"] == "stderr" else self._out).extend(data)
            return OutputChunk(str(j["stream"]), data)
        if isinstance(j.get("error"), dict) and "exit_code" not in j:
            raise error_from_stream(j)
        self.result = ExecResult.from_json(j, bytes(self._out), bytes(self._err))
        return None

    def wait(self) -> ExecResult:
        """Consume the rest of the output and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def _decode(j: Dict[str, Any]) -> bytes:
    return decode_field(j, "data")
