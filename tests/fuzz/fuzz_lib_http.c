/* libwarren's HTTP/1.1 response parser (src/lib/http.c) and the JSON/stream
 * readers above it (client.c, api.c, images.c), driven through the public
 * API against a fake daemon: a thread on a unix socket answers every
 * connection with the fuzz input after the first byte, which picks the call. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "warren/warren.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);

static char sock_path[108];

static void
cleanup (void)
{
  unlink (sock_path);
}

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
  snprintf (sock_path, sizeof sock_path, "/tmp/warren-fuzz-lib-%d.sock", (int)getpid ());
  unlink (sock_path);
  struct sockaddr_un sa = { .sun_family = AF_UNIX };
  snprintf (sa.sun_path, sizeof sa.sun_path, "%s", sock_path);
  int listen_fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd < 0 || bind (listen_fd, (struct sockaddr *)&sa, sizeof sa) < 0
      || listen (listen_fd, 16) < 0)
    abort ();
  fuzz_server_start (listen_fd);
  atexit (cleanup);
  return 0;
}

static int
on_output (void *ud, int stream, const void *data, size_t len)
{
  *(size_t *)ud += len;
  return *(size_t *)ud > (1u << 20);
}

static void
on_progress (void *ud, const char *what, uint64_t done, uint64_t total)
{
  (void)strlen (what);
}

static void
check_result (json_t *r)
{
  if (r == NULL)
    return;
  (void)warren_result_status (r);
  static const char *keys[] = { "stdout", "stderr", "data" };
  for (size_t i = 0; i < 3; i++)
    {
      void *buf = NULL;
      size_t len = 0;
      warren_error_t err;
      if (warren_result_bytes (r, keys[i], &buf, &len, &err) == 0)
        free (buf);
    }
  json_decref (r);
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  if (size < 1)
    return 0;
  fuzz_server_set (data + 1, size - 1, NULL);

  char host[128];
  snprintf (host, sizeof host, "unix:%s", sock_path);
  warren_error_t err;
  warren_client_t *c = warren_client_new (host, "fuzz-token", &err);
  if (c == NULL)
    abort ();
  warren_client_set_timeout (c, 3000);
  json_t *req = json_pack ("{s:[s],s:s}", "cmd", "true", "stdin", "x");
  size_t out = 0;
  switch (data[0] % 12)
    {
    case 0:
      check_result (warren_exec (c, "abcd-1234", req, &err));
      break;
    case 1:
      check_result (warren_exec_stream (c, "abcd-1234", req, on_output, &out, &err));
      break;
    case 2:
      check_result (warren_sandbox_list (c, &err));
      break;
    case 3:
      check_result (warren_sandbox_create (c, req, &err));
      break;
    case 4:
      {
        void *buf = NULL;
        size_t len = 0;
        if (warren_file_get (c, "abcd-1234", "/etc/passwd", &buf, &len, 1u << 20, &err) == 0)
          free (buf);
        break;
      }
    case 5:
      check_result (warren_file_list (c, "abcd-1234", "/", &err));
      break;
    case 6:
      check_result (
          warren_image_pull (c, "localhost:5000/x:1", NULL, true, on_progress, NULL, &err));
      break;
    case 7:
      check_result (warren_image_build (c, "x:1", "FROM busybox\n", NULL, on_progress, NULL, &err));
      break;
    case 8:
      free (warren_metrics (c, &err));
      break;
    case 9:
      (void)warren_sandbox_delete (c, "abcd-1234", &err);
      break;
    case 10:
      check_result (warren_call (c, req, &err));
      break;
    default:
      {
        json_t *ret = NULL;
        if (warren_request (c, "GET", "/healthz", NULL, &ret, &err) >= 0)
          json_decref (ret);
        /* a second request on the kept connection, if any */
        check_result (warren_healthz (c, &err));
        break;
      }
    }
  json_decref (req);
  warren_client_free (c);
  return 0;
}
