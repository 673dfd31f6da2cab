/* warrend: the Warren node daemon (docs/operations.md). */
#include "daemon/daemon.h"

#include <getopt.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <event2/thread.h>

#include "common/httpd.h"
#include "common/util.h"
#include "daemon/compat_sf.h"  /* SandboxFusion API */
#include "daemon/compat_e2b.h" /* E2B API */
#include "daemon/fncall.h"
#include "daemon/log.h"
#include "daemon/trajlog.h"
#include "daemon/cluster.h"  /* cluster mode */
#include "daemon/zram.h"     /* pause */
#include "backend/backend.h" /* wr_cg_favor_dynmods */

static void
usage (FILE *f)
{
  fprintf (
      f,
      "usage: warrend --root DIR [--listen unix:PATH]... [--listen tcp:ADDR:PORT --token-file F]\n"
      "               [--default-image REF] [--pool REF=N]... [--uid-range START:COUNT]\n"
      "               [--fncall-pool REF=N[,python][,reuse][,memory=MB]]... [--fncall-size N]\n"
      "               [--fncall-queue N] [--fncall-max-calls N] [--fncall-idle S]\n"
      "               [--fncall-zygote PATH] [--fncall-preload MOD,...]\n"
      "               [--max-connections N] [--http-header-timeout S] [--http-idle-timeout S]\n"
      "               [--max-sandboxes N] [--agent-conns N]\n"
      "               [--allow-host-paths] [--allow-host-network] [--version]\n"
      "               [--log-level error|warning|info|debug]\n"
      "               [--listen-compat tcp:ADDR:PORT [--compat-token-file F]]\n"
      "               [--listen-e2b tcp:ADDR:PORT]\n"
      "               [--registry-ca FILE] [--registry-auth FILE] [--registry-mirror H=M]...\n"
      "               [--registry-insecure HOST:PORT]... [--registry-trust-erofs HOST[:PORT]]...\n"
      "               [--compat-image [LANG=]REF]... [--log-retention S]\n"
      "               [--zram-size MB [--zram-priority N]] [--idle-pause S]\n"
      "               [--no-agent-zygote] [--no-cgroup-favordynmods]\n"
      "               [--net-default-egress-kbps KBPS]\n"
      "               [--net-default-connections N]\n"
      "               [--net-dns-min-ttl S] [--net-dns-max-ttl S] [--vm-boot-timeout "
      "S]\n" WRD_CLUSTER_USAGE
      "Runs the Warren node daemon in the foreground; all state lives under DIR.\n"
      "Default listener: unix:DIR/warrend.sock (owner-only).\n");
}

static void
on_signal (evutil_socket_t sig, short what WR_UNUSED, void *arg)
{
  struct wrd *d = arg;
  wrd_log (WRD_LOG_INFO, "signal %d, shutting down", (int)sig);
  event_base_loopbreak (d->base);
}

static char *
exe_dir_agent (void)
{
  char self[PATH_MAX];
  ssize_t n = readlink ("/proc/self/exe", self, sizeof self - 32);
  if (n < 0)
    return NULL;
  self[n] = '\0';
  char *slash = strrchr (self, '/');
  if (slash == NULL)
    return NULL;
  strcpy (slash + 1, "warren-agent");
  return strdup (self);
}

/* NAME=old,value (the repeatable registry flags) */
static int
env_append (const char *name, const char *value)
{
  const char *old = getenv (name);
  _cleanup_free_ char *v = NULL;
  if (asprintf (&v, "%s%s%s", old ? old : "", old ? "," : "", value) < 0)
    return -1;
  return setenv (name, v, 1);
}

int
main (int argc, char **argv)
{
  static struct wrd d;
  const char *listens[16];
  size_t n_listen = 0;
  const char *pools[64];
  size_t n_pools = 0;
  const char *root = NULL, *token_file = NULL, *agent = NULL;
  unsigned long long uid_start = 0, uid_count = 0;
  snprintf (d.default_image, sizeof d.default_image, "busybox:latest");
  static const struct option opts[] = {
    { "root", required_argument, NULL, 'r' },
    { "listen", required_argument, NULL, 'l' },
    { "token-file", required_argument, NULL, 't' },
    { "default-image", required_argument, NULL, 'i' },
    { "pool", required_argument, NULL, 'p' },
    { "uid-base", required_argument, NULL, 'u' }, /* before per-sandbox blocks: ignored */
    { "uid-range", required_argument, NULL, 'U' },
    { "agent", required_argument, NULL, 'a' },
    { "help", no_argument, NULL, 'h' },
    { "version", no_argument, NULL, 'V' },
    { "log-level", required_argument, NULL, 'L' },
    { "fncall-pool", required_argument, NULL, 'F' },
    { "fncall-size", required_argument, NULL, 'S' },
    { "fncall-queue", required_argument, NULL, 'Q' },
    { "fncall-max-calls", required_argument, NULL, 'M' },
    { "fncall-idle", required_argument, NULL, 'D' },
    { "fncall-zygote", required_argument, NULL, 'Z' },
    { "fncall-preload", required_argument, NULL, 'P' },
    WR_HTTPD_LONG_OPTIONS,
    { "allow-host-paths", no_argument, NULL, 'A' },
    { "allow-host-network", no_argument, NULL, 'N' },
    WRD_CLUSTER_OPTIONS, /* cluster mode */
    /* SandboxFusion API */
    { "listen-compat", required_argument, NULL, 2000 },
    { "compat-token-file", required_argument, NULL, 2001 },
    { "compat-image", required_argument, NULL, 2002 },
    /* registries: environment variables the pulls read (docs/images.md) */
    { "registry-ca", required_argument, NULL, 2200 },
    { "registry-auth", required_argument, NULL, 2201 },
    { "registry-mirror", required_argument, NULL, 2202 },
    { "registry-insecure", required_argument, NULL, 2203 },
    { "registry-trust-erofs", required_argument, NULL, 2204 },
    { "log-retention", required_argument, NULL, 2100 }, /* trajectory log */
    { "listen-e2b", required_argument, NULL, 2300 },    /* E2B API */
    { "max-sandboxes", required_argument, NULL, 2400 }, /* limits.c */
    { "agent-conns", required_argument, NULL, 2401 },   /* limits.c */
    /* pause that frees memory (docs/containers.md, "Pause") */
    { "zram-size", required_argument, NULL, 2500 },
    { "zram-priority", required_argument, NULL, 2501 },
    { "idle-pause", required_argument, NULL, 2502 },
    /* exec each sandbox's agent (docs/containers.md, "Agent zygote") */
    { "no-agent-zygote", no_argument, NULL, 2600 },
    /* leave the host's cgroup2 root flags alone (docs/containers.md, "Task migrations") */
    { "no-cgroup-favordynmods", no_argument, NULL, 2601 },
    /* default egress limits of allow= sandboxes (docs/network.md) */
    { "net-default-egress-kbps", required_argument, NULL, 2700 },
    { "net-default-connections", required_argument, NULL, 2701 },
    /* bounds of re-resolved names' TTLs (docs/network.md, "DNS") */
    { "net-dns-min-ttl", required_argument, NULL, 2702 },
    { "net-dns-max-ttl", required_argument, NULL, 2703 },
    /* a VM guest that never starts its agent (sandbox.c, boot watchdog) */
    { "vm-boot-timeout", required_argument, NULL, 2800 },
    { NULL, 0, NULL, 0 },
  };
  const char *fn_pools[64];
  size_t n_fn_pools = 0;
  struct wrd_fncall_config fcfg = { 0 };
  struct wrd_compat_sf_config sfcfg = { 0 }; /* SandboxFusion API */
  const char *e2b_listen = NULL;             /* E2B API */
  bool favor_dynmods = true;                 /* --no-cgroup-favordynmods */
  /* trajectory log */
  double traj_retention = WRD_TRAJ_DEFAULT_RETENTION_S;
  char *traj_end = NULL;
  unsigned max_sandboxes = 0;                      /* limits.c */
  long long agent_conns = 0;                       /* limits.c: 0 derived, < 0 never shed */
  unsigned long long zram_mb = 0, zram_prio = 100; /* pause */
  struct wrd_zram zram = { .dev = -1 };
  int c;
  while ((c = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    switch (c)
      {
      case 'F':
        if (n_fn_pools < WR_ARRAY_SIZE (fn_pools))
          fn_pools[n_fn_pools++] = optarg;
        break;
      case 'S':
        fcfg.default_size = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'Q':
        fcfg.max_queue = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'M':
        fcfg.max_calls = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'D':
        fcfg.idle_s = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'Z':
        fcfg.zygote = optarg;
        break;
      case 'P':
        fcfg.preload = optarg;
        break;
      case WR_HTTPD_OPT_MAX_CONNECTIONS:
      case WR_HTTPD_OPT_HEADER_TIMEOUT:
      case WR_HTTPD_OPT_IDLE_TIMEOUT:
        {
          wr_err_t herr;
          if (wr_httpd_limit_opt (c, optarg, &d.http.max_connections, &d.http.header_timeout_s,
                                  &d.http.idle_timeout_s, &herr)
              < 0)
            {
              wrd_log (WRD_LOG_ERROR, "%s", herr.msg);
              return 2;
            }
          break;
        }
      case 2100: /* trajectory log */
        traj_retention = strtod (optarg, &traj_end);
        if (*traj_end || !(traj_retention > 0))
          {
            wrd_log (WRD_LOG_ERROR, "--log-retention wants seconds > 0"); /* trajectory log */
            return 2;
          }
        break;
      case 2500: /* pause */
      case 2501:
      case 2502:
        {
          char *end;
          unsigned long long v = strtoull (optarg, &end, 10);
          if (*end || optarg[0] == '\0' || (c == 2501 && v > 32767)
              || (c == 2502 && v > 30 * 86400))
            {
              static const char *const names[] = { "zram-size", "zram-priority", "idle-pause" };
              wrd_log (WRD_LOG_ERROR, "--%s wants a number in range", names[c - 2500]);
              return 2;
            }
          if (c == 2500)
            zram_mb = v;
          else if (c == 2501)
            zram_prio = v;
          else
            d.idle_pause_s = (unsigned)v;
          break;
        }
      case 2600: /* the runtime reads it (src/backend/runtime.c) */
        setenv ("WARREN_AGENT_ZYGOTE", "0", 1);
        break;
      case 2601:
        favor_dynmods = false;
        break;
      case 2700: /* default egress limits (netsvc.c) */
      case 2701:
        {
          char *end;
          unsigned long long v = strtoull (optarg, &end, 10);
          if (*end || optarg[0] == '\0' || v > (c == 2700 ? 100000000ull : 1000000ull))
            {
              wrd_log (WRD_LOG_ERROR, "--net-default-%s wants a number in range",
                       c == 2700 ? "egress-kbps" : "connections");
              return 2;
            }
          *(c == 2700 ? &d.net_default_egress_kbps : &d.net_default_connections) = v;
          break;
        }
      case 2702: /* re-resolution (netsvc.c) */
      case 2703:
        {
          char *end;
          unsigned long v = strtoul (optarg, &end, 10);
          if (*end || optarg[0] == '\0' || v < 1 || v > 86400)
            {
              wrd_log (WRD_LOG_ERROR, "--net-dns-%s-ttl wants seconds in [1, 86400]",
                       c == 2702 ? "min" : "max");
              return 2;
            }
          *(c == 2702 ? &d.net_dns_ttl_min : &d.net_dns_ttl_max) = (unsigned)v;
          break;
        }
      case 2800:
        {
          char *end;
          unsigned long v = strtoul (optarg, &end, 10);
          if (*end || optarg[0] == '\0' || v < 1 || v > 86400)
            {
              wrd_log (WRD_LOG_ERROR, "--vm-boot-timeout wants seconds in [1, 86400]");
              return 2;
            }
          d.vm_boot_timeout_s = (unsigned)v;
          break;
        }
      case 2000: /* SandboxFusion API */
        sfcfg.listen = optarg;
        break;
      case 2001:
        sfcfg.token_file = optarg;
        break;
      case 2300: /* E2B API */
        e2b_listen = optarg;
        break;
      case 2400: /* limits.c */
        {
          char *end;
          unsigned long v = strtoul (optarg, &end, 10);
          if (*optarg == '\0' || *end || v == 0 || v > 10000000)
            {
              wrd_log (WRD_LOG_ERROR, "--max-sandboxes wants a number in [1, 10000000]");
              return 2;
            }
          max_sandboxes = (unsigned)v;
          break;
        }
      case 2401: /* limits.c */
        {
          char *end;
          long long v = strtoll (optarg, &end, 10);
          if (*optarg == '\0' || *end || v < -1 || v > 10000000)
            {
              wrd_log (WRD_LOG_ERROR, "--agent-conns wants -1, 0 or a number up to 10000000");
              return 2;
            }
          agent_conns = v;
          break;
        }
      case 2002:
        if (sfcfg.n_images < WRD_COMPAT_SF_MAX_IMAGES)
          sfcfg.images[sfcfg.n_images++] = optarg;
        break;
      case 'A':
        d.http.allow_host_paths = true;
        break;
      case 'N':
        d.allow_host_network = true;
        break;
      case 'r':
        root = optarg;
        break;
      case 'l':
        if (n_listen < WR_ARRAY_SIZE (listens))
          listens[n_listen++] = optarg;
        break;
      case 't':
        token_file = optarg;
        break;
      case 'i':
        snprintf (d.default_image, sizeof d.default_image, "%s", optarg);
        break;
      case 'p':
        if (n_pools < WR_ARRAY_SIZE (pools))
          pools[n_pools++] = optarg;
        break;
      case 'u':
        break;
      case 'U':
        {
          char *end;
          uid_start = strtoull (optarg, &end, 10);
          if (*end != ':' || (uid_count = strtoull (end + 1, &end, 10)) == 0 || *end)
            {
              fprintf (stderr, "warrend: --uid-range wants START:COUNT, got %s\n", optarg);
              return 2;
            }
          break;
        }
      case 'a':
        agent = optarg;
        break;
      case 'h':
        usage (stdout);
        return 0;
      case 'L':
        {
          int level = wrd_log_level_parse (optarg);
          if (level < 0)
            {
              wrd_log (WRD_LOG_ERROR, "--log-level wants error, warning, info or debug");
              return 2;
            }
          wrd_log_set_level ((enum wrd_log_level)level);
          break;
        }
      case 'V':
        printf ("warrend %s\n", WARREN_VERSION);
        return 0;
      case 2200:
        setenv ("WARREN_REGISTRY_CA", optarg, 1);
        break;
      case 2201:
        setenv ("WARREN_REGISTRY_AUTH", optarg, 1);
        break;
      case 2202: /* repeated: HOST=MIRROR,HOST2=MIRROR2 */
      case 2203: /* repeated: HOST:PORT,... (plain http) */
      case 2204: /* repeated: HOST[:PORT],... (Warren EROFS layers accepted) */
        if (env_append (c == 2202   ? "WARREN_REGISTRY_MIRRORS"
                        : c == 2203 ? "WARREN_REGISTRY_INSECURE"
                                    : "WARREN_REGISTRY_TRUST_EROFS",
                        optarg)
            < 0)
          return 2;
        break;
      case WRD_OPT_CLUSTER ... WRD_OPT_ETCD_KEY: /* cluster mode */
        {
          wr_err_t cerr;
          if (wrd_cluster_opt (c, optarg, &cerr) < 0)
            {
              wrd_log (WRD_LOG_ERROR, "%s", cerr.msg);
              return 2;
            }
          break;
        }
      default:
        usage (stderr);
        return 2;
      }
  if (root == NULL)
    root = getenv ("WARREN_ROOT");
  if (root == NULL || root[0] != '/')
    {
      wrd_log (WRD_LOG_ERROR, "--root must be an absolute directory");
      usage (stderr);
      return 2;
    }
  snprintf (d.root, sizeof d.root, "%s", root);
  if (wr_mkdir_p (d.root, 0700) < 0 || chmod (d.root, 0700) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "cannot create %s: %m", d.root);
      return 1;
    }
  char sub[1200];
  snprintf (sub, sizeof sub, "%s/sandboxes", d.root);
  mkdir (sub, 0700);
  if (token_file)
    {
      char *tok = NULL;
      size_t len;
      if (wr_read_file_at (AT_FDCWD, token_file, &tok, &len, 4096) < 0)
        {
          wrd_log (WRD_LOG_ERROR, "cannot read token file %s: %m", token_file);
          return 1;
        }
      while (len && (tok[len - 1] == '\n' || tok[len - 1] == '\r' || tok[len - 1] == ' '))
        tok[--len] = '\0';
      if (len < 16 || len >= sizeof d.token)
        {
          wrd_log (WRD_LOG_ERROR, "token in %s must be 16..255 characters", token_file);
          free (tok);
          return 1;
        }
      snprintf (d.token, sizeof d.token, "%s", tok);
      free (tok);
    }
  /* Many sandboxes and many client connections: raise the fd limit and
   * pid_max (budgeted below, once the runtime and the registry are up). */
  wrd_limits_raise (agent_conns);
  /* task migrations (every create's v1 attach, a first exec's cgroup join)
   * must not wait for an RCU grace period: src/backend/cgdyn.c */
  if (favor_dynmods)
    {
      char where[256];
      wr_err_t ferr;
      int f = wr_cg_favor_dynmods (where, &ferr);
      if (f < 0)
        wrd_log (WRD_LOG_WARN, "cgroup: favordynmods not set (%s): task migrations wait for RCU",
                 ferr.msg);
      else
        wrd_log (WRD_LOG_INFO,
                 "cgroup: favordynmods %s %s (task migrations do not wait for an RCU grace "
                 "period; a host-wide flag the kernel may not let be cleared)",
                 f ? "set on" : "already set on", where);
    }
  else
    wrd_log (WRD_LOG_INFO, "cgroup: favordynmods left as it is (--no-cgroup-favordynmods)");
  signal (SIGPIPE, SIG_IGN);
  /* A private mount namespace: layer mounts stay out of the host's table and
   * every clone copies a short mount list. */
  if (unshare (CLONE_NEWNS) < 0 || mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "private mount namespace: %m");
      return 1;
    }
  /* compressed swap for paused sandboxes: a node without it still pauses */
  if (zram_mb)
    {
      wr_err_t zerr;
      if (wrd_zram_setup (&zram, d.root, zram_mb, (int)zram_prio, &zerr) < 0)
        wrd_log (WRD_LOG_WARN,
                 "zram: %s; paused sandboxes keep their anonymous memory (no swap to move it to)",
                 zerr.msg);
      else
        wrd_log (WRD_LOG_INFO, "zram: zram%d, %llu MB of compressed swap at priority %llu",
                 zram.dev, zram_mb, zram_prio);
    }
  evthread_use_pthreads ();
  d.base = event_base_new ();
  /* 0: urgent, 1: requests (the default), 2: background work such as pool
   * refills, which only runs when no request is waiting. */
  event_base_priority_init (d.base, 3);
  wr_random_hex (d.node, 4);
  wr_err_t err;
  _cleanup_free_ char *agent_default = exe_dir_agent ();
  struct wr_runtime_config rc = {
    .root = d.root,
    .agent_path = agent ? agent : agent_default,
    .uid_range_start = uid_start, /* 0 count: $WARREN_UID_RANGE, else the default */
    .uid_range_count = uid_count,
  };
  if (wrd_db_open (&d, &err) < 0 || wrd_traj_open (&d, traj_retention, &err) < 0
      || wr_runtime_new (&rc, &d.rt, &err) < 0
      || wr_store_open (d.root, d.db, wr_runtime_userns_fd (d.rt), &d.store, &err) < 0
      || wrd_recover (&d, &err) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "%s", err.msg);
      return 1;
    }
  wrd_limits_budget (&d, max_sandboxes);
  char defsock[1200];
  snprintf (defsock, sizeof defsock, "unix:%s/warrend.sock", d.root);
  /* The owner-only unix socket is always served (local administration),
   * at DIR/warrend.sock unless another unix path was given. */
  bool have_unix = false;
  for (size_t i = 0; i < n_listen; i++)
    have_unix |= strncmp (listens[i], "unix:", 5) == 0;
  if (!have_unix && n_listen < WR_ARRAY_SIZE (listens))
    listens[n_listen++] = defsock;
  for (size_t i = 0; i < n_listen; i++)
    if (wrd_http_listen (&d, listens[i], &err) < 0)
      {
        wrd_log (WRD_LOG_ERROR, "%s", err.msg);
        return 1;
      }
  struct event *sigint = NULL, *sigterm = NULL;
  /* cluster mode: before pools fill, so every id carries the node name */
  if (wrd_cluster_start (&d, &err) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "cluster: %s", err.msg);
      goto failed;
    }
  wrd_pools_load (&d, NULL);
  if (wrd_fncall_init (&d, &fcfg, &err) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "fncall: %s", err.msg);
      goto failed;
    }
  if (sfcfg.listen && wrd_compat_sf_start (&d, &sfcfg, &err) < 0) /* SandboxFusion API */
    {
      wrd_log (WRD_LOG_ERROR, "--listen-compat: %s", err.msg);
      goto failed;
    }
  if (e2b_listen && wrd_compat_e2b_start (&d, e2b_listen, &err) < 0) /* E2B API */
    {
      wrd_log (WRD_LOG_ERROR, "--listen-e2b: %s", err.msg);
      goto failed;
    }
  for (size_t i = 0; i < n_fn_pools; i++)
    if (wrd_fncall_pool_arg (&d, fn_pools[i], &err) < 0)
      wrd_log (WRD_LOG_WARN, "fncall pool %s: %s", fn_pools[i], err.msg);
  for (size_t i = 0; i < n_pools; i++)
    {
      char ref[256];
      snprintf (ref, sizeof ref, "%s", pools[i]);
      char *eq = strrchr (ref, '=');
      if (eq == NULL)
        {
          wrd_log (WRD_LOG_ERROR, "--pool wants REF=N");
          goto failed;
        }
      *eq = '\0';
      if (wrd_pool_set (&d, ref, (unsigned)atoi (eq + 1), &err) < 0)
        wrd_log (WRD_LOG_WARN, "pool %s: %s", ref, err.msg);
    }
  sigint = evsignal_new (d.base, SIGINT, on_signal, &d);
  sigterm = evsignal_new (d.base, SIGTERM, on_signal, &d);
  evsignal_add (sigint, NULL);
  evsignal_add (sigterm, NULL);
  wrd_log (WRD_LOG_INFO, "serving %s (root %s, node %s)", listens[0], d.root, d.node);
  event_base_dispatch (d.base);
  int exit_code = 0;
  if (0)
    {
    failed:
      /* a start that failed once the runtime existed: what this daemon made
       * goes (its cgroups, listeners, sockets), as at a stop; sandboxes
       * adopted from an earlier run stay for the next daemon */
      exit_code = 2;
      sigint = sigterm = NULL;
    }
  d.stopping = true;
  wrd_cluster_stop (&d); /* cluster mode: leave at once */
  /* SandboxFusion API */
  wrd_compat_sf_stop (&d);
  wrd_compat_e2b_stop (&d); /* E2B API */
  /* image jobs use the store and their requests: done before both go */
  wrd_jobs_drain (&d);
  wrd_http_free (&d);
  wrd_fncall_shutdown (&d);
  wrd_shutdown (&d);
  wrd_traj_close (&d);
  wr_store_close (d.store);
  wr_runtime_free (d.rt);
  wrd_zram_teardown (&zram); /* pause */
  sqlite3_close (d.db);
  if (sigint)
    event_free (sigint);
  if (sigterm)
    event_free (sigterm);
  event_base_free (d.base);
  free (d.table);
  for (size_t i = 0; i < n_listen; i++)
    if (strncmp (listens[i], "unix:", 5) == 0)
      unlink (listens[i] + 5);
  return exit_code;
}
