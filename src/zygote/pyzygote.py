# Warren's Python fncall zygote (docs/fncall.md).
#
# warrend starts one per pool sandbox as a long-running exec:
#   python3 -I -S -u -c <this file> UID GID SCRATCH MODULES MODE [WORKER_CALLS]
# and talks to it over that exec's stdin/stdout. Single threaded; one call at
# a time. Frames both ways: u32 little-endian length + JSON. A result frame's
# JSON carries out_len/err_len and the raw output bytes follow it.
#
# MODE is the pool's, set by its owner; requests in another mode are refused.
# fork mode: a fresh child per call (setsid, rlimits, call uid, seccomp,
# scratch cwd), exec()s the code in the preloaded interpreter, exits.
# reuse mode: one pre-forked worker (already at the call uid, limits and
# filter applied) runs call after call in a fresh globals dict; the zygote
# enforces the wall-clock timeout by killing and replacing it. Every call
# gets its own request memfd and result pipe, passed over a socket the worker
# cannot write to: nothing a call writes to any fd reaches another call's
# result. Code in the shared interpreter can still change how later calls
# run: reuse is for calls that trust each other (docs/fncall.md).
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

UID, GID, SCRATCH = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
PRELOAD = [m for m in (sys.argv[4] if len(sys.argv) > 4 else "").split(",") if m]
MODE = sys.argv[5] if len(sys.argv) > 5 else "fork"
WORKER_CALLS = int(sys.argv[6]) if len(sys.argv) > 6 else 0  # reuse: calls per worker (0: no limit)
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
IN, OUT = 0, os.dup(1)  # the daemon's frames; fd 1 itself goes to /dev/null
_null = os.open("/dev/null", os.O_RDWR)
os.dup2(_null, 1)
os.set_inheritable(OUT, False)
HDR = struct.Struct("<I")
MAX_REQ = 64 << 20
INLINE_REQ = 32 << 10  # reuse requests up to this size travel in the control message

for _m in PRELOAD:
    try:
        __import__(_m)
    except Exception as e:  # a missing module must not kill the pool
        sys.stderr.write("pyzygote: preload %s: %s\n" % (_m, e))

# ---- per-call seccomp filter (same list as the agent's, src/agent/zygote.c) ----

_SYSCALLS = {
    # x86_64: ptrace process_vm_readv process_vm_writev pidfd_getfd
    # io_uring_setup io_uring_enter io_uring_register msgget semget shmget
    # mq_open personality chroot mknodat mknod. pidfd_open stays allowed: the
    # zygote waits on its children with it, and a pidfd grants nothing kill()
    # would not (pidfd_getfd, which needs ptrace rights, is denied).
    "x86_64": (0xC000003E, [101, 310, 311, 438, 425, 426, 427, 68, 64, 29, 240, 135, 161, 259, 133]),
    "aarch64": (0xC00000B7, [117, 270, 271, 438, 425, 426, 427, 186, 190, 194, 180, 92, 51, 33]),
}


def _build_filter():
    arch = os.uname().machine
    if arch not in _SYSCALLS:
        return None
    audit, nrs = _SYSCALLS[arch]
    ins = []

    def stmt(code, k):
        ins.append(struct.pack("<HBBI", code, 0, 0, k))

    def jump(code, k, jt, jf):
        ins.append(struct.pack("<HBBI", code, jt, jf, k))

    BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
    stmt(BPF_LD_W_ABS, 4)  # seccomp_data.arch
    jump(BPF_JEQ_K, audit, 1, 0)
    stmt(BPF_RET_K, 0x80000000)  # SECCOMP_RET_KILL_PROCESS
    stmt(BPF_LD_W_ABS, 0)  # seccomp_data.nr
    for nr in nrs:
        jump(BPF_JEQ_K, nr, 0, 1)
        stmt(BPF_RET_K, 0x00050000 | 1)  # SECCOMP_RET_ERRNO | EPERM
    stmt(BPF_RET_K, 0x7FFF0000)  # SECCOMP_RET_ALLOW
    return b"".join(ins)


try:
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)
    _prog_bytes = _build_filter()
    if _prog_bytes:
        _prog_buf = ctypes.create_string_buffer(_prog_bytes)

        class _Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        _fprog = _Fprog(len(_prog_bytes) // 8, ctypes.cast(_prog_buf, ctypes.c_void_p))
    else:
        _fprog = None
except Exception:  # no ctypes in the image: the sandbox-wide filter still applies
    _libc = _fprog = None
SECCOMP = _fprog is not None
FILTERED = False  # the zygote itself carries the filter: children inherit it


def install_filter():
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    if _fprog is not None and _libc.prctl(22, 2, ctypes.byref(_fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp")


def confine(limits):
    """In a fresh child: drop to the call uid with limits and the filter.
    Every object touched here costs a copy-on-write fault: keep it lean."""
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
    except OSError:
        pass
    for name, res in (("as_bytes", resource.RLIMIT_AS), ("nproc", resource.RLIMIT_NPROC),
                      ("fsize_bytes", resource.RLIMIT_FSIZE), ("nofile", resource.RLIMIT_NOFILE)):
        v = limits.get(name)
        if v:
            resource.setrlimit(res, (v, v))
    cpu = limits.get("cpu_s")
    if cpu:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setgroups([])
    os.setresgid(GID, GID, GID)
    os.setresuid(UID, UID, UID)
    if not FILTERED and _libc is not None:
        install_filter()


def run_code(code, glb):
    """exec() code as __main__; returns the exit status."""
    try:
        if isinstance(code, BaseException):
            raise code  # compiling failed in the zygote: report it as the call's error
        exec(code if not isinstance(code, str) else compile(code, "<call>", "exec"), glb)
        return 0
    except SystemExit as e:
        c = e.code
        if c is None:
            return 0
        if isinstance(c, int):
            return c & 0xFF
        try:
            sys.stderr.write(str(c) + "\n")
        except Exception:
            pass
        return 1
    except BaseException:
        import traceback

        t, e, tb = sys.exc_info()
        try:
            traceback.print_exception(t, e, tb.tb_next)  # not the zygote's own frame
        except BaseException:
            pass
        del t, e, tb  # the traceback holds the call's frames (and its memory)
        return 1


# ---- cleanup of what a call leaves behind ----


def _alive(pid):
    try:
        with open("/proc/%s/stat" % pid, "rb") as f:
            s = f.read()
        return s[s.rindex(b")") + 2:s.rindex(b")") + 3] not in (b"Z", b"X")
    except (OSError, ValueError):
        return False


SUBREAPER = False  # orphans of calls are reparented to us, not to the agent


def has_children():
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


def reap_all(deadline):
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)


def kill_uid(spare=0):
    """SIGKILL every living process of the call uid except spare, until none."""
    for _ in range(64):
        found = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            if pid == spare:
                continue
            try:
                if os.stat("/proc/" + name).st_uid != UID:
                    continue
            except OSError:
                continue
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    found += 1
                except OSError:
                    pass
        if not found:
            return


def _rm(path):
    try:
        st = os.lstat(path)
    except OSError:
        return
    if (st.st_mode & 0o170000) == 0o040000:
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
        try:
            names = os.listdir(path)
        except OSError:
            names = []
        for n in names:
            _rm(path + "/" + n)
        try:
            os.rmdir(path)
        except OSError:
            pass
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


scratch_ok = False  # SCRATCH exists, empty, ours, mode 0700

# Directories a scan found nothing to remove in, by path: the stat that scan
# started from. A directory whose entries change gets a new ctime, which no
# call can set back (utimensat sets ctime to now, and only the owner may):
# the same stat again means the same entries, and the scan (open, getdents,
# a stat per entry: most of a reuse call's cleanup) is skipped. Only stats
# with a ctime older than CTIME_SETTLED_NS are kept, so a change in the same
# clock tick as the scan cannot leave the ctime as it was.
_unchanged = {}
CTIME_SETTLED_NS = 1000000000


def _dir_key(st):
    return (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_mode, st.st_uid,
            st.st_nlink)


def _settled(st):
    return time.time_ns() - st.st_ctime_ns > CTIME_SETTLED_NS


def scratch_clean():
    try:
        st = os.lstat(SCRATCH)
        if st.st_uid != UID or st.st_mode != 0o40700:
            return False
        key = _dir_key(st)
        if _unchanged.get(SCRATCH) == key:
            return True
        with os.scandir(SCRATCH) as it:
            for _ in it:
                return False
        if _settled(st):
            _unchanged[SCRATCH] = key
        return True
    except OSError:
        return False


def wipe_files():
    """Remove everything the call uid left in the scratch and temp dirs."""
    global scratch_ok
    scratch_ok = scratch_clean()  # the common case: untouched, keep it
    if not scratch_ok:
        _unchanged.pop(SCRATCH, None)
        _rm(SCRATCH)
    for d in TMP_DIRS:
        try:
            st = os.stat(d)
        except OSError:
            continue
        key = _dir_key(st)
        if _unchanged.get(d) == key:
            continue
        _unchanged.pop(d, None)
        removed = False
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                if scratch_ok and d + "/" + e.name == SCRATCH:
                    continue
                try:
                    if e.stat(follow_symlinks=False).st_uid == UID:
                        _rm(d + "/" + e.name)
                        removed = True
                except OSError:
                    pass
        if not removed and st.st_uid != UID and _settled(st):
            _unchanged[d] = key


def make_scratch():
    global scratch_ok
    if scratch_ok:
        scratch_ok = False  # the call about to run may dirty it
        return
    _unchanged.pop(SCRATCH, None)
    try:
        os.mkdir(SCRATCH, 0o700)
    except FileExistsError:
        _rm(SCRATCH)
        os.mkdir(SCRATCH, 0o700)
    os.chown(SCRATCH, UID, GID)


def reap():
    # orphans of calls are reparented to the agent (PID 1); only our own
    # children are reaped here
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---- framing ----


_inbuf = b""  # read from the daemon's channel, not yet a whole frame


def read_frame(fd):
    """One frame; a single read() for the usual request that arrived whole."""
    global _inbuf
    buf, need = _inbuf, 4
    while True:
        if len(buf) >= 4:
            (n,) = HDR.unpack_from(buf)
            if n > MAX_REQ:
                raise ValueError("frame too large")
            need = 4 + n
            if len(buf) >= need:
                _inbuf = buf[need:]
                return buf[4:need]
        b = os.read(fd, max(65536, need - len(buf)))
        if not b:
            return None
        buf += b


def write_all(fd, data):
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def send_result(fd, hdr, out=b"", err=b""):
    hdr["out_len"], hdr["err_len"] = len(out), len(err)
    j = json.dumps(hdr, separators=(",", ":")).encode()
    write_all(fd, HDR.pack(len(j)) + j + out + err)


def usage_of(ru):
    return {"cpu_user_ms": int(ru.ru_utime * 1000), "cpu_system_ms": int(ru.ru_stime * 1000),
            "max_rss_kb": ru.ru_maxrss}


def decode_stdin(req):
    s = req.get("stdin_b64")
    if not s:
        return b""
    import base64

    return base64.b64decode(s)


# ---- fork mode ----


class Capture:
    __slots__ = ("fd", "cap", "buf", "trunc", "eof")

    def __init__(self, fd, cap):
        self.fd, self.cap, self.buf, self.trunc, self.eof = fd, cap, bytearray(), False, False

    def pump(self):
        # only after poll() or select() found the pipe readable: no wait
        b = os.read(self.fd, 65536)
        if not b:
            self.eof = True
            return
        room = self.cap - len(self.buf)
        if room >= len(b):
            self.buf += b
        else:
            if room > 0:
                self.buf += b[:room]
            self.trunc = True


def call_fork(req):
    limits = req.get("limits") or {}
    timeout = req.get("timeout_ms", 30000) / 1000.0
    data = decode_stdin(req)
    make_scratch()
    if data:
        in_fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        write_all(in_fd, data)
        os.lseek(in_fd, 0, 0)
    else:
        in_fd = _null
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    t0 = time.monotonic()
    # Compile before forking: allocations made now are private pages, the
    # same ones made in the child would each cost a copy-on-write fault.
    try:
        compiled = compile(req.get("code", ""), "<call>", "exec")
    except BaseException as e:  # SyntaxError, ValueError (NUL), MemoryError...
        compiled = e
    glb = {"__name__": "__main__", "__builtins__": __builtins__}
    caps = [Capture(out_r, req.get("out_cap", 1 << 20)), Capture(err_r, req.get("err_cap", 1 << 20))]
    poll = select.poll()
    for c in caps:
        poll.register(c.fd, select.POLLIN)
    deadline = t0 + timeout
    timed_out = exited = False
    status = ru = None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.dup2(in_fd, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 1 << 16)  # the daemon's channel, worker pipes: not the call's
            os.chdir(SCRATCH)
            confine(limits)
            env = req.get("env")
            if env:
                os.environ.update(env)
            # sys.stdin/stdout/stderr are the zygote's own objects, unused
            # and empty there; they now read and write the call's fds
            code = run_code(compiled, glb)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException as e:
            try:
                os.write(2, ("warren: call setup failed: %s\n" % e).encode())
            except BaseException:
                pass
            code = 126
        os._exit(code)
    if in_fd != _null:
        os.close(in_fd)
    os.close(out_w)
    os.close(err_w)
    pidfd = os.pidfd_open(pid)
    poll.register(pidfd, select.POLLIN)
    while not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            kill_uid()
            left = 1.0
        for fd, _ in poll.poll(left * 1000):
            if fd == pidfd:
                _, status, ru = os.wait4(pid, 0)
                exited = True
            else:
                for c in caps:
                    if c.fd == fd:
                        c.pump()
                        if c.eof:
                            poll.unregister(fd)
    dur = time.monotonic() - t0
    os.close(pidfd)
    # Background processes may hold the pipes: kill them, then drain to EOF.
    # As subreaper, "no children left" proves no process of the call lives.
    leftovers = not SUBREAPER or has_children()
    if leftovers:
        kill_uid()
        if SUBREAPER:
            reap_all(time.monotonic() + 2)
    for c in caps:
        while not c.eof:
            if select.select([c.fd], [], [], 1.0)[0]:
                c.pump()
        os.close(c.fd)
    code = os.waitstatus_to_exitcode(status)
    hdr = {"exit_code": code if code >= 0 else -1, "signal": -code if code < 0 else 0,
           "timed_out": timed_out, "stdout_truncated": caps[0].trunc,
           "stderr_truncated": caps[1].trunc, "duration_ms": int(dur * 1000),
           "usage": usage_of(ru), "mode": "fork"}
    send_result(OUT, hdr, bytes(caps[0].buf), bytes(caps[1].buf))
    # the next request waits in the pipe while we clean up
    if leftovers and not SUBREAPER:
        kill_uid()
    wipe_files()


# ---- reuse mode ----


class CapText:
    """sys.stdout/stderr of a reuse call: bytes up to a cap, the rest counted."""

    def __init__(self, cap):
        self.cap, self.buf, self.trunc = cap, bytearray(), False
        self.buffer = self

    def write(self, s):
        b = s.encode("utf-8", "backslashreplace") if isinstance(s, str) else bytes(s)
        room = self.cap - len(self.buf)
        if room >= len(b):
            self.buf += b
        else:
            if room > 0:
                self.buf += b[:room]
            self.trunc = True
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False

    def writable(self):
        return True

    encoding = "utf-8"
    errors = "backslashreplace"


TIMER_SIGNALS = (signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF)


def worker_main(ctl):
    import io

    base_limits = {"nproc": 1}  # no subprocesses or threads: nothing can outlive a call
    confine(base_limits)
    # what a call may leave armed that would fire inside the next one (an
    # alarm its own timeout code did not cancel): reset after every call
    handlers = {s: signal.getsignal(s) for s in TIMER_SIGNALS}
    as_set = None  # RLIMIT_AS in force (a pool's calls all have the same)
    while True:
        # one message per call: the request (inline, or a memfd when larger
        # than INLINE_REQ) and the write end of a pipe made for this call's
        # result alone (the zygote closes the read end once it has the
        # result, so a copy kept by the call leads nowhere)
        try:
            msg, fds, flags, _ = socket.recv_fds(ctl, INLINE_REQ, 2)
        except OSError:
            os._exit(1)
        if not msg:
            os._exit(0)
        if flags & socket.MSG_TRUNC or not 1 <= len(fds) <= 2:
            os._exit(1)
        res_fd = fds[-1]
        if len(fds) == 2:
            req_fd = fds[0]
            chunks = []
            while True:
                b = os.read(req_fd, 1 << 20)
                if not b:
                    break
                chunks.append(b)
            os.close(req_fd)
            msg = b"".join(chunks)
            del chunks
        req = json.loads(msg)
        del msg
        limits = req.get("limits") or {}
        try:
            os.chdir(SCRATCH)
        except OSError:
            pass
        lim_as = limits.get("as_bytes")
        if lim_as != as_set:
            resource.setrlimit(resource.RLIMIT_AS, (lim_as or resource.RLIM_INFINITY,
                                                    resource.RLIM_INFINITY))
            as_set = lim_as
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = limits.get("cpu_s")
        if cpu:
            used = int(r0.ru_utime + r0.ru_stime)
            resource.setrlimit(resource.RLIMIT_CPU, (used + cpu, resource.RLIM_INFINITY))
        out, err = CapText(req.get("out_cap", 1 << 20)), CapText(req.get("err_cap", 1 << 20))
        saved = sys.stdin, sys.stdout, sys.stderr
        sys.stdin = io.TextIOWrapper(io.BytesIO(decode_stdin(req)), encoding="utf-8")
        sys.stdout, sys.stderr = out, err
        t0 = time.monotonic()
        glb = {"__name__": "__main__", "__builtins__": __builtins__}
        code = run_code(req.get("code", ""), glb)
        dur = time.monotonic() - t0
        for t in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
            signal.setitimer(t, 0)
        for s, h in handlers.items():
            if signal.getsignal(s) is not h:
                signal.signal(s, h)
        glb.clear()  # functions and their globals form cycles: break them now
        if code:
            gc.collect()  # a failed call's frames may sit in cycles
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        sys.stdin, sys.stdout, sys.stderr = saved
        o, e = bytes(out.buf), bytes(err.buf)
        try:
            write_all(res_fd, RES.pack(code & 0xFF, out.trunc | err.trunc << 1,
                                       max(0, int(dur * 1000)),
                                       max(0, int((r1.ru_utime - r0.ru_utime) * 1000)),
                                       max(0, int((r1.ru_stime - r0.ru_stime) * 1000)),
                                       max(0, r1.ru_maxrss), len(o), len(e)) + o + e)
        except (OSError, struct.error):
            pass
        os.close(res_fd)


class Worker:
    def __init__(self):
        make_scratch()
        # SEQPACKET: one request per message, fds attached; the worker's end
        # is shut down for writing before any call runs, so a call can
        # neither write into the zygote's side nor undo that
        zs, ws = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.setsid()
                os.dup2(_null, 0)
                os.dup2(_null, 1)
                os.dup2(_null, 2)
                os.dup2(ws.fileno(), 3)
                os.closerange(4, 1 << 16)  # the daemon channel, the zygote's end
                signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a stale pipe is an error, not death
                ctl = socket.socket(fileno=3)
                ctl.shutdown(socket.SHUT_WR)
                worker_main(ctl)
            except BaseException:
                pass
            os._exit(1)
        ws.close()
        self.ctl = zs
        self.calls = 0

    def close(self):
        # never reaped before this: its pid cannot have been reused
        self.ctl.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


worker = None

# A reuse result on the call's pipe: a fixed binary header (exit code,
# truncation bits, duration, user and system CPU ms, max RSS kB, output
# lengths), then stdout and stderr. Any bytes unpack to integers of these
# types: the zygote checks the lengths, bounds the numbers and writes the
# daemon's JSON from a template (no JSON parsed or built per call).
RES = struct.Struct("<BB6Q")
NUM_MAX = (1 << 53) - 1  # what JSON readers take as an integer exactly
RESULT_JSON = ('{"exit_code":%d,"signal":0,"timed_out":false,"stdout_truncated":%s,'
               '"stderr_truncated":%s,"duration_ms":%d,"usage":{"cpu_user_ms":%d,'
               '"cpu_system_ms":%d,"max_rss_kb":%d},"mode":"reuse","out_len":%d,"err_len":%d}')
_BOOL = ("false", "true")


def read_result(fd, deadline, out_cap, err_cap):
    """One result from the call's own pipe, read until the deadline: (the
    daemon's result frame header, stdout, stderr). None when the worker
    died, timed out or wrote something malformed. Blocking reads, each
    after select() found data: they return what is there."""
    buf = bytearray()
    f = None
    need = RES.size  # then the header and the output
    while True:
        if len(buf) >= need:
            if f is None:
                f = RES.unpack_from(buf)
                ol, el = f[6], f[7]
                if ol > out_cap or el > err_cap:
                    return None
                need = RES.size + ol + el
                continue
            at = RES.size
            j = (RESULT_JSON % (f[0], _BOOL[f[1] & 1], _BOOL[f[1] >> 1 & 1],
                                min(f[2], NUM_MAX), min(f[3], NUM_MAX), min(f[4], NUM_MAX),
                                min(f[5], NUM_MAX), ol, el)).encode()
            return HDR.pack(len(j)) + j, bytes(buf[at:at + ol]), bytes(buf[at + ol:need])
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        b = os.read(fd, max(65536, need - len(buf)))
        if not b:
            return None
        buf += b


def call_reuse(req, raw):
    """raw: the request frame as the daemon sent it (passed on, not re-encoded)."""
    global worker
    timeout = req.get("timeout_ms", 30000) / 1000.0
    if len(raw) < INLINE_REQ:
        req_fd = None
    else:
        req_fd = os.memfd_create("call", os.MFD_CLOEXEC)
        write_all(req_fd, raw)
    res_r, res_w = os.pipe2(os.O_CLOEXEC)
    t0 = time.monotonic()
    # A worker that a previous call broke after its result (closed the
    # control socket, exited) must not fail this call: replace it once. Its
    # end of the socket is in no other process (it cannot fork), so the
    # send fails once it is gone; unreaped until then, its pid is not reused.
    for _ in range(2):
        if worker is None:
            worker = Worker()
        try:
            if req_fd is None:
                socket.send_fds(worker.ctl, [raw], [res_w], socket.MSG_NOSIGNAL)
            else:
                os.lseek(req_fd, 0, 0)
                socket.send_fds(worker.ctl, [b"m"], [req_fd, res_w], socket.MSG_NOSIGNAL)
            break
        except OSError:
            worker.close()
            worker = None
    if req_fd is not None:
        os.close(req_fd)
    os.close(res_w)
    if worker is None:
        worker = Worker()  # so that the failure path below has one to reap
    deadline = t0 + timeout
    got = read_result(res_r, deadline, req.get("out_cap", 1 << 20), req.get("err_cap", 1 << 20))
    os.close(res_r)  # whatever the call still holds of this pipe now leads nowhere
    if got is None:
        # timeout, or the worker died (it exhausted memory, killed itself...)
        # or wrote a broken frame: replace it; the call's result says what
        # happened
        timed_out = time.monotonic() >= deadline
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            _, status, ru = os.wait4(worker.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = -9
        worker.ctl.close()
        worker = None
        sig = -code if code < 0 else 0
        msg = b"" if timed_out else b"warren: the reuse worker died (exit status %d)\n" % code
        hdr = {"exit_code": -1 if sig else code, "signal": sig, "timed_out": timed_out,
               "stdout_truncated": False, "stderr_truncated": False,
               "duration_ms": int((time.monotonic() - t0) * 1000),
               "usage": {"cpu_user_ms": 0, "cpu_system_ms": 0, "max_rss_kb": 0}, "mode": "reuse"}
        send_result(OUT, hdr, b"", msg)
        kill_uid()
        wipe_files()
        return
    hdr, out, err = got
    write_all(OUT, hdr + out + err)
    # best effort: only files, the worker cannot have started processes
    wipe_files()
    worker.calls += 1
    if WORKER_CALLS and worker.calls >= WORKER_CALLS:
        # what calls leave in the interpreter (and its fragmented heap) goes
        # with the worker: a fresh one now, while the daemon answers
        worker.close()
        worker = Worker()
    elif not scratch_ok:
        try:
            os.mkdir(SCRATCH, 0o700)
            os.chown(SCRATCH, UID, GID)
        except OSError:
            pass


def main():
    global SUBREAPER, FILTERED, worker
    if _libc is not None and _libc.prctl(36, 1, 0, 0, 0) == 0:  # PR_SET_CHILD_SUBREAPER
        SUBREAPER = True
    if _libc is not None:
        try:
            install_filter()  # once here instead of once per call
            FILTERED = True
        except OSError as e:
            sys.stderr.write("pyzygote: seccomp in the zygote: %s (per call instead)\n" % e)
    os.environ["HOME"] = os.environ["TMPDIR"] = SCRATCH
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.umask(0o022)
    kill_uid()
    wipe_files()
    gc.collect()
    gc.freeze()  # forked children do not dirty the zygote's objects with GC bookkeeping
    send_result(OUT, {"ready": True, "pid": os.getpid(), "seccomp": SECCOMP or FILTERED,
                      "subreaper": SUBREAPER, "mode": MODE,
                      "preloaded": PRELOAD})
    while True:
        raw = read_frame(IN)
        if raw is None:
            return
        try:
            req = json.loads(raw)
            if (req.get("mode") or "fork") != MODE:
                raise ValueError("this zygote runs %s calls, not %s" % (MODE, req.get("mode")))
            if MODE == "reuse":
                call_reuse(req, raw)
            else:
                call_fork(req)
        except Exception as e:
            send_result(OUT, {"error": "zygote: %s: %s" % (type(e).__name__, e)})
            if worker is not None:
                worker.close()
                worker = None
            kill_uid()
            wipe_files()


main()
