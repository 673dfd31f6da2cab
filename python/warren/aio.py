"""asyncio client of the same shape as :mod:`warren.client`:
:class:`AsyncClient`, :class:`AsyncSandbox`, :class:`AsyncImages`.

One client per event loop; it multiplexes every sandbox over a bounded pool
of keep-alive connections (``max_connections``), so thousands of sandboxes
need no thread and a few hundred sockets at most.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import (Any, AsyncIterator, Awaitable, Callable, Dict, Generator, List, Mapping, Optional,
                    Sequence, Set, Union)

from . import _api
from ._common import (REAP_DELAYS, SDK_LABEL, LineSplitter, Request, Response, call_body, create_body, exec_body,
                      exec_deadline, raise_for, resolve_target, resolve_token)
from ._async import AsyncStream, AsyncTransport
from .errors import ConnectError, NotFound, ProtocolError, WarrenError, error_from_stream
from .types import ExecResult, FileStat, Image, OutputChunk, SandboxInfo, decode_field

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncImages", "AsyncExecStream"]

Cmd = Union[str, Sequence[str], None]
Progress = Callable[[str, int, int], Any]


class AsyncClient:
    """asyncio client of one ``warrend``. Use ``async with AsyncClient() as
    client`` so that cleanups still in flight (deletes of sandboxes whose
    task was cancelled) finish before the loop ends.

    Args:
        host, token, timeout: as for :class:`warren.Client`.
        max_connections: sockets open at once; more concurrent calls queue.
    """

    def __init__(self, host: Optional[str] = None, *, token: Optional[str] = None,
                 timeout: float = 60.0, max_connections: int = 256) -> None:
        self.target = resolve_target(host)
        self.timeout = timeout
        self._t = AsyncTransport(self.target, resolve_token(token), max_connections)
        self._pending: Set["asyncio.Task[Any]"] = set()
        self.images = AsyncImages(self)

    def __repr__(self) -> str:
        return f"AsyncClient({str(self.target)!r})"

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def drain(self, timeout: float = 60.0) -> None:
        """Wait for background cleanups (deletes started by cancellations)."""
        while self._pending:
            pending = list(self._pending)
            done, _ = await asyncio.wait(pending, timeout=timeout)
            if not done:
                break

    async def aclose(self) -> None:
        """Finish background cleanups, then close pooled connections."""
        await asyncio.shield(self.drain())
        await self._t.close()

    def _background(self, coro: Awaitable[Any]) -> "asyncio.Task[Any]":
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _call(self, req: Request) -> Any:
        return await self._t.call(req)

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
               **extra: Any) -> "_Creation":
        """Create a sandbox. Await it (``sb = await client.create(...)``) or
        use it directly as ``async with client.create(...) as sb`` (deleted
        on exit, also when the task is cancelled).

        Cancelling the task while the create is in flight never leaks the
        sandbox: the request finishes in the background and whatever it
        created is deleted (found by a client-generated label if the answer
        was lost).
        """
        tag = uuid.uuid4().hex
        body = create_body(backend, image, layers, memory_mb, cpus, disk_mb, pids_max, ttl_s,
                           network, env, dict(labels or {}, **{SDK_LABEL: tag}), extra,
                           qos=qos, idle_pause_s=idle_pause_s)
        return _Creation(self, _api.create(body, self._to(timeout)), tag)

    async def _reap_label(self, tag: str) -> int:
        """Delete the sandbox carrying our create label, polling for a few
        seconds in case the daemon is still creating it."""
        for delay in (0.0,) + REAP_DELAYS:
            if delay:
                await asyncio.sleep(delay)
            try:
                for s in await self._call(_api.list_sandboxes(10.0)):
                    if s.labels.get(SDK_LABEL) == tag:
                        try:
                            await self._call(_api.delete(s.id, 10.0))
                        except NotFound:
                            pass
                        return 1
            except WarrenError:
                pass
        return 0

    async def _reap_creation(self, inner: "asyncio.Task[Any]", tag: str) -> None:
        try:
            info = await inner
        except asyncio.CancelledError:
            await self._reap_label(tag)
            return
        except WarrenError as e:
            if e.status == 0 and not isinstance(e, ConnectError):
                await self._reap_label(tag)
            return
        try:
            await self._call(_api.delete(info.id, 30.0))
        except NotFound:
            pass

    def sandbox(self, sandbox_id: str) -> "AsyncSandbox":
        """A handle on an existing sandbox, without a request."""
        return AsyncSandbox(self, SandboxInfo(id=sandbox_id))

    async def log(self, sandbox_id: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The trajectory log of a sandbox, also after it was destroyed."""
        return await self._call(_api.log(sandbox_id, self._to(timeout)))

    async def replay(self, sandbox_id: str, *, until: Optional[str] = None,
                     timeout: Optional[float] = None) -> "AsyncSandbox":
        """A new sandbox fast-forwarded along ``sandbox_id``'s log up to step
        ``until`` (see :meth:`warren.Client.replay`)."""
        return AsyncSandbox(self, await self._call(_api.replay(sandbox_id, until, timeout)))

    async def get(self, sandbox_id: str, *, timeout: Optional[float] = None) -> "AsyncSandbox":
        return AsyncSandbox(self, await self._call(_api.get(sandbox_id, self._to(timeout))))

    async def list(self, *, labels: Optional[Mapping[str, str]] = None,
                   timeout: Optional[float] = None) -> List[SandboxInfo]:
        out = await self._call(_api.list_sandboxes(self._to(timeout)))
        if labels:
            out = [s for s in out if all(s.labels.get(k) == v for k, v in labels.items())]
        return out

    async def delete(self, sandbox_id: str, *, missing_ok: bool = False,
                     timeout: Optional[float] = None) -> None:
        try:
            await self._call(_api.delete(sandbox_id, self._to(timeout)))
        except NotFound:
            if not missing_ok:
                raise

    async def call(self, cmd: Cmd = None, *, shell: Optional[str] = None,
                   code: Optional[str] = None, image: Optional[str] = None,
                   mode: Optional[str] = None, stdin: Union[None, bytes, str] = None,
                   timeout: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
                   memory_mb: Optional[int] = None, request_timeout: Optional[float] = None,
                   **extra: Any) -> ExecResult:
        """fncall: one stateless job in a warm pool; see :meth:`warren.Client.call`."""
        body = call_body(cmd, shell, code, image, mode, env, stdin, timeout, memory_mb, extra)
        return await self._call(_api.call(body, exec_deadline(body, request_timeout)))

    async def health(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self._call(_api.health(self._to(timeout)))

    async def metrics(self, *, timeout: Optional[float] = None) -> str:
        return await self._call(_api.metrics(self._to(timeout)))

    async def pools(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self._call(_api.pools(self._to(timeout)))

    async def set_pool(self, image: str, size: int, *,
                       timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self._call(_api.set_pool(image, size, self._to(timeout)))


class _Creation:
    """What :meth:`AsyncClient.create` returns: awaitable, or an async
    context manager that deletes the sandbox on exit."""

    def __init__(self, client: AsyncClient, req: Request, tag: str) -> None:
        self._c, self._req, self._tag = client, req, tag
        self._sb: Optional[AsyncSandbox] = None

    async def _run(self) -> "AsyncSandbox":
        inner = asyncio.ensure_future(self._c._call(self._req))
        try:
            info = await asyncio.shield(inner)
        except asyncio.CancelledError:
            # The request carries on; whatever it creates is deleted.
            self._c._background(self._c._reap_creation(inner, self._tag))
            raise
        except WarrenError as e:
            if e.status == 0 and not isinstance(e, ConnectError):
                await asyncio.shield(self._c._background(self._c._reap_label(self._tag)))
            raise
        return AsyncSandbox(self._c, info)

    def __await__(self) -> Generator[Any, None, "AsyncSandbox"]:
        return self._run().__await__()

    async def __aenter__(self) -> "AsyncSandbox":
        self._sb = await self._run()
        return self._sb

    async def __aexit__(self, *exc: Any) -> None:
        if self._sb is not None:
            await self._sb.aclose()


class AsyncImages:
    """``client.images`` of an :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def list(self, *, timeout: Optional[float] = None) -> List[Image]:
        return await self._c._call(_api.images_list(self._c._to(timeout)))

    async def get(self, ref: str, *, timeout: Optional[float] = None) -> Image:
        return await self._c._call(_api.image_get(ref, self._c._to(timeout)))

    async def exists(self, ref: str, *, timeout: Optional[float] = None) -> bool:
        try:
            await self.get(ref, timeout=timeout)
            return True
        except NotFound:
            return False

    async def import_(self, name: str, path: str, *, timeout: Optional[float] = None,
                      progress: Optional[Progress] = None, upload: Optional[bool] = None
                      ) -> Image:
        if not self._uploads(upload):
            return await self._job(_api.image_import(name, path, timeout, progress is not None),
                                   progress)
        uid = await self._upload(path, progress)
        return await self._job(_api.image_import_upload(name, uid, timeout, progress is not None),
                               progress)

    async def pull(self, ref: str, *, name: Optional[str] = None, insecure: bool = False,
                   timeout: Optional[float] = None, progress: Optional[Progress] = None) -> Image:
        return await self._job(_api.image_pull(ref, name, insecure, timeout, progress is not None),
                               progress)

    async def push(self, ref: str, target: str, *, insecure: bool = False,
                   timeout: Optional[float] = None,
                   progress: Optional[Progress] = None) -> Dict[str, Any]:
        return await self._job(_api.image_push(ref, target, insecure, timeout,
                                               progress is not None), progress)

    async def build(self, name: str, spec: str, *, context: Optional[str] = None,
                    timeout: Optional[float] = None, progress: Optional[Progress] = None,
                    upload: Optional[bool] = None) -> Image:
        if context is None or not self._uploads(upload):
            return await self._job(_api.image_build(name, spec, context, timeout,
                                                    progress is not None), progress)
        uid = await self._upload(context, progress)
        return await self._job(_api.image_build_upload(name, spec, uid, timeout,
                                                       progress is not None), progress)

    def _uploads(self, upload: Optional[bool]) -> bool:
        return self._c.target.unix_path is None if upload is None else bool(upload)

    async def _upload(self, path: str, progress: Optional[Progress]) -> str:
        f, size = _api.upload_source(path)
        with f:
            steps = _api.upload_steps(f, size, progress)
            try:
                req = next(steps)
                while True:
                    req = steps.send(await self._c._call(req))
            except StopIteration as done:
                return done.value

    async def tag(self, source: str, name: str, *, timeout: Optional[float] = None) -> Image:
        return await self._c._call(_api.image_tag(source, name, self._c._to(timeout)))

    async def _job(self, req: Request, progress: Optional[Progress]) -> Image:
        if progress is None:
            return await self._c._call(req)
        s = await self._c._t.stream(req)
        split = LineSplitter()
        result: Optional[Image] = None
        try:
            if s.status not in req.ok:
                body = b"".join([p async for p in s.chunks()])
                raise_for(Response(s.status, s.headers, body))
            async for part in s.chunks():
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

    async def delete(self, ref: str, *, timeout: Optional[float] = None) -> None:
        await self._c._call(_api.image_delete(ref, self._c._to(timeout)))

    remove = delete


class AsyncSandbox:
    """A live sandbox driven from asyncio; same methods as
    :class:`warren.Sandbox`, as coroutines. ``async with`` deletes it on exit
    (shielded: a cancelled task still deletes its sandbox)."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.closed = False
        self._closing: Optional["asyncio.Task[Any]"] = None

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _delete(self, timeout: Optional[float]) -> None:
        try:
            await self.client._call(_api.delete(self.id, self.client._to(timeout)))
        except NotFound:
            pass
        self.closed = True

    async def aclose(self, *, timeout: Optional[float] = None) -> None:
        """Delete the sandbox. The delete runs shielded: cancelling the
        caller does not cancel it (AsyncClient.aclose waits for it)."""
        if self.closed:
            return
        if self._closing is None or (self._closing.done() and self._closing.exception()):
            self._closing = self.client._background(self._delete(timeout))
        await asyncio.shield(self._closing)

    close = aclose

    async def _call(self, req: Request) -> Any:
        return await self.client._call(req)

    def _to(self, timeout: Optional[float]) -> float:
        return self.client._to(timeout)

    async def refresh(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._call(_api.get(self.id, self._to(timeout)))
        return self.info

    async def exec(self, cmd: Cmd = None, *, shell: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                   stdin: Union[None, bytes, str] = None, timeout: Optional[float] = None,
                   stdout_cap: Optional[int] = None, stderr_cap: Optional[int] = None,
                   step: Optional[str] = None, request_timeout: Optional[float] = None,
                   **extra: Any) -> ExecResult:
        """See :meth:`warren.Sandbox.exec`. Cancelling the awaiting task
        drops the connection; the daemon then kills the command."""
        body = exec_body(cmd, shell, env, cwd, stdin, timeout, stdout_cap, stderr_cap, step, extra)
        req = _api.exec_(self.id, body, exec_deadline(body, request_timeout), stream=True)
        return await AsyncExecStream(self.client._t, req, True).wait()

    def exec_stream(self, cmd: Cmd = None, *, shell: Optional[str] = None,
                    env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                    stdin: Union[None, bytes, str] = None, timeout: Optional[float] = None,
                    step: Optional[str] = None, request_timeout: Optional[float] = None,
                    collect: bool = False, **extra: Any) -> "AsyncExecStream":
        """Streaming exec::

            async with sb.exec_stream(["sh", "-c", "make test"]) as s:
                async for chunk in s:
                    print(chunk.text, end="")
            print(s.result.exit_code)
        """
        body = exec_body(cmd, shell, env, cwd, stdin, timeout, None, None, step, extra)
        req = _api.exec_(self.id, body, exec_deadline(body, request_timeout), stream=True)
        return AsyncExecStream(self.client._t, req, collect)

    async def write_file(self, path: str, data: Union[bytes, str], *, mode: Optional[int] = None,
                         append: bool = False, step: Optional[str] = None,
                         timeout: Optional[float] = None) -> int:
        return await self._call(_api.write_file(self.id, path, data, mode, append,
                                                self._to(timeout), step))

    async def log(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """This sandbox's trajectory log (see :meth:`AsyncClient.log`)."""
        return await self.client.log(self.id, timeout=timeout)

    async def read_file(self, path: str, *, timeout: Optional[float] = None) -> bytes:
        return await self._call(_api.read_file(self.id, path, self._to(timeout)))

    async def stat(self, path: str, *, timeout: Optional[float] = None) -> FileStat:
        return await self._call(_api.stat(self.id, path, self._to(timeout)))

    async def list_dir(self, path: str, *, timeout: Optional[float] = None) -> List[FileStat]:
        return await self._call(_api.list_dir(self.id, path, self._to(timeout)))

    async def mkdir(self, path: str, *, parents: bool = False,
                    timeout: Optional[float] = None) -> None:
        await self._call(_api.mkdir(self.id, path, parents, self._to(timeout)))

    async def remove(self, path: str, *, recursive: bool = False,
                     timeout: Optional[float] = None) -> None:
        await self._call(_api.remove(self.id, path, recursive, self._to(timeout)))

    async def pause(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._call(_api.state(self.id, "pause", self._to(timeout)))
        return self.info

    async def resume(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._call(_api.state(self.id, "resume", self._to(timeout)))
        return self.info

    async def allow(self, rules: str, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Add comma-separated rules to a live ``allow=`` sandbox's network
        policy (docs/network.md); ``info.network`` is the new policy."""
        self.info = await self._call(_api.set_network(self.id, {"allow": rules}, self._to(timeout)))
        return self.info

    async def deny(self, rules: str, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Remove rules from the sandbox's network policy, at once."""
        self.info = await self._call(_api.set_network(self.id, {"deny": rules}, self._to(timeout)))
        return self.info

    async def set_network(self, network: str, *,
                    timeout: Optional[float] = None) -> SandboxInfo:
        """Replace the policy: ``"allow=RULE,..."``."""
        self.info = await self._call(_api.set_network(self.id, network, self._to(timeout)))
        return self.info

    async def pack(self, name: str, *, timeout: Optional[float] = None) -> Image:
        return await self._call(_api.pack(self.id, name, timeout))

    async def fork(self, count: int, *, timeout: Optional[float] = None,
             **overrides: Any) -> "List[AsyncSandbox]":
        """``count`` new sandboxes starting from this one's current file system
        (docs/api.md, Group fork); keyword overrides (memory_mb, cpus, ttl_s,
        network, env, labels, ...) apply to every child."""
        infos = await self._call(_api.fork(self.id, count, overrides, timeout))
        return [AsyncSandbox(self.client, i) for i in infos]

    async def checkpoint(self, name: Optional[str] = None, *,
                   timeout: Optional[float] = None) -> str:
        """Snapshot the file system as checkpoint ``name`` (default ckpt-N); returns the name."""
        return await self._call(_api.checkpoint(self.id, name, timeout))

    async def restore(self, name: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Put the file system back to checkpoint ``name``; processes keep running."""
        return await self._call(_api.restore(self.id, name, timeout))

    async def diff(self, frm: Optional[str] = None, to: Optional[str] = None, *,
             path: Optional[str] = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """What changed between two states ("image", "now" or a checkpoint name):
        {"changes": [{"path", "kind", "type", "size", "diff"}], "summary": ...}."""
        return await self._call(_api.diff(self.id, frm, to, path, timeout))


class AsyncExecStream:
    """Output of a streaming exec. The request starts on ``async with`` or
    the first iteration; :attr:`result` is set when the command ends."""

    def __init__(self, t: AsyncTransport, req: Request, collect: bool) -> None:
        self._t, self._req, self._collect = t, req, collect
        self._s: Optional[AsyncStream] = None
        self._out = bytearray()
        self._err = bytearray()
        self.result: Optional[ExecResult] = None

    async def _open(self) -> AsyncStream:
        if self._s is None:
            s = await self._t.stream(self._req)
            if s.status != 200:
                try:
                    body = b"".join([p async for p in s.chunks()])
                finally:
                    s.close()
                raise_for(Response(s.status, s.headers, body))
            self._s = s
        return self._s

    async def __aenter__(self) -> "AsyncExecStream":
        await self._open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; an unfinished command is killed by the daemon."""
        if self._s is not None:
            self._s.close()

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[OutputChunk]:
        if self.result is not None:
            return
        s = await self._open()
        split = LineSplitter()
        try:
            async for part in s.chunks():
                for line in split.feed(part):
                    chunk = self._line(line, s.status)
                    if chunk is not None:
                        yield chunk
            tail = split.rest()
            if tail:
                chunk = self._line(tail, s.status)
                if chunk is not None:
                    yield chunk
        finally:
            if self.result is None:
                s.close()
        if self.result is None:
            raise ProtocolError("the stream ended without a result")

    def _line(self, line: bytes, status: int) -> Optional[OutputChunk]:
        j = _api.stream_line(line)
        if "stream" in j:
            data = decode_field(j, "data")
            if self._collect:
                (self._err if j["stream"] == "stderr" else self._out).extend(data)
            return OutputChunk(str(j["stream"]), data)
        if isinstance(j.get("error"), dict) and "exit_code" not in j:
            raise error_from_stream(j)
        self.result = ExecResult.from_json(j, bytes(self._out), bytes(self._err))
        return None

    async def wait(self) -> ExecResult:
        """Consume the rest of the output and return the result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result
