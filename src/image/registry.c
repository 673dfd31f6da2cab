/* Pull from an OCI distribution (v2) registry (docs/images.md).
 *
 * A small blocking HTTP/1.1 client (one connection per request, plain HTTP:
 * TLS is not built in, so pulls must say insecure). Manifests are checked
 * against the requested digest or the registry's Docker-Content-Digest,
 * every blob is hashed while it streams to ROOT/tmp and rejected on
 * mismatch; layers are fetched by a few threads at once and layers whose
 * blob is already stored are not fetched at all. */
#include "store.h"

#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <linux/netlink.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>

#include "../backend/jail.h"
#include "../common/util.h"
#include "internal.h"
#include "sha256.h"

#define MAX_MANIFEST (4u << 20)
#define PULL_THREADS 4

static const char accept_manifests[]
    = "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, "
      "application/vnd.docker.distribution.manifest.v2+json, "
      "application/vnd.docker.distribution.manifest.list.v2+json";

struct rref
{
  char host[256];
  char port[8];
  char repo[256];
  char tag[129];
  char digest[72];
  /* redirect policy: may blob redirects reach this host's own or loopback
   * addresses (the registry itself is on loopback), link-local ones (only
   * when the store allows private redirects)? */
  bool local_ok, private_ok;
};

static bool
repo_char_ok (char c)
{
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'
         || c == '/';
}

static int
rref_parse (const char *s, struct rref *r, wr_err_t *err)
{
  memset (r, 0, sizeof *r);
  if (s == NULL || strlen (s) > 600)
    return wr_error (err, 0, WR_E_INVALID, "invalid registry reference");
  const char *slash = strchr (s, '/');
  if (slash == NULL || slash == s || (size_t)(slash - s) >= sizeof r->host)
    return wr_error (err, 0, WR_E_INVALID,
                     "registry reference '%.300s' needs a host: HOST[:PORT]/REPO[:TAG|@DIGEST]", s);
  char hostport[256];
  memcpy (hostport, s, (size_t)(slash - s));
  hostport[slash - s] = '\0';
  char *colon = strrchr (hostport, ':');
  if (colon && !strchr (colon, ']'))
    {
      *colon = '\0';
      snprintf (r->port, sizeof r->port, "%.7s", colon + 1);
      for (const char *p = r->port; *p; p++)
        if (*p < '0' || *p > '9')
          return wr_error (err, 0, WR_E_INVALID, "invalid port in '%.300s'", s);
    }
  else
    strcpy (r->port, "80");
  snprintf (r->host, sizeof r->host, "%s", hostport);
  if (r->host[0] == '[')
    {
      /* [::1] */
      size_t l = strlen (r->host);
      if (r->host[l - 1] != ']')
        return wr_error (err, 0, WR_E_INVALID, "invalid host in '%.300s'", s);
      memmove (r->host, r->host + 1, l - 2);
      r->host[l - 2] = '\0';
    }
  const char *rest = slash + 1;
  const char *at = strchr (rest, '@');
  size_t rlen = at ? (size_t)(at - rest) : strlen (rest);
  if (at)
    {
      if (strncmp (at + 1, "sha256:", 7) != 0 || strlen (at + 1) != 71)
        return wr_error (err, 0, WR_E_INVALID, "invalid digest in '%.300s'", s);
      snprintf (r->digest, sizeof r->digest, "%s", at + 1);
    }
  const char *tc = memchr (rest, ':', rlen);
  size_t repolen = tc ? (size_t)(tc - rest) : rlen;
  if (repolen == 0 || repolen >= sizeof r->repo)
    return wr_error (err, 0, WR_E_INVALID, "invalid repository in '%.300s'", s);
  for (size_t i = 0; i < repolen; i++)
    if (!repo_char_ok (rest[i]))
      return wr_error (err, 0, WR_E_INVALID, "invalid repository in '%.300s'", s);
  memcpy (r->repo, rest, repolen);
  if (tc)
    {
      size_t tl = rlen - repolen - 1;
      if (tl == 0 || tl > 128)
        return wr_error (err, 0, WR_E_INVALID, "invalid tag in '%.300s'", s);
      memcpy (r->tag, tc + 1, tl);
    }
  else if (!at)
    strcpy (r->tag, "latest");
  return 0;
}

/* Is the registry itself on loopback (then its blobs may be redirected to
 * this host, as a local registry with local storage does)? */
static bool
host_is_loopback (const char *host, const char *port)
{
  struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *res = NULL;
  if (getaddrinfo (host, port, &hints, &res) != 0)
    return false;
  bool all = res != NULL;
  for (struct addrinfo *a = res; a; a = a->ai_next)
    {
      const struct sockaddr *sa = a->ai_addr;
      if (sa->sa_family == AF_INET)
        all = all && (ntohl (((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
      else if (sa->sa_family == AF_INET6)
        all = all && IN6_IS_ADDR_LOOPBACK (&((const struct sockaddr_in6 *)sa)->sin6_addr);
      else
        all = false;
    }
  freeaddrinfo (res);
  return all;
}

/* ---- HTTP ---- */

struct resp
{
  int status;
  char location[2048];
  char digest[80];
  char content_type[256];
  long long length; /* -1: unknown */
  bool chunked;
};

struct sink
{
  int fd;          /* >= 0: write here */
  char *buf;       /* else: accumulate */
  size_t len, max; /* bytes received; more than max is an error, never read */
  struct wr_sha256 *hash;
  uint64_t *counter; /* progress, updated under pull lock */
  void (*tick) (void *ud, size_t n);
  void *ud;
  const char *what; /* "layer 2", for errors */
  bool blob;        /* a blob: may be redirected to storage on another host */
};

static int
sink_put (struct sink *k, const char *p, size_t n, wr_err_t *err)
{
  if (n > k->max - k->len)
    return wr_error (err, EFBIG, WR_E_INVALID, "registry sent more than %zu bytes for %s", k->max,
                     k->what);
  if (k->hash)
    wr_sha256_update (k->hash, p, n);
  if (k->fd >= 0)
    {
      if (wr_write_all (k->fd, p, n) < 0)
        {
          int r = wr_sys_error (err, "write blob");
          if (errno == ENOSPC || errno == EDQUOT)
            err->code = WR_E_EXHAUSTED;
          return r;
        }
    }
  else
    {
      char *nb = realloc (k->buf, k->len + n + 1);
      if (nb == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      k->buf = nb;
      memcpy (k->buf + k->len, p, n);
      k->buf[k->len + n] = '\0';
    }
  k->len += n;
  if (k->tick)
    k->tick (k->ud, n);
  return 0;
}

struct conn
{
  int fd;
  char buf[65536];
  size_t off, len;
};

static ssize_t
conn_fill (struct conn *c)
{
  if (c->off < c->len)
    return (ssize_t)(c->len - c->off);
  for (;;)
    {
      ssize_t n = read (c->fd, c->buf, sizeof c->buf);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        return -errno;
      c->off = 0;
      c->len = (size_t)n;
      return n;
    }
}

static int
conn_line (struct conn *c, char *line, size_t size, wr_err_t *err)
{
  size_t n = 0;
  for (;;)
    {
      ssize_t r = conn_fill (c);
      if (r <= 0)
        return wr_error (err, r < 0 ? (int)-r : 0, WR_E_UNAVAILABLE,
                         "registry closed the connection mid-response");
      char ch = c->buf[c->off++];
      if (ch == '\n')
        {
          if (n > 0 && line[n - 1] == '\r')
            n--;
          line[n] = '\0';
          return 0;
        }
      if (n + 1 >= size)
        return wr_error (err, 0, WR_E_INVALID, "registry sent an over-long header line");
      line[n++] = ch;
    }
}

static int
conn_copy (struct conn *c, unsigned long long n, struct sink *k, wr_err_t *err)
{
  while (n > 0)
    {
      ssize_t r = conn_fill (c);
      if (r < 0)
        return wr_error (err, (int)-r, WR_E_UNAVAILABLE, "read from registry");
      if (r == 0)
        return wr_error (err, 0, WR_E_UNAVAILABLE, "registry response truncated");
      size_t take = (size_t)r < n ? (size_t)r : (size_t)n;
      int e = sink_put (k, c->buf + c->off, take, err);
      if (e < 0)
        return e;
      c->off += take;
      n -= take;
    }
  return 0;
}

enum addr_class
{
  ADDR_PUBLIC,
  ADDR_LOCAL,     /* loopback, unspecified (reaches loopback), or one of this host's */
  ADDR_LINKLOCAL, /* 169.254/16, fe80::/10 (cloud metadata services live there) */
};

static bool
is_own_address (const struct sockaddr *sa)
{
  struct ifaddrs *ifs = NULL;
  if (getifaddrs (&ifs) < 0)
    return false;
  bool own = false;
  for (struct ifaddrs *i = ifs; i && !own; i = i->ifa_next)
    {
      if (i->ifa_addr == NULL || i->ifa_addr->sa_family != sa->sa_family)
        continue;
      if (sa->sa_family == AF_INET)
        own = ((const struct sockaddr_in *)sa)->sin_addr.s_addr
              == ((const struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
      else if (sa->sa_family == AF_INET6)
        own = memcmp (&((const struct sockaddr_in6 *)sa)->sin6_addr,
                      &((const struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, 16)
              == 0;
    }
  freeifaddrs (ifs);
  return own;
}

static enum addr_class
addr_classify (const struct sockaddr *sa)
{
  uint32_t v4 = 0;
  if (sa->sa_family == AF_INET6)
    {
      const uint8_t *b = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
      static const uint8_t mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };
      static const uint8_t zero[16];
      if (memcmp (b, mapped, 12) == 0)
        v4 = (uint32_t)b[12] << 24 | (uint32_t)b[13] << 16 | (uint32_t)b[14] << 8 | b[15];
      else if (memcmp (b, zero, 15) == 0 && (b[15] == 0 || b[15] == 1))
        return ADDR_LOCAL; /* :: and ::1 */
      else if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80)
        return ADDR_LINKLOCAL;
      else
        return is_own_address (sa) ? ADDR_LOCAL : ADDR_PUBLIC;
    }
  else if (sa->sa_family == AF_INET)
    v4 = ntohl (((const struct sockaddr_in *)sa)->sin_addr.s_addr);
  else
    return ADDR_LOCAL;
  if ((v4 >> 24) == 127 || (v4 >> 24) == 0)
    return ADDR_LOCAL;
  if ((v4 >> 16) == 0xa9fe)
    return ADDR_LINKLOCAL;
  struct sockaddr_in in = { .sin_family = AF_INET, .sin_addr.s_addr = htonl (v4) };
  return is_own_address ((const struct sockaddr *)&in) ? ADDR_LOCAL : ADDR_PUBLIC;
}

/* Connect to host:port. A redirect target (r != NULL) is checked on the
 * very address connected to, so a name cannot resolve differently between
 * the check and the connection. */
static int
dial (const char *host, const char *port, const struct rref *r, wr_err_t *err)
{
  struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *res = NULL;
  int g = getaddrinfo (host, port, &hints, &res);
  if (g != 0)
    return wr_error (err, 0, WR_E_UNAVAILABLE, "cannot resolve registry host %s: %s", host,
                     gai_strerror (g));
  int fd = -1, e = 0;
  const char *refused = NULL;
  for (struct addrinfo *a = res; a; a = a->ai_next)
    {
      if (r)
        {
          enum addr_class c = addr_classify (a->ai_addr);
          if ((c == ADDR_LOCAL && !r->local_ok && !r->private_ok)
              || (c == ADDR_LINKLOCAL && !r->private_ok))
            {
              refused = c == ADDR_LOCAL ? "a loopback or local" : "a link-local";
              continue;
            }
        }
      fd = socket (a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0)
        continue;
      struct timeval tv = { .tv_sec = 60 };
      setsockopt (fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      setsockopt (fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
      if (connect (fd, a->ai_addr, a->ai_addrlen) == 0)
        break;
      e = errno;
      close (fd);
      fd = -1;
    }
  freeaddrinfo (res);
  if (fd < 0 && refused)
    return wr_error (err, EACCES, WR_E_INVALID,
                     "registry redirected to %.200s, %s address: refused (docs/images.md, "
                     "Registry pulls)",
                     host, refused);
  if (fd < 0)
    return wr_error (err, e, WR_E_UNAVAILABLE, "cannot connect to registry %s:%s", host, port);
  return fd;
}

/* The message of a registry's error body ({"errors":[{"code","message"}]}),
 * never anything else the server sent. */
static void
registry_error_text (const char *body, char *out, size_t size)
{
  out[0] = '\0';
  json_t *j = body ? json_loads (body, 0, NULL) : NULL;
  json_t *e0 = json_array_get (json_object_get (j, "errors"), 0);
  const char *code = json_string_value (json_object_get (e0, "code"));
  const char *msg = json_string_value (json_object_get (e0, "message"));
  if (code || msg)
    snprintf (out, size, ": %.40s %.200s", code ? code : "", msg ? msg : "");
  for (char *c = out; *c; c++)
    if ((unsigned char)*c < 0x20)
      *c = ' ';
  json_decref (j);
}

/* A redirect's path goes into our request line: visible ASCII only, so a
 * Location cannot smuggle headers or a second request. */
static bool
path_ok (const char *p)
{
  if (p[0] != '/')
    return false;
  for (; *p; p++)
    if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f)
      return false;
  return true;
}

/* Split an absolute http:// Location into host, port and path. */
static int
parse_location (const char *loc, char host[256], char port[8], char path[2048], wr_err_t *err)
{
  if (strncmp (loc, "http://", 7) != 0)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "registry redirects to %.200s (only plain http is supported)", loc);
  const char *hs = loc + 7;
  size_t hl = strcspn (hs, "/?#");
  char hp[256];
  if (hl == 0 || hl >= sizeof hp || memchr (hs, '@', hl))
    return wr_error (err, 0, WR_E_INVALID, "bad redirect from registry");
  memcpy (hp, hs, hl);
  hp[hl] = '\0';
  char *h = hp, *pc;
  if (hp[0] == '[')
    {
      char *close_br = strchr (hp, ']');
      if (close_br == NULL)
        return wr_error (err, 0, WR_E_INVALID, "bad redirect from registry");
      *close_br = '\0';
      h = hp + 1;
      pc = close_br[1] == ':' ? close_br + 1 : NULL;
    }
  else
    pc = strchr (hp, ':');
  if (pc)
    {
      *pc = '\0';
      if (pc[1] == '\0' || strlen (pc + 1) > 5 || strspn (pc + 1, "0123456789") != strlen (pc + 1))
        return wr_error (err, 0, WR_E_INVALID, "bad port in redirect from registry");
      snprintf (port, 8, "%s", pc + 1);
    }
  else
    strcpy (port, "80");
  if (h[0] == '\0'
      || strspn (h, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:")
             != strlen (h))
    return wr_error (err, 0, WR_E_INVALID, "bad host in redirect from registry");
  snprintf (host, 256, "%s", h);
  snprintf (path, 2048, "%s", hs[hl] == '/' ? hs + hl : "/");
  return 0;
}

/* GET path from the registry r into k, following up to 5 redirects the way
 * a registry client should: within the registry for anything, to another
 * host only for blobs (storage), and never to a loopback, local or
 * link-local address unless r allows it (dial). Only blobs and the
 * registry's own error messages are ever returned: never a body from
 * elsewhere. */
static int
http_get (const struct rref *r, const char *path0, const char *accept, struct sink *k,
          struct resp *rp, wr_err_t *err)
{
  char host[256], port[8], path[2048];
  snprintf (host, sizeof host, "%s", r->host);
  snprintf (port, sizeof port, "%s", r->port);
  snprintf (path, sizeof path, "%s", path0);
  for (int hop = 0; hop < 6; hop++)
    {
      memset (rp, 0, sizeof *rp);
      rp->length = -1;
      bool offsite = strcmp (host, r->host) != 0 || strcmp (port, r->port) != 0;
      _cleanup_close_ int fd = dial (host, port, offsite ? r : NULL, err);
      if (fd < 0)
        return fd;
      char req[4096];
      bool v6 = strchr (host, ':') != NULL;
      int n = snprintf (req, sizeof req,
                        "GET %s HTTP/1.1\r\nHost: %s%s%s:%s\r\nUser-Agent: warren\r\n"
                        "Accept: %s\r\nConnection: close\r\n\r\n",
                        path, v6 ? "[" : "", host, v6 ? "]" : "", port, accept ? accept : "*/*");
      if (n < 0 || (size_t)n >= sizeof req)
        return wr_error (err, 0, WR_E_INVALID, "registry request too long");
      if (wr_write_all (fd, req, (size_t)n) < 0)
        return wr_error (err, errno, WR_E_UNAVAILABLE, "send to registry %s", host);
      struct conn *c = malloc (sizeof *c);
      if (c == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      _cleanup_free_ struct conn *cc = c;
      c->fd = fd;
      c->off = c->len = 0;
      char line[8192];
      int e = conn_line (c, line, sizeof line, err);
      if (e < 0)
        return e;
      if (sscanf (line, "HTTP/1.%*d %d", &rp->status) != 1)
        return wr_error (err, 0, WR_E_UNAVAILABLE, "registry sent no HTTP status line");
      for (int h = 0;; h++)
        {
          if (h > 200)
            return wr_error (err, 0, WR_E_INVALID, "registry sent too many headers");
          e = conn_line (c, line, sizeof line, err);
          if (e < 0)
            return e;
          if (line[0] == '\0')
            break;
          char *colon = strchr (line, ':');
          if (colon == NULL)
            continue;
          *colon = '\0';
          char *v = colon + 1;
          while (*v == ' ' || *v == '\t')
            v++;
          if (strcasecmp (line, "content-length") == 0)
            {
              char *end;
              errno = 0;
              rp->length = strtoll (v, &end, 10);
              if (errno || end == v || rp->length < 0)
                return wr_error (err, 0, WR_E_INVALID, "registry sent a bad Content-Length");
            }
          else if (strcasecmp (line, "transfer-encoding") == 0)
            rp->chunked = strcasestr (v, "chunked") != NULL;
          else if (strcasecmp (line, "location") == 0)
            snprintf (rp->location, sizeof rp->location, "%s", v);
          else if (strcasecmp (line, "docker-content-digest") == 0)
            snprintf (rp->digest, sizeof rp->digest, "%s", v);
          else if (strcasecmp (line, "content-type") == 0)
            snprintf (rp->content_type, sizeof rp->content_type, "%s", v);
        }
      if (rp->status >= 300 && rp->status < 400 && rp->location[0])
        {
          char nhost[256], nport[8], npath[2048];
          if (rp->location[0] == '/')
            {
              snprintf (nhost, sizeof nhost, "%s", host);
              snprintf (nport, sizeof nport, "%s", port);
              snprintf (npath, sizeof npath, "%s", rp->location);
            }
          else if ((e = parse_location (rp->location, nhost, nport, npath, err)) < 0)
            return e;
          if (!path_ok (npath))
            return wr_error (err, 0, WR_E_INVALID, "bad path in redirect from registry");
          if (!k->blob && (strcmp (nhost, r->host) != 0 || strcmp (nport, r->port) != 0))
            return wr_error (err, EACCES, WR_E_INVALID,
                             "registry redirected the %s request to another host (%.200s): "
                             "refused, only blobs may live elsewhere",
                             k->what, nhost);
          memcpy (host, nhost, sizeof host);
          memcpy (port, nport, sizeof port);
          memcpy (path, npath, sizeof path);
          continue;
        }
      if (rp->status != 200)
        {
          /* a small error body, from the registry itself only */
          struct sink ek = { .fd = -1, .max = 2048, .what = "error" };
          if (!offsite && !rp->chunked && rp->length > 0 && rp->length <= 2048)
            conn_copy (c, (unsigned long long)rp->length, &ek, NULL);
          char detail[300];
          registry_error_text (ek.buf, detail, sizeof detail);
          free (ek.buf);
          const char *code = rp->status == 404   ? WR_E_NOT_FOUND
                             : rp->status == 401 ? WR_E_UNAUTHORIZED
                                                 : WR_E_UNAVAILABLE;
          e = wr_error (err, 0, code, "registry answered %d for %s%s", rp->status,
                        offsite ? k->what : path, detail);
          if (rp->status == 401)
            wr_error_wrap (err, "registry authentication is not supported");
          return e;
        }
      /* a body longer than expected is refused before it is read */
      if (rp->length >= 0 && (uint64_t)rp->length > k->max - k->len)
        return wr_error (err, EFBIG, WR_E_INVALID,
                         "registry sends %lld bytes for %s, more than the %zu expected", rp->length,
                         k->what, k->max);
      if (rp->chunked)
        {
          for (;;)
            {
              e = conn_line (c, line, sizeof line, err);
              if (e < 0)
                return e;
              char *end;
              unsigned long long sz = strtoull (line, &end, 16);
              if (end == line)
                return wr_error (err, 0, WR_E_UNAVAILABLE, "bad chunk from registry");
              if (sz == 0)
                break;
              e = conn_copy (c, sz, k, err);
              if (e < 0)
                return e;
              e = conn_line (c, line, sizeof line, err);
              if (e < 0)
                return e;
            }
          return 0;
        }
      if (rp->length >= 0)
        return conn_copy (c, (unsigned long long)rp->length, k, err);
      /* no length: until the server closes */
      for (;;)
        {
          ssize_t got = conn_fill (c);
          if (got < 0)
            return wr_error (err, (int)-got, WR_E_UNAVAILABLE, "read from registry");
          if (got == 0)
            return 0;
          e = sink_put (k, c->buf + c->off, (size_t)got, err);
          if (e < 0)
            return e;
          c->off += (size_t)got;
        }
    }
  return wr_error (err, 0, WR_E_UNAVAILABLE, "too many redirects from registry");
}

static int
check_digest (struct wr_sha256 *h, const char *want, const char *what, wr_err_t *err)
{
  uint8_t d[32];
  char hex[65];
  wr_sha256_final (h, d);
  wr_sha256_to_hex (d, hex);
  if (strncmp (want, "sha256:", 7) != 0 || strcmp (want + 7, hex) != 0)
    return wr_error (err, 0, WR_E_INVALID,
                     "digest mismatch for %s: content is sha256:%.12s..., expected %.19s...", what,
                     hex, want);
  return 0;
}

/* Fetch a manifest (by tag or digest) into memory and verify it. */
static int
get_manifest (const struct rref *r, const char *ref, const char *want_digest, json_t **ret,
              char **ret_type, wr_err_t *err)
{
  char path[1024];
  snprintf (path, sizeof path, "/v2/%s/manifests/%s", r->repo, ref);
  struct wr_sha256 h;
  wr_sha256_init (&h);
  struct sink k = { .fd = -1, .max = MAX_MANIFEST, .hash = &h, .what = "manifest" };
  struct resp rp;
  int e = http_get (r, path, accept_manifests, &k, &rp, err);
  _cleanup_free_ char *buf = k.buf;
  if (e < 0)
    return e;
  const char *want = want_digest && want_digest[0] ? want_digest : rp.digest[0] ? rp.digest : NULL;
  if (want)
    {
      e = check_digest (&h, want, "manifest", err);
      if (e < 0)
        return e;
    }
  json_error_t jerr;
  *ret = json_loadb (buf ? buf : "", k.len, 0, &jerr);
  if (*ret == NULL)
    return wr_error (err, 0, WR_E_INVALID, "registry manifest is not JSON: %s", jerr.text);
  const char *mt = json_string_value (json_object_get (*ret, "mediaType"));
  *ret_type = strdup (mt ? mt : rp.content_type);
  return 0;
}

/* ---- the fetcher ----
 *
 * Everything that talks to the registry (HTTP, redirects, manifests,
 * indexes, the config and the blobs) runs in the fetcher: a helper forked
 * from the daemon that enters new mount, pid, IPC and UTS namespaces (not
 * network: it needs the host's), pivots into a root holding only /usr, the
 * resolver's files and its staging directory, drops to the unpack helper's
 * uid with no capabilities and no_new_privs, and runs under a seccomp
 * allow-list whose sockets are AF_INET/AF_INET6 (and a NETLINK_ROUTE one
 * for the host's own addresses). It writes "config" and "layer-N" into the
 * staging directory and reports over a socket; the daemon checks what it
 * is told, re-hashes every file it takes and only then commits. */

/* what the fetcher reports: untrusted */
struct fetch_status
{
  int32_t r, errnum;
  char code[32];
  char msg[512];
};

struct fetch_meta
{
  struct fetch_status st;
  char config[72];
  uint32_t n;
  struct
  {
    char digest[72];
    int64_t size;
  } layers[WR_MAX_LAYERS];
};

/* the daemon's answer: which layers to fetch (the others are stored) */
struct fetch_plan
{
  uint8_t fetch[WR_MAX_LAYERS];
};

/* progress (done 0) and the end (done 1) */
struct fetch_note
{
  uint32_t done;
  uint64_t bytes;
  struct fetch_status st;
};

struct fetcher
{
  struct rref r;
  int dirfd; /* the staging directory */
  int sock;  /* to the daemon */
};

static int
send_all (int sock, const void *buf, size_t len)
{
  const char *p = buf;
  while (len > 0)
    {
      ssize_t n = send (sock, p, len, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        return -errno;
      p += n;
      len -= (size_t)n;
    }
  return 0;
}

static void
status_set (struct fetch_status *st, int r, const wr_err_t *err)
{
  memset (st, 0, sizeof *st);
  st->r = r < 0 ? -1 : 0;
  if (r < 0 && err)
    {
      st->errnum = err->errnum;
      snprintf (st->code, sizeof st->code, "%s", err->code ? err->code : WR_E_INTERNAL);
      snprintf (st->msg, sizeof st->msg, "%s", err->msg);
    }
}

static bool
digest_ok (const char *d)
{
  if (d == NULL || strncmp (d, "sha256:", 7) != 0 || strlen (d) != 71)
    return false;
  for (const char *c = d + 7; *c; c++)
    if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
      return false;
  return true;
}

/* fetcher: the manifest (through indexes), its layer list and its config,
 * written to "config" */
static int
fetch_meta (struct fetcher *f, struct fetch_meta *ret, wr_err_t *err)
{
  const struct rref *r = &f->r;
  _cleanup_ (json_decrefp) json_t *m = NULL;
  _cleanup_free_ char *mt = NULL;
  int e = get_manifest (r, r->digest[0] ? r->digest : r->tag, r->digest, &m, &mt, err);
  if (e < 0)
    return e;
  for (int depth = 0; json_is_array (json_object_get (m, "manifests")); depth++)
    {
      if (depth > 2)
        return wr_error (err, 0, WR_E_INVALID, "image indexes nested too deep");
      json_t *pick = NULL;
      size_t i;
      json_t *d;
      json_array_foreach (json_object_get (m, "manifests"), i, d)
      {
        json_t *pl = json_object_get (d, "platform");
        const char *os = json_string_value (json_object_get (pl, "os"));
        const char *arch = json_string_value (json_object_get (pl, "architecture"));
        if (pick == NULL
            && (pl == NULL
                || ((!os || !strcmp (os, "linux")) && (!arch || !strcmp (arch, WR_OCI_ARCH)))))
          pick = d;
      }
      const char *dg = json_string_value (json_object_get (pick, "digest"));
      if (!digest_ok (dg))
        return wr_error (err, 0, WR_E_NOT_FOUND, "no linux/%s image in the index", WR_OCI_ARCH);
      char dgc[72];
      snprintf (dgc, sizeof dgc, "%s", dg);
      json_t *next = NULL;
      free (mt);
      mt = NULL;
      e = get_manifest (r, dgc, dgc, &next, &mt, err);
      if (e < 0)
        return e;
      json_decref (m);
      m = next;
    }
  json_t *layers = json_object_get (m, "layers");
  size_t n = json_array_size (layers);
  if (!json_is_array (layers) || n == 0)
    return wr_error (err, 0, WR_E_INVALID,
                     "registry manifest has no usable layer list (schema 1 is not supported)");
  e = wr_layers_check (n, "the registry manifest", err);
  if (e < 0)
    return e;
  const char *cdg = json_string_value (json_object_get (json_object_get (m, "config"), "digest"));
  if (!digest_ok (cdg))
    return wr_error (err, 0, WR_E_INVALID, "registry manifest has no config digest");
  snprintf (ret->config, sizeof ret->config, "%s", cdg);
  ret->n = (uint32_t)n;
  for (size_t i = 0; i < n; i++)
    {
      json_t *l = json_array_get (layers, i);
      const char *dg = json_string_value (json_object_get (l, "digest"));
      json_t *szv = json_object_get (l, "size");
      if (!digest_ok (dg))
        return wr_error (err, 0, WR_E_INVALID, "layer %zu has an invalid digest", i + 1);
      if (!json_is_integer (szv) || json_integer_value (szv) <= 0)
        return wr_error (err, 0, WR_E_INVALID, "layer %zu has no size in the manifest", i + 1);
      snprintf (ret->layers[i].digest, sizeof ret->layers[i].digest, "%s", dg);
      ret->layers[i].size = json_integer_value (szv);
    }

  /* the config, to a file the daemon reads (and hashes) itself */
  char path[1024];
  snprintf (path, sizeof path, "/v2/%s/blobs/%s", r->repo, cdg);
  _cleanup_close_ int fd
      = openat (f->dirfd, "config", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return wr_sys_error (err, "create the config file");
  struct wr_sha256 h;
  wr_sha256_init (&h);
  struct sink k = { .fd = fd, .max = MAX_MANIFEST, .hash = &h, .what = "config", .blob = true };
  struct resp rp;
  e = http_get (r, path, NULL, &k, &rp, err);
  if (e < 0)
    return wr_error_wrap (err, "config");
  return check_digest (&h, cdg, "config", err);
}

struct pull
{
  const struct rref *r;
  const struct fetch_meta *meta;
  const struct fetch_plan *plan;
  int dirfd, sock;
  pthread_mutex_t lock;
  size_t next;
  bool failed;
  wr_err_t err;
  uint64_t done, last_report;
};

static void
pull_tick (void *ud, size_t n)
{
  struct pull *p = ud;
  pthread_mutex_lock (&p->lock);
  p->done += n;
  if (p->done - p->last_report >= (1u << 20))
    {
      p->last_report = p->done;
      struct fetch_note note = { .bytes = p->done };
      send_all (p->sock, &note, sizeof note);
    }
  pthread_mutex_unlock (&p->lock);
}

static int
fetch_blob (struct pull *p, size_t i, wr_err_t *err)
{
  const char *digest = p->meta->layers[i].digest;
  char name[32];
  snprintf (name, sizeof name, "layer-%zu", i);
  _cleanup_close_ int fd
      = openat (p->dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return wr_sys_error (err, "create %s", name);
  char path[1024];
  snprintf (path, sizeof path, "/v2/%s/blobs/%s", p->r->repo, digest);
  struct wr_sha256 h;
  wr_sha256_init (&h);
  char what[64];
  snprintf (what, sizeof what, "layer %zu", i + 1);
  /* never more than the manifest declares (checked against the limits) */
  int64_t want = p->meta->layers[i].size;
  struct sink k = { .fd = fd,
                    .max = (size_t)want,
                    .hash = &h,
                    .tick = pull_tick,
                    .ud = p,
                    .what = what,
                    .blob = true };
  struct resp rp;
  int r = http_get (p->r, path, NULL, &k, &rp, err);
  if (r < 0)
    return wr_error_wrap (err, "layer %zu", i + 1);
  if (k.len != (size_t)want)
    return wr_error (err, 0, WR_E_INVALID, "layer %zu is %zu bytes, the manifest says %lld", i + 1,
                     k.len, (long long)want);
  return check_digest (&h, digest, what, err);
}

static void *
pull_worker (void *arg)
{
  struct pull *p = arg;
  for (;;)
    {
      pthread_mutex_lock (&p->lock);
      size_t i = p->next;
      while (i < p->meta->n && !p->plan->fetch[i])
        i++;
      p->next = i + 1;
      bool stop = p->failed || i >= p->meta->n;
      pthread_mutex_unlock (&p->lock);
      if (stop)
        return NULL;
      wr_err_t e;
      if (fetch_blob (p, i, &e) < 0)
        {
          pthread_mutex_lock (&p->lock);
          if (!p->failed)
            {
              p->failed = true;
              p->err = e;
            }
          pthread_mutex_unlock (&p->lock);
          return NULL;
        }
    }
}

/* The fetcher's whole conversation with the daemon. */
static void *
fetcher_main (void *arg)
{
  struct fetcher *f = arg;
  struct fetch_meta *meta = calloc (1, sizeof *meta);
  if (meta == NULL)
    return NULL;
  wr_err_t err = { 0 };
  int r = fetch_meta (f, meta, &err);
  status_set (&meta->st, r, &err);
  struct fetch_plan plan;
  if (send_all (f->sock, meta, sizeof *meta) < 0 || r < 0
      || wr_read_all (f->sock, &plan, sizeof plan) != (ssize_t)sizeof plan)
    {
      free (meta);
      return NULL;
    }
  struct pull p = { .r = &f->r, .meta = meta, .plan = &plan, .dirfd = f->dirfd, .sock = f->sock };
  pthread_mutex_init (&p.lock, NULL);
  size_t todo = 0;
  for (size_t i = 0; i < meta->n; i++)
    todo += plan.fetch[i] != 0;
  pthread_t th[PULL_THREADS];
  size_t nth = todo < PULL_THREADS ? todo : PULL_THREADS, started = 0;
  for (size_t t = 0; t < nth; t++)
    if (pthread_create (&th[t], NULL, pull_worker, &p) == 0)
      started++;
  if (started == 0 && todo > 0)
    pull_worker (&p);
  for (size_t t = 0; t < started; t++)
    pthread_join (th[t], NULL);
  pthread_mutex_destroy (&p.lock);
  struct fetch_note note = { .done = 1, .bytes = p.done };
  status_set (&note.st, p.failed ? -1 : 0, &p.err);
  send_all (f->sock, &note, sizeof note);
  free (meta);
  return NULL;
}

static int
fetcher_syscalls (void)
{
  static const int allowed[]
      = { SCMP_SYS (read),
          SCMP_SYS (write),
          SCMP_SYS (pread64),
          SCMP_SYS (readv),
          SCMP_SYS (writev),
          SCMP_SYS (lseek),
          SCMP_SYS (openat),
          SCMP_SYS (close),
          SCMP_SYS (fstat),
          SCMP_SYS (newfstatat),
          SCMP_SYS (statx),
          SCMP_SYS (fcntl),
          SCMP_SYS (faccessat),
          SCMP_SYS (faccessat2),
          SCMP_SYS (readlinkat),
          SCMP_SYS (getdents64),
          SCMP_SYS (mmap),
          SCMP_SYS (munmap),
          SCMP_SYS (mremap),
          SCMP_SYS (mprotect),
          SCMP_SYS (brk),
          SCMP_SYS (madvise),
          SCMP_SYS (futex),
          SCMP_SYS (set_robust_list),
          SCMP_SYS (rseq),
          SCMP_SYS (exit),
          SCMP_SYS (exit_group),
          SCMP_SYS (rt_sigreturn),
          SCMP_SYS (rt_sigprocmask),
          SCMP_SYS (clock_gettime),
          SCMP_SYS (clock_nanosleep),
          SCMP_SYS (nanosleep),
          SCMP_SYS (gettid),
          SCMP_SYS (getpid),
          SCMP_SYS (getrandom),
          SCMP_SYS (sched_yield),
          SCMP_SYS (sched_getaffinity),
          SCMP_SYS (getuid),
          SCMP_SYS (geteuid),
          SCMP_SYS (getgid),
          SCMP_SYS (getegid),
          SCMP_SYS (uname),
          SCMP_SYS (prlimit64),
          SCMP_SYS (connect),
          SCMP_SYS (bind),
          SCMP_SYS (getsockname),
          SCMP_SYS (getpeername),
          SCMP_SYS (setsockopt),
          SCMP_SYS (getsockopt),
          SCMP_SYS (sendto),
          SCMP_SYS (recvfrom),
          SCMP_SYS (sendmsg),
          SCMP_SYS (recvmsg),
          SCMP_SYS (sendmmsg),
          SCMP_SYS (poll),
          SCMP_SYS (ppoll),
          SCMP_SYS (shutdown),
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__)
          SCMP_SYS (sigaltstack),
#endif
        };
  scmp_filter_ctx ctx = seccomp_init (SCMP_ACT_KILL_PROCESS);
  if (ctx == NULL)
    return -ENOMEM;
  int r = 0;
  for (size_t i = 0; i < WR_ARRAY_SIZE (allowed) && r == 0; i++)
    if (allowed[i] >= 0)
      r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, allowed[i], 0);
  /* the network: IPv4 and IPv6 sockets, and the route netlink getifaddrs
   * reads the host's own addresses with; nscd's unix socket is refused
   * (the resolver then asks DNS itself) */
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, SCMP_SYS (socket), 1,
                          SCMP_A0 (SCMP_CMP_EQ, AF_INET));
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, SCMP_SYS (socket), 1,
                          SCMP_A0 (SCMP_CMP_EQ, AF_INET6));
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, SCMP_SYS (socket), 2,
                          SCMP_A0 (SCMP_CMP_EQ, AF_NETLINK), SCMP_A2 (SCMP_CMP_EQ, NETLINK_ROUTE));
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EACCES), SCMP_SYS (socket), 1,
                          SCMP_A0 (SCMP_CMP_EQ, AF_UNIX));
  /* threads only (pthread_create falls back from clone3 to clone) */
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, SCMP_SYS (clone), 1,
                          SCMP_A0 (SCMP_CMP_MASKED_EQ, CLONE_THREAD, CLONE_THREAD));
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (ENOSYS), SCMP_SYS (clone3), 0);
  if (r == 0)
    r = seccomp_load (ctx);
  seccomp_release (ctx);
  return r;
}

/* The forked fetcher: fd 3 is its socket, everything else of the daemon's
 * is closed. Returns only in the parent. */
static pid_t
fetcher_spawn (struct fetcher *f, int sock, const char *workdir, const char *jaildir, uid_t uid)
{
  /* the resolver's files (resolv.conf may be a link into /run) */
  char resolv[PATH_MAX];
  bool linked = realpath ("/etc/resolv.conf", resolv) != NULL;
  struct wr_jail j = { .uid = uid,
                       .gid = uid,
                       .root = jaildir,
                       .state_dir = workdir,
                       .ro = { "/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf",
                               "/etc/host.conf", "/etc/gai.conf" },
                       .n_ro = 5 };
  if (linked && strcmp (resolv, "/etc/resolv.conf") != 0)
    j.ro[j.n_ro++] = resolv;
  pid_t pid = fork ();
  if (pid != 0)
    return pid;
  prctl (PR_SET_PDEATHSIG, SIGKILL);
  int devnull = open ("/dev/null", O_RDWR);
  if (devnull < 0 || dup2 (devnull, 0) < 0 || dup2 (devnull, 1) < 0 || dup2 (devnull, 2) < 0
      || dup2 (sock, 3) < 0)
    _exit (2);
  close_range (4, ~0u, 0);
  if (unshare (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS) < 0)
    _exit (2);
  /* PID 1 of its own pid namespace: its /proc shows nothing else */
  pid_t child = fork ();
  if (child < 0)
    _exit (2);
  if (child == 0)
    {
      prctl (PR_SET_PDEATHSIG, SIGKILL);
      f->sock = 3;
      if (wr_jail_enter (&j) < 0 || prctl (PR_SET_DUMPABLE, 0) < 0
          || (f->dirfd = open (".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0
          || fetcher_syscalls () < 0)
        _exit (3);
      fetcher_main (f);
      _exit (0);
    }
  close (3);
  int status;
  while (waitpid (child, &status, 0) < 0)
    if (errno != EINTR)
      _exit (2);
  _exit (WIFSIGNALED (status) ? 100 + WTERMSIG (status) : WEXITSTATUS (status));
}

/* daemon: read the fetcher's config file, check it is the config the
 * manifest names, parse it */
static int
load_config (int dirfd, const char *digest, json_t **ret, wr_err_t *err)
{
  _cleanup_close_ int fd = openat (dirfd, "config", O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  struct stat st;
  if (fd < 0 || fstat (fd, &st) < 0 || !S_ISREG (st.st_mode) || st.st_size > MAX_MANIFEST)
    return wr_error (err, 0, WR_E_INVALID, "the registry fetcher left no usable image config");
  _cleanup_free_ char *buf = malloc ((size_t)st.st_size + 1);
  if (buf == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  if (wr_read_all (fd, buf, (size_t)st.st_size) != (ssize_t)st.st_size)
    return wr_sys_error (err, "read the image config");
  struct wr_sha256 h;
  wr_sha256_init (&h);
  wr_sha256_update (&h, buf, (size_t)st.st_size);
  int e = check_digest (&h, digest, "config", err);
  if (e < 0)
    return e;
  json_error_t jerr;
  *ret = json_loadb (buf, (size_t)st.st_size, 0, &jerr);
  if (*ret == NULL)
    return wr_error (err, 0, WR_E_INVALID, "image config is not JSON: %s", jerr.text);
  return 0;
}

/* daemon: take a blob the fetcher wrote, if it is what the manifest says:
 * our own hash, never the fetcher's word */
static int
take_blob (int dirfd, size_t i, const char *digest, int64_t size, wr_err_t *err)
{
  char name[32];
  snprintf (name, sizeof name, "layer-%zu", i);
  _cleanup_close_ int fd = openat (dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  struct stat st;
  if (fd < 0 || fstat (fd, &st) < 0 || !S_ISREG (st.st_mode) || st.st_nlink != 1)
    return wr_error (err, 0, WR_E_INVALID, "the registry fetcher left no usable layer %zu", i + 1);
  if (st.st_size != size)
    return wr_error (err, 0, WR_E_INVALID, "layer %zu is %lld bytes, the manifest says %lld", i + 1,
                     (long long)st.st_size, (long long)size);
  /* ours from now on: nothing of the fetcher's uid may change it */
  if (fchown (fd, 0, 0) < 0 || fchmod (fd, 0400) < 0)
    return wr_sys_error (err, "take layer %zu", i + 1);
  char hex[65];
  int r = wr_sha256_fd (fd, hex);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "hash layer %zu", i + 1);
  if (strcmp (hex, digest + 7) != 0)
    return wr_error (err, 0, WR_E_INVALID,
                     "digest mismatch for layer %zu: content is sha256:%.12s..., expected "
                     "%.19s...",
                     i + 1, hex, digest);
  return TAKE_FD (fd);
}

/* daemon: the fetcher's report is untrusted; check what we act on */
static int
meta_check (struct fetch_meta *m, wr_err_t *err)
{
  m->st.code[sizeof m->st.code - 1] = '\0';
  m->st.msg[sizeof m->st.msg - 1] = '\0';
  m->config[sizeof m->config - 1] = '\0';
  if (m->st.r < 0)
    {
      wr_error (err, m->st.errnum > 0 && m->st.errnum < 4096 ? m->st.errnum : 0,
                wr_unpack_code (m->st.code), "%s", m->st.msg);
      if (err)
        snprintf (err->msg, sizeof err->msg, "%s", m->st.msg);
      return -1;
    }
  int e = wr_layers_check (m->n, "the registry manifest", err);
  if (e < 0)
    return e;
  if (m->n == 0 || !digest_ok (m->config))
    return wr_error (err, 0, WR_E_INVALID, "the registry fetcher sent a bad layer list");
  for (size_t i = 0; i < m->n; i++)
    {
      m->layers[i].digest[sizeof m->layers[i].digest - 1] = '\0';
      if (!digest_ok (m->layers[i].digest) || m->layers[i].size <= 0)
        return wr_error (err, 0, WR_E_INVALID, "layer %zu has an invalid digest or size", i + 1);
    }
  return 0;
}

struct pull_run
{
  pid_t pid;        /* the forked fetcher, or 0 */
  pthread_t thread; /* in-process (fuzzing) */
  bool threaded;
  int sock;
  struct fetcher f;
};

static int
run_wait (struct pull_run *run, bool kill_it)
{
  if (run->sock >= 0)
    close (run->sock);
  run->sock = -1;
  if (run->threaded)
    pthread_join (run->thread, NULL);
  run->threaded = false;
  /* the thread's ends (in the forked case they live in the child only) */
  if (run->f.dirfd >= 0)
    close (run->f.dirfd);
  if (run->f.sock >= 0)
    close (run->f.sock);
  run->f.dirfd = run->f.sock = -1;
  if (run->pid <= 0)
    return 0;
  if (kill_it)
    kill (run->pid, SIGKILL);
  int status = 0;
  while (waitpid (run->pid, &status, 0) < 0)
    if (errno != EINTR)
      break;
  run->pid = 0;
  return WIFEXITED (status) ? WEXITSTATUS (status) : 128;
}

/* daemon: the fetcher ended without a word */
static int
fetcher_died (struct pull_run *run, wr_err_t *err)
{
  int code = run_wait (run, true);
  if (code > 100)
    return wr_error (err, 0, WR_E_INVALID, "the registry fetcher was killed by signal %d%s",
                     code - 100,
                     code - 100 == SIGSYS ? " (a call outside its seccomp filter)" : "");
  return wr_error (err, 0, WR_E_INTERNAL, "the registry fetcher failed (status %d)", code);
}

static int
pull_in (struct wr_store *s, struct pull_run *run, int wfd, const char *target,
         const struct wr_store_limits *lim, wr_progress_fn progress, void *ud,
         struct wr_image **ret, wr_err_t *err)
{
  _cleanup_free_ struct fetch_meta *m = calloc (1, sizeof *m);
  if (m == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  if (wr_read_all (run->sock, m, sizeof *m) != (ssize_t)sizeof *m)
    return fetcher_died (run, err);
  int e = meta_check (m, err);
  if (e < 0)
    return e;
  _cleanup_ (json_decrefp) json_t *config = NULL;
  e = load_config (wfd, m->config, &config, err);
  if (e < 0)
    return e;

  /* layers already stored are not fetched */
  struct fetch_plan plan = { { 0 } };
  uint64_t total = 0;
  for (size_t i = 0; i < m->n; i++)
    {
      char have[72];
      if (wr_blob_layer (s, m->layers[i].digest, have, NULL) == 1)
        continue;
      uint64_t sz = (uint64_t)m->layers[i].size;
      if (lim->layer_bytes && sz > lim->layer_bytes)
        return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                         "layer %zu is %llu bytes, more than the %llu allowed (docs/images.md, "
                         "Limits)",
                         i + 1, (unsigned long long)sz, (unsigned long long)lim->layer_bytes);
      total += sz;
      if (lim->image_bytes && total > lim->image_bytes)
        return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                         "the image's layers are more than the %llu bytes allowed "
                         "(docs/images.md, Limits)",
                         (unsigned long long)lim->image_bytes);
      plan.fetch[i] = 1;
    }
  if (send_all (run->sock, &plan, sizeof plan) < 0)
    return fetcher_died (run, err);
  struct fetch_note note;
  for (;;)
    {
      if (wr_read_all (run->sock, &note, sizeof note) != (ssize_t)sizeof note)
        return fetcher_died (run, err);
      if (progress)
        progress (ud, "download", note.bytes < total ? note.bytes : total, total);
      if (note.done)
        break;
    }
  note.st.code[sizeof note.st.code - 1] = '\0';
  note.st.msg[sizeof note.st.msg - 1] = '\0';
  if (note.st.r < 0)
    {
      wr_error (err, note.st.errnum > 0 && note.st.errnum < 4096 ? note.st.errnum : 0,
                wr_unpack_code (note.st.code), "%s", note.st.msg);
      if (err)
        snprintf (err->msg, sizeof err->msg, "%s", note.st.msg);
      return -1;
    }
  /* gone before we look at what it wrote */
  run_wait (run, false);

  int fds[WR_MAX_LAYERS];
  const char *blobs[WR_MAX_LAYERS];
  for (size_t i = 0; i < m->n; i++)
    {
      fds[i] = -1;
      blobs[i] = m->layers[i].digest;
    }
  e = 0;
  for (size_t i = 0; i < m->n && e == 0; i++)
    if (plan.fetch[i])
      {
        fds[i] = take_blob (wfd, i, m->layers[i].digest, m->layers[i].size, err);
        e = fds[i] < 0 ? fds[i] : 0;
      }
  if (e == 0)
    e = wr_oci_commit (s, target, config, fds, blobs, m->n, progress, ud, ret, err);
  for (size_t i = 0; i < m->n; i++)
    if (fds[i] >= 0)
      close (fds[i]);
  return e;
}

static void
rm_tmpdir (char *dir)
{
  if (dir[0] == '\0')
    return;
  char *slash = strrchr (dir, '/');
  *slash = '\0';
  _cleanup_close_ int pfd = open (dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd >= 0)
    wr_rm_rf_at (pfd, slash + 1);
  *slash = '/';
}

int
wr_image_pull (struct wr_store *s, const char *refstr, const char *name, bool insecure,
               wr_progress_fn progress, void *ud, struct wr_image **ret, wr_err_t *err)
{
  struct pull_run run = { .sock = -1, .f = { .dirfd = -1, .sock = -1 } };
  int e = rref_parse (refstr, &run.f.r, err);
  if (e < 0)
    return e;
  struct rref *r = &run.f.r;
  if (!insecure)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "pulls use plain HTTP (TLS is not built in): set \"insecure\" for a "
                     "registry you trust on this network");
  char target[512];
  if (name && name[0])
    snprintf (target, sizeof target, "%s", name);
  else
    snprintf (target, sizeof target, "%s:%s", r->repo, r->tag[0] ? r->tag : "latest");
  if (!wr_ref_valid (target) || strchr (target, '@'))
    return wr_error (err, 0, WR_E_INVALID, "invalid local image name '%.300s'", target);

  struct wr_store_limits lim;
  wr_store_get_limits (s, &lim);
  struct wr_extract_limits xlim;
  wr_store_extract_limits (s, false, &xlim);
  r->private_ok = lim.private_redirects;
  r->local_ok = host_is_loopback (r->host, r->port);
  if (progress)
    progress (ud, "manifest", 0, 1);

  char workdir[4096] = "", jaildir[4096] = "";
  e = wr_store_tmpdir (s, "pull", workdir, sizeof workdir, err);
  if (e < 0)
    return e;
  _cleanup_close_ int wfd = open (workdir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  uid_t uid = wr_unpack_uid_base ();
  int sp[2] = { -1, -1 };
  if (wfd < 0)
    e = wr_sys_error (err, "open %s", workdir);
  else if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
    e = wr_sys_error (err, "socketpair");
  else if (xlim.in_process)
    {
      /* fuzzing: the same conversation with a thread of ours */
      run.sock = sp[0];
      run.f.sock = sp[1];
      run.f.dirfd = fcntl (wfd, F_DUPFD_CLOEXEC, 3);
      run.threaded = pthread_create (&run.thread, NULL, fetcher_main, &run.f) == 0;
      if (!run.threaded)
        e = wr_error (err, EAGAIN, WR_E_INTERNAL, "cannot start the registry fetcher");
    }
  else if (fchown (wfd, uid, uid) < 0)
    e = wr_sys_error (err, "hand %s to the registry fetcher", workdir);
  else if ((e = wr_store_tmpdir (s, "pulljail", jaildir, sizeof jaildir, err)) == 0)
    {
      run.sock = sp[0];
      run.pid = fetcher_spawn (&run.f, sp[1], workdir, jaildir, uid);
      close (sp[1]);
      if (run.pid < 0)
        e = wr_sys_error (err, "fork the registry fetcher");
    }
  if (run.sock < 0)
    {
      if (sp[0] >= 0)
        close (sp[0]);
      if (sp[1] >= 0 && !xlim.in_process)
        close (sp[1]);
    }
  if (e == 0)
    e = pull_in (s, &run, wfd, target, &lim, progress, ud, ret, err);
  run_wait (&run, true);
  rm_tmpdir (workdir);
  rm_tmpdir (jaildir);
  return e;
}
