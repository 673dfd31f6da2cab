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
#include <curl/curl.h>

#include "../backend/jail.h"
#include "../common/b64.h"
#include "../common/util.h"
#include "internal.h"
#include "sha256.h"

#define MAX_MANIFEST (4u << 20)
#define PULL_THREADS 4
/* a Warren layer as pushed: the store's EROFS file (docs/images.md, Push) */
#define WARREN_EROFS_TYPE "application/vnd.warren.layer.v1.erofs"
#define OCI_MANIFEST_TYPE "application/vnd.oci.image.manifest.v1+json"

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
  bool tls;               /* https (else "insecure": plain http) */
  char ca_file[PATH_MAX]; /* extra trusted CAs (--registry-ca), or "" */
  struct rauth *auth;     /* credentials and token, shared by the threads */
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

/* ---- HTTP (libcurl) ----
 *
 * libcurl does the wire (TLS, proxies from the environment, chunked and
 * sized bodies); we keep the policy: redirects are followed by hand so each
 * hop is checked (opensocket_cb sees the very address connected to), the
 * registry's credentials never leave the registry, bodies are capped at
 * their declared size and only the registry's own error text is quoted. */

/* The credentials and the token of one pull or push, shared by its threads. */
struct rauth
{
  pthread_mutex_t lock;
  char basic[1024];  /* "user:password" for the registry, or "" */
  char bearer[8192]; /* the token service's last token, or "" */
};

struct resp
{
  int status;
  char location[2048]; /* as sent (push: the upload URL) */
  char digest[80];
  char content_type[256];
  char www_auth[1024];
  long long length; /* -1: unknown */
  char detail[300]; /* the registry's own error text, or "" */
};

struct sink
{
  int fd;          /* >= 0: write here */
  char *buf;       /* else: accumulate */
  size_t len, max; /* bytes received; more than max is an error, never read */
  struct wr_sha256 *hash;
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

/* A redirect's path: visible ASCII only. */
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

/* Testing (the fuzzer): every connection goes to this "::HOST:PORT". */
static const char *registry_connect_to;

/* One request on the wire; the callbacks' state. */
struct xfer
{
  struct resp *rp;
  struct sink *k; /* a 2xx body */
  struct sink ek; /* an error body: small, and from the registry itself only */
  bool offsite;   /* not the registry: storage or a token service */
  const struct rref *policy;
  const char *refused;
  wr_err_t *err;
  bool sink_failed, len_checked;
  /* an upload body: body_fd from body_off, or body */
  int body_fd;
  uint64_t body_off, body_len, body_sent;
  const char *body;
};

static size_t
header_cb (char *b, size_t sz, size_t n, void *ud)
{
  struct xfer *x = ud;
  size_t len = sz * n;
  char line[2048];
  size_t l = len < sizeof line - 1 ? len : sizeof line - 1;
  memcpy (line, b, l);
  line[l] = '\0';
  line[strcspn (line, "\r\n")] = '\0';
  struct resp *rp = x->rp;
  if (strncmp (line, "HTTP/", 5) == 0)
    {
      /* a new response (after 100 Continue, or a proxy's CONNECT) */
      memset (rp, 0, sizeof *rp);
      rp->length = -1;
      sscanf (line, "HTTP/%*s %d", &rp->status);
      return len;
    }
  char *colon = strchr (line, ':');
  if (colon == NULL)
    return len;
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
        rp->length = -1;
    }
  else if (strcasecmp (line, "location") == 0)
    snprintf (rp->location, sizeof rp->location, "%s", v);
  else if (strcasecmp (line, "docker-content-digest") == 0)
    snprintf (rp->digest, sizeof rp->digest, "%s", v);
  else if (strcasecmp (line, "content-type") == 0)
    snprintf (rp->content_type, sizeof rp->content_type, "%s", v);
  else if (strcasecmp (line, "www-authenticate") == 0)
    snprintf (rp->www_auth, sizeof rp->www_auth, "%s", v);
  return len;
}

static size_t
write_cb (char *p, size_t sz, size_t n, void *ud)
{
  struct xfer *x = ud;
  size_t len = sz * n;
  int st = x->rp->status;
  if (st >= 200 && st < 300 && x->k)
    {
      struct sink *k = x->k;
      /* a body longer than expected is refused before it is read */
      if (!x->len_checked && x->rp->length >= 0 && (uint64_t)x->rp->length > k->max - k->len)
        {
          wr_error (x->err, EFBIG, WR_E_INVALID,
                    "registry sends %lld bytes for %s, more than the %zu expected", x->rp->length,
                    k->what, k->max);
          x->sink_failed = true;
          return 0;
        }
      x->len_checked = true;
      if (sink_put (k, p, len, x->err) < 0)
        {
          x->sink_failed = true;
          return 0;
        }
      return len;
    }
  if ((st < 300 || st >= 400) && !x->offsite && x->ek.len + len <= x->ek.max)
    sink_put (&x->ek, p, len, NULL);
  return len;
}

static size_t
read_cb (char *buf, size_t sz, size_t n, void *ud)
{
  struct xfer *x = ud;
  size_t want = sz * n;
  uint64_t left = x->body_len - x->body_sent;
  if (want > left)
    want = (size_t)left;
  if (want == 0)
    return 0;
  if (x->body)
    memcpy (buf, x->body + x->body_sent, want);
  else
    {
      ssize_t r;
      do
        r = pread (x->body_fd, buf, want, (off_t)(x->body_off + x->body_sent));
      while (r < 0 && errno == EINTR);
      if (r <= 0)
        return CURL_READFUNC_ABORT;
      want = (size_t)r;
    }
  x->body_sent += want;
  return want;
}

/* Every connection: an offsite hop may not reach a loopback, local or
 * link-local address unless the pull's policy allows it. */
static curl_socket_t
opensocket_cb (void *ud, curlsocktype purpose, struct curl_sockaddr *a)
{
  struct xfer *x = ud;
  (void)purpose;
  if (x->offsite && x->policy)
    {
      enum addr_class c = addr_classify (&a->addr);
      if ((c == ADDR_LOCAL && !x->policy->local_ok && !x->policy->private_ok)
          || (c == ADDR_LINKLOCAL && !x->policy->private_ok))
        {
          x->refused = c == ADDR_LOCAL ? "a loopback or local" : "a link-local";
          return CURL_SOCKET_BAD;
        }
    }
  return socket (a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

struct hreq
{
  const char *method; /* GET (NULL), HEAD, POST, PUT, PATCH */
  const char *accept;
  const char *ctype;
  int body_fd; /* >= 0: upload body_len bytes from body_off */
  uint64_t body_off, body_len;
  const char *body;           /* or these */
  const char *bearer, *basic; /* credentials for this URL (the registry only) */
};

/* One request to url, no redirect followed; rp says what came back. A
 * transport failure (DNS, connect, TLS, a refused address, a sink error)
 * is an error; any HTTP status is not. */
static int
http_once (const struct rref *r, const char *url, bool offsite, const struct hreq *q,
           struct sink *k, struct resp *rp, wr_err_t *err)
{
  struct xfer x = { .rp = rp,
                    .k = k,
                    .ek = { .fd = -1, .max = 2048, .what = "error" },
                    .offsite = offsite,
                    .policy = r,
                    .err = err,
                    .body_fd = q->body_fd,
                    .body_off = q->body_off,
                    .body_len = q->body ? strlen (q->body) : q->body_len,
                    .body = q->body };
  memset (rp, 0, sizeof *rp);
  rp->length = -1;
  CURL *c = curl_easy_init ();
  if (c == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "curl_easy_init");
  char errbuf[CURL_ERROR_SIZE] = "";
  struct curl_slist *hs = NULL, *ct = NULL;
  char h[8300];
  snprintf (h, sizeof h, "Accept: %s", q->accept ? q->accept : "*/*");
  hs = curl_slist_append (hs, h);
  hs = curl_slist_append (hs, "Expect:");
  if (q->ctype)
    {
      snprintf (h, sizeof h, "Content-Type: %s", q->ctype);
      hs = curl_slist_append (hs, h);
    }
  if (q->bearer && q->bearer[0])
    {
      snprintf (h, sizeof h, "Authorization: Bearer %s", q->bearer);
      hs = curl_slist_append (hs, h);
    }
  else if (q->basic && q->basic[0])
    {
      curl_easy_setopt (c, CURLOPT_HTTPAUTH, (long)CURLAUTH_BASIC);
      curl_easy_setopt (c, CURLOPT_USERPWD, q->basic);
    }
  if (registry_connect_to)
    ct = curl_slist_append (ct, registry_connect_to);
  curl_easy_setopt (c, CURLOPT_URL, url);
  curl_easy_setopt (c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt (c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt (c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt (c, CURLOPT_CONNECTTIMEOUT, 60L);
  curl_easy_setopt (c, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt (c, CURLOPT_LOW_SPEED_TIME, 60L);
  curl_easy_setopt (c, CURLOPT_USERAGENT, "warren");
  curl_easy_setopt (c, CURLOPT_HTTPHEADER, hs);
  curl_easy_setopt (c, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt (c, CURLOPT_HEADERFUNCTION, header_cb);
  curl_easy_setopt (c, CURLOPT_HEADERDATA, &x);
  curl_easy_setopt (c, CURLOPT_WRITEFUNCTION, write_cb);
  curl_easy_setopt (c, CURLOPT_WRITEDATA, &x);
  curl_easy_setopt (c, CURLOPT_OPENSOCKETFUNCTION, opensocket_cb);
  curl_easy_setopt (c, CURLOPT_OPENSOCKETDATA, &x);
  if (ct)
    curl_easy_setopt (c, CURLOPT_CONNECT_TO, ct);
  if (r->ca_file[0])
    {
      /* the registry's CA, and the system's for everything else */
      curl_easy_setopt (c, CURLOPT_CAINFO, r->ca_file);
      curl_easy_setopt (c, CURLOPT_CAPATH, "/etc/ssl/certs");
    }
  const char *m = q->method ? q->method : "GET";
  if (strcmp (m, "HEAD") == 0)
    curl_easy_setopt (c, CURLOPT_NOBODY, 1L);
  else if (strcmp (m, "POST") == 0 && x.body_len == 0)
    {
      curl_easy_setopt (c, CURLOPT_POST, 1L);
      curl_easy_setopt (c, CURLOPT_POSTFIELDSIZE, 0L);
    }
  else if (strcmp (m, "GET") != 0)
    {
      curl_easy_setopt (c, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt (c, CURLOPT_READFUNCTION, read_cb);
      curl_easy_setopt (c, CURLOPT_READDATA, &x);
      curl_easy_setopt (c, CURLOPT_INFILESIZE_LARGE, (curl_off_t)x.body_len);
      if (strcmp (m, "PUT") != 0)
        curl_easy_setopt (c, CURLOPT_CUSTOMREQUEST, m);
    }
  CURLcode rc = curl_easy_perform (c);
  curl_easy_cleanup (c);
  curl_slist_free_all (hs);
  curl_slist_free_all (ct);
  if (rc == CURLE_OK && rp->status != 0)
    {
      if (rp->status >= 300 && x.ek.buf)
        registry_error_text (x.ek.buf, rp->detail, sizeof rp->detail);
      free (x.ek.buf);
      return 0;
    }
  free (x.ek.buf);
  if (x.sink_failed)
    return -1; /* err says why */
  char where[300];
  snprintf (where, sizeof where, "%s", url);
  where[strcspn (where, "?")] = '\0';
  if (x.refused)
    return wr_error (err, EACCES, WR_E_INVALID,
                     "registry redirected to %.200s, %s address: refused (docs/images.md, "
                     "Registry pulls)",
                     where, x.refused);
  if (rc == CURLE_PEER_FAILED_VERIFICATION || rc == CURLE_SSL_CACERT_BADFILE
      || rc == CURLE_SSL_CONNECT_ERROR || rc == CURLE_SSL_CERTPROBLEM)
    return wr_error (err, 0, WR_E_UNAVAILABLE,
                     "TLS with %.200s failed: %.200s (a private CA: warrend --registry-ca FILE; "
                     "a plain-HTTP registry: \"insecure\")",
                     where, errbuf[0] ? errbuf : curl_easy_strerror (rc));
  return wr_error (err, 0, WR_E_UNAVAILABLE, "registry request %.200s failed: %.200s", where,
                   errbuf[0] ? errbuf : curl_easy_strerror (rc));
}

/* One parameter of a WWW-Authenticate challenge: name="value". */
static bool
challenge_param (const char *ch, const char *name, char *out, size_t size)
{
  size_t nl = strlen (name);
  for (const char *p = ch; (p = strcasestr (p, name)) != NULL; p += nl)
    {
      if (p != ch && p[-1] != ' ' && p[-1] != ',')
        continue;
      if (p[nl] != '=')
        continue;
      const char *v = p + nl + 1;
      bool quoted = *v == '"';
      v += quoted;
      size_t l = quoted ? strcspn (v, "\"") : strcspn (v, ", ");
      if (l >= size)
        return false;
      memcpy (out, v, l);
      out[l] = '\0';
      return true;
    }
  return false;
}

/* The Bearer token flow: GET realm?service=...&scope=... (with the
 * registry's basic credentials, if any), {"token"|"access_token"}. */
static int
fetch_token (const struct rref *r, const char *challenge, wr_err_t *err)
{
  char realm[1024], service[256] = "", scope[512] = "";
  if (!challenge_param (challenge, "realm", realm, sizeof realm))
    return wr_error (err, 0, WR_E_UNAUTHORIZED, "registry %s asks for a token without a realm",
                     r->host);
  challenge_param (challenge, "service", service, sizeof service);
  challenge_param (challenge, "scope", scope, sizeof scope);
  CURLU *u = curl_url ();
  if (u == NULL || curl_url_set (u, CURLUPART_URL, realm, 0) != CURLUE_OK)
    {
      curl_url_cleanup (u);
      return wr_error (err, 0, WR_E_INVALID, "registry %s names a bad token realm", r->host);
    }
  char q[1100];
  if (service[0])
    {
      snprintf (q, sizeof q, "service=%s", service);
      curl_url_set (u, CURLUPART_QUERY, q, CURLU_APPENDQUERY | CURLU_URLENCODE);
    }
  if (scope[0])
    {
      snprintf (q, sizeof q, "scope=%s", scope);
      curl_url_set (u, CURLUPART_QUERY, q, CURLU_APPENDQUERY | CURLU_URLENCODE);
    }
  char *url = NULL, *scheme = NULL, *host = NULL;
  curl_url_get (u, CURLUPART_URL, &url, 0);
  curl_url_get (u, CURLUPART_SCHEME, &scheme, 0);
  curl_url_get (u, CURLUPART_HOST, &host, 0);
  curl_url_cleanup (u);
  int e = 0;
  if (url == NULL || scheme == NULL || host == NULL
      || (strcmp (scheme, "https") != 0 && strcmp (scheme, "http") != 0))
    e = wr_error (err, 0, WR_E_INVALID, "registry %s names a bad token realm", r->host);
  struct sink k = { .fd = -1, .max = 65536, .what = "token" };
  struct resp rp;
  if (e == 0)
    {
      /* the token service gets the registry's credentials (it is the
       * registry's delegate), but a realm on another host is held to the
       * storage redirects' address policy: no metadata service's answer
       * may become a token sent back to the registry */
      bool elsewhere = strcmp (host, r->host) != 0;
      struct hreq hq = { .body_fd = -1, .accept = "application/json", .basic = r->auth->basic };
      e = http_once (r, url, elsewhere, &hq, &k, &rp, err);
    }
  if (e == 0 && rp.status != 200)
    e = wr_error (err, 0,
                  rp.status == 401 || rp.status == 403 ? WR_E_UNAUTHORIZED : WR_E_UNAVAILABLE,
                  "the token service of registry %s answered %d%s%s", r->host, rp.status,
                  rp.status == 401 || rp.status == 403
                      ? (r->auth->basic[0] ? ": the credentials for it (--registry-auth) were "
                                             "refused"
                                           : ": it wants credentials (--registry-auth)")
                      : "",
                  rp.detail);
  if (e == 0)
    {
      json_t *j = json_loadb (k.buf ? k.buf : "", k.len, 0, NULL);
      const char *t = json_string_value (json_object_get (j, "token"));
      if (t == NULL)
        t = json_string_value (json_object_get (j, "access_token"));
      if (t == NULL || strlen (t) >= sizeof r->auth->bearer || strpbrk (t, "\r\n"))
        e = wr_error (err, 0, WR_E_UNAUTHORIZED, "the token service of registry %s sent no token",
                      r->host);
      else
        {
          pthread_mutex_lock (&r->auth->lock);
          snprintf (r->auth->bearer, sizeof r->auth->bearer, "%s", t);
          pthread_mutex_unlock (&r->auth->lock);
        }
      json_decref (j);
    }
  free (k.buf);
  curl_free (url);
  curl_free (scheme);
  curl_free (host);
  return e;
}

static void
registry_url (const struct rref *r, const char *path, char *out, size_t size)
{
  bool v6 = strchr (r->host, ':') != NULL;
  snprintf (out, size, "%s://%s%s%s:%s%s", r->tls ? "https" : "http", v6 ? "[" : "", r->host,
            v6 ? "]" : "", r->port, path);
}

/* A request to the registry r (path, or an absolute URL it gave us),
 * following up to 5 redirects the way a registry client should: within
 * the registry for anything, to another host only for blobs (storage),
 * never from https to http, and never to a loopback, local or link-local
 * address unless r allows it (opensocket_cb). A 401 is answered once with
 * the challenge's scheme: a token from the token service, or the
 * credentials. Returns 0 with rp->status whatever it is (the caller
 * decides), < 0 on a transport failure or a refused redirect. */
static int
http_do (const struct rref *r, const char *path0, const struct hreq *q0, struct sink *k,
         struct resp *rp, wr_err_t *err)
{
  char url[4096];
  if (strncmp (path0, "http://", 7) == 0 || strncmp (path0, "https://", 8) == 0)
    snprintf (url, sizeof url, "%s", path0);
  else
    registry_url (r, path0, url, sizeof url);
  char origin[600];
  registry_url (r, "", origin, sizeof origin);
  bool offsite = strncmp (url, origin, strlen (origin)) != 0
                 || (url[strlen (origin)] != '/' && url[strlen (origin)] != '\0');
  struct hreq q = *q0;
  bool auth_tried = false;
  char bearer[8192];
  for (int hop = 0; hop < 8; hop++)
    {
      pthread_mutex_lock (&r->auth->lock);
      snprintf (bearer, sizeof bearer, "%s", r->auth->bearer);
      pthread_mutex_unlock (&r->auth->lock);
      /* the registry's credentials go to the registry only */
      q.bearer = offsite ? NULL : bearer;
      q.basic = offsite ? NULL : r->auth->basic;
      size_t at = k ? k->len : 0;
      int e = http_once (r, url, offsite, &q, k, rp, err);
      if (e < 0)
        return e;
      if (k && k->len != at)
        return 0; /* a body arrived: final */
      if (rp->status == 401 && !offsite && !auth_tried)
        {
          auth_tried = true;
          if (strncasecmp (rp->www_auth, "Bearer", 6) == 0)
            {
              e = fetch_token (r, rp->www_auth + 6, err);
              if (e < 0)
                return e;
              continue;
            }
          return 0;
        }
      if (rp->status < 300 || rp->status >= 400 || rp->location[0] == '\0'
          || (q.method && strcmp (q.method, "GET") != 0 && strcmp (q.method, "HEAD") != 0))
        return 0;
      /* a redirect: absolute, checked, then followed by hand */
      CURLU *u = curl_url ();
      char *nurl = NULL, *scheme = NULL, *path = NULL;
      bool ok = u && curl_url_set (u, CURLUPART_URL, url, 0) == CURLUE_OK
                && curl_url_set (u, CURLUPART_URL, rp->location, 0) == CURLUE_OK
                && curl_url_get (u, CURLUPART_URL, &nurl, 0) == CURLUE_OK
                && curl_url_get (u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK
                && curl_url_get (u, CURLUPART_PATH, &path, 0) == CURLUE_OK;
      char *user = NULL;
      if (ok && curl_url_get (u, CURLUPART_USER, &user, 0) == CURLUE_OK)
        ok = false; /* no credentials in a redirect */
      curl_free (user);
      curl_url_cleanup (u);
      if (ok && (strcmp (scheme, "http") != 0 && strcmp (scheme, "https") != 0))
        e = wr_error (err, 0, WR_E_UNSUPPORTED, "registry redirects to %.200s", rp->location);
      else if (ok && r->tls && strcmp (scheme, "https") != 0)
        e = wr_error (err, EACCES, WR_E_INVALID,
                      "registry redirected the %s request from https to http: refused",
                      k ? k->what : "upload");
      else if (!ok || !path_ok (path) || strlen (nurl) >= sizeof url)
        e = wr_error (err, 0, WR_E_INVALID, "bad redirect from registry");
      else
        {
          bool noff = strncmp (nurl, origin, strlen (origin)) != 0
                      || (nurl[strlen (origin)] != '/' && nurl[strlen (origin)] != '\0');
          if (noff && !(k && k->blob))
            e = wr_error (err, EACCES, WR_E_INVALID,
                          "registry redirected the %s request to another host: refused, only "
                          "blobs may live elsewhere",
                          k ? k->what : "upload");
          else
            {
              offsite = offsite || noff;
              snprintf (url, sizeof url, "%s", nurl);
            }
        }
      curl_free (nurl);
      curl_free (scheme);
      curl_free (path);
      if (e < 0)
        return e;
    }
  return wr_error (err, 0, WR_E_UNAVAILABLE, "too many redirects from registry");
}

/* An error for a final status that is not what was wanted. */
static int
http_status_error (const struct rref *r, const struct resp *rp, const char *what, wr_err_t *err)
{
  if (rp->status == 401 || rp->status == 403)
    return wr_error (err, 0, WR_E_UNAUTHORIZED, "registry %s answered %d for %s%s: %s", r->host,
                     rp->status, what, rp->detail,
                     r->auth->basic[0] ? "the credentials for it (--registry-auth) were refused"
                                       : "it wants credentials (warrend --registry-auth FILE)");
  const char *code = rp->status == 404 ? WR_E_NOT_FOUND : WR_E_UNAVAILABLE;
  return wr_error (err, 0, code, "registry answered %d for %s%s", rp->status, what, rp->detail);
}

/* GET path into k; anything but 200 is an error. */
static int
http_get (const struct rref *r, const char *path, const char *accept, struct sink *k,
          struct resp *rp, wr_err_t *err)
{
  struct hreq q = { .accept = accept, .body_fd = -1 };
  int e = http_do (r, path, &q, k, rp, err);
  if (e < 0)
    return e;
  if (rp->status != 200)
    return http_status_error (r, rp, k->what, err);
  return 0;
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
    uint8_t erofs; /* a Warren EROFS layer, else an OCI tar */
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
  /* push (wr_image_push): the blobs, layers at fds then the config, and
   * the manifest; the fds are the fetcher's own (4, 5, ...) once forked */
  bool push;
  size_t n_push;
  int push_fds[WR_MAX_LAYERS];
  char push_digests[WR_MAX_LAYERS + 1][72];
  int64_t push_sizes[WR_MAX_LAYERS + 1];
  const char *push_config, *push_manifest;
  struct rref r;
  struct rref mirror; /* tried first when mirror.host is set (--registry-mirror) */
  struct rauth auth, mirror_auth;
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
      const char *lmt = json_string_value (json_object_get (l, "mediaType"));
      ret->layers[i].erofs = lmt && strcmp (lmt, WARREN_EROFS_TYPE) == 0;
    }

  /* the config, to a file the daemon reads (and hashes) itself; truncated
   * when a mirror's attempt left one (the filter has no unlinkat) */
  char path[1024];
  snprintf (path, sizeof path, "/v2/%s/blobs/%s", r->repo, cdg);
  _cleanup_close_ int fd
      = openat (f->dirfd, "config", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
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
  const struct rref *origin; /* r is a mirror: a blob it cannot serve comes from here */
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
fetch_blob_from (struct pull *p, const struct rref *from, size_t i, int fd, wr_err_t *err)
{
  const char *digest = p->meta->layers[i].digest;
  char path[1024];
  snprintf (path, sizeof path, "/v2/%s/blobs/%s", from->repo, digest);
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
  int r = http_get (from, path, NULL, &k, &rp, err);
  if (r < 0)
    return wr_error_wrap (err, "layer %zu", i + 1);
  if (k.len != (size_t)want)
    return wr_error (err, 0, WR_E_INVALID, "layer %zu is %zu bytes, the manifest says %lld", i + 1,
                     k.len, (long long)want);
  return check_digest (&h, digest, what, err);
}

static int
fetch_blob (struct pull *p, size_t i, wr_err_t *err)
{
  char name[32];
  snprintf (name, sizeof name, "layer-%zu", i);
  _cleanup_close_ int fd
      = openat (p->dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return wr_sys_error (err, "create %s", name);
  int r = fetch_blob_from (p, p->r, i, fd, err);
  if (r < 0 && p->origin)
    {
      /* the mirror lacks it or sent something else: the origin's bytes
       * overwrite it (never longer than the manifest's size) */
      if (lseek (fd, 0, SEEK_SET) < 0)
        return wr_sys_error (err, "rewind %s", name);
      r = fetch_blob_from (p, p->origin, i, fd, err);
    }
  return r;
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

/* push: what the fetcher reports at the end */
struct push_note
{
  uint32_t done;
  uint32_t uploaded, skipped;
  uint64_t bytes;
  struct fetch_status st;
};

/* fetcher: one blob to the registry unless it has it (HEAD), with the
 * monolithic upload: POST .../blobs/uploads/ then PUT LOCATION?digest= */
static int
push_blob (struct fetcher *f, size_t i, bool *ret_skipped, wr_err_t *err)
{
  const struct rref *r = &f->r;
  const char *digest = f->push_digests[i];
  bool is_config = i == f->n_push;
  char path[1024], what[64];
  snprintf (what, sizeof what, is_config ? "the config" : "layer %zu", i + 1);
  snprintf (path, sizeof path, "/v2/%s/blobs/%s", r->repo, digest);
  struct resp rp;
  struct hreq head = { .method = "HEAD", .body_fd = -1 };
  int e = http_do (r, path, &head, NULL, &rp, err);
  if (e < 0)
    return wr_error_wrap (err, "%s", what);
  *ret_skipped = rp.status == 200;
  if (rp.status == 200)
    return 0;
  if (rp.status == 401 || rp.status == 403)
    return http_status_error (r, &rp, what, err);
  snprintf (path, sizeof path, "/v2/%s/blobs/uploads/", r->repo);
  struct hreq post = { .method = "POST", .body_fd = -1 };
  e = http_do (r, path, &post, NULL, &rp, err);
  if (e < 0)
    return wr_error_wrap (err, "%s", what);
  if (rp.status != 202 || rp.location[0] == '\0')
    return http_status_error (r, &rp, "a blob upload", err);
  char url[4096];
  snprintf (url, sizeof url, "%s%sdigest=%s", rp.location, strchr (rp.location, '?') ? "&" : "?",
            digest);
  struct hreq put = { .method = "PUT", .ctype = "application/octet-stream", .body_fd = -1 };
  if (is_config)
    put.body = f->push_config;
  else
    {
      put.body_fd = f->push_fds[i];
      put.body_len = (uint64_t)f->push_sizes[i];
    }
  e = http_do (r, url, &put, NULL, &rp, err);
  if (e < 0)
    return wr_error_wrap (err, "%s", what);
  if (rp.status != 201)
    return http_status_error (r, &rp, what, err);
  return 0;
}

/* fetcher: the blobs, then the manifest under the tag */
static void
push_main (struct fetcher *f)
{
  struct push_note note = { .done = 1 };
  wr_err_t err = { 0 };
  int e = 0;
  for (size_t i = 0; i <= f->n_push && e == 0; i++)
    {
      bool skipped = false;
      e = push_blob (f, i, &skipped, &err);
      if (e == 0 && skipped)
        note.skipped++;
      else if (e == 0)
        {
          note.uploaded++;
          note.bytes += (uint64_t)f->push_sizes[i];
        }
      struct push_note tick
          = { .uploaded = note.uploaded, .skipped = note.skipped, .bytes = note.bytes };
      if (e == 0)
        send_all (f->sock, &tick, sizeof tick);
    }
  if (e == 0)
    {
      char path[1024];
      snprintf (path, sizeof path, "/v2/%s/manifests/%s", f->r.repo, f->r.tag);
      struct hreq put = {
        .method = "PUT", .ctype = OCI_MANIFEST_TYPE, .body_fd = -1, .body = f->push_manifest
      };
      struct resp rp;
      e = http_do (&f->r, path, &put, NULL, &rp, &err);
      if (e == 0 && rp.status != 201)
        e = http_status_error (&f->r, &rp, "the manifest", &err);
    }
  status_set (&note.st, e, &err);
  send_all (f->sock, &note, sizeof note);
}

/* The fetcher's whole conversation with the daemon. */
static void *
fetcher_main (void *arg)
{
  struct fetcher *f = arg;
  if (f->push)
    {
      push_main (f);
      return NULL;
    }
  struct fetch_meta *meta = calloc (1, sizeof *meta);
  if (meta == NULL)
    return NULL;
  wr_err_t err = { 0 };
  int r = -1;
  struct rref origin = f->r;
  bool mirrored = false;
  if (f->mirror.host[0])
    {
      /* the mirror first; anything it cannot serve comes from the origin */
      f->r = f->mirror;
      r = fetch_meta (f, meta, &err);
      mirrored = r == 0;
      if (r < 0)
        {
          f->r = origin;
          memset (meta, 0, sizeof *meta);
        }
    }
  if (r < 0)
    r = fetch_meta (f, meta, &err);
  status_set (&meta->st, r, &err);
  struct fetch_plan plan;
  if (send_all (f->sock, meta, sizeof *meta) < 0 || r < 0
      || wr_read_all (f->sock, &plan, sizeof plan) != (ssize_t)sizeof plan)
    {
      free (meta);
      return NULL;
    }
  struct pull p = { .r = &f->r,
                    .origin = mirrored ? &origin : NULL,
                    .meta = meta,
                    .plan = &plan,
                    .dirfd = f->dirfd,
                    .sock = f->sock };
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
          SCMP_SYS (rt_sigaction), /* libcurl's SIGPIPE guard: own handlers only */
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
  /* libcurl's threaded resolver wakes the transfer over a socketpair: a
   * pair connects to nothing */
  if (r == 0)
    r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, SCMP_SYS (socketpair), 1,
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

/* The intermediate process: SIGTERM (run_wait, wr_registry_cancel_all)
 * ends the fetcher, PID 1 of its namespace, and with it the namespace (its
 * parent-death signal does not survive its change of uid). */
static volatile pid_t fetcher_child;

static void
fetcher_term (int sig)
{
  (void)sig;
  if (fetcher_child > 0)
    kill (fetcher_child, SIGKILL);
}

/* The fetcher runs as this binary exec'd afresh, never as a bare fork of
 * the threaded daemon: curl, the resolver and OpenSSL take locks another
 * thread may have held at the fork. The daemon sends what it knows on the
 * socket first (struct fetch_boot, then the strings). */
#define FETCHER_ENV "WARREN_REGISTRY_FETCHER"

struct fetch_boot
{
  struct fetcher f; /* its pointers are rebuilt on the other side */
  uid_t uid;
  uint32_t len[4]; /* workdir, jaildir, push config, push manifest (+1 each) */
};

static int
boot_send (int sock, const struct fetcher *f, uid_t uid, const char *workdir, const char *jaildir)
{
  struct fetch_boot b;
  memset (&b, 0, sizeof b);
  b.f = *f;
  b.f.r.auth = b.f.mirror.auth = NULL;
  b.f.push_config = b.f.push_manifest = NULL;
  memset (&b.f.auth.lock, 0, sizeof b.f.auth.lock);
  memset (&b.f.mirror_auth.lock, 0, sizeof b.f.mirror_auth.lock);
  b.uid = uid;
  const char *str[4]
      = { workdir, jaildir, f->push ? f->push_config : "", f->push ? f->push_manifest : "" };
  for (int i = 0; i < 4; i++)
    b.len[i] = (uint32_t)strlen (str[i] ? str[i] : "") + 1;
  int e = send_all (sock, &b, sizeof b);
  for (int i = 0; e == 0 && i < 4; i++)
    e = send_all (sock, str[i] ? str[i] : "", b.len[i]);
  return e;
}

static char *
boot_string (int fd, uint32_t len)
{
  char *s = len > 0 && len <= (64u << 20) ? malloc (len) : NULL;
  if (s == NULL || wr_read_all (fd, s, len) != (ssize_t)len || s[len - 1] != '\0')
    _exit (2);
  return s;
}

/* In the exec'd fetcher: fd 3 is its socket, 4... the layers it pushes;
 * 0-2 are /dev/null. */
static void __attribute__ ((noreturn)) fetcher_run (void)
{
  static struct fetch_boot b;
  if (wr_read_all (3, &b, sizeof b) != (ssize_t)sizeof b)
    _exit (2);
  struct fetcher *f = &b.f;
  char *workdir = boot_string (3, b.len[0]), *jaildir = boot_string (3, b.len[1]);
  char *cfg = boot_string (3, b.len[2]), *man = boot_string (3, b.len[3]);
  if (f->n_push > WR_MAX_LAYERS)
    _exit (2);
  f->push_config = cfg;
  f->push_manifest = man;
  f->r.auth = &f->auth;
  f->mirror.auth = &f->mirror_auth;
  pthread_mutex_init (&f->auth.lock, NULL);
  pthread_mutex_init (&f->mirror_auth.lock, NULL);
  curl_global_init (CURL_GLOBAL_DEFAULT);
  /* the resolver's files (resolv.conf may be a link into /run) */
  char resolv[PATH_MAX];
  bool linked = realpath ("/etc/resolv.conf", resolv) != NULL;
  struct wr_jail j = { .uid = b.uid,
                       .gid = b.uid,
                       .root = jaildir,
                       .state_dir = workdir,
                       .ro = { "/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf",
                               "/etc/host.conf", "/etc/gai.conf" },
                       .n_ro = 5 };
  if (linked && strcmp (resolv, "/etc/resolv.conf") != 0)
    j.ro[j.n_ro++] = resolv;
  /* TLS: the system's CA store and OpenSSL's config, and --registry-ca */
  if (access ("/etc/ssl", R_OK) == 0)
    j.ro[j.n_ro++] = "/etc/ssl";
  if (f->r.ca_file[0])
    j.ro[j.n_ro++] = f->r.ca_file;
  if (unshare (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS) < 0)
    _exit (2);
  /* PID 1 of its own pid namespace: its /proc shows nothing else */
  sigset_t term, old;
  sigemptyset (&term);
  sigaddset (&term, SIGTERM);
  sigprocmask (SIG_BLOCK, &term, &old);
  struct sigaction sa = { .sa_handler = fetcher_term };
  sigaction (SIGTERM, &sa, NULL);
  pid_t child = fork ();
  if (child < 0)
    _exit (2);
  if (child == 0)
    {
      signal (SIGTERM, SIG_DFL);
      sigprocmask (SIG_SETMASK, &old, NULL);
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
  fetcher_child = child;
  sigprocmask (SIG_SETMASK, &old, NULL);
  int status;
  while (waitpid (child, &status, 0) < 0)
    if (errno != EINTR)
      _exit (2);
  _exit (WIFSIGNALED (status) ? 100 + WTERMSIG (status) : WEXITSTATUS (status));
}

/* Before main: be the fetcher if this process was started as one (the
 * variable is set only in its otherwise empty environment). */
__attribute__ ((constructor)) static void
fetcher_entry (void)
{
  if (getenv (FETCHER_ENV) != NULL)
    fetcher_run ();
}

/* Start the fetcher: fd 3 its socket (sock, the child's end; peer is the
 * daemon's end, where its boot data goes), everything else of the daemon's
 * closed. Returns the pid, or -1 with errno. */
static pid_t
fetcher_spawn (struct fetcher *f, int sock, int peer, const char *workdir, const char *jaildir,
               uid_t uid)
{
  char *const argv[] = { (char *)"warren-fetcher", NULL };
  /* what curl and OpenSSL read from the environment passes through */
  static const char *const pass[]
      = { "http_proxy", "HTTP_PROXY", "https_proxy",   "HTTPS_PROXY",  "all_proxy",     "ALL_PROXY",
          "no_proxy",   "NO_PROXY",   "SSL_CERT_FILE", "SSL_CERT_DIR", "CURL_CA_BUNDLE" };
  char *envp[WR_ARRAY_SIZE (pass) + 2];
  size_t ne = 0;
  envp[ne++] = (char *)FETCHER_ENV "=1";
  for (size_t i = 0; i < WR_ARRAY_SIZE (pass); i++)
    {
      char **e;
      size_t l = strlen (pass[i]);
      for (e = environ; e && *e; e++)
        if (strncmp (*e, pass[i], l) == 0 && (*e)[l] == '=')
          break;
      if (e && *e)
        envp[ne++] = *e;
    }
  envp[ne] = NULL;
  int pushfds[WR_MAX_LAYERS];
  size_t n_push = f->push ? f->n_push : 0;
  memcpy (pushfds, f->push_fds, sizeof pushfds);
  pid_t pid = fork ();
  if (pid < 0)
    return -1;
  if (pid == 0)
    {
      prctl (PR_SET_PDEATHSIG, SIGKILL);
      int devnull = open ("/dev/null", O_RDWR | O_CLOEXEC);
      if (devnull < 0 || dup2 (devnull, 0) < 0 || dup2 (devnull, 1) < 0 || dup2 (devnull, 2) < 0
          || dup2 (sock, 3) < 0)
        _exit (2);
      /* push: the layer files at 4, 5, ... (moved out of the way first) */
      for (size_t i = 0; i < n_push; i++)
        if ((pushfds[i] = fcntl (pushfds[i], F_DUPFD, 4 + WR_MAX_LAYERS)) < 0)
          _exit (2);
      for (size_t i = 0; i < n_push; i++)
        if (dup2 (pushfds[i], 4 + (int)i) < 0)
          _exit (2);
      close_range (4 + (unsigned)n_push, ~0u, 0);
      execve ("/proc/self/exe", argv, envp);
      _exit (5);
    }
  struct fetcher sent = *f;
  for (size_t i = 0; i < n_push; i++)
    sent.push_fds[i] = 4 + (int)i;
  /* a fetcher that died before reading fails the conversation that
   * follows, with its exit status */
  (void)boot_send (peer, &sent, uid, workdir, jaildir);
  return pid;
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

/* daemon: the fetcher's error code, one of the few it may send */
static const char *
fetch_code (const char *c)
{
  if (strcmp (c, WR_E_UNAUTHORIZED) == 0)
    return WR_E_UNAUTHORIZED;
  if (strcmp (c, WR_E_UNAVAILABLE) == 0)
    return WR_E_UNAVAILABLE;
  return wr_unpack_code (c);
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
                fetch_code (m->st.code), "%s", m->st.msg);
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

/* The forked fetchers alive, so that a stopping daemon can end them
 * (wr_registry_cancel_all); a pid leaves the list before it is reaped, so
 * a kill never reaches a reused pid. */
static pthread_mutex_t fetchers_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t fetchers[64];
static bool fetchers_cancelled;

static bool
fetcher_track (pid_t pid)
{
  pthread_mutex_lock (&fetchers_lock);
  bool ok = !fetchers_cancelled;
  for (size_t i = 0; ok && i < WR_ARRAY_SIZE (fetchers); i++)
    if (fetchers[i] == 0)
      {
        fetchers[i] = pid;
        break;
      }
  pthread_mutex_unlock (&fetchers_lock);
  return ok;
}

static void
fetcher_untrack (pid_t pid)
{
  pthread_mutex_lock (&fetchers_lock);
  for (size_t i = 0; i < WR_ARRAY_SIZE (fetchers); i++)
    if (fetchers[i] == pid)
      fetchers[i] = 0;
  pthread_mutex_unlock (&fetchers_lock);
}

void
wr_registry_cancel_all (void)
{
  pthread_mutex_lock (&fetchers_lock);
  fetchers_cancelled = true;
  for (size_t i = 0; i < WR_ARRAY_SIZE (fetchers); i++)
    if (fetchers[i] > 0)
      kill (fetchers[i], SIGTERM);
  pthread_mutex_unlock (&fetchers_lock);
}

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
  fetcher_untrack (run->pid);
  if (kill_it)
    kill (run->pid, SIGTERM);
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
  pthread_mutex_lock (&fetchers_lock);
  bool cancelled = fetchers_cancelled;
  pthread_mutex_unlock (&fetchers_lock);
  if (cancelled)
    return wr_error (err, 0, WR_E_UNAVAILABLE, "the daemon is stopping: registry transfer ended");
  if (code > 100)
    return wr_error (err, 0, WR_E_INVALID, "the registry fetcher was killed by signal %d%s",
                     code - 100,
                     code - 100 == SIGSYS ? " (a call outside its seccomp filter)" : "");
  return wr_error (err, 0, WR_E_INTERNAL, "the registry fetcher failed (status %d)", code);
}

/* daemon: is this EROFS layer (a Warren push) stored already? */
static bool
erofs_stored (struct wr_store *s, const char *digest)
{
  char path[PATH_MAX];
  return wr_layer_file (s, digest, path, sizeof path, NULL) == 0 && access (path, F_OK) == 0;
}

/* daemon: an image of Warren EROFS layers: the blobs are the store's layer
 * files (their digests were checked), the config's "warren" object is the
 * store's config. */
static int
erofs_commit (struct wr_store *s, const char *target, json_t *config, const int *fds,
              const char *const *blobs, size_t n, struct wr_image **ret, wr_err_t *err)
{
  struct wr_staged_layer *staged[WR_MAX_LAYERS] = { NULL };
  struct wr_layer_ref refs[WR_MAX_LAYERS];
  memset (refs, 0, sizeof refs);
  int e = 0;
  for (size_t i = 0; i < n && e == 0; i++)
    {
      refs[i].digest = blobs[i];
      if (fds[i] < 0)
        continue; /* stored: the commit re-checks it under the lock */
      e = wr_layer_stage_erofs (s, fds[i], &staged[i], err);
      if (e == 0 && strcmp (staged[i]->digest, blobs[i]) != 0)
        e = wr_error (err, 0, WR_E_INVALID, "layer %zu changed while it was read", i + 1);
      refs[i].staged = staged[i];
    }
  json_t *wc = json_object_get (config, "warren");
  if (e == 0)
    e = wr_image_commit (s, target, refs, n, json_is_object (wc) ? wc : NULL, ret, err);
  for (size_t i = 0; i < n; i++)
    wr_layer_stage_free (staged[i]);
  return e;
}

/* Warren EROFS layers are file-system images the host kernel mounts: taken
 * only from registries the operator lists (WARREN_REGISTRY_TRUST_EROFS,
 * warrend --registry-trust-erofs HOST[:PORT],...; "*" for any), never from
 * any registry a reference names. Tar layers are always rebuilt here. */
static bool
erofs_trusted (const struct rref *r)
{
  const char *list = getenv ("WARREN_REGISTRY_TRUST_EROFS");
  char hp[300];
  snprintf (hp, sizeof hp, "%s%s%s", r->host, r->port[0] ? ":" : "", r->port);
  for (const char *p = list; p && *p; p += strcspn (p, ","), p += *p == ',')
    {
      size_t n = strcspn (p, ",");
      if ((n == 1 && *p == '*') || (n == strlen (hp) && strncmp (p, hp, n) == 0)
          || (n == strlen (r->host) && strncmp (p, r->host, n) == 0))
        return true;
    }
  return false;
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
      if (m->layers[i].erofs ? erofs_stored (s, m->layers[i].digest)
                             : wr_blob_layer (s, m->layers[i].digest, have, NULL) == 1)
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
                fetch_code (note.st.code), "%s", note.st.msg);
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
  size_t n_erofs = 0;
  for (size_t i = 0; i < m->n; i++)
    n_erofs += m->layers[i].erofs;
  if (e == 0 && n_erofs == 0)
    e = wr_oci_commit (s, target, config, fds, blobs, m->n, progress, ud, ret, err);
  else if (e == 0 && n_erofs != m->n)
    e = wr_error (err, 0, WR_E_UNSUPPORTED,
                  "the image mixes Warren EROFS layers with tar layers (docs/images.md, Push)");
  else if (e == 0 && !erofs_trusted (&run->f.r))
    e = wr_error (err, 0, WR_E_FORBIDDEN,
                  "%s serves Warren EROFS layers, which this host's kernel would mount as they "
                  "are: accept them only from your own registry (warrend --registry-trust-erofs "
                  "%s%s%s; docs/images.md, Push)",
                  run->f.r.host, run->f.r.host, run->f.r.port[0] ? ":" : "", run->f.r.port);
  else if (e == 0)
    e = erofs_commit (s, target, config, fds, blobs, m->n, ret, err);
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

/* ---- the daemon's registry configuration (docs/images.md, Registry
 * configuration): warrend --registry-ca/--registry-auth/--registry-mirror,
 * or WARREN_REGISTRY_CA/_AUTH/_MIRRORS. Read by the daemon; the fetcher
 * only gets the one credential its registry needs. */

/* "HOST[:PORT]" of a credentials key ("https://host:port/v1/" and the like) */
static bool
auth_key_matches (const char *key, const char *host, const char *port, bool default_port)
{
  if (strncmp (key, "https://", 8) == 0)
    key += 8;
  else if (strncmp (key, "http://", 7) == 0)
    key += 7;
  size_t kl = strcspn (key, "/");
  char hp[300];
  bool v6 = strchr (host, ':') != NULL;
  snprintf (hp, sizeof hp, "%s%s%s:%s", v6 ? "[" : "", host, v6 ? "]" : "", port);
  if (kl == strlen (hp) && strncmp (key, hp, kl) == 0)
    return true;
  return default_port && kl == strlen (host) && strncmp (key, host, kl) == 0;
}

/* The docker-style credentials file: {"auths":{"HOST[:PORT]":{"auth":
 * base64("user:password")} or {"username","password"}}}. */
static int
creds_lookup (const char *file, const struct rref *r, bool default_port, char *out, size_t size,
              wr_err_t *err)
{
  out[0] = '\0';
  json_error_t jerr;
  _cleanup_ (json_decrefp) json_t *j = json_load_file (file, 0, &jerr);
  if (j == NULL)
    return wr_error (err, 0, WR_E_INVALID, "registry credentials %.200s: %.200s", file, jerr.text);
  const char *key;
  json_t *v;
  json_object_foreach (json_object_get (j, "auths"), key, v)
  {
    if (!auth_key_matches (key, r->host, r->port, default_port))
      continue;
    const char *a = json_string_value (json_object_get (v, "auth"));
    const char *u = json_string_value (json_object_get (v, "username"));
    const char *p = json_string_value (json_object_get (v, "password"));
    long dl = a && strlen (a) < size ? wr_b64_decode (a, strlen (a), out) : -1;
    if (dl >= 0)
      out[dl] = '\0';
    if (a && (dl < 0 || strlen (out) != (size_t)dl))
      return wr_error (err, 0, WR_E_INVALID, "registry credentials %.200s: bad \"auth\" for %.200s",
                       file, key);
    if (!a && u && p)
      snprintf (out, size, "%s:%s", u, p);
    return 0;
  }
  return 0;
}

static int
endpoint_setup (struct rref *r, struct rauth *a, bool insecure, wr_err_t *err)
{
  bool default_port = r->port[0] == '\0';
  if (default_port)
    strcpy (r->port, insecure ? "80" : "443");
  r->tls = !insecure;
  r->auth = a;
  pthread_mutex_init (&a->lock, NULL);
  r->local_ok = host_is_loopback (r->host, r->port);
  const char *ca = getenv ("WARREN_REGISTRY_CA");
  if (ca && ca[0])
    {
      if (access (ca, R_OK) < 0 || strlen (ca) >= sizeof r->ca_file)
        return wr_error (err, errno, WR_E_INVALID, "registry CA file %.200s is not readable", ca);
      snprintf (r->ca_file, sizeof r->ca_file, "%s", ca);
    }
  const char *auth = getenv ("WARREN_REGISTRY_AUTH");
  if (auth && auth[0])
    return creds_lookup (auth, r, default_port, a->basic, sizeof a->basic, err);
  return 0;
}

/* Fill the registry side of f: scheme, port, CA, credentials, mirror. */
static int
registry_setup (struct fetcher *f, bool insecure, wr_err_t *err)
{
  struct rref *r = &f->r;
  char hp[300];
  snprintf (hp, sizeof hp, "%s%s%s", r->host, r->port[0] ? ":" : "", r->port);
  int e = endpoint_setup (r, &f->auth, insecure, err);
  if (e < 0)
    return e;
  /* HOST[:PORT]=MIRROR[:PORT],... */
  const char *ms = getenv ("WARREN_REGISTRY_MIRRORS");
  size_t hl = strlen (hp);
  for (const char *p = ms; p && *p; p += strcspn (p, ","), p += *p == ',')
    {
      size_t l = strcspn (p, ",");
      if (l <= hl + 1 || strncmp (p, hp, hl) != 0 || p[hl] != '=')
        continue;
      char mref[600];
      snprintf (mref, sizeof mref, "%.*s/%s:x", (int)(l - hl - 1), p + hl + 1, r->repo);
      e = rref_parse (mref, &f->mirror, err);
      if (e < 0)
        return wr_error_wrap (err, "registry mirror for %s", hp);
      snprintf (f->mirror.tag, sizeof f->mirror.tag, "%s", r->tag);
      snprintf (f->mirror.digest, sizeof f->mirror.digest, "%s", r->digest);
      return endpoint_setup (&f->mirror, &f->mirror_auth, insecure, err);
    }
  return 0;
}

/* Start the fetcher for run (forked and confined; a thread when the store
 * parses in process, for fuzzing) on the staging directory wfd. */
static int
run_start (struct wr_store *s, struct pull_run *run, int wfd, const char *workdir, char *jaildir,
           size_t jsize, wr_err_t *err)
{
  struct wr_extract_limits xlim;
  wr_store_extract_limits (s, false, &xlim);
  uid_t uid = wr_unpack_uid_base ();
  int sp[2] = { -1, -1 };
  int e = 0;
  if (wfd < 0)
    e = wr_sys_error (err, "open %s", workdir);
  else if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
    e = wr_sys_error (err, "socketpair");
  else if (xlim.in_process)
    {
      /* fuzzing: the same conversation with a thread of ours */
      run->sock = sp[0];
      run->f.sock = sp[1];
      run->f.dirfd = fcntl (wfd, F_DUPFD_CLOEXEC, 3);
      run->threaded = pthread_create (&run->thread, NULL, fetcher_main, &run->f) == 0;
      if (!run->threaded)
        e = wr_error (err, EAGAIN, WR_E_INTERNAL, "cannot start the registry fetcher");
    }
  else if (fchown (wfd, uid, uid) < 0)
    e = wr_sys_error (err, "hand %s to the registry fetcher", workdir);
  else if ((e = wr_store_tmpdir (s, "pulljail", jaildir, jsize, err)) == 0)
    {
      run->sock = sp[0];
      run->pid = fetcher_spawn (&run->f, sp[1], sp[0], workdir, jaildir, uid);
      close (sp[1]);
      if (run->pid < 0)
        e = wr_sys_error (err, "fork the registry fetcher");
      else if (!fetcher_track (run->pid))
        e = wr_error (err, 0, WR_E_UNAVAILABLE, "the daemon is stopping");
    }
  if (run->sock < 0)
    {
      if (sp[0] >= 0)
        close (sp[0]);
      if (sp[1] >= 0 && !xlim.in_process)
        close (sp[1]);
    }
  return e;
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
  curl_global_init (CURL_GLOBAL_DEFAULT);
  e = registry_setup (&run.f, insecure, err);
  if (e < 0)
    return e;
  char target[512];
  if (name && name[0])
    snprintf (target, sizeof target, "%s", name);
  else
    snprintf (target, sizeof target, "%s:%s", r->repo, r->tag[0] ? r->tag : "latest");
  if (!wr_ref_valid (target) || strchr (target, '@'))
    return wr_error (err, 0, WR_E_INVALID, "invalid local image name '%.300s'", target);

  struct wr_store_limits lim;
  wr_store_get_limits (s, &lim);
  r->private_ok = run.f.mirror.private_ok = lim.private_redirects;
  if (progress)
    progress (ud, "manifest", 0, 1);

  char workdir[4096] = "", jaildir[4096] = "";
  e = wr_store_tmpdir (s, "pull", workdir, sizeof workdir, err);
  if (e < 0)
    return e;
  _cleanup_close_ int wfd = open (workdir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  e = run_start (s, &run, wfd, workdir, jaildir, sizeof jaildir, err);
  if (e == 0)
    e = pull_in (s, &run, wfd, target, &lim, progress, ud, ret, err);
  run_wait (&run, true);
  rm_tmpdir (workdir);
  rm_tmpdir (jaildir);
  return e;
}

/* ---- push (docs/images.md, Push) ---- */

/* daemon: the OCI config of a stored image: the store's config under
 * "warren" (what a Warren pull takes back), the usual fields for others */
static char *
push_config_text (const struct wr_image *img)
{
  json_t *wc = img->config;
  json_t *diff = json_array ();
  for (size_t i = 0; i < img->n_layers; i++)
    json_array_append_new (diff, json_string (img->layers[i]));
  json_t *c
      = json_pack ("{s:s,s:s,s:{s:O?,s:O?,s:O?,s:O?},s:{s:s,s:o},s:O?}", "architecture",
                   WR_OCI_ARCH, "os", "linux", "config", "Env", json_object_get (wc, "env"),
                   "WorkingDir", json_object_get (wc, "workdir"), "User",
                   json_object_get (wc, "user"), "Entrypoint", json_object_get (wc, "entrypoint"),
                   "rootfs", "type", "layers", "diff_ids", diff, "warren", wc);
  char *text = c ? json_dumps (c, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
  json_decref (c);
  return text;
}

static void
sha256_text_digest (const char *text, char out[72])
{
  char hex[65];
  wr_sha256_hex (text, strlen (text), hex);
  snprintf (out, 72, "sha256:%s", hex);
}

int
wr_image_push (struct wr_store *s, const char *ref, const char *target, bool insecure,
               wr_progress_fn progress, void *ud, json_t **ret, wr_err_t *err)
{
  struct pull_run run = { .sock = -1, .f = { .dirfd = -1, .sock = -1, .push = true } };
  for (size_t i = 0; i < WR_MAX_LAYERS; i++)
    run.f.push_fds[i] = -1;
  int e = rref_parse (target, &run.f.r, err);
  if (e < 0)
    return e;
  if (run.f.r.digest[0])
    return wr_error (err, 0, WR_E_INVALID, "push to a tag, not a digest: '%.300s'", target);
  struct wr_image *img = NULL;
  e = wr_image_resolve (s, ref, &img, err);
  if (e < 0)
    return e;
  curl_global_init (CURL_GLOBAL_DEFAULT);
  e = registry_setup (&run.f, insecure, err);
  memset (&run.f.mirror, 0, sizeof run.f.mirror); /* mirrors are for pulls */
  struct fetcher *f = &run.f;
  _cleanup_free_ char *cfg = NULL, *man = NULL;
  uint64_t total = 0;
  f->n_push = img->n_layers;
  for (size_t i = 0; i < img->n_layers && e == 0; i++)
    {
      char path[PATH_MAX];
      struct stat st;
      e = wr_layer_file (s, img->layers[i], path, sizeof path, err);
      if (e == 0
          && ((f->push_fds[i] = open (path, O_RDONLY | O_CLOEXEC)) < 0
              || fstat (f->push_fds[i], &st) < 0))
        e = wr_sys_error (err, "open layer %s", img->layers[i]);
      if (e == 0)
        {
          snprintf (f->push_digests[i], sizeof f->push_digests[i], "%s", img->layers[i]);
          f->push_sizes[i] = st.st_size;
          total += (uint64_t)st.st_size;
        }
    }
  if (e == 0 && (cfg = push_config_text (img)) == NULL)
    e = wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  json_t *layers = e == 0 ? json_array () : NULL;
  for (size_t i = 0; layers && i < img->n_layers; i++)
    json_array_append_new (layers,
                           json_pack ("{s:s,s:s,s:I}", "mediaType", WARREN_EROFS_TYPE, "digest",
                                      f->push_digests[i], "size", (json_int_t)f->push_sizes[i]));
  if (e == 0)
    {
      size_t n = img->n_layers;
      sha256_text_digest (cfg, f->push_digests[n]);
      f->push_sizes[n] = (int64_t)strlen (cfg);
      json_t *m = json_pack (
          "{s:i,s:s,s:{s:s,s:s,s:I},s:o}", "schemaVersion", 2, "mediaType", OCI_MANIFEST_TYPE,
          "config", "mediaType", "application/vnd.oci.image.config.v1+json", "digest",
          f->push_digests[n], "size", (json_int_t)f->push_sizes[n], "layers", layers);
      layers = NULL;
      man = m ? json_dumps (m, JSON_COMPACT) : NULL;
      json_decref (m);
      if (man == NULL)
        e = wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
    }
  json_decref (layers);
  f->push_config = cfg;
  f->push_manifest = man;

  char workdir[4096] = "", jaildir[4096] = "";
  if (e == 0)
    e = wr_store_tmpdir (s, "push", workdir, sizeof workdir, err);
  if (e == 0)
    {
      _cleanup_close_ int wfd = open (workdir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
      e = run_start (s, &run, wfd, workdir, jaildir, sizeof jaildir, err);
    }
  /* the forked fetcher has its own copies of the layer fds */
  for (size_t i = 0; run.pid > 0 && i < f->n_push; i++)
    if (f->push_fds[i] >= 0)
      {
        close (f->push_fds[i]);
        f->push_fds[i] = -1;
      }
  struct push_note note = { 0 };
  while (e == 0)
    {
      if (wr_read_all (run.sock, &note, sizeof note) != (ssize_t)sizeof note)
        {
          e = fetcher_died (&run, err);
          break;
        }
      if (progress)
        progress (ud, "upload", note.bytes < total ? note.bytes : total, total);
      if (note.done)
        break;
    }
  if (e == 0 && note.st.r < 0)
    {
      note.st.code[sizeof note.st.code - 1] = '\0';
      note.st.msg[sizeof note.st.msg - 1] = '\0';
      e = wr_error (err, note.st.errnum > 0 && note.st.errnum < 4096 ? note.st.errnum : 0,
                    fetch_code (note.st.code), "%s", note.st.msg);
    }
  run_wait (&run, true);
  for (size_t i = 0; i < f->n_push; i++)
    if (f->push_fds[i] >= 0)
      close (f->push_fds[i]);
  rm_tmpdir (workdir);
  rm_tmpdir (jaildir);
  if (e == 0 && ret)
    {
      char mdigest[72];
      sha256_text_digest (man, mdigest);
      *ret = json_pack ("{s:s,s:s,s:s,s:I,s:I,s:I}", "ref", img->name, "target", target, "digest",
                        mdigest, "uploaded", (json_int_t)note.uploaded, "skipped",
                        (json_int_t)note.skipped, "bytes", (json_int_t)note.bytes);
    }
  wr_image_free (img);
  return e;
}

/* ---- fetch on first use (docs/cluster.md, Images in a cluster) ---- */

int
wr_registry_local_name (const char *ref, char *buf, size_t size)
{
  const char *slash = strchr (ref, '/');
  if (slash == NULL)
    return 0;
  size_t hl = (size_t)(slash - ref);
  bool host = (memchr (ref, '.', hl) || memchr (ref, ':', hl)
               || (hl == 9 && strncmp (ref, "localhost", 9) == 0));
  if (!host || strchr (ref, '@'))
    return 0;
  /* HOST:PORT/REPO:TAG is stored as HOST-PORT/REPO:TAG */
  const char *rest = slash + 1;
  bool tagged = strchr (rest, ':') != NULL;
  int n = snprintf (buf, size, "%.*s/%s%s", (int)hl, ref, rest, tagged ? "" : ":latest");
  if (n < 0 || (size_t)n >= size)
    return 0;
  for (size_t i = 0; i < hl; i++)
    if (buf[i] == ':')
      buf[i] = '-';
  return wr_ref_valid (buf) ? 1 : 0;
}

/* One pull per local name at a time: the others wait for it and share its
 * result, success or error. */
struct inflight
{
  char name[512];
  unsigned waiters;
  bool done;
  int r;
  wr_err_t err;
  struct inflight *next;
};
static pthread_mutex_t inflight_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t inflight_cond = PTHREAD_COND_INITIALIZER;
static struct inflight *inflight_head;

static bool
registry_insecure (const char *ref)
{
  const char *list = getenv ("WARREN_REGISTRY_INSECURE");
  size_t hl = strcspn (ref, "/");
  for (const char *p = list; p && *p; p += strcspn (p, ","), p += *p == ',')
    if (strcspn (p, ",") == hl && strncmp (p, ref, hl) == 0)
      return true;
  return false;
}

int
wr_image_fetch_once (struct wr_store *s, const char *ref, const char *name, struct wr_image **ret,
                     wr_err_t *err)
{
  pthread_mutex_lock (&inflight_lock);
  struct inflight *f = inflight_head;
  while (f && strcmp (f->name, name) != 0)
    f = f->next;
  if (f)
    {
      f->waiters++;
      while (!f->done)
        pthread_cond_wait (&inflight_cond, &inflight_lock);
      int r = f->r;
      if (r < 0 && err)
        *err = f->err;
      if (--f->waiters == 0)
        {
          struct inflight **pp = &inflight_head;
          while (*pp != f)
            pp = &(*pp)->next;
          *pp = f->next;
          free (f);
        }
      pthread_mutex_unlock (&inflight_lock);
      return r < 0 ? r : wr_image_resolve (s, name, ret, err);
    }
  f = calloc (1, sizeof *f);
  if (f == NULL)
    {
      pthread_mutex_unlock (&inflight_lock);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
    }
  snprintf (f->name, sizeof f->name, "%s", name);
  f->waiters = 1;
  f->next = inflight_head;
  inflight_head = f;
  pthread_mutex_unlock (&inflight_lock);

  /* a pull that finished just before this one started counts */
  int r = wr_image_resolve (s, name, ret, NULL);
  if (r < 0)
    r = wr_image_pull (s, ref, name, registry_insecure (ref), NULL, NULL, ret, &f->err);

  pthread_mutex_lock (&inflight_lock);
  f->r = r;
  f->done = true;
  if (r < 0 && err)
    *err = f->err;
  pthread_cond_broadcast (&inflight_cond);
  if (--f->waiters == 0)
    {
      struct inflight **pp = &inflight_head;
      while (*pp != f)
        pp = &(*pp)->next;
      *pp = f->next;
      free (f);
    }
  pthread_mutex_unlock (&inflight_lock);
  return r;
}
