#!/usr/bin/env python3
"""Writes the seed corpus tests/fuzz/corpus/TARGET/ (checked in; rerun after
changing a format). Seeds are small valid inputs: libFuzzer mutates from them."""
import gzip, hashlib, io, json, os, struct, sys, tarfile

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def frame(stream, typ, payload=b""):
    if isinstance(payload, str):
        payload = payload.encode()
    return struct.pack("<IIB3x", len(payload), stream, typ) + payload


def tar_of(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, data in files:
            if data is None:
                ti = tarfile.TarInfo(name)
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                t.addfile(ti)
                continue
            if isinstance(data, tuple):  # ("symlink"|"link", target)
                ti = tarfile.TarInfo(name)
                ti.type = tarfile.SYMTYPE if data[0] == "symlink" else tarfile.LNKTYPE
                ti.linkname = data[1]
                t.addfile(ti)
                continue
            if isinstance(data, str):
                data = data.encode()
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def sha(b):
    return hashlib.sha256(b).hexdigest()


# ---- codecs ----
put("codec", "ascii", "hello world")
put("codec", "b64", "aGVsbG8=")
put("codec", "utf8", b"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xed\xa0\x80")

# ---- protocol ----
hello = json.dumps({"version": 1, "agent": "warren-agent", "pid": 1, "resolver": "openat2"})
put("proto", "hello", frame(0, 1, hello))
put("proto", "mixed", frame(1, 5, "out") + frame(1, 6, "err") + frame(1, 7, '{"exit_code":0}') + frame(0, 12, "p"))

put("agent_conn", "exec", frame(0, 1, hello) + frame(1, 5, "hello\n") + frame(1, 6, "") +
    frame(1, 7, json.dumps({"exit_code": 0, "signal": 0, "timed_out": False})))
put("agent_conn", "file", frame(2, 9, "data") + frame(2, 10, '{"size":4,"again":1}') + frame(4, 10, "{}"))
put("agent_conn", "error", frame(1, 11, '{"code":"not_found","message":"x","errno":2}') + frame(0, 12, "ping") + frame(3, 5, "late"))

put("agent", "stat", frame(1, 8, '{"op":"stat","path":"/"}') + frame(2, 8, '{"op":"list","path":"/"}'))
put("agent", "write_read", frame(1, 8, '{"op":"write","path":"/f","mode":420}') + frame(1, 9, "content") +
    frame(1, 9) + frame(2, 8, '{"op":"read","path":"/f","max_bytes":3}'))
put("agent", "mkdir_rm", frame(1, 8, '{"op":"mkdir","path":"/a/b/c","parents":true}') +
    frame(2, 8, '{"op":"remove","path":"/a","recursive":true}') + frame(3, 8, '{"op":"stat","path":"/a/../../etc"}'))
put("agent", "exec", frame(1, 2, json.dumps({"cmd": ["ls", "-l"], "env": {"A": "1"}, "cwd": "/", "timeout_ms": 5,
                                             "stdin": True, "tty": False, "rows": 24, "cols": 80})) +
    frame(1, 3, "in") + frame(1, 4, '{"signal":9}') + frame(0, 12, "p"))
put("agent", "call", frame(1, 2, json.dumps({"shell": "echo", "call": {"uid": 1000, "gid": 1000, "scratch": "/tmp/s",
                                                                        "rlimits": {"nofile": 64}}})))

# ---- HTTP (daemon): byte 0 bit0 = TCP (token), bit1 = exec validator ----
def req(method, path, body=None, hdrs=""):
    b = json.dumps(body) if body is not None else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{hdrs}Content-Length: {len(b)}\r\n\r\n{b}"

put("http", "healthz", "\0" + req("GET", "/healthz"))
put("http", "create", "\0" + req("POST", "/v1/sandboxes", {"image": "busybox:latest", "memory_mb": 256, "env": {"A": "b"}}))
put("http", "tcp_token", "\1" + req("GET", "/v1/sandboxes?all=1&x=%20", None, "Authorization: Bearer fuzz-token-0123456789\r\n"))
TOK = "Authorization: Bearer fuzz-token-0123456789\r\n"
# TCP: the guard admits on the first request's headers; later requests are checked by route()
put("http", "tcp_create", "\1" + req("POST", "/v1/sandboxes", {"image": "busybox:latest"}, TOK) + req("GET", "/healthz"))
put("http", "tcp_no_token", "\1" + req("POST", "/v1/sandboxes", {"image": "x" * 64}))
put("http", "tcp_bad_token", "\1" + req("GET", "/healthz", None, "authorization:  Bearer fuzz-token-012345678 \r\n"))
put("http", "tcp_upload", "\1" + req("POST", "/v1/uploads", {"size": 10}, TOK) + req("PATCH", "/v1/uploads/u1?offset=0", None, TOK))
put("http", "pool", "\0" + req("PUT", "/v1/pools/busybox%3Alatest", {"size": 2}) + req("GET", "/metrics"))
put("http", "exec_route", "\0" + req("POST", "/v1/sandboxes/abcd-1234/exec?stream=1", {"cmd": ["true"]}))
put("http", "exec_json", "\2" + json.dumps({"cmd": ["sh", "-c", "x"], "env": {"K": "V"}, "cwd": "/tmp", "timeout_s": 2.5,
                                            "stdout_cap": 10, "stdin": "aGk=", "stdin_encoding": "base64"}))

# ---- JSON validators: byte 0 bit0 = create, else fncall ----
put("json", "create", "\1" + json.dumps({"backend": "container", "image": "a/b:c", "layers": ["x:1"], "cpus": 0.5,
                                          "network": "none", "labels": {"k": "v"}, "ttl_s": 60}))
put("json", "call", "\0" + json.dumps({"image": "python:3", "cmd": ["python3", "-c", "1"], "stdin": "x",
                                       "timeout_s": 3, "memory_mb": 128, "env": {"A": "B"}}))
put("json", "call_py", "\0" + json.dumps({"lang": "python", "code": "print(1)", "stdin_encoding": "base64", "stdin": "eA=="}))

# ---- build spec ----
put("buildspec", "spec", "FROM busybox:latest\nENV A=1 B=\"two words\" C=\\\"q\nENV PATH /usr/bin\nWORKDIR app\n"
    "LABEL org.x=y\nUSER 1000\nCOPY a b /dst/\nRUN echo hi && \\\n  echo there\n# comment\n")

# ---- tar ----
put("tar", "plain", tar_of([("etc/", None), ("etc/passwd", "root:x:0:0\n"), ("bin/sh", ("symlink", "busybox")),
                            ("bin/ln", ("link", "etc/passwd")), ("usr/.wh.gone", ""), ("usr/.wh..wh..opq", "")]))
put("tar", "gzip", gzip.compress(tar_of([("a", "x" * 100), ("../evil", "x"), ("/abs", "y")]), mtime=0))

# ---- image archives ----
layer = tar_of([("etc/", None), ("etc/hostname", "fuzz\n")])
diff = sha(layer)
config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"], "WorkingDir": "/"},
                     "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff]}}).encode()
chex = sha(config)
put("image", "docker_save", tar_of([("manifest.json", json.dumps([{"Config": chex + ".json", "RepoTags": ["x:1"],
                                                                  "Layers": [diff + "/layer.tar"]}])),
                                    (chex + ".json", config), (diff + "/layer.tar", layer)]))
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + chex, "size": len(config)},
                       "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:" + diff, "size": len(layer)}]}).encode()
mhex = sha(manifest)
index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                      "digest": "sha256:" + mhex, "size": len(manifest),
                                                      "platform": {"os": "linux", "architecture": "amd64"}}]})
put("image", "oci_layout", tar_of([("oci-layout", '{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                                   ("blobs/sha256/" + mhex, manifest), ("blobs/sha256/" + chex, config),
                                   ("blobs/sha256/" + diff, layer)]))

# ---- registry: line 1 = reference, then one HTTP response per connection ----
def resp(body, ctype="application/octet-stream", extra=""):
    if isinstance(body, str):
        body = body.encode()
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nDocker-Content-Digest: sha256:{sha(body)}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body

SEP = b"=====\n"
put("registry", "pull", b"127.0.0.1:5000/fuzz/img:1\n" + SEP.join([
    resp(manifest, "application/vnd.oci.image.manifest.v1+json"), resp(config), resp(layer)]))
chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(config) + config + b"\r\n0\r\n\r\n"
put("registry", "redirect", b"localhost:5000/img@sha256:" + mhex.encode() + b"\n" + SEP.join([
    b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://other:5000/v2/img/manifests/x\r\nContent-Length: 0\r\n\r\n",
    resp(manifest, "application/vnd.oci.image.manifest.v1+json"), chunked,
    b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"]))

# ---- libwarren: byte 0 picks the call, the rest is the daemon's answer ----
def http_resp(body, status="200 OK", extra=""):
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n{body}"

put("lib_http", "exec", "\0" + http_resp({"exit_code": 0, "stdout": "aGk=", "stdout_encoding": "base64", "stderr": ""}))
lines = '{"stream":"stdout","data":"aGk=","encoding":"base64"}\n{"exit_code":0}\n'
put("lib_http", "exec_stream", "\1HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
    f"{len(lines):x}\r\n{lines}\r\n0\r\nX-Trailer: 1\r\n\r\n")
put("lib_http", "list", "\2" + http_resp({"sandboxes": [{"id": "abcd-1234"}]}))
put("lib_http", "error", "\3" + http_resp({"error": {"code": "invalid_argument", "message": "bad"}}, "400 Bad Request"))
put("lib_http", "file_get", "\4HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\nraw bytes until close")
put("lib_http", "pull_progress", "\6" + http_resp('{"progress":"layer","done":1,"total":2}\n{"image":{"name":"x:1"}}\n'))
put("lib_http", "interim", "\13HTTP/1.1 100 Continue\r\n\r\n" + http_resp({"status": "ok"}, extra="Connection: keep-alive\r\n"))
# ---- compat_sf: byte 0 picks the parser (fuzz_compat_sf.c) ----
put("compat_sf", "tar", b"\0" + tar_of([("./out/a.txt", b"hello\n"), ("b" * 120, b"long name")]))
put("compat_sf", "head", b"\1POST /run_code HTTP/1.1\r\nHost: x\r\n\xffContent-Length: 12\r\n\r\n"
    b"\xffGET /v1/ping HTTP/1.1\nTransfer-Encoding: chunked\n\n")
put("compat_sf", "body", "\2" + json.dumps({
    "code": "print(1)", "language": "python", "memory_limit_MB": 64,
    "files": {"a/b.txt": "aGk=", "x": None}, "fetch_files": ["out.txt", "/abs", "../up"]}))
put("compat_sf", "string", b"\3ok \xc3\xa9 bad \xff\xfe \xe2\x82")

# ---- compat_e2b: byte 0 picks the parser (fuzz_compat_e2b.c) ----
mp = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nhi\r\n"
      b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nsecond\r\n--XyZ--\r\n")
put("compat_e2b", "multipart", b"\0multipart/form-data; boundary=\"XyZ\"\n" + mp)
put("compat_e2b", "gzip", b"\1" + gzip.compress(b"x" * 5000))
put("compat_e2b", "unary", b"\2" + json.dumps({"path": "/home/user", "depth": 1}).encode())
msg = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-c", "ls"]}}).encode()
put("compat_e2b", "enveloped", b"\3" + struct.pack(">BI", 0, len(msg)) + msg)
put("compat_e2b", "path", b"\4~/dir/../file")
print("corpus written to", OUT)
