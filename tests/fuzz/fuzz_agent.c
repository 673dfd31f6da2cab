/* The agent's side of the protocol (src/agent/main.c): frames from the
 * daemon are split by conn_read and dispatched. FILE requests run for real
 * against an empty temporary root; EXEC requests go through the exec spec
 * parsers (parse_spec, ag_call_parse) but never start a process. */
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);

/* main.c's call goes to the stub below; exec.c's spawning version is renamed. */
/* The project's sources are gcc's; clang-only warnings in them are not errors here. */
#pragma clang diagnostic push
#pragma clang diagnostic warning "-Weverything"
#pragma clang diagnostic ignored "-Weverything"
#define main warren_agent_main
#define ag_exec_start fuzz_exec_start
#include "agent/main.c"
#undef ag_exec_start
#define ag_exec_start ag_exec_start_spawn
#include "agent/exec.c"
#undef ag_exec_start
#undef main
#pragma clang diagnostic pop

#include "agent/zygote.h"
#include "harness.h"

void
fuzz_exec_start (uint32_t stream, json_t *body)
{
  wr_err_t err = { 0 };
  struct spec s = { 0 };
  struct ag_call call;
  int r = parse_spec (body, &s, &err);
  if (r == 0)
    r = ag_call_parse (body, &call, &err);
  strv_free (&s.argv);
  strv_free (&s.env);
  if (r < 0)
    ag_send_error (stream, &err);
  else
    ag_send_json (stream, WR_MSG_EXIT, exit_json (0, 0, false, false, false, 0, NULL));
}

static char root[] = "/tmp/warren-fuzz-agent-XXXXXX";
static int cwdfd = -1; /* the agent's watch op ends in chdir ("/"): back after each input */

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
  fuzz_tmpdir (root);
  cwdfd = open (".", O_PATH | O_DIRECTORY | O_CLOEXEC);
  ag.rootfd = open (root, O_PATH | O_DIRECTORY | O_CLOEXEC);
  ag.use_openat2 = ag_openat2_works (ag.rootfd);
  ag.devnull = open ("/dev/null", O_RDONLY | O_CLOEXEC);
  ag.epfd = epoll_create1 (EPOLL_CLOEXEC);
  if (ag.rootfd < 0 || ag.epfd < 0)
    abort ();
  signal (SIGPIPE, SIG_IGN);
  return 0;
}

static void
drain (int fd)
{
  char buf[65536];
  while (read (fd, buf, sizeof buf) > 0)
    ;
}

static void
wipe_root (void)
{
  int dfd = open (root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    abort ();
  DIR *d = fdopendir (dfd);
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    if (strcmp (de->d_name, ".") != 0 && strcmp (de->d_name, "..") != 0)
      wr_rm_rf_at (dirfd (d), de->d_name);
  closedir (d);
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  int sv[2];
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
    abort ();
  conn_open (sv[0]);
  size_t off = 0;
  for (int spins = 0; spins < 1000 && ag_connected (); spins++)
    {
      if (off < size)
        {
          ssize_t n = write (sv[1], data + off, size - off);
          if (n > 0)
            off += (size_t)n;
        }
      conn_read ();
      drain (sv[1]);
      if (conn.oq_head && !conn.dead)
        conn_flush ();
      bool more = false;
      for (int i = 0; i < 8 && (more = ag_file_pump ()); i++)
        {
          drain (sv[1]);
          if (conn.oq_head && !conn.dead)
            conn_flush ();
        }
      drain (sv[1]);
      run_deferred ();
      if (off == size && !more && conn.oq_head == NULL)
        break;
    }
  conn.dead = true;
  conn_close ();
  while (ag_file_pump ()) /* orphaned reads finish silently */
    ;
  run_deferred ();
  close (sv[1]);
  wipe_root ();
  if (cwdfd >= 0 && fchdir (cwdfd) < 0)
    abort ();
  return 0;
}
