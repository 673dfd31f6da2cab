"""Request builders for every API call (docs/api.md); both clients run them."""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from typing import IO, Any, Callable, Dict, Generator, List, Optional, Tuple

from ._common import (DEFAULT_TIMEOUT, SLOW_TIMEOUT, Json, Request, Response, check_id,
                      files_path, json_req, quote)
from .errors import InvalidArgument, ProtocolError, error_from_stream
from .types import ExecResult, FileStat, Image, SandboxInfo


def _obj(r: Response) -> Json:
    j = r.json()
    if not isinstance(j, dict):
        raise ProtocolError(f"expected a JSON object, got {str(j)[:100]}")
    return j


def _list_of(key: str, cls: Any):
    def parse(r: Response) -> List[Any]:
        j = _obj(r)
        items = j.get(key)
        if not isinstance(items, list):
            raise ProtocolError(f"response has no {key!r} list")
        return [cls.from_json(x) for x in items]
    return parse


def _t(timeout: Optional[float], default: float = DEFAULT_TIMEOUT) -> float:
    if timeout is None:
        return default
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidArgument("timeout must be a positive number of seconds")
    return float(timeout)


def _ref(ref: str) -> str:
    if not isinstance(ref, str) or not ref or "\0" in ref:
        raise InvalidArgument(f"malformed image reference {ref!r}")
    return quote(ref)


def create(body: Json, timeout: Optional[float]) -> Request:
    return json_req("POST", "/v1/sandboxes", body, ok=(201, 200), timeout=_t(timeout),
                    parse=lambda r: SandboxInfo.from_json(_obj(r)))


def list_sandboxes(timeout: Optional[float]) -> Request:
    return json_req("GET", "/v1/sandboxes", timeout=_t(timeout),
                    parse=_list_of("sandboxes", SandboxInfo))


def get(sid: str, timeout: Optional[float]) -> Request:
    return json_req("GET", f"/v1/sandboxes/{check_id(sid)}", timeout=_t(timeout),
                    parse=lambda r: SandboxInfo.from_json(_obj(r)))


def delete(sid: str, timeout: Optional[float]) -> Request:
    return json_req("DELETE", f"/v1/sandboxes/{check_id(sid)}", ok=(204, 200),
                    timeout=_t(timeout), parse=lambda r: None)


def exec_(sid: str, body: Json, deadline: float, stream: bool = False) -> Request:
    if stream:
        body = dict(body, stream=True)
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/exec", body, timeout=deadline,
                    stream=stream, parse=lambda r: ExecResult.from_json(_obj(r)))


def call(body: Json, deadline: float, stream: bool = False) -> Request:
    if stream:
        body = dict(body, stream=True)
    return json_req("POST", "/v1/calls", body, timeout=deadline, stream=stream,
                    parse=lambda r: ExecResult.from_json(_obj(r)))


def state(sid: str, verb: str, timeout: Optional[float]) -> Request:
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/{verb}", timeout=_t(timeout),
                    parse=lambda r: SandboxInfo.from_json(_obj(r)))


def set_network(sid: str, network: Any, timeout: Optional[float]) -> Request:
    """PATCH the live policy: "allow=..." replaces it, {"allow"|"deny": RULES} edits it."""
    return json_req("PATCH", f"/v1/sandboxes/{check_id(sid)}", {"network": network},
                    timeout=_t(timeout), parse=lambda r: SandboxInfo.from_json(_obj(r)))


def pack(sid: str, name: str, timeout: Optional[float]) -> Request:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("pack needs an image name NAME[:TAG]")
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/pack", {"name": name}, ok=(201, 200),
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: Image.from_json(_obj(r)))


def fork(sid: str, count: int, overrides: Optional[Dict[str, Any]],
         timeout: Optional[float]) -> Request:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidArgument("fork needs a count of at least 1")
    body: Dict[str, Any] = dict(overrides or {})
    body["count"] = count
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/fork", body, ok=(201,),
                    timeout=_t(timeout, SLOW_TIMEOUT),
                    parse=lambda r: [SandboxInfo.from_json(x) for x in _obj(r)["sandboxes"]])


def checkpoint(sid: str, name: Optional[str], timeout: Optional[float]) -> Request:
    body = {} if name is None else {"name": name}
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/checkpoints", body, ok=(201,),
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: _obj(r)["name"])


def restore(sid: str, name: str, timeout: Optional[float]) -> Request:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("restore needs a checkpoint name")
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/restore", {"name": name},
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=_obj)


def diff(sid: str, frm: Optional[str], to: Optional[str], path: Optional[str],
         timeout: Optional[float]) -> Request:
    q = "&".join(f"{k}={quote(v)}" for k, v in (("from", frm), ("to", to), ("path", path))
                 if v is not None)
    return json_req("GET", f"/v1/sandboxes/{check_id(sid)}/diff" + (f"?{q}" if q else ""),
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=_obj)


def write_file(sid: str, path: str, data: "bytes | str", mode: Optional[int], append: bool,
               timeout: Optional[float], step: Optional[str] = None) -> Request:
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidArgument("file data must be bytes or str")
    if mode is not None and (not isinstance(mode, int) or not 0 <= mode <= 0o7777):
        raise InvalidArgument("mode must be an int in [0, 0o7777]")
    target = files_path(sid, path, mode=None if mode is None else format(mode, "o"), append=append,
                        step=step)
    # An append is not idempotent: never re-sent (unless its step id makes a
    # repeat answer from the trajectory log).
    return Request("PUT", target, bytes(data), "application/octet-stream", timeout=_t(timeout),
                   idempotent=not append or step is not None, ok=(201, 200),
                   parse=lambda r: int(_obj(r).get("size", len(data))))


def log(sid: str, timeout: Optional[float]) -> Request:
    """The trajectory log (docs/rl.md), also of a destroyed sandbox."""
    return json_req("GET", f"/v1/sandboxes/{check_id(sid)}/log", timeout=_t(timeout), parse=_obj)


def replay(sid: str, until: Optional[str], timeout: Optional[float]) -> Request:
    if until is not None and (not isinstance(until, str) or not until):
        raise InvalidArgument("until must be a non-empty step id")
    body = {} if until is None else {"until": until}
    return json_req("POST", f"/v1/sandboxes/{check_id(sid)}/replay", body, ok=(201,),
                    timeout=_t(timeout, SLOW_TIMEOUT),
                    parse=lambda r: SandboxInfo.from_json(_obj(r)))


def read_file(sid: str, path: str, timeout: Optional[float]) -> Request:
    return Request("GET", files_path(sid, path), timeout=_t(timeout), parse=lambda r: r.body)


def stat(sid: str, path: str, timeout: Optional[float]) -> Request:
    return Request("GET", files_path(sid, path, op="stat"), timeout=_t(timeout),
                   parse=lambda r: FileStat.from_json(_obj(r)))


def list_dir(sid: str, path: str, timeout: Optional[float]) -> Request:
    return Request("GET", files_path(sid, path, op="list"), timeout=_t(timeout),
                   parse=_list_of("entries", FileStat))


def mkdir(sid: str, path: str, parents: bool, timeout: Optional[float]) -> Request:
    return Request("POST", files_path(sid, path, op="mkdir", parents=parents), b"",
                   timeout=_t(timeout), ok=(201, 200), idempotent=parents, parse=lambda r: None)


def remove(sid: str, path: str, recursive: bool, timeout: Optional[float]) -> Request:
    return Request("DELETE", files_path(sid, path, recursive=recursive), timeout=_t(timeout),
                   ok=(204, 200), parse=lambda r: None)


def health(timeout: Optional[float]) -> Request:
    return json_req("GET", "/healthz", timeout=_t(timeout), parse=_obj)


def metrics(timeout: Optional[float]) -> Request:
    return Request("GET", "/metrics", timeout=_t(timeout),
                   parse=lambda r: r.body.decode("utf-8", "replace"))


def pools(timeout: Optional[float]) -> Request:
    return json_req("GET", "/v1/pools", timeout=_t(timeout), parse=_obj)


def set_pool(image: str, size: int, timeout: Optional[float]) -> Request:
    if not isinstance(size, int) or size < 0:
        raise InvalidArgument("pool size must be a non-negative int")
    return json_req("PUT", f"/v1/pools/{_ref(image)}", {"size": size}, timeout=_t(timeout),
                    parse=_obj)


# ---- images ----

def images_list(timeout: Optional[float]) -> Request:
    return json_req("GET", "/v1/images", timeout=_t(timeout), parse=_list_of("images", Image))


def image_get(ref: str, timeout: Optional[float]) -> Request:
    return json_req("GET", f"/v1/images/{_ref(ref)}", timeout=_t(timeout),
                    parse=lambda r: Image.from_json(_obj(r)))


def image_delete(ref: str, timeout: Optional[float]) -> Request:
    return json_req("DELETE", f"/v1/images/{_ref(ref)}", ok=(204, 200), timeout=_t(timeout),
                    parse=lambda r: None)


def image_import(name: str, path: str, timeout: Optional[float], stream: bool = False) -> Request:
    body: Dict[str, Any] = {"name": name, "path": path}
    if stream:
        body["stream"] = True
    return json_req("POST", "/v1/images/import", body, ok=(201, 200), stream=stream,
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: Image.from_json(_obj(r)))


def image_pull(ref: str, name: Optional[str], insecure: bool, timeout: Optional[float],
               stream: bool = False) -> Request:
    body: Dict[str, Any] = {"ref": ref}
    if name is not None:
        body["name"] = name
    if insecure:
        body["insecure"] = True
    if stream:
        body["stream"] = True
    return json_req("POST", "/v1/images/pull", body, ok=(201, 200), stream=stream,
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: Image.from_json(_obj(r)))


def image_push(ref: str, target: str, insecure: bool, timeout: Optional[float],
               stream: bool = False) -> Request:
    body: Dict[str, Any] = {"ref": ref, "target": target}
    if insecure:
        body["insecure"] = True
    if stream:
        body["stream"] = True
    return json_req("POST", "/v1/images/push", body, ok=(200,), stream=stream,
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=_obj)


def image_build(name: str, spec: str, context: Optional[str], timeout: Optional[float],
                stream: bool = False) -> Request:
    body: Dict[str, Any] = {"name": name, "spec": spec}
    if context is not None:
        body["context"] = context
    if stream:
        body["stream"] = True
    return json_req("POST", "/v1/images/build", body, ok=(201, 200), stream=stream,
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: Image.from_json(_obj(r)))


def image_import_upload(name: str, upload: str, timeout: Optional[float],
                        stream: bool = False) -> Request:
    body: Dict[str, Any] = {"name": name, "upload": upload}
    if stream:
        body["stream"] = True
    return json_req("POST", "/v1/images/import", body, ok=(201, 200), stream=stream,
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: Image.from_json(_obj(r)))


def image_build_upload(name: str, spec: str, upload: str, timeout: Optional[float],
                       stream: bool = False) -> Request:
    body: Dict[str, Any] = {"name": name, "spec": spec, "context_upload": upload}
    if stream:
        body["stream"] = True
    return json_req("POST", "/v1/images/build", body, ok=(201, 200), stream=stream,
                    timeout=_t(timeout, SLOW_TIMEOUT), parse=lambda r: Image.from_json(_obj(r)))


# ---- uploads (docs/api.md, Uploads) ----

UPLOAD_CHUNK = 8 << 20  # the daemon's limit per request
UPLOAD_RESUMES = 5


def upload_source(path: str) -> Tuple[IO[bytes], int]:
    """The bytes to upload for a local ``path``: a file as is, a directory as
    a tar (symlinks kept as links) in an anonymous temporary file."""
    if not isinstance(path, str) or not path:
        raise InvalidArgument("a local path is required")
    if os.path.isdir(path):
        f = tempfile.TemporaryFile()
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for name in sorted(os.listdir(path)):
                tf.add(os.path.join(path, name), arcname="./" + name)
    else:
        f = open(path, "rb")
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    return f, size


def upload_steps(f: IO[bytes], size: int, progress: Optional[Callable[[str, int, int], Any]]
                 ) -> Generator[Request, Any, str]:
    """The requests of one upload, for either client: send each request
    yielded and send its parsed answer back; returns the upload id. A chunk
    refused for its offset (416) resumes from the size the daemon has."""
    created = yield json_req("POST", "/v1/uploads", {"size": size}, ok=(201,),
                             timeout=DEFAULT_TIMEOUT, parse=_obj)
    uid = created.get("id")
    if not isinstance(uid, str) or len(uid) != 32:
        raise ProtocolError("no upload id in the answer")
    off, resumes = 0, 0
    if progress is not None:
        progress("upload", 0, size)
    while off < size:
        f.seek(off)
        data = f.read(min(UPLOAD_CHUNK, size - off))
        status, j = yield Request("PUT", f"/v1/uploads/{uid}?offset={off}", body=data,
                                  content_type="application/octet-stream",
                                  timeout=SLOW_TIMEOUT, idempotent=True, ok=(202, 200, 416),
                                  parse=lambda r: (r.status, _obj(r)))
        if status == 416:
            resumes += 1
            if resumes > UPLOAD_RESUMES:
                raise ProtocolError(f"upload {uid}: the daemon keeps refusing offset {off}")
            j = yield json_req("GET", f"/v1/uploads/{uid}", timeout=DEFAULT_TIMEOUT, parse=_obj)
        if not isinstance(j.get("size"), int) or j["size"] > size:
            raise ProtocolError(f"upload {uid}: bad size in the answer")
        off = j["size"]
        if progress is not None:
            progress("upload", off, size)
    return uid


def image_tag(source: str, name: str, timeout: Optional[float]) -> Request:
    return json_req("POST", f"/v1/images/{_ref(source)}/tag", {"name": name}, ok=(201, 200),
                    timeout=_t(timeout), parse=lambda r: Image.from_json(_obj(r)))


def stream_line(line: bytes) -> Json:
    try:
        j = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"malformed NDJSON line: {e}") from None
    if not isinstance(j, dict):
        raise ProtocolError("NDJSON line is not an object")
    return j


def job_line(line: bytes, progress: Optional[Callable[[str, int, int], Any]]) -> Optional[Image]:
    """One NDJSON line of a streamed import/pull/build: progress is reported,
    an error raised, the final image returned."""
    j = stream_line(line)
    if "progress" in j and "name" not in j:
        if progress is not None:
            progress(str(j.get("progress")), int(j.get("done") or 0), int(j.get("total") or 0))
        return None
    if isinstance(j.get("error"), dict):
        raise error_from_stream(j)
    if "uploaded" in j and "target" in j:
        return j  # type: ignore[return-value]  # a push's result
    return Image.from_json(j)
