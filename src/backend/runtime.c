/* wr_runtime: per-daemon state of the container backend, built once:
 * cgroup layout, the uid range sandboxes take blocks from, the seccomp program and the
 * agent binary fd (docs/containers.md). */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <linux/magic.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../common/limits.h"
#include "../common/util.h"
#include "backend.h"
#include "child.h"
#include "pool.h"
#include "syscalls.h"

#define CHILD_STACK (64 * 1024)

int
wr_runtime_private_mountns (wr_err_t *err)
{
  if (unshare (CLONE_NEWNS) < 0)
    return wr_sys_error (err, "unshare(CLONE_NEWNS)");
  if (mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return wr_sys_error (err, "make / private");
  return 0;
}

/* ---- per-sandbox uid blocks ----
 *
 * Each sandbox maps its root to its own block of WR_UID_BLOCK host ids taken
 * from the runtime's range. A block is claimed by a file WR_UID_CLAIM_DIR/<first
 * uid> holding "<daemon root>\n<sandbox id>\n", created with link() so that
 * it appears whole or not at all: daemons on one host (the directory is
 * host-wide) never hand out the same block, and the claim survives a daemon
 * restart, so an adopted sandbox keeps its ids. */

static const char *
claim_dir (void)
{
  const char *d = getenv ("WARREN_UID_CLAIM_DIR"); /* tests only */
  return d && d[0] == '/' ? d : WR_UID_CLAIM_DIR;
}

/* Does [lo, lo+n) meet a range of /etc/subuid|subgid ("name:start:count")
 * or an id of /etc/passwd|group ("name:x:id:...")? Read at every allocation:
 * users and subordinate ranges may be added while the daemon runs. */
static bool
ids_taken_on_host (uint64_t lo, uint64_t n)
{
  static const char *const sub[] = { "/etc/subuid", "/etc/subgid" };
  static const char *const pw[] = { "/etc/passwd", "/etc/group" };
  char line[1024];
  for (int f = 0; f < 4; f++)
    {
      FILE *fp = fopen (f < 2 ? sub[f] : pw[f - 2], "re");
      if (fp == NULL)
        continue;
      bool hit = false;
      while (!hit && fgets (line, sizeof line, fp))
        {
          char *c1 = strchr (line, ':');
          if (c1 == NULL)
            continue;
          unsigned long long start, count = 1;
          if (f < 2)
            {
              if (sscanf (c1 + 1, "%llu:%llu", &start, &count) != 2)
                continue;
            }
          else
            {
              char *c2 = strchr (c1 + 1, ':');
              if (c2 == NULL || sscanf (c2 + 1, "%llu", &start) != 1)
                continue;
            }
          hit = start < lo + n && lo < start + count;
        }
      fclose (fp);
      if (hit)
        return true;
    }
  return false;
}

static int
claim_read (int dfd, const char *name, char *buf, size_t size)
{
  int fd = openat (dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return -1;
  ssize_t n = read (fd, buf, size - 1);
  close (fd);
  if (n < 0)
    return -1;
  buf[n] = 0;
  return 0;
}

static bool
claim_is (const char *text, const char *root, const char *id)
{
  size_t lr = strlen (root);
  if (strncmp (text, root, lr) != 0 || text[lr] != '\n')
    return false;
  const char *i = text + lr + 1;
  if (id == NULL)
    return strchr (i, '\n') != NULL;
  size_t li = strlen (id);
  return strncmp (i, id, li) == 0 && i[li] == '\n' && i[li + 1] == 0;
}

/* Claim block `base` for id; 0, -EEXIST if someone holds it, or -errno. */
static int
claim_block (struct wr_runtime *rt, int dfd, uid_t base, const char *id)
{
  char tmp[64], name[16], text[4200];
  snprintf (tmp, sizeof tmp, ".tmp-%d-%ld", (int)getpid (), (long)syscall (SYS_gettid));
  snprintf (name, sizeof name, "%u", (unsigned)base);
  int n = snprintf (text, sizeof text, "%s\n%s\n", rt->root, id);
  if (n < 0 || (size_t)n >= sizeof text)
    return -ENAMETOOLONG;
  unlinkat (dfd, tmp, 0);
  int fd = openat (dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return -errno;
  int r = write (fd, text, (size_t)n) == n ? 0 : -EIO;
  close (fd);
  if (r == 0 && linkat (dfd, tmp, dfd, name, 0) < 0)
    r = -errno;
  unlinkat (dfd, tmp, 0);
  return r;
}

static int
open_claim_dir (void)
{
  const char *d = claim_dir ();
  if (mkdir (d, 0700) < 0 && errno != EEXIST)
    return -errno;
  int fd = open (d, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  return fd < 0 ? -errno : fd;
}

int
wr_uid_block_alloc (struct wr_runtime *rt, const char *id, uid_t *ret, wr_err_t *err)
{
  _cleanup_close_ int dfd = open_claim_dir ();
  if (dfd < 0)
    return wr_error (err, -dfd, WR_E_INTERNAL, "open %s", claim_dir ());
  /* lowest free block first: ids are reused, the range in use stays small.
   * The scan starts at a hint (every block below it was claimed when last
   * looked at; a free lowers it), so a create costs O(1), not a probe per
   * live sandbox. Races between builders only cost extra probes: the claim
   * itself is an atomic link. */
  uint32_t from = __atomic_load_n (&rt->uid_hint, __ATOMIC_RELAXED);
  for (uint32_t i = 0; i < rt->uid_blocks; i++)
    {
      uint32_t b = (from + i) % rt->uid_blocks;
      uid_t base = rt->uid_range_start + b * WR_UID_BLOCK;
      char name[16];
      snprintf (name, sizeof name, "%u", (unsigned)base);
      if (faccessat (dfd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        continue;
      if (ids_taken_on_host (base, WR_UID_BLOCK))
        continue;
      int r = claim_block (rt, dfd, base, id);
      if (r == -EEXIST)
        continue;
      if (r < 0)
        return wr_error (err, -r, WR_E_INTERNAL, "claim uid block %u in %s", (unsigned)base,
                         claim_dir ());
      __atomic_store_n (&rt->uid_hint, b + 1, __ATOMIC_RELAXED);
      *ret = base;
      return 0;
    }
  return wr_error (err, ENOSPC, WR_E_EXHAUSTED, "no free uid block in %u+%" PRIu64,
                   (unsigned)rt->uid_range_start, (uint64_t)rt->uid_blocks * WR_UID_BLOCK);
}

/* Visit this daemon's claims; fn returns true to release the claim. */
static void
claims_foreach (struct wr_runtime *rt, bool (*fn) (struct wr_runtime *, const char *id, void *),
                void *arg)
{
  int dfd = open_claim_dir ();
  if (dfd < 0)
    return;
  DIR *d = fdopendir (dfd);
  if (d == NULL)
    {
      close (dfd);
      return;
    }
  struct dirent *de;
  char text[4200];
  size_t lr = strlen (rt->root);
  while ((de = readdir (d)) != NULL)
    {
      if (de->d_name[0] < '0' || de->d_name[0] > '9'
          || claim_read (dirfd (d), de->d_name, text, sizeof text) < 0
          || !claim_is (text, rt->root, NULL))
        continue;
      char *id = text + lr + 1;
      id[strcspn (id, "\n")] = 0;
      if (fn (rt, id, arg))
        unlinkat (dirfd (d), de->d_name, 0);
    }
  closedir (d);
}

static bool
match_id (struct wr_runtime *rt, const char *id, void *arg)
{
  (void)rt;
  return strcmp (id, (const char *)arg) == 0;
}

void
wr_uid_block_free (struct wr_runtime *rt, const char *id, uid_t base)
{
  if (base < rt->uid_range_start || (base - rt->uid_range_start) % WR_UID_BLOCK)
    {
      claims_foreach (rt, match_id, (void *)id); /* block unknown: look at every claim */
      return;
    }
  /* the one claim file: a destroy costs the same with 10 or 10,000 alive */
  _cleanup_close_ int dfd = open_claim_dir ();
  char name[16], text[4200];
  snprintf (name, sizeof name, "%u", (unsigned)base);
  if (dfd < 0 || claim_read (dfd, name, text, sizeof text) < 0 || !claim_is (text, rt->root, id))
    return;
  unlinkat (dfd, name, 0);
  uint32_t b = (base - rt->uid_range_start) / WR_UID_BLOCK;
  uint32_t h = __atomic_load_n (&rt->uid_hint, __ATOMIC_RELAXED);
  while (b < h
         && !__atomic_compare_exchange_n (&rt->uid_hint, &h, b, false, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED))
    ;
}

/* Startup: a claim whose sandbox has no cgroup left has no process left
 * either (every sandbox process lives in it), so its block is free again. */
static bool
orphaned (struct wr_runtime *rt, const char *id, void *arg)
{
  (void)arg;
  if (!wr_valid_id (id))
    return true;
  struct wr_cg_sandbox cgs;
  int n = wr_cg_open (&rt->cg, id, &cgs);
  wr_cg_sandbox_close (&cgs);
  return n == 0;
}

int
wr_uid_block_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uid_t *ret, wr_err_t *err)
{
  char path[64];
  _cleanup_free_ char *map = NULL;
  snprintf (path, sizeof path, "/proc/%d/uid_map", (int)pid);
  unsigned in, out, count;
  if (wr_read_file_at (AT_FDCWD, path, &map, NULL, 4096) < 0
      || sscanf (map, "%u %u %u", &in, &out, &count) != 3 || in != 0)
    return wr_error (err, EINVAL, WR_E_INTERNAL, "read %s", path);
  _cleanup_close_ int dfd = open_claim_dir ();
  if (dfd < 0)
    return wr_error (err, -dfd, WR_E_INTERNAL, "open %s", claim_dir ());
  char name[16], text[4200];
  snprintf (name, sizeof name, "%u", out);
  if (claim_read (dfd, name, text, sizeof text) == 0)
    {
      if (!claim_is (text, rt->root, id))
        return wr_error (err, EEXIST, WR_E_CONFLICT, "uid block %u of %s is claimed by another",
                         out, id);
    }
  else
    {
      /* the claim directory was wiped (it lives on /run): claim it again */
      int r = claim_block (rt, dfd, out, id);
      if (r < 0)
        return wr_error (err, -r, WR_E_CONFLICT, "reclaim uid block %u of %s", out, id);
    }
  *ret = out;
  return 0;
}

static int
parse_range (const char *s, uint64_t *start, uint64_t *count)
{
  char *end;
  errno = 0;
  unsigned long long a = strtoull (s, &end, 10);
  if (errno || *end != ':')
    return -1;
  unsigned long long b = strtoull (end + 1, &end, 10);
  if (errno || *end)
    return -1;
  *start = a;
  *count = b;
  return 0;
}

int
wr_idmap_mount (int userns_fd, const char *src_dir, const char *dst_dir, wr_err_t *err)
{
  _cleanup_close_ int t
      = wr_sys_open_tree (AT_FDCWD, src_dir, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
  if (t < 0)
    return wr_sys_error (err, "open_tree %s", src_dir);
  struct mount_attr attr = { .attr_set = MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns_fd };
  if (wr_sys_mount_setattr (t, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0)
    return wr_error (err, errno, errno == EINVAL ? WR_E_UNSUPPORTED : WR_E_INTERNAL, "idmap %s",
                     src_dir);
  if (wr_sys_move_mount (t, "", AT_FDCWD, dst_dir, MOVE_MOUNT_F_EMPTY_PATH) < 0)
    return wr_sys_error (err, "move_mount %s -> %s", src_dir, dst_dir);
  return 0;
}

/* Agent sockets on a tmpfs when the daemon root is not on one: a socket
 * bound on this host's journal-less ext4 allocates an inode, which scans
 * for recently deleted ones (~3% of create+destroy, perf). /dev/shm is
 * there on every host and outlives daemon restarts, as the sockets must (a
 * restarted daemon reconnects to them). <shm>/<cgroup name> is ours when
 * it is a real dir of our uid, 0700; a dir someone else made first (the
 * name is predictable, /dev/shm world-writable) only costs the state dirs. */
static void
agent_sock_dir (struct wr_runtime *rt)
{
  const char *shm = getenv ("WARREN_AGENT_SOCK_TMPFS"); /* tests: another tmpfs; "" none */
  if (shm == NULL)
    shm = "/dev/shm";
  struct statfs sf;
  if (shm[0] != '/' || (statfs (rt->root, &sf) == 0 && sf.f_type == TMPFS_MAGIC)
      || statfs (shm, &sf) < 0 || sf.f_type != TMPFS_MAGIC)
    return;
  int n = snprintf (rt->sock_dir, sizeof rt->sock_dir, "%s/%s", shm, rt->cg_name);
  /* the longest id (64) must fit in sun_path after it */
  if (n < 0 || (size_t)n >= sizeof rt->sock_dir || n + 1 + 64 >= 108)
    return;
  if (mkdir (rt->sock_dir, 0700) < 0 && errno != EEXIST)
    return;
  int fd = open (rt->sock_dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd >= 0 && fstat (fd, &st) == 0 && S_ISDIR (st.st_mode) && st.st_uid == geteuid ()
      && (st.st_mode & 077) == 0)
    rt->sock_dir_fd = fd;
  else if (fd >= 0)
    close (fd);
}

static const char *
layout_name (enum wr_cg_layout l)
{
  return l == WR_CG_V2 ? "v2" : l == WR_CG_HYBRID ? "hybrid" : "v1";
}

int
wr_runtime_new (const struct wr_runtime_config *cfg, struct wr_runtime **ret, wr_err_t *err)
{
  if (cfg == NULL || cfg->root == NULL || cfg->root[0] != '/' || cfg->agent_path == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "runtime config needs an absolute root and agent");
  uint64_t range_start = cfg->uid_range_start, range_count = cfg->uid_range_count;
  const char *env = getenv ("WARREN_UID_RANGE");
  if (range_count == 0 && env && env[0])
    {
      if (parse_range (env, &range_start, &range_count) < 0)
        return wr_error (err, EINVAL, WR_E_INVALID, "WARREN_UID_RANGE=%s: want START:COUNT", env);
    }
  else if (range_count == 0)
    {
      range_start = WR_UID_RANGE_START;
      range_count = WR_UID_RANGE_COUNT;
    }
  /* root of a sandbox must never be host root, and (uid_t)-1 is no id */
  if (range_start == 0 || range_start % WR_UID_BLOCK != 0 || range_count < WR_UID_BLOCK
      || range_start + range_count > UINT32_MAX)
    return wr_error (err, EINVAL, WR_E_INVALID,
                     "uid range %" PRIu64 "+%" PRIu64 ": start a non-zero multiple of %u, at "
                     "least one block, below 2^32-1",
                     range_start, range_count, WR_UID_BLOCK);
  struct wr_runtime *rt = calloc (1, sizeof *rt);
  if (rt == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "runtime");
  rt->agent_fd = rt->sock_dir_fd = -1;
  rt->cg.v2_fd = rt->cg.be_v2_fd = rt->cg.be_cpu_fd = -1;
  for (int i = 0; i < WR_V1_N; i++)
    rt->cg.v1_fd[i] = -1;
  pthread_mutex_init (&rt->lock, NULL);
  pthread_cond_init (&rt->stack_free, NULL);
  rt->uid_range_start = (uid_t)range_start;
  rt->uid_blocks = (uint32_t)(range_count / WR_UID_BLOCK);
  int r;
  rt->root = strdup (cfg->root);
  if (rt->root == NULL || asprintf (&rt->mnt_dir, "%s/run/mnt", cfg->root) < 0)
    {
      rt->mnt_dir = NULL;
      r = wr_error (err, ENOMEM, WR_E_INTERNAL, "runtime");
      goto fail;
    }
  if ((r = wr_mkdir_p (rt->mnt_dir, 0700)) < 0)
    {
      r = wr_error (err, -r, WR_E_INTERNAL, "mkdir %s", rt->mnt_dir);
      goto fail;
    }
  rt->agent_fd = open (cfg->agent_path, O_RDONLY | O_CLOEXEC);
  if (rt->agent_fd < 0)
    {
      r = wr_sys_error (err, "open agent %s", cfg->agent_path);
      goto fail;
    }
  {
    _cleanup_free_ char *b = NULL;
    rt->cap_last = 40;
    if (wr_read_file_at (AT_FDCWD, "/proc/sys/kernel/cap_last_cap", &b, NULL, 64) == 0)
      rt->cap_last = atoi (b);
  }
  for (int s = 1; s < 65; s++)
    {
      struct sigaction sa;
      if (s != SIGKILL && s != SIGSTOP && sigaction (s, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN)
        rt->ign_signals[rt->n_ign++] = s;
    }
  {
    /* One cgroup parent per daemon root: stable across restarts (recovery
     * finds the sandboxes), distinct between daemons on one host. */
    uint32_t h = 2166136261u;
    for (const char *c = rt->root; *c; c++)
      h = (h ^ (unsigned char)*c) * 16777619u;
    snprintf (rt->cg_name, sizeof rt->cg_name, "warren-%08x", h);
  }
  if ((r = wr_cg_init (&rt->cg, rt->cg_name, err)) < 0)
    goto fail;
  claims_foreach (rt, orphaned, NULL);
  if ((r = wr_seccomp_build (&rt->seccomp, err)) < 0)
    goto fail;
  rt->stack_size = CHILD_STACK;
  for (int i = 0; i < WR_CHILD_STACKS; i++)
    {
      rt->stack[i] = mmap (NULL, rt->stack_size, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
      if (rt->stack[i] == MAP_FAILED)
        {
          rt->stack[i] = NULL;
          r = wr_sys_error (err, "mmap child stack");
          goto fail;
        }
    }
  {
    /* WARREN_NETNS_POOL=N: network namespaces kept ready (0: none) */
    const char *np = getenv ("WARREN_NETNS_POOL");
    unsigned n = np && *np ? (unsigned)strtoul (np, NULL, 10) : WR_NETNS_POOL_DEFAULT;
    if ((r = wr_netns_pool_new (n, &rt->netns_pool, err)) < 0)
      goto fail;
  }
  agent_sock_dir (rt);
  /* WARREN_AGENT_ZYGOTE=0: every sandbox execs its agent (the fallback) */
  const char *zy = getenv ("WARREN_AGENT_ZYGOTE");
  bool zygote_on = !(zy && strcmp (zy, "0") == 0);
  if ((r = wr_zygote_new (zygote_on, &rt->zygote)) < 0)
    {
      r = wr_error (err, -r, WR_E_INTERNAL, "agent zygote");
      goto fail;
    }
  snprintf (rt->describe, sizeof rt->describe,
            "{\"cgroup_layout\":\"%s\",\"cgroup_v2\":\"%s\",\"clone_into_cgroup\":%s,"
            "\"uid_range_start\":%u,\"uid_blocks\":%u,\"uid_block\":%u,\"idmapped_layers\":\"per-"
            "sandbox\",\"seccomp_insns\":%u,"
            "\"clone_vm\":%s,\"agent_zygote\":%s}",
            layout_name (rt->cg.layout), rt->cg.v2_fd >= 0 ? rt->cg.v2_path : "",
            rt->cg.v2_fd >= 0 ? "true" : "false", (unsigned)rt->uid_range_start, rt->uid_blocks,
            WR_UID_BLOCK, rt->seccomp.len, WR_HAVE_CLONE3_RUN ? "true" : "false",
            zygote_on ? "true" : "false");
  *ret = rt;
  return 0;
fail:
  wr_runtime_free (rt);
  return r;
}

void
wr_runtime_free (struct wr_runtime *rt)
{
  if (rt == NULL)
    return;
  wr_zygote_free (rt->zygote);
  if (rt->sock_dir_fd >= 0)
    {
      close (rt->sock_dir_fd);
      rmdir (rt->sock_dir); /* kept while sockets of live sandboxes are in it */
    }
  wr_netns_pool_free (rt->netns_pool);
  wr_cg_fini (&rt->cg);
  if (rt->agent_fd >= 0)
    close (rt->agent_fd);

  for (int i = 0; i < WR_CHILD_STACKS; i++)
    if (rt->stack[i])
      munmap (rt->stack[i], rt->stack_size);
  if (rt->mnt_dir)
    rmdir (rt->mnt_dir);
  if (rt->root)
    {
      /* the child stack slots' layer mount points (container.c) */
      char p[PATH_MAX];
      for (int i = 0; i < WR_CHILD_STACKS; i++)
        {
          for (int l = 0; l < WR_MAX_LAYERS; l++)
            if (snprintf (p, sizeof p, "%s/run/l/%d/%d", rt->root, i, l) < (int)sizeof p
                && rmdir (p) < 0 && errno == ENOENT)
              break;
          snprintf (p, sizeof p, "%s/run/l/%d", rt->root, i);
          rmdir (p);
        }
      snprintf (p, sizeof p, "%s/run/l", rt->root);
      rmdir (p);
    }
  free (rt->seccomp.filter);
  free (rt->mnt_dir);
  free (rt->root);
  pthread_mutex_destroy (&rt->lock);
  pthread_cond_destroy (&rt->stack_free);
  free (rt);
}

const char *
wr_runtime_describe (struct wr_runtime *rt)
{
  return rt->describe;
}

int
wr_runtime_userns_fd (struct wr_runtime *rt)
{
  (void)rt;
  return -1; /* layers are idmapped per sandbox, by wr_container_create */
}

const char *
wr_runtime_cgroup_name (struct wr_runtime *rt)
{
  return rt->cg_name;
}
