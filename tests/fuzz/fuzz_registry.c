/* Registry pulls (src/image/registry.c): the reference parser, our side of
 * libcurl (header and body callbacks, redirects, the WWW-Authenticate
 * challenge and token parsing, the size caps), manifest and index parsing
 * and blob download into a scratch store. Every connection goes to a fake
 * registry on loopback (libcurl's CONNECT_TO; getaddrinfo for our own
 * lookups), which answers its N-th connection with the N-th part of the
 * input (parts end with "=====\n"). */
#include <netdb.h>
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);
static int fuzz_getaddrinfo (const char *host, const char *port, const struct addrinfo *hints,
                             struct addrinfo **res);

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#define getaddrinfo fuzz_getaddrinfo
#include "image/registry.c"
#undef getaddrinfo
#pragma clang diagnostic pop

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>

#include "harness.h"

static char root[] = "/tmp/warren-fuzz-registry-XXXXXX";
static struct wr_store *store;
static char port_str[8];

static int
fuzz_getaddrinfo (const char *host, const char *port, const struct addrinfo *hints,
                  struct addrinfo **res)
{
  return getaddrinfo ("127.0.0.1", port_str, hints, res);
}

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
  store = fuzz_store (root);
  fuzz_private_netns ();
  struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl (INADDR_LOOPBACK) };
  socklen_t sl = sizeof sa;
  int listen_fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd < 0 || bind (listen_fd, (struct sockaddr *)&sa, sizeof sa) < 0
      || listen (listen_fd, 64) < 0 || getsockname (listen_fd, (struct sockaddr *)&sa, &sl) < 0)
    abort ();
  snprintf (port_str, sizeof port_str, "%u", ntohs (sa.sin_port));
  static char connect_to[64];
  snprintf (connect_to, sizeof connect_to, "::127.0.0.1:%s", port_str);
  registry_connect_to = connect_to;
  fuzz_server_start (listen_fd);
  return 0;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  /* The first line is the reference to pull. */
  const uint8_t *nl = memchr (data, '\n', size);
  if (nl == NULL || (size_t)(nl - data) > 300)
    return 0;
  char ref[301];
  memcpy (ref, data, (size_t)(nl - data));
  ref[nl - data] = '\0';
  fuzz_server_set (nl + 1, size - (size_t)(nl + 1 - data), "=====\n");
  struct wr_image *img = NULL;
  wr_err_t err;
  if (wr_image_pull (store, ref, "fuzz:latest", true, NULL, NULL, &img, &err) == 0)
    {
      wr_image_free (img);
      wr_image_remove (store, "fuzz:latest", &err);
      wr_store_gc (store, &err);
    }
  return 0;
}
