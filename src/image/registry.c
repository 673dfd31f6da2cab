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
#include <pthread.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>

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

/* ---- parallel layer fetch ---- */

struct pull
{
  const struct rref *r;
  struct wr_store *s;
  json_t *layers;
  size_t n;
  int *fds;
  const char **blobs;
  char workdir[4096];
  pthread_mutex_t lock;
  size_t next;
  bool failed;
  wr_err_t err;
  uint64_t done, total;
  wr_progress_fn progress;
  void *ud;
  uint64_t last_report;
};

static void
pull_tick (void *ud, size_t n)
{
  struct pull *p = ud;
  pthread_mutex_lock (&p->lock);
  p->done += n;
  if (p->progress && (p->done - p->last_report >= (1u << 20) || p->done == p->total))
    {
      p->last_report = p->done;
      p->progress (p->ud, "download", p->done, p->total);
    }
  pthread_mutex_unlock (&p->lock);
}

static int
fetch_blob (struct pull *p, size_t i, wr_err_t *err)
{
  const char *digest = p->blobs[i];
  char file[4200];
  snprintf (file, sizeof file, "%s/%zu", p->workdir, i);
  int fd = open (file, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return wr_sys_error (err, "create %s", file);
  p->fds[i] = fd;
  char path[1024];
  snprintf (path, sizeof path, "/v2/%s/blobs/%s", p->r->repo, digest);
  struct wr_sha256 h;
  wr_sha256_init (&h);
  char what[64];
  snprintf (what, sizeof what, "layer %zu", i + 1);
  /* never more than the manifest declares (checked against the limits) */
  json_int_t want = json_integer_value (json_object_get (json_array_get (p->layers, i), "size"));
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
      while (i < p->n && p->fds[i] != -1)
        i++;
      p->next = i + 1;
      bool stop = p->failed || i >= p->n;
      if (!stop)
        p->fds[i] = -3; /* claimed */
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

int
wr_image_pull (struct wr_store *s, const char *refstr, const char *name, bool insecure,
               wr_progress_fn progress, void *ud, struct wr_image **ret, wr_err_t *err)
{
  struct rref r;
  int e = rref_parse (refstr, &r, err);
  if (e < 0)
    return e;
  if (!insecure)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "pulls use plain HTTP (TLS is not built in): set \"insecure\" for a "
                     "registry you trust on this network");
  char target[512];
  if (name && name[0])
    snprintf (target, sizeof target, "%s", name);
  else
    snprintf (target, sizeof target, "%s:%s", r.repo, r.tag[0] ? r.tag : "latest");
  if (!wr_ref_valid (target) || strchr (target, '@'))
    return wr_error (err, 0, WR_E_INVALID, "invalid local image name '%.300s'", target);

  struct wr_store_limits lim;
  wr_store_get_limits (s, &lim);
  r.private_ok = lim.private_redirects;
  r.local_ok = host_is_loopback (r.host, r.port);
  if (progress)
    progress (ud, "manifest", 0, 1);
  _cleanup_ (json_decrefp) json_t *m = NULL;
  _cleanup_free_ char *mt = NULL;
  e = get_manifest (&r, r.digest[0] ? r.digest : r.tag, r.digest, &m, &mt, err);
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
      if (dg == NULL || strncmp (dg, "sha256:", 7) != 0 || strlen (dg) != 71)
        return wr_error (err, 0, WR_E_NOT_FOUND, "no linux/%s image in the index", WR_OCI_ARCH);
      char dgc[72];
      snprintf (dgc, sizeof dgc, "%s", dg);
      json_t *next = NULL;
      free (mt);
      mt = NULL;
      e = get_manifest (&r, dgc, dgc, &next, &mt, err);
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
  if (cdg == NULL || strncmp (cdg, "sha256:", 7) != 0 || strlen (cdg) != 71)
    return wr_error (err, 0, WR_E_INVALID, "registry manifest has no config digest");

  /* config */
  _cleanup_ (json_decrefp) json_t *config = NULL;
  {
    char path[1024];
    snprintf (path, sizeof path, "/v2/%s/blobs/%s", r.repo, cdg);
    struct wr_sha256 h;
    wr_sha256_init (&h);
    struct sink k = { .fd = -1, .max = MAX_MANIFEST, .hash = &h, .what = "config", .blob = true };
    struct resp rp;
    e = http_get (&r, path, NULL, &k, &rp, err);
    _cleanup_free_ char *buf = k.buf;
    if (e < 0)
      return wr_error_wrap (err, "config");
    e = check_digest (&h, cdg, "config", err);
    if (e < 0)
      return e;
    json_error_t jerr;
    config = json_loadb (buf ? buf : "", k.len, 0, &jerr);
    if (config == NULL)
      return wr_error (err, 0, WR_E_INVALID, "image config is not JSON: %s", jerr.text);
  }

  /* layers: skip the ones already stored, fetch the rest in parallel */
  struct pull p = { .r = &r, .s = s, .layers = layers, .n = n, .progress = progress, .ud = ud };
  int fds[WR_MAX_LAYERS];
  const char *blobs[WR_MAX_LAYERS];
  p.fds = fds;
  p.blobs = blobs;
  size_t todo = 0;
  for (size_t i = 0; i < n; i++)
    {
      json_t *l = json_array_get (layers, i);
      blobs[i] = json_string_value (json_object_get (l, "digest"));
      if (blobs[i] == NULL || strncmp (blobs[i], "sha256:", 7) != 0 || strlen (blobs[i]) != 71)
        return wr_error (err, 0, WR_E_INVALID, "layer %zu has an invalid digest", i + 1);
      for (const char *c = blobs[i] + 7; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
          return wr_error (err, 0, WR_E_INVALID, "layer %zu has an invalid digest", i + 1);
      /* the key was hashed from the blob's bytes when it was stored */
      char have[72];
      fds[i] = wr_blob_layer (s, blobs[i], have, NULL) == 1 ? -2 : -1;
      if (fds[i] == -1)
        {
          todo++;
          json_t *szv = json_object_get (l, "size");
          json_int_t sz = json_integer_value (szv);
          if (!json_is_integer (szv) || sz <= 0)
            return wr_error (err, 0, WR_E_INVALID, "layer %zu has no size in the manifest", i + 1);
          if (lim.layer_bytes && (uint64_t)sz > lim.layer_bytes)
            return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                             "layer %zu is %lld bytes, more than the %llu allowed (docs/images.md, "
                             "Limits)",
                             i + 1, (long long)sz, (unsigned long long)lim.layer_bytes);
          p.total += (uint64_t)sz;
          if (lim.image_bytes && p.total > lim.image_bytes)
            return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                             "the image's layers are more than the %llu bytes allowed "
                             "(docs/images.md, Limits)",
                             (unsigned long long)lim.image_bytes);
        }
    }
  e = wr_store_tmpdir (s, "pull", p.workdir, sizeof p.workdir, err);
  if (e < 0)
    return e;
  pthread_mutex_init (&p.lock, NULL);
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
  if (p.failed)
    {
      if (err)
        *err = p.err;
      e = -EIO;
    }
  else
    {
      for (size_t i = 0; i < n; i++)
        if (fds[i] == -2)
          fds[i] = -1; /* already stored: wr_oci_commit looks it up */
      e = wr_oci_commit (s, target, config, fds, blobs, n, progress, ud, ret, err);
    }
  for (size_t i = 0; i < n; i++)
    if (fds[i] >= 0)
      close (fds[i]);
  char *slash = strrchr (p.workdir, '/');
  *slash = '\0';
  _cleanup_close_ int pfd = open (p.workdir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd >= 0)
    wr_rm_rf_at (pfd, slash + 1);
  return e;
}
