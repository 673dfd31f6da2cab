#include "harness.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include "backend/pool.h"
#include "common/util.h"
#include "image/store.h"

#define MAX_DIRS 4

static char *dirs[MAX_DIRS];
static size_t n_dirs;
static struct wr_store *store;
static sqlite3 *db; /* the caller's: wr_store_close leaves it open */

static void
cleanup (void)
{
  wr_store_close (store);
  sqlite3_close (db);
  for (size_t i = 0; i < n_dirs; i++)
    wr_rm_rf_at (AT_FDCWD, dirs[i]);
}

void
fuzz_tmpdir (char *tmpl)
{
  if (mkdtemp (tmpl) == NULL || n_dirs == MAX_DIRS)
    abort ();
  if (n_dirs == 0)
    atexit (cleanup);
  dirs[n_dirs++] = tmpl;
}

struct wr_store *
fuzz_store (char *tmpl)
{
  fuzz_tmpdir (tmpl);
  char db_path[4096];
  snprintf (db_path, sizeof db_path, "%s/db", tmpl);
  wr_err_t err;
  if (store != NULL || sqlite3_open (db_path, &db) != SQLITE_OK
      || wr_store_open (tmpl, db, -1, &store, &err) < 0)
    abort ();
  /* archives are parsed here, not in the confined helper: its coverage and
   * its crashes must be the fuzzer's */
  wr_store_set_unpack_in_process (store, true);
  return store;
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *input; /* a copy: the server may still answer a late connection */
static size_t input_len;
static char separator[16];
static unsigned served;

void
fuzz_server_set (const uint8_t *data, size_t size, const char *sep)
{
  pthread_mutex_lock (&lock);
  free (input);
  input = malloc (size + 1);
  if (input == NULL)
    abort ();
  memcpy (input, data, size);
  input_len = size;
  snprintf (separator, sizeof separator, "%s", sep ? sep : "");
  served = 0;
  pthread_mutex_unlock (&lock);
}

/* Part n of the input (called with the lock held). */
static void
part (unsigned n, const uint8_t **ret, size_t *ret_len)
{
  const uint8_t *p = input, *end = input + input_len;
  size_t sl = strlen (separator);
  for (;;)
    {
      const uint8_t *s = sl ? memmem (p, (size_t)(end - p), separator, sl) : NULL;
      if (sl == 0 || n == 0 || s == NULL)
        {
          *ret = sl == 0 || n == 0 ? p : end;
          *ret_len = sl == 0 || n == 0 ? (size_t)((s ? s : end) - p) : 0;
          return;
        }
      p = s + sl;
      n--;
    }
}

static void
read_request (int fd)
{
  char buf[65536];
  size_t have = 0, want = SIZE_MAX;
  while (have < want && have < sizeof buf - 1)
    {
      struct pollfd p = { .fd = fd, .events = POLLIN };
      if (poll (&p, 1, 2000) <= 0)
        break;
      ssize_t n = read (fd, buf + have, sizeof buf - 1 - have);
      if (n <= 0)
        break;
      have += (size_t)n;
      buf[have] = '\0';
      char *end = strstr (buf, "\r\n\r\n");
      if (end && want == SIZE_MAX)
        {
          char *cl = strcasestr (buf, "\r\nContent-Length:");
          want = (size_t)(end + 4 - buf) + (cl && cl < end ? strtoul (cl + 17, NULL, 10) : 0);
        }
    }
}

static void *
server (void *arg)
{
  int listen_fd = (int)(intptr_t)arg;
  for (;;)
    {
      int fd = accept4 (listen_fd, NULL, NULL, SOCK_CLOEXEC);
      if (fd < 0)
        continue;
      read_request (fd);
      pthread_mutex_lock (&lock);
      const uint8_t *p;
      size_t len;
      part (served++, &p, &len);
      size_t off = 0;
      while (off < len)
        {
          ssize_t n = send (fd, p + off, len - off, MSG_NOSIGNAL);
          if (n <= 0)
            break;
          off += (size_t)n;
        }
      pthread_mutex_unlock (&lock);
      shutdown (fd, SHUT_WR);
      close (fd);
    }
  return NULL;
}

void
fuzz_server_start (int listen_fd)
{
  pthread_t t;
  if (pthread_create (&t, NULL, server, (void *)(intptr_t)listen_fd) != 0)
    abort ();
  pthread_detach (t);
}

void
fuzz_private_netns (void)
{
  if (unshare (CLONE_NEWNET) < 0)
    {
      fprintf (stderr, "fuzz: no network namespace of its own (%m): loopback is the host's\n");
      return;
    }
  if (wr_netns_loopback_up () < 0)
    abort ();
  int fd = open ("/proc/sys/net/ipv4/tcp_no_metrics_save", O_WRONLY | O_CLOEXEC);
  if (fd >= 0)
    {
      if (write (fd, "1", 1) != 1)
        fprintf (stderr, "fuzz: tcp_no_metrics_save: %m\n");
      close (fd);
    }
}
