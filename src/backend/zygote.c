/* The agent zygote, daemon side (docs/containers.md "Agent zygote"): a
 * warren-agent process per child stack slot, exec'd once in --zygote mode, whose
 * forked children become sandboxes' agents. It is started at the first
 * create (so it shares the creator's mount namespace, where the idmapped
 * layer mounts are made), restarted when it dies, and a create falls back
 * to the exec'd agent when it cannot be used. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <linux/close_range.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../common/util.h"
#include "backend.h"
#include "child.h"
#include "syscalls.h"

/* a zygote that failed this many starts in a row is given up on */
#define ZYGOTE_MAX_FAILURES 3
#define ZYGOTE_TIMEOUT_MS 10000

/* One zygote per child stack slot: creates in flight never queue behind
 * each other's clone3 (which waits for the cgroup locks when
 * CLONE_INTO_CGROUP is given: up to 0.9 s seen under load, every create of
 * a single zygote waited with it) */
struct zy_one
{
  pthread_mutex_t lock; /* one request at a time: a zygote serves them in order */
  int ctl;              /* our end of the control socket, -1: not running */
  int pidfd;
  pid_t pid;
  bool disabled;
  unsigned failures; /* starts failed in a row */
  uint64_t forks, starts;
};

struct wr_zygote
{
  struct zy_one one[WR_CHILD_STACKS];
};

int
wr_zygote_new (bool enabled, struct wr_zygote **ret)
{
  struct wr_zygote *zs = calloc (1, sizeof *zs);
  if (zs == NULL)
    return -ENOMEM;
  for (int i = 0; i < WR_CHILD_STACKS; i++)
    {
      struct zy_one *z = &zs->one[i];
      pthread_mutex_init (&z->lock, NULL);
      z->ctl = z->pidfd = -1;
      z->disabled = !enabled;
    }
  *ret = zs;
  return 0;
}

static void
zygote_stop (struct zy_one *z)
{
  if (z->ctl >= 0)
    close (z->ctl); /* EOF: the zygote exits on its own */
  z->ctl = -1;
  if (z->pidfd >= 0)
    {
      /* it may be blocked in a request: no waiting on it */
      wr_sys_pidfd_send_signal (z->pidfd, SIGKILL);
      siginfo_t si;
      waitid ((idtype_t)P_PIDFD, (id_t)z->pidfd, &si, WEXITED | __WALL);
      close (z->pidfd);
    }
  z->pidfd = -1;
  z->pid = 0;
}

void
wr_zygote_free (struct wr_zygote *zs)
{
  if (zs == NULL)
    return;
  for (int i = 0; i < WR_CHILD_STACKS; i++)
    {
      zygote_stop (&zs->one[i]);
      pthread_mutex_destroy (&zs->one[i].lock);
    }
  free (zs);
}

static int
wait_readable (int fd, int ms)
{
  struct pollfd p = { .fd = fd, .events = POLLIN };
  int n;
  while ((n = poll (&p, 1, ms)) < 0 && errno == EINTR)
    ;
  return n < 0 ? -errno : n == 0 ? -ETIMEDOUT : 0;
}

/* fork + execveat of the agent binary as `warren-agent --zygote 3`; the
 * child of a threaded daemon: async-signal-safe calls only until exec. */
static int
zygote_start (struct wr_runtime *rt, struct zy_one *z)
{
  int sv[2];
  if (socketpair (AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
    return -errno;
  _cleanup_close_ int ours = sv[0], theirs = sv[1];
  int pidfd = -1;
  struct wr_clone_args ca = {
    .flags = CLONE_PIDFD,
    .pidfd = (uint64_t)(uintptr_t)&pidfd,
    .exit_signal = SIGCHLD,
  };
  static char a0[] = "warren-agent", a1[] = "--zygote", a2[] = "3";
  static char e0[] = "PATH=" WR_DEFAULT_PATH, e1[] = "HOME=/root", e2[] = "container=warren";
  static char *const argv[] = { a0, a1, a2, NULL };
  static char *const envp[] = { e0, e1, e2, NULL }; /* the exec'd agent's */
  long pid = syscall (__NR_clone3, &ca, sizeof ca);
  if (pid == 0)
    {
      /* everything but fd 3 closes at exec (the agent binary's fd too) */
      int afd = fcntl (rt->agent_fd, F_DUPFD_CLOEXEC, 4);
      int ok = afd >= 0
               && (theirs == 3 ? fcntl (3, F_SETFD, 0) : dup2 (theirs, 3)) == (theirs == 3 ? 0 : 3)
               && syscall (SYS_close_range, 4, ~0U, CLOSE_RANGE_CLOEXEC) == 0;
      if (ok)
        {
          sigset_t none;
          sigemptyset (&none);
          sigprocmask (SIG_SETMASK, &none, NULL);
          syscall (SYS_execveat, afd, "", argv, envp, AT_EMPTY_PATH);
        }
      _exit (127);
    }
  if (pid < 0)
    return -errno;
  close (TAKE_FD (theirs));
  /* the seccomp program its children load, then its "ready" */
  int r = 0;
  size_t len = rt->seccomp.len * sizeof *rt->seccomp.filter;
  if (send (ours, rt->seccomp.filter, len, MSG_NOSIGNAL) != (ssize_t)len)
    r = -errno;
  int32_t ready = -1;
  if (r == 0 && (r = wait_readable (ours, ZYGOTE_TIMEOUT_MS)) == 0)
    {
      ssize_t n = recv (ours, &ready, sizeof ready, 0);
      r = n == (ssize_t)sizeof ready ? (ready == 0 ? 0 : -ready) : n < 0 ? -errno : -EPROTO;
    }
  z->ctl = TAKE_FD (ours);
  z->pidfd = pidfd;
  z->pid = (pid_t)pid;
  if (r < 0)
    {
      zygote_stop (z);
      return r;
    }
  z->starts++;
  return 0;
}

static ssize_t
zygote_call (struct zy_one *z, const void *msg, size_t len, const int *fds, int nfds,
             int *ret_pidfd)
{
  struct iovec iov = { (void *)msg, len };
  union
  {
    char buf[CMSG_SPACE (sizeof (int) * WR_ZYGOTE_MAX_FDS)];
    struct cmsghdr align;
  } cm;
  memset (&cm, 0, sizeof cm);
  struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
  if (nfds > 0)
    {
      mh.msg_control = cm.buf;
      mh.msg_controllen = CMSG_SPACE (sizeof (int) * (size_t)nfds);
      struct cmsghdr *c = CMSG_FIRSTHDR (&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN (sizeof (int) * (size_t)nfds);
      memcpy (CMSG_DATA (c), fds, sizeof (int) * (size_t)nfds);
    }
  if (sendmsg (z->ctl, &mh, MSG_NOSIGNAL) != (ssize_t)len)
    return -EPIPE; /* nothing was started: worth another zygote */
  int r = wait_readable (z->ctl, ZYGOTE_TIMEOUT_MS);
  if (r < 0)
    return r;
  int32_t res = 0;
  iov = (struct iovec){ &res, sizeof res };
  memset (&cm, 0, sizeof cm);
  mh = (struct msghdr){ .msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = cm.buf,
                        .msg_controllen = CMSG_SPACE (sizeof (int)) };
  ssize_t n = recvmsg (z->ctl, &mh, MSG_CMSG_CLOEXEC);
  if (n < 0)
    return -errno;
  int pidfd = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR (&mh); c; c = CMSG_NXTHDR (&mh, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      {
        size_t k = (c->cmsg_len - CMSG_LEN (0)) / sizeof (int);
        int got[WR_ZYGOTE_MAX_FDS];
        memcpy (got, CMSG_DATA (c), k * sizeof (int));
        for (size_t i = 0; i < k; i++)
          if (pidfd < 0)
            pidfd = got[i];
          else
            close (got[i]);
      }
  if (n != (ssize_t)sizeof res)
    {
      if (pidfd >= 0)
        close (pidfd);
      return n == 0 ? -ECONNRESET : -EPROTO;
    }
  if (res > 0 && pidfd < 0)
    return -EPROTO; /* the child is killed with the zygote (below) */
  if (res <= 0)
    {
      if (pidfd >= 0)
        close (pidfd);
      return res == 0 ? -EPROTO : res;
    }
  *ret_pidfd = pidfd;
  return res;
}

long
wr_zygote_spawn (struct wr_runtime *rt, int slot, const void *msg, size_t len, const int *fds,
                 int nfds, int *ret_pidfd)
{
  if (rt->zygote == NULL || slot < 0 || slot >= WR_CHILD_STACKS)
    return -ENOSYS;
  struct zy_one *z = &rt->zygote->one[slot];
  pthread_mutex_lock (&z->lock);
  long r = -ENOSYS;
  for (int attempt = 0; attempt < 2 && !z->disabled; attempt++)
    {
      /* died since the last create: a new one before sending */
      if (z->pidfd >= 0 && wait_readable (z->pidfd, 0) == 0)
        zygote_stop (z);
      if (z->ctl < 0)
        {
          r = zygote_start (rt, z);
          if (r < 0)
            {
              if (++z->failures >= ZYGOTE_MAX_FAILURES)
                z->disabled = true;
              r = -ENOSYS; /* the caller execs the agent instead */
              break;
            }
          z->failures = 0;
        }
      r = zygote_call (z, msg, len, fds, nfds, ret_pidfd);
      if (r > 0)
        {
          z->forks++;
          break;
        }
      if (r == -EPIPE)
        {
          zygote_stop (z);
          r = -ENOSYS;
          continue;
        }
      /* no answer, or a broken one: a child may exist (it is in the
       * sandbox's cgroup, which the caller kills); the next create gets a
       * new zygote */
      if (r == -ECONNRESET || r == -ETIMEDOUT || r == -EPROTO)
        zygote_stop (z);
      break;
    }
  pthread_mutex_unlock (&z->lock);
  return r;
}

void
wr_zygote_stats (struct wr_runtime *rt, struct wr_zygote_stats *ret)
{
  memset (ret, 0, sizeof *ret);
  if (rt->zygote == NULL)
    return;
  for (int i = 0; i < WR_CHILD_STACKS; i++)
    {
      struct zy_one *z = &rt->zygote->one[i];
      pthread_mutex_lock (&z->lock);
      ret->enabled |= !z->disabled;
      if (ret->pid == 0 && z->ctl >= 0)
        ret->pid = z->pid; /* the first slot's when it runs */
      ret->running += z->ctl >= 0;
      ret->forks += z->forks;
      ret->starts += z->starts;
      pthread_mutex_unlock (&z->lock);
    }
}
