/* warren-agent: the in-sandbox init and request server (docs/protocol.md).
 *
 *   warren-agent [--listen-fd N] [--conn-fd N] [--device PATH] [--root DIR]
 *                [--no-openat2]
 *
 * One daemon connection at a time: --conn-fd first, then every connection
 * accepted on --listen-fd replaces the current one; --device is a
 * virtio-serial port reopened whenever the host side goes away. */
#include "agent/agent.h"
#include "common/proto.h"
#include "common/util.h"

#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <linux/random.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <linux/securebits.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>

#include "backend/child.h"
#include "backend/syscalls.h"

#define DEVICE_RETRY_MS 100

struct ag_state ag = { .epfd = -1, .rootfd = -1, .devnull = -1 };

struct obuf
{
  struct obuf *next;
  size_t len, off;
  uint8_t data[];
};

static struct
{
  struct ag_watch w;
  bool dead; /* closed at the top of the next loop iteration */
  bool read_paused;
  /* frames held while an export or apply runs (conn_parse), in order */
  struct obuf *held_head, *held_tail;
  size_t held_bytes;
  uint8_t *in;
  size_t in_len;
  struct obuf *oq_head, *oq_tail;
} conn = { .w.fd = -1 };

static struct ag_watch listen_w = { .fd = -1 }, sig_w = { .fd = -1 };
static const char *device_path;
static uint64_t device_retry_at;
/* device mode: a networked VM's NIC is looked for until vmnet_until (0:
 * done), every VMNET_RETRY_MS: a disk image's udev may load virtio_net
 * after the agent starts (vmnet.c) */
#define VMNET_WAIT_MS 60000
#define VMNET_RETRY_MS 100
static uint64_t vmnet_until, vmnet_next;

static void **deferred;
static size_t n_deferred, cap_deferred;

/* ---- small infrastructure ---- */

int
ag_watch_set (struct ag_watch *w, uint32_t events)
{
  if (w->fd < 0)
    return -EBADF;
  if (events == w->events)
    return 0;
  struct epoll_event ev = { .events = events, .data.ptr = w };
  int op = w->events == 0 ? EPOLL_CTL_ADD : events == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
  if (epoll_ctl (ag.epfd, op, w->fd, &ev) < 0)
    return -errno;
  w->events = events;
  return 0;
}

void
ag_watch_close (struct ag_watch *w)
{
  if (w->fd < 0)
    return;
  if (w->events)
    epoll_ctl (ag.epfd, EPOLL_CTL_DEL, w->fd, NULL);
  close (w->fd);
  w->fd = -1;
  w->events = 0;
}

void
ag_defer_free (void *p)
{
  if (n_deferred == cap_deferred)
    {
      size_t cap = cap_deferred ? cap_deferred * 2 : 16;
      void **n = realloc (deferred, cap * sizeof *n);
      if (n == NULL)
        return; /* leak rather than risk a use after free */
      deferred = n;
      cap_deferred = cap;
    }
  deferred[n_deferred++] = p;
}

static void
run_deferred (void)
{
  for (size_t i = 0; i < n_deferred; i++)
    free (deferred[i]);
  n_deferred = 0;
}

struct ag_req *
ag_req_find (uint32_t stream)
{
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    if (r->stream == stream && !r->orphan)
      return r;
  return NULL;
}

void
ag_req_link (struct ag_req *r)
{
  r->next = ag.reqs;
  ag.reqs = r;
}

void
ag_req_unlink (struct ag_req *r)
{
  for (struct ag_req **p = &ag.reqs; *p; p = &(*p)->next)
    if (*p == r)
      {
        *p = r->next;
        r->next = NULL;
        return;
      }
}

json_t *
ag_json_lossy (const char *s, size_t len)
{
  _cleanup_free_ char *out = malloc (len + 1);
  if (out == NULL)
    return json_string ("?");
  const unsigned char *u = (const unsigned char *)s;
  size_t o = 0;
  for (size_t i = 0; i < len;)
    {
      unsigned c = u[i];
      size_t k = c < 0x80                 ? 0
                 : c >= 0xc2 && c <= 0xdf ? 1
                 : c >= 0xe0 && c <= 0xef ? 2
                 : c >= 0xf0 && c <= 0xf4 ? 3
                                          : 9;
      bool ok = k != 9 && i + k < len && c != 0;
      for (size_t j = 1; ok && j <= k; j++)
        ok = (u[i + j] & 0xc0) == 0x80;
      if (ok && k >= 2)
        ok = !((c == 0xe0 && u[i + 1] < 0xa0) || (c == 0xed && u[i + 1] > 0x9f)
               || (c == 0xf0 && u[i + 1] < 0x90) || (c == 0xf4 && u[i + 1] > 0x8f));
      if (!ok)
        {
          out[o++] = '?';
          i++;
          continue;
        }
      memcpy (out + o, u + i, k + 1);
      o += k + 1;
      i += k + 1;
    }
  return json_stringn (out, o);
}

/* ---- sending ---- */

bool
ag_connected (void)
{
  return conn.w.fd >= 0 && !conn.dead;
}

static void
conn_update (void)
{
  if (conn.w.fd < 0 || conn.dead)
    return;
  uint32_t ev = (conn.read_paused ? 0 : EPOLLIN) | (conn.oq_head ? EPOLLOUT : 0);
  if (ag_watch_set (&conn.w, ev) < 0)
    conn.dead = true;
}

void
ag_send (uint32_t stream, uint8_t type, const void *payload, size_t len)
{
  if (!ag_connected ())
    return;
  if (len > WR_FRAME_MAX)
    len = WR_FRAME_MAX; /* callers keep JSON below; never a bad frame */
  uint8_t hdr[WR_FRAME_HDR];
  wr_frame_hdr_encode (hdr, (uint32_t)len, stream, type);
  size_t total = sizeof hdr + len, done = 0;
  if (conn.oq_head == NULL)
    {
      struct iovec iov[2] = { { hdr, sizeof hdr }, { (void *)payload, len } };
      ssize_t n;
      do
        n = writev (conn.w.fd, iov, len ? 2 : 1);
      while (n < 0 && errno == EINTR);
      if (n < 0 && errno != EAGAIN)
        {
          conn.dead = true;
          return;
        }
      done = n > 0 ? (size_t)n : 0;
      if (done == total)
        return;
    }
  struct obuf *b = malloc (sizeof *b + total - done);
  if (b == NULL)
    {
      conn.dead = true; /* a lost frame would desynchronize the stream */
      return;
    }
  b->next = NULL;
  b->len = total - done;
  b->off = 0;
  size_t hdr_left = done < sizeof hdr ? sizeof hdr - done : 0;
  memcpy (b->data, hdr + (sizeof hdr - hdr_left), hdr_left);
  memcpy (b->data + hdr_left, (const uint8_t *)payload + (done - (sizeof hdr - hdr_left)),
          b->len - hdr_left);
  if (conn.oq_tail)
    conn.oq_tail->next = b;
  else
    conn.oq_head = b;
  conn.oq_tail = b;
  ag.outq_bytes += b->len;
  conn_update ();
}

void
ag_send_json (uint32_t stream, uint8_t type, json_t *j)
{
  if (j == NULL)
    {
      j = json_pack ("{s:s,s:s,s:i}", "code", WR_E_INTERNAL, "message", "out of memory", "errno",
                     ENOMEM);
      type = WR_MSG_ERROR;
    }
  char *s = json_dumps (j, JSON_COMPACT);
  json_decref (j);
  if (s)
    ag_send (stream, type, s, strlen (s));
  free (s);
}

void
ag_send_error (uint32_t stream, const wr_err_t *err)
{
  ag_send_json (stream, WR_MSG_ERROR,
                json_pack ("{s:s,s:o,s:i}", "code", err->code ? err->code : WR_E_INTERNAL,
                           "message", ag_json_lossy (err->msg, strlen (err->msg)), "errno",
                           err->errnum));
}

void
ag_send_errorf (uint32_t stream, int errnum, const char *code, const char *fmt, ...)
{
  wr_err_t err;
  va_list ap;
  va_start (ap, fmt);
  wr_verror (&err, errnum, code, fmt, ap);
  va_end (ap);
  ag_send_error (stream, &err);
}

static void
conn_flush (void)
{
  while (conn.oq_head)
    {
      struct obuf *b = conn.oq_head;
      ssize_t n = write (conn.w.fd, b->data + b->off, b->len - b->off);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0 && errno == EAGAIN)
        break;
      if (n <= 0)
        {
          conn.dead = true;
          return;
        }
      b->off += (size_t)n;
      ag.outq_bytes -= (size_t)n;
      if (b->off == b->len)
        {
          conn.oq_head = b->next;
          if (conn.oq_head == NULL)
            conn.oq_tail = NULL;
          free (b);
        }
    }
  conn_update ();
}

/* ---- receiving ---- */

/* A VM restored from a snapshot shares the template's kernel RNG state,
 * clock and hostname with every other clone. The daemon then sends one
 * control PING "WRVM1" + 64 bytes of host entropy + u64 unix ns (LE) +
 * hostname (docs/vm.md): credit the entropy and force a reseed, set the
 * clock and the hostname. Only in device mode (we are the guest's init). */
static void
vm_restored (const uint8_t *p, size_t len)
{
  if (len < 77 || len > 77 + 64 || memcmp (p, "WRVM1", 5) != 0)
    return;
  struct
  {
    int entropy_count;
    int buf_size;
    uint8_t buf[64];
  } e = { .entropy_count = 64 * 8, .buf_size = 64 };
  memcpy (e.buf, p + 5, 64);
  int fd = open ("/dev/urandom", O_WRONLY | O_CLOEXEC);
  if (fd >= 0)
    {
      ioctl (fd, RNDADDENTROPY, &e);
      ioctl (fd, RNDRESEEDCRNG);
      close (fd);
    }
  explicit_bzero (&e, sizeof e);
  uint64_t ns = 0;
  for (int i = 0; i < 8; i++)
    ns |= (uint64_t)p[69 + i] << (8 * i);
  struct timespec ts
      = { .tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull) };
  if (ns)
    clock_settime (CLOCK_REALTIME, &ts);
  if (len > 77)
    sethostname ((const char *)p + 77, len - 77);
}

static void
dispatch (const struct wr_frame *f)
{
  if (f->stream == 0)
    {
      if (f->type == WR_MSG_PING && device_path)
        vm_restored (f->payload, f->len);
      if (f->type == WR_MSG_PING)
        ag_send (0, WR_MSG_PONG, f->payload, f->len);
      else if (f->type == WR_MSG_LIMITS)
        ag_cg_limits (f->payload, f->len);
      else if (f->type == WR_MSG_EXEC || f->type == WR_MSG_FILE)
        ag_send_errorf (0, EINVAL, WR_E_INVALID, "stream 0 is the control stream");
      return;
    }
  struct ag_req *r = ag_req_find (f->stream);
  switch (f->type)
    {
    case WR_MSG_EXEC:
    case WR_MSG_FILE:
      {
        if (r)
          {
            ag_send_errorf (f->stream, EBUSY, WR_E_CONFLICT, "stream %u already has a live request",
                            f->stream);
            return;
          }
        json_error_t jerr;
        json_t *body = json_loadb ((const char *)f->payload, f->len, 0, &jerr);
        if (!json_is_object (body))
          {
            ag_send_errorf (f->stream, EINVAL, WR_E_INVALID, "%s: malformed JSON: %s",
                            wr_msg_name (f->type), body ? "not an object" : jerr.text);
            json_decref (body);
            return;
          }
        if (f->type == WR_MSG_EXEC)
          ag_exec_start (f->stream, body);
        else
          ag_file_start (f->stream, body);
        json_decref (body);
        return;
      }
    case WR_MSG_STDIN:
      if (r)
        ag_exec_stdin (r, f->payload, f->len);
      return; /* late input for a finished exec is discarded */
    case WR_MSG_SIGNAL:
      if (r)
        ag_exec_signal (r, f->payload, f->len);
      return;
    case WR_MSG_DATA:
      if (r)
        ag_file_data (r, f->payload, f->len);
      return;
    case WR_MSG_PING:
      ag_send (f->stream, WR_MSG_PONG, f->payload, f->len);
      return;
    default:
      if (r == NULL)
        ag_send_errorf (f->stream, EINVAL, WR_E_INVALID, "unexpected %s frame",
                        wr_msg_name (f->type));
      return;
    }
}

/* While an export or apply runs (ag.exporting), a new EXEC or FILE request
 * waits, with every later frame of its stream, in arrival order: it comes
 * after the snapshot, as in a frozen container. Frames of the requests
 * already running (an apply's DATA above all) go on. */
static bool
stream_held (uint32_t stream)
{
  for (struct obuf *b = conn.held_head; b; b = b->next)
    if ((b->data[4] | b->data[5] << 8 | b->data[6] << 16 | (uint32_t)b->data[7] << 24) == stream)
      return true;
  return false;
}

static bool
hold (const uint8_t *frame, size_t len)
{
  struct obuf *b = malloc (sizeof *b + len);
  if (b == NULL)
    return false;
  b->next = NULL;
  b->len = len;
  b->off = 0;
  memcpy (b->data, frame, len);
  if (conn.held_tail)
    conn.held_tail->next = b;
  else
    conn.held_head = b;
  conn.held_tail = b;
  conn.held_bytes += len;
  return true;
}

/* the held frames, once nothing holds them (again: one may start an export) */
static void
held_release (void)
{
  while (conn.held_head && !ag.exporting && !conn.dead)
    {
      struct obuf *b = conn.held_head;
      conn.held_head = b->next;
      if (conn.held_head == NULL)
        conn.held_tail = NULL;
      conn.held_bytes -= b->len;
      struct wr_frame f;
      if (wr_frame_parse (b->data, b->len, &f) > 0)
        dispatch (&f);
      free (b);
    }
}

static void
obufs_free (struct obuf **head, struct obuf **tail, size_t *bytes)
{
  while (*head)
    {
      struct obuf *b = *head;
      *head = b->next;
      free (b);
    }
  *tail = NULL;
  *bytes = 0;
}

/* Dispatch the complete frames in `in`. */
static void
conn_parse (void)
{
  size_t off = 0;
  while (!conn.dead)
    {
      struct wr_frame f;
      int r = wr_frame_parse (conn.in + off, conn.in_len - off, &f);
      if (r == 0)
        break;
      if (r < 0)
        {
          conn.dead = true; /* cannot find the next frame boundary */
          return;
        }
      if (f.stream != 0
          && ((ag.exporting && (f.type == WR_MSG_EXEC || f.type == WR_MSG_FILE))
              || (conn.held_head && stream_held (f.stream))))
        {
          if (!hold (conn.in + off, (size_t)r))
            {
              conn.dead = true; /* a lost frame would desynchronize the stream */
              return;
            }
        }
      else
        dispatch (&f);
      off += (size_t)r;
    }
  memmove (conn.in, conn.in + off, conn.in_len - off);
  conn.in_len -= off;
}

static void
conn_read (void)
{
  size_t cap = WR_FRAME_HDR + WR_FRAME_MAX;
  ssize_t n = read (conn.w.fd, conn.in + conn.in_len, cap - conn.in_len);
  if (n < 0 && (errno == EINTR || errno == EAGAIN))
    return;
  if (n <= 0)
    {
      conn.dead = true;
      return;
    }
  conn.in_len += (size_t)n;
  conn_parse ();
}

static void
conn_cb (struct ag_watch *w, uint32_t events)
{
  if (w->fd < 0)
    return;
  if (events & EPOLLOUT)
    conn_flush ();
  if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !conn.dead && !conn.read_paused)
    conn_read ();
}

static void
conn_close (void)
{
  for (struct ag_req *r = ag.reqs, *next; r; r = next)
    {
      next = r->next;
      if (r->orphan)
        continue;
      if (r->kind == AG_REQ_EXEC)
        ag_exec_orphan (r);
      else
        ag_file_orphan (r);
    }
  obufs_free (&conn.oq_head, &conn.oq_tail, &ag.outq_bytes);
  ag_watch_close (&conn.w);
  conn.dead = false;
  conn.read_paused = false;
  obufs_free (&conn.held_head, &conn.held_tail, &conn.held_bytes);
  conn.in_len = 0;
  if (device_path)
    device_retry_at = wr_now_ms () + DEVICE_RETRY_MS;
}

static void
conn_open (int fd)
{
  if (conn.in == NULL && (conn.in = malloc (WR_FRAME_HDR + WR_FRAME_MAX)) == NULL)
    {
      close (fd);
      return;
    }
  int fl = fcntl (fd, F_GETFL);
  fcntl (fd, F_SETFL, fl | O_NONBLOCK);
  conn.w.fn = conn_cb;
  conn.w.fd = fd;
  conn.w.events = 0;
  conn.dead = false;
  conn.in_len = 0;
  conn_update ();
  ag_send_json (0, WR_MSG_HELLO,
                json_pack ("{s:i,s:s,s:i,s:s,s:b}", "version", WR_PROTO_VERSION, "agent",
                           "warren-agent", "pid", (int)getpid (), "resolver",
                           ag.use_openat2 ? "openat2" : "walk", "cgroup", ag_cg_enabled ()));
}

static void
device_open (void)
{
  int fd = open (device_path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    {
      device_retry_at = wr_now_ms () + DEVICE_RETRY_MS;
      return;
    }
  device_retry_at = 0;
  conn_open (fd);
}

static void
listen_cb (struct ag_watch *w, uint32_t events)
{
  int fd = accept4 (w->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0)
    return;
  /* A (restarted) daemon reconnected: it knows nothing of the old streams. */
  if (conn.w.fd >= 0)
    conn_close ();
  conn_open (fd);
}

static void
sig_cb (struct ag_watch *w, uint32_t events)
{
  struct signalfd_siginfo si[8];
  while (read (w->fd, si, sizeof si) > 0)
    ;
  /* Reap everything: our execs and every orphan reparented to us. */
  for (;;)
    {
      int status;
      struct rusage ru;
      pid_t pid = wait4 (-1, &status, WNOHANG, &ru);
      if (pid <= 0)
        break;
      ag_exec_reaped (pid, status, &ru);
    }
}

/* ---- setup ---- */

static int
parse_fd (const char *s)
{
  char *end;
  long v = strtol (s, &end, 10);
  if (*s == '\0' || *end || v < 0 || v > 1 << 20 || fcntl ((int)v, F_GETFD) < 0)
    return -1;
  return (int)v;
}

static void
usage (void)
{
  fputs ("usage: warren-agent [--listen-fd N] [--conn-fd N] [--device PATH] [--root DIR] "
         "[--no-openat2] [--keep-fd N] [--cgroup-fd N] [--upper DIR]\n",
         stderr);
  exit (2);
}

/* ---- agent zygote (docs/containers.md "Agent zygote") ----
 * `warren-agent --zygote FD`: started once per daemon, it forks sandboxes'
 * agents instead of the daemon exec'ing one per sandbox (execve, ELF
 * mapping, the static glibc start-up with its CPUID traps under a
 * hypervisor). It clones each child into the sandbox's new namespaces as
 * the daemon's CLONE_VM child would; the child runs the very same setup
 * (wr_child_setup: ids, mounts, pivot_root, capabilities, seccomp) and then
 * continues in main as the sandbox's agent, pid 1 of its namespace. The
 * zygote itself holds nothing but its control socket, keeps no request
 * after answering it, and exits at the daemon's EOF. */
static struct sock_filter zy_filter[BPF_MAXINSNS];
static size_t zy_filter_len;
static char zy_msg[WR_ZYGOTE_MAX_MSG];
static char zy_a0[] = "warren-agent", zy_a1[] = "--listen-fd", zy_a2[] = "3", zy_a3[] = "--conn-fd",
            zy_a4[] = "4", zy_a5[] = "--keep-fd", zy_a6[] = "7", zy_a7[] = "--cgroup-fd",
            zy_a8[] = "8";
static char *zy_argv[] = { zy_a0, zy_a1, zy_a2, zy_a3, zy_a4, zy_a5, zy_a6, NULL, NULL, NULL };

static void
zy_reply (int ctl, int32_t res, int fd)
{
  struct iovec iov = { &res, sizeof res };
  union
  {
    char buf[CMSG_SPACE (sizeof (int))];
    struct cmsghdr align;
  } cm;
  memset (&cm, 0, sizeof cm);
  struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
  if (fd >= 0)
    {
      mh.msg_control = cm.buf;
      mh.msg_controllen = sizeof cm.buf;
      struct cmsghdr *c = CMSG_FIRSTHDR (&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN (sizeof (int));
      memcpy (CMSG_DATA (c), &fd, sizeof fd);
    }
  if (sendmsg (ctl, &mh, MSG_NOSIGNAL) < 0)
    _exit (0); /* the daemon is gone */
}

/* One request: 0 in the new child (ready to be its agent), the child's pid
 * or -errno in the zygote. */
static long
zy_fork (const struct wr_zygote_req *req, const char *strs, size_t len, const int *fds, int nfds,
         int own_netns, int *ret_pidfd)
{
  bool cg = req->flags & WR_ZY_CGROUP, netns = req->flags & WR_ZY_NETNS;
  if (req->magic != WR_ZYGOTE_MAGIC || req->n_lower == 0 || req->n_lower > WR_MAX_LAYERS
      || req->owner == 0 || req->cap_last < 0 || req->cap_last > 63
      || nfds != 4 + (cg ? 1 : 0) + (netns ? 2 : 0)
      || (req->ns_flags
          & ~(uint64_t)(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP
                        | CLONE_NEWNET)))
    return -EINVAL;
  const char *s[4 + WR_MAX_LAYERS];
  size_t off = 0;
  for (size_t i = 0; i < 4 + req->n_lower; i++)
    {
      const char *z = off < len ? memchr (strs + off, 0, len - off) : NULL;
      if (z == NULL)
        return -EINVAL;
      s[i] = strs + off;
      off = (size_t)(z - strs) + 1;
    }
  int k = 4;
  int cgroup_fd = cg ? fds[k++] : -1;
  int netns_fd = netns ? fds[k++] : -1;
  int sysfs_fd = netns ? fds[k++] : -1;
  struct sock_fprog prog = { (unsigned short)zy_filter_len, zy_filter };
  struct wr_child_ctx ctx = {
    .sync_fd = fds[0],
    .err_fd = fds[1],
    .listen_fd = fds[2],
    .conn_fd = fds[3],
    .agent_fd = -1,
    .cgroup_fd = (req->flags & WR_ZY_DELEGATE) ? cgroup_fd : -1,
    .net_host = req->flags & WR_ZY_NET_HOST,
    .timens_offsets = (req->flags & WR_ZY_TIMENS) ? s[3] : NULL,
    .sysfs_fd = sysfs_fd,
    .mnt = s[0],
    .tmpfs_size = s[1],
    .hostname = s[2],
    .hostname_len = strlen (s[2]),
    .lowers = s + 4,
    .n_lower = req->n_lower,
    .cap_keep = req->cap_keep,
    .cap_last = req->cap_last,
    .seccomp = &prog,
    .securebits = req->securebits,
  };
  int pidfd = -1;
  struct wr_clone_args ca = {
    .flags = req->ns_flags | CLONE_PIDFD,
    .pidfd = (uint64_t)(uintptr_t)&pidfd,
    .exit_signal = SIGCHLD, /* ignored here: the kernel reaps them */
  };
  if (cgroup_fd >= 0)
    {
      ca.flags |= CLONE_INTO_CGROUP;
      ca.cgroup = (uint64_t)cgroup_fd;
    }
  if (netns_fd >= 0)
    {
      ca.flags &= ~(uint64_t)CLONE_NEWNET;
      if (setns (netns_fd, CLONE_NEWNET) < 0)
        return -errno;
    }
  /* as the daemon's clone_as does: the owner of the new user namespace is
   * the block's root, so per-user counts are charged to it; capabilities
   * kept (NO_SETUID_FIXUP), fsuid stays 0 */
  long pid;
  if (prctl (PR_SET_SECUREBITS, req->securebits | SECBIT_NO_SETUID_FIXUP, 0, 0, 0) < 0)
    pid = -errno;
  else if (syscall (SYS_setresuid, -1, req->owner, -1) < 0)
    pid = -errno;
  else
    {
      syscall (SYS_setfsuid, 0);
      pid = syscall (__NR_clone3, &ca, sizeof ca);
      if (pid < 0)
        pid = -errno;
    }
  if (pid == 0)
    {
      int r = wr_child_setup (&ctx);
      if (r != 0)
        _exit (r);
      /* no exec: close what the exec'd agent's O_CLOEXEC would have, and
       * forget the request */
      close (WR_CHILD_ERR_FD);
      prctl (PR_SET_NAME, "warren-agent", 0, 0, 0);
      explicit_bzero (zy_msg, sizeof *req + len); /* not the whole buffer: COW faults */
      zy_argv[7] = (req->flags & WR_ZY_DELEGATE) ? zy_a7 : NULL;
      zy_argv[8] = (req->flags & WR_ZY_DELEGATE) ? zy_a8 : NULL;
      return 0;
    }
  if (syscall (SYS_setresuid, -1, 0, -1) < 0
      || prctl (PR_SET_SECUREBITS, req->securebits, 0, 0, 0) < 0
      || (netns_fd >= 0 && setns (own_netns, CLONE_NEWNET) < 0))
    _exit (1); /* never serve another request with the wrong identity */
  prctl (PR_SET_DUMPABLE, 0, 0, 0, 0);
  *ret_pidfd = pidfd;
  return pid;
}

/* Returns only in a forked child, with *ret_argv its agent's arguments. */
static void
zygote_serve (int ctl, int *ret_argc, char ***ret_argv)
{
  /* out of the way of fds 3-8, which each child arranges */
  int hi = fcntl (ctl, F_DUPFD_CLOEXEC, 64);
  if (hi < 0)
    exit (1);
  close (ctl);
  ctl = hi;
  prctl (PR_SET_NAME, "warren-zygote", 0, 0, 0);
  prctl (PR_SET_DUMPABLE, 0, 0, 0, 0);
  sigset_t none;
  sigemptyset (&none);
  sigprocmask (SIG_SETMASK, &none, NULL);
  for (int sig = 1; sig < 65; sig++)
    if (sig != SIGKILL && sig != SIGSTOP)
      signal (sig, SIG_DFL);
  signal (SIGCHLD, SIG_IGN); /* children are reaped by the kernel */
  /* MSG_TRUNC: the real length, so a program too long for us is refused,
   * never loaded cut short */
  ssize_t n = recv (ctl, zy_filter, sizeof zy_filter, MSG_TRUNC);
  if (n <= 0 || (size_t)n > sizeof zy_filter || n % (ssize_t)sizeof zy_filter[0])
    exit (1);
  zy_filter_len = (size_t)n / sizeof zy_filter[0];
  wr_dev_template_make ();
  int own_netns = open ("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (own_netns < 0)
    exit (1);
  {
    int hi_ns = fcntl (own_netns, F_DUPFD_CLOEXEC, 64);
    close (own_netns);
    own_netns = hi_ns;
  }
  zy_reply (ctl, 0, -1); /* ready */
  for (;;)
    {
      struct iovec iov = { zy_msg, sizeof zy_msg };
      union
      {
        char buf[CMSG_SPACE (sizeof (int) * WR_ZYGOTE_MAX_FDS)];
        struct cmsghdr align;
      } cm;
      struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf
      };
      n = recvmsg (ctl, &mh, MSG_CMSG_CLOEXEC);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0)
        exit (0); /* the daemon closed its end (or exited) */
      int fds[WR_ZYGOTE_MAX_FDS], nfds = 0;
      for (struct cmsghdr *c = CMSG_FIRSTHDR (&mh); c; c = CMSG_NXTHDR (&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
          {
            size_t k = (c->cmsg_len - CMSG_LEN (0)) / sizeof (int);
            for (size_t i = 0; i < k && nfds < WR_ZYGOTE_MAX_FDS; i++)
              memcpy (&fds[nfds++], CMSG_DATA (c) + i * sizeof (int), sizeof (int));
          }
      long pid = -EINVAL;
      int pidfd = -1;
      if ((size_t)n >= sizeof (struct wr_zygote_req) && !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
        {
          struct wr_zygote_req req;
          memcpy (&req, zy_msg, sizeof req);
          pid = zy_fork (&req, zy_msg + sizeof req, (size_t)n - sizeof req, fds, nfds, own_netns,
                         &pidfd);
          if (pid == 0)
            {
              *ret_argc = zy_argv[7] ? 9 : 7;
              *ret_argv = zy_argv;
              return;
            }
        }
      /* the child holds its own copies; the error pipe's EOF must be its */
      for (int i = 0; i < nfds; i++)
        close (fds[i]);
      zy_reply (ctl, (int32_t)pid, pidfd);
      if (pidfd >= 0)
        close (pidfd);
      explicit_bzero (zy_msg, (size_t)n);
    }
}

static void
close_range_fallback (unsigned lo, unsigned hi)
{
  if (syscall (SYS_close_range, lo, hi, 0) == 0)
    return;
  for (unsigned fd = lo; fd <= hi && fd < 4096; fd++)
    close ((int)fd);
}

/* Close every fd >= 3 but keep[0..n) (any may be -1; sorted ascending). */
static void
close_fds_except (const int *keep, int n)
{
  unsigned lo = 3;
  for (int i = 0; i < n; i++)
    {
      if (keep[i] < (int)lo)
        continue;
      if ((unsigned)keep[i] > lo)
        close_range_fallback (lo, (unsigned)keep[i] - 1);
      lo = (unsigned)keep[i] + 1;
    }
  close_range_fallback (lo, ~0u);
}

static int
setup (int listen_fd, int conn_fd, int keep_fd, int cgroup_fd, const char *root, bool no_openat2)
{
  prctl (PR_SET_DUMPABLE, 0);
  if (getpid () != 1)
    prctl (PR_SET_CHILD_SUBREAPER, 1);

  /* fds 0-2 must be taken so our pipes never land there and get clobbered
   * by the dup2s of a spawned child. */
  for (int fd = 0; fd < 3; fd++)
    if (fcntl (fd, F_GETFD) < 0 && open ("/dev/null", O_RDWR) < 0 && open ("/", O_PATH) < 0)
      return -errno;
  /* Nothing inherited may leak into sandbox processes (our sockets above
   * all), and stray copies of the daemon socket would hide its EOF. */
  int keep[4] = { listen_fd, conn_fd, keep_fd, cgroup_fd };
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++)
      if (keep[j] < keep[i])
        {
          int t = keep[i];
          keep[i] = keep[j];
          keep[j] = t;
        }
  close_fds_except (keep, 4);
  if (cgroup_fd >= 0)
    {
      int cr = ag_cg_init_delegated (cgroup_fd);
      if (cr < 0)
        fprintf (stderr, "warren-agent: delegated cgroup unusable: %s\n", strerror (-cr));
    }
  /* --keep-fd: held for the daemon (pidfd_getfd), never handed to children */
  if (keep_fd >= 0)
    fcntl (keep_fd, F_SETFD, FD_CLOEXEC);
  if (listen_fd >= 0)
    fcntl (listen_fd, F_SETFD, FD_CLOEXEC);
  if (conn_fd >= 0)
    fcntl (conn_fd, F_SETFD, FD_CLOEXEC);

  for (size_t i = 0; i < 11; i++)
    {
      static const int sigs[] = { SIGHUP,  SIGINT,  SIGQUIT, SIGPIPE, SIGALRM, SIGTERM,
                                  SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU };
      signal (sigs[i], SIG_IGN);
    }
  sigset_t chld;
  sigemptyset (&chld);
  sigaddset (&chld, SIGCHLD);
  sigprocmask (SIG_BLOCK, &chld, NULL);

  if (chdir ("/") < 0)
    return -errno;
  ag.rootfd = open (root ? root : "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (ag.rootfd < 0)
    return -errno;
  ag.use_openat2 = !no_openat2 && ag_openat2_works (ag.rootfd);
  ag.devnull = open ("/dev/null", O_RDONLY | O_CLOEXEC);

  ag.epfd = epoll_create1 (EPOLL_CLOEXEC);
  if (ag.epfd < 0)
    return -errno;
  sig_w.fn = sig_cb;
  sig_w.fd = signalfd (-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
  if (sig_w.fd < 0 || ag_watch_set (&sig_w, EPOLLIN) < 0)
    return -errno;
  if (listen_fd >= 0)
    {
      int fl = fcntl (listen_fd, F_GETFL);
      fcntl (listen_fd, F_SETFL, fl | O_NONBLOCK);
      listen_w.fn = listen_cb;
      listen_w.fd = listen_fd;
      if (ag_watch_set (&listen_w, EPOLLIN) < 0)
        return -errno;
    }
  if (conn_fd >= 0)
    conn_open (conn_fd);
  if (device_path)
    {
      /* init of a VM guest: the limits are ours to enforce. Under another
       * init (systemd on a disk image) the cgroup tree is that init's. */
      int cr = getpid () == 1 ? ag_cg_init () : -EBUSY;
      if (cr < 0)
        fprintf (stderr, "warren-agent: no cgroup tree, limits not enforced: %s\n", strerror (-cr));
      vmnet_until = ag_vmnet_try () ? 0 : wr_now_ms () + VMNET_WAIT_MS;
      device_open ();
    }
  return 0;
}

int
main (int argc, char **argv)
{
  static const struct option opts[] = {
    { "listen-fd", required_argument, NULL, 'l' },
    { "conn-fd", required_argument, NULL, 'c' },
    { "device", required_argument, NULL, 'd' },
    { "root", required_argument, NULL, 'r' },
    { "no-openat2", no_argument, NULL, 'N' },
    { "keep-fd", required_argument, NULL, 'k' },
    { "cgroup-fd", required_argument, NULL, 'g' },
    { "upper", required_argument, NULL, 'u' },
    { "help", no_argument, NULL, 'h' },
    { NULL, 0, NULL, 0 },
  };
  if (argc == 3 && strcmp (argv[1], "--zygote") == 0)
    {
      int ctl = parse_fd (argv[2]);
      if (ctl < 0)
        usage ();
      zygote_serve (ctl, &argc, &argv); /* returns in a sandbox's new agent */
    }
  int listen_fd = -1, conn_fd = -1, keep_fd = -1, cgroup_fd = -1, c;
  const char *root = NULL;
  bool no_openat2 = false;
  while ((c = getopt_long (argc, argv, "", opts, NULL)) != -1)
    switch (c)
      {
      case 'l':
        if ((listen_fd = parse_fd (optarg)) < 0)
          usage ();
        break;
      case 'c':
        if ((conn_fd = parse_fd (optarg)) < 0)
          usage ();
        break;
      case 'd':
        device_path = optarg;
        break;
      case 'r':
        root = optarg;
        break;
      case 'N':
        no_openat2 = true;
        break;
      case 'k':
        if ((keep_fd = parse_fd (optarg)) < 0)
          usage ();
        break;
      case 'g':
        if ((cgroup_fd = parse_fd (optarg)) < 0)
          usage ();
        break;
      case 'u':
        ag_upper_dir = optarg;
        break;
      default:
        usage ();
      }
  if (optind != argc || (listen_fd < 0 && conn_fd < 0 && device_path == NULL))
    usage ();
  int r = setup (listen_fd, conn_fd, keep_fd, cgroup_fd, root, no_openat2);
  if (r < 0)
    {
      fprintf (stderr, "warren-agent: setup: %s\n", strerror (-r));
      return 1;
    }

  bool out_paused = false;
  for (;;)
    {
      if (conn.dead)
        conn_close ();
      if (device_path && conn.w.fd < 0 && wr_now_ms () >= device_retry_at)
        device_open ();
      bool congested = ag.outq_bytes > AG_OUTQ_HIGH;
      if (congested != out_paused)
        {
          ag_exec_pause_output (out_paused = congested);
          ag_fwatch_pause (congested);
        }
      bool more = ag_file_pump ();
      if (conn.held_head && !ag.exporting && conn.w.fd >= 0 && !conn.dead)
        held_release ();
      conn.read_paused = ag.outq_bytes > AG_OUTQ_STOP_READ
                         || ag.stdin_bytes > AG_STDIN_STOP_READ
                         /* an apply ends only with DATA still to read */
                         || (conn.held_bytes > AG_STDIN_STOP_READ && !ag.applying);
      conn_update ();
      if (conn.dead)
        continue;

      int timeout = ag_exec_timeouts (wr_now_ms ());
      if (vmnet_until)
        {
          uint64_t now = wr_now_ms ();
          if (now >= vmnet_next)
            {
              vmnet_next = now + VMNET_RETRY_MS;
              if (ag_vmnet_try () || now >= vmnet_until)
                vmnet_until = 0;
            }
          if (vmnet_until && (timeout < 0 || timeout > VMNET_RETRY_MS))
            timeout = VMNET_RETRY_MS;
        }
      if (device_path && conn.w.fd < 0)
        {
          uint64_t now = wr_now_ms ();
          int wait = device_retry_at > now ? (int)(device_retry_at - now) : 0;
          if (timeout < 0 || wait < timeout)
            timeout = wait;
        }
      if (more)
        timeout = 0;
      struct epoll_event evs[64];
      int n = epoll_wait (ag.epfd, evs, WR_ARRAY_SIZE (evs), timeout);
      for (int i = 0; i < n; i++)
        {
          struct ag_watch *w = evs[i].data.ptr;
          if (w->fd >= 0)
            w->fn (w, evs[i].events);
        }
      run_deferred ();
    }
}
