/* SandboxFusion-compatible API (docs/compat.md).
 *
 * A separate TCP listener speaks SandboxFusion's contract (bytedance/
 * SandboxFusion, sandbox/server/sandbox_api.py): POST /run_code, POST
 * /run_jupyter, GET /v1/ping. Every stage of a request (compile, run) is one
 * fncall call, so a burst costs forks in warm pools, not sandbox boots.
 *
 * The layer is a client of the node's own API: it posts /v1/calls over a
 * private owner-only unix socket of this daemon. That keeps fncall's pools,
 * admission, retries and isolation the only implementation of a call, and
 * lets a gateway host the same layer against any node. A client that hangs
 * up closes its loopback connection, which fncall takes as "drop the call".
 *
 * A call's scratch directory is wiped after it, so a stage's inputs (the
 * request's files, the source, the compiled artifacts, stdin) travel in its
 * stdin as a tar archive the stage's shell unpacks, staged in-process
 * (wrd_fncall_stage: not in the call's 1 MiB JSON body); a compile stage answers
 * with a tar of its artifacts, and a run stage with fetch_files answers with
 * a tar holding the program's stdout, stderr, status and the files. Python
 * without files takes the zygote fast path (a fork per request). */
#include "daemon/compat_sf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>

#include "common/b64.h"
#include "common/httpd.h"
#include "common/util.h"
#include "daemon/compat_e2b.h"
#include "daemon/fncall.h"
#include "daemon/log.h"

#define SF_DEFAULT_IMAGE "base:bookworm"
#define SF_DEFAULT_MEMORY_MB 1024 /* memory_limit_MB <= 0: SandboxFusion's "no limit" */
#define SF_OUT_CAP (16u << 20)
/* A request's body (code, files in base64, stdin). A stage's inputs reach
 * its call staged in-process (wrd_fncall_stage), not in the call's JSON
 * body, so this is the only input limit. */
#define SF_MAX_BODY (64u << 20)
#define SF_MAX_TIMEOUT_S 3600.0
#define SF_TOO_LARGE "X-Warren-Body-Too-Large" /* see sf_filter_in */
#define SF_FETCH_SLACK_S 10.0                  /* unpacking and packing around a fetch-mode run */
#define SF_JUPYTER_MARK "\x1eWR-JUPYTER-RESULT\x1e"

/* The call's address-space limit (memory_mb) leaves G1's reservations and
 * the default 1 GB class space no room for a thread stack: a JVM did not
 * start; the serial collector and smaller reservations fit. Under an
 * address-space limit the JVM sizes its heap at half of it, which left a
 * Java run at 1 GB 8 MB of room (VmPeak 1016 of 1024 MB): one more glibc
 * malloc arena (64 MB of address space each, up to 8 per core, created as
 * threads contend) and the JVM died at start, "insufficient memory" (a
 * JUnit run, 1 in 60 here, one in CI). So the heap is a third of the limit
 * (the stage's shell sets $WR_SF_HEAP from memory_mb, see stage_start) and
 * glibc keeps two arenas. SF_JVM_J passes the options through a launcher
 * (javac, scalac, scala); SF_JVM_ENV goes before every JVM command. */
#define SF_JVM_ENV "env MALLOC_ARENA_MAX=2 "
#define SF_JVM                                                                                     \
  "-XX:+UseSerialGC $WR_SF_HEAP -XX:CompressedClassSpaceSize=64m -XX:ReservedCodeCacheSize=64m"
#define SF_JVM_J                                                                                   \
  "-J-XX:+UseSerialGC -J$WR_SF_HEAP -J-XX:CompressedClassSpaceSize=64m "                           \
  "-J-XX:ReservedCodeCacheSize=64m"
#define SF_JUNIT "/usr/share/java/junit-platform-console-standalone.jar"

/* Per language: source file, compile command (NULL: interpreted), run
 * command, the artifacts a compile leaves, and whether plain runs may use
 * the Python zygote. Commands follow sandbox/runners/major.py and minor.py;
 * "c" is Warren's own addition (SandboxFusion has only cpp). */
struct sf_lang
{
  const char *name, *src, *compile, *run, *artifacts;
  bool zygote;
};

static const struct sf_lang langs[] = {
  { "python", "main.py", NULL, "python3 main.py", NULL, true },
  { "pytest", "test_main.py", NULL, "python3 -m pytest test_main.py", NULL, false },
  { "bash", "main.sh", NULL, "bash main.sh", NULL, false },
  { "c", "main.c", "gcc -O2 main.c -o test -lm", "./test", "test", false },
  { "cpp", "main.cpp", "g++ -std=c++17 main.cpp -o test -lpthread", "./test", "test", false },
  { "perl", "main.pl", NULL, "perl main.pl", NULL, false },
  { "nodejs", "main.js", NULL, "node main.js", NULL, false },
  { "go", "main.go", "go build -o out main.go", "./out", "out", false },
  /* stripped: a 4 MB unstripped hello world travels twice (out of the
   * compile stage, into the run stage) for nothing */
  { "rust", "main.rs", "rustc -C strip=symbols main.rs -o test", "./test", "test", false },
  /* SF_JVM: see above */
  { "java", "Main.java", SF_JVM_ENV "javac " SF_JVM_J " -J-XX:TieredStopAtLevel=1 Main.java",
    SF_JVM_ENV "java " SF_JVM " -ea Main", "*.class", false },
  /* JUnit 5's console launcher (Debian's junit5); the source file is named
   * after its public class, as SandboxFusion does */
  { "junit", "Main.java",
    "n=$(sed -nE 's/.*\\bpublic\\s+(abstract\\s+|final\\s+)?class\\s+(\\w+).*/\\2/p' Main.java | "
    "head -n 1)\n"
    "[ -z \"$n\" ] || [ \"$n\" = Main ] || mv Main.java \"$n.java\"\n" SF_JVM_ENV "javac " SF_JVM_J
    " -J-XX:TieredStopAtLevel=1 -cp .:" SF_JUNIT " *.java",
    SF_JVM_ENV "java " SF_JVM " -jar " SF_JUNIT " --class-path . --scan-class-path", "*.class",
    false },
  { "php", "main.php", NULL, "php -f main.php", NULL, false },
  { "lua", "main.lua", NULL, "lua main.lua", NULL, false },
  { "ruby", "main.rb", NULL, "ruby main.rb", NULL, false },
  { "R", "main.R", NULL, "Rscript main.R", NULL, false },
  /* go test's file-list mode; SandboxFusion's go.mod and module cache are
   * not here: Debian's Go libraries (testify) resolve in GOPATH mode */
  { "go_test", "main_test.go", NULL,
    "env GO111MODULE=off GOPATH=/usr/share/gocode go test main_test.go", NULL, false },
  /* ts-node without type checks, as SandboxFusion's tsx (not in bookworm) */
  { "typescript", "main.ts", NULL, "ts-node --transpile-only main.ts", NULL, false },
  /* SandboxFusion's package.json and babel.config.js (preset-env for the
   * running node, preset-typescript) as jest's --config */
  { "jest", "main.test.ts", NULL,
    "env FORCE_COLOR=0 jest --config '{\"transform\": {\"[.][jt]sx?$\": [\"babel-jest\", "
    "{\"presets\": "
    "[[\"@babel/preset-env\", {\"targets\": {\"node\": \"current\"}}], "
    "\"@babel/preset-typescript\"]}]}}'",
    NULL, false },
  /* Mono for SandboxFusion's dotnet (not in bookworm): mcs compiles every
   * .cs file, as `dotnet run` does a project's; a failed Debug.Assert is
   * reported on stderr (Mono's does not stop the program) */
  { "csharp", "Program.cs", "mcs -d:DEBUG -out:Program.exe *.cs",
    "env MONO_TRACE_LISTENER=Console.Error mono Program.exe", "Program.exe", false },
  /* the main object is the source's first `object NAME` (SandboxFusion's
   * rule), named in the jar's manifest so the run needs no source. glibc's
   * per-thread malloc arenas (64 MB of address space each, up to 8 per
   * core) took what the heap left of the limit: scalac failed to start */
  { "scala", "main.scala",
    "n=$(sed -nE 's/.*object\\s+(\\w+).*/\\1/p' main.scala | head -n 1)\n"
    "[ -n \"$n\" ] || { echo 'Object name not found.' >&2; exit 1; }\n" SF_JVM_ENV
    "scalac " SF_JVM_J " -J-XX:TieredStopAtLevel=1 -d main.jar "
    "-Xmain-class \"$n\" main.scala",
    SF_JVM_ENV "scala " SF_JVM_J " main.jar", "main.jar", false },
  { "racket", "main.rkt", NULL, "racket main.rkt", NULL, false },
  /* Debian's Kotlin 1.3: `kotlin main.kts` is "not yet supported" there,
   * `kotlinc -script` runs a script; the JVM's limits as scala's, and a
   * 256 MB heap (after SF_JVM's: the last -Xmx wins): with the JVM's
   * default the compiler's jar mappings found no room under the
   * address-space limit ("Map failed") */
  { "kotlin_script", "main.kts", NULL,
    SF_JVM_ENV "JAVA_OPTS=\"" SF_JVM " -XX:TieredStopAtLevel=1 -Xmx256m\" "
               "kotlinc -script main.kts",
    NULL, false },
  /* ldc's dmd-compatible driver for SandboxFusion's dmd */
  { "D_ut", "main.d", "ldmd2 main.d -unittest -of=test", "./test", "test", false },
  { "verilog", "main.sv",
    "iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o test.vvp main.sv", "vvp -n test.vvp",
    "test.vvp", false },
};

struct sf_image
{
  char lang[32]; /* "" for every language */
  char ref[256];
};

struct sf
{
  struct wrd *d;
  struct wr_httpd *guard; /* with a token */
  struct evhttp *http;    /* without one */
  char token[256];
  struct sockaddr_un loop; /* our private socket on the daemon's unix server */
  struct sf_image images[WRD_COMPAT_SF_MAX_IMAGES];
  size_t n_images;
  int port; /* bound: published in the node's cluster status (compat_port) */
};

static struct sf *g_sf;

struct sf_file
{
  char *name;
  char *data;
  size_t len;
  unsigned mode;
};

struct sf_files
{
  struct sf_file *v;
  size_t n;
};

enum sf_stage
{
  STAGE_COMPILE,
  STAGE_RUN,
  STAGE_FETCH_RUN,
  STAGE_JUPYTER,
};

struct sf_req
{
  struct sf *s;
  struct evhttp_request *req;
  struct evhttp_connection *evcon;
  const struct sf_lang *lang;
  char image[256];
  json_t *code;  /* string (run_code) */
  json_t *cells; /* array (run_jupyter) */
  char *in;
  size_t in_len;
  struct sf_files files, arts;
  json_t *fetch; /* array of strings */
  double compile_timeout, run_timeout;
  unsigned memory_mb;
  enum sf_stage stage;
  json_t *compile_result, *run_result, *out_files;
  char in_ref[WRD_FNCALL_REF_LEN + 1]; /* the stage input staged for the call in flight */
  struct bufferevent *bev;             /* the loopback call in flight */
  struct event *hangup;                /* the client's socket closed (EV_CLOSED) */
};

/* ---- small helpers ---- */

static void
files_free (struct sf_files *f)
{
  for (size_t i = 0; i < f->n; i++)
    {
      free (f->v[i].name);
      free (f->v[i].data);
    }
  free (f->v);
  f->v = NULL;
  f->n = 0;
}

static int
files_add (struct sf_files *f, const char *name, size_t name_len, const void *data, size_t len,
           unsigned mode)
{
  struct sf_file *v = realloc (f->v, (f->n + 1) * sizeof *v);
  if (v == NULL)
    return -ENOMEM;
  f->v = v;
  struct sf_file *x = &v[f->n];
  x->name = strndup (name, name_len);
  x->data = malloc (len ? len : 1);
  if (x->name == NULL || x->data == NULL)
    {
      free (x->name);
      free (x->data);
      return -ENOMEM;
    }
  memcpy (x->data, data, len);
  x->len = len;
  x->mode = mode;
  f->n++;
  return 0;
}

/* A JSON string from bytes that may not be UTF-8: invalid sequences become
 * U+FFFD (SandboxFusion decodes output the same lossy way). */
static json_t *
sf_string (const void *buf, size_t n)
{
  const unsigned char *p = buf;
  if (wr_utf8_valid (p, n))
    return json_stringn (buf, n);
  struct evbuffer *b = evbuffer_new ();
  for (size_t i = 0; i < n;)
    {
      unsigned char c = p[i];
      size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
      if (k == 1)
        {
          evbuffer_add (b, &p[i], 1);
          i++;
          continue;
        }
      if (k > 1 && i + k <= n && wr_utf8_valid (&p[i], k))
        {
          evbuffer_add (b, &p[i], k);
          i += k;
          continue;
        }
      evbuffer_add (b, "\xef\xbf\xbd", 3);
      i++;
    }
  size_t len = evbuffer_get_length (b);
  json_t *j = json_stringn_nocheck ((const char *)evbuffer_pullup (b, -1), len);
  evbuffer_free (b);
  return j;
}

/* Bytes of a /v1/calls result field (decoded when it travelled base64). */
static char *
result_bytes (json_t *res, const char *field, size_t *ret_len)
{
  json_t *v = json_object_get (res, field);
  const char *s = json_string_value (v);
  size_t n = json_string_length (v);
  char enc_field[64];
  snprintf (enc_field, sizeof enc_field, "%s_encoding", field);
  const char *enc = json_string_value (json_object_get (res, enc_field));
  char *out = malloc (n + 4);
  if (out == NULL)
    return NULL;
  if (s && enc && strcmp (enc, "base64") == 0)
    {
      long k = wr_b64_decode (s, n, out);
      n = k < 0 ? 0 : (size_t)k;
    }
  else if (s)
    memcpy (out, s, n);
  else
    n = 0;
  out[n] = '\0';
  *ret_len = n;
  return out;
}

/* A relative path without "..": where a file lands in the scratch dir. */
static bool
path_ok (const char *p)
{
  if (p[0] == '\0' || p[0] == '/' || strlen (p) > 250 || strchr (p, '\n'))
    return false;
  for (const char *s = p; s; s = strchr (s, '/') ? strchr (s, '/') + 1 : NULL)
    if (strncmp (s, "..", 2) == 0 && (s[2] == '/' || s[2] == '\0'))
      return false;
  return true;
}

/* ---- tar (ustar) in and out ---- */

static void
tar_add (struct evbuffer *b, const char *name, const void *data, size_t len, unsigned mode)
{
  char h[512] = { 0 };
  size_t nl = strlen (name);
  const char *base = name;
  if (nl > 100)
    {
      /* split "prefix/name" at a slash: prefix <= 155, name <= 100 */
      const char *s = strchr (name + nl - 100, '/');
      if (s && (size_t)(s - name) <= 155)
        {
          memcpy (h + 345, name, (size_t)(s - name));
          base = s + 1;
        }
    }
  memcpy (h, base, strnlen (base, 100));
  snprintf (h + 100, 8, "%07o", mode & 07777);
  snprintf (h + 108, 8, "%07o", 0u);
  snprintf (h + 116, 8, "%07o", 0u);
  snprintf (h + 124, 12, "%011llo", (unsigned long long)len);
  snprintf (h + 136, 12, "%011llo", (unsigned long long)time (NULL));
  h[156] = '0';
  memcpy (h + 257, "ustar", 6);
  memcpy (h + 263, "00", 2);
  memset (h + 148, ' ', 8);
  unsigned sum = 0;
  for (size_t i = 0; i < 512; i++)
    sum += (unsigned char)h[i];
  snprintf (h + 148, 8, "%06o", sum);
  evbuffer_add (b, h, 512);
  evbuffer_add (b, data, len);
  static const char zero[512];
  if (len % 512)
    evbuffer_add (b, zero, 512 - len % 512);
}

static unsigned long long
tar_octal (const char *p, size_t n)
{
  unsigned long long v = 0;
  for (size_t i = 0; i < n && p[i]; i++)
    if (p[i] >= '0' && p[i] <= '7')
      v = v * 8 + (unsigned)(p[i] - '0');
  return v;
}

/* Regular files of a tar archive (ustar, GNU long names); -1 if malformed. */
static int
tar_read (const char *buf, size_t n, struct sf_files *ret)
{
  char longname[4096] = "";
  size_t off = 0;
  while (off + 512 <= n)
    {
      const char *h = buf + off;
      if (h[0] == '\0')
        return 0; /* end of archive */
      unsigned long long size = tar_octal (h + 124, 12);
      if (size > n - off - 512)
        return -1;
      const char *data = h + 512;
      char name[512];
      if (longname[0])
        snprintf (name, sizeof name, "%s", longname);
      else if (h[345])
        snprintf (name, sizeof name, "%.155s/%.100s", h + 345, h);
      else
        snprintf (name, sizeof name, "%.100s", h);
      longname[0] = '\0';
      if (h[156] == 'L')
        snprintf (longname, sizeof longname, "%.*s", (int)(size < 4095 ? size : 4095), data);
      else if (h[156] == '0' || h[156] == '\0')
        {
          const char *nm = name;
          while (strncmp (nm, "./", 2) == 0)
            nm += 2;
          if (files_add (ret, nm, strlen (nm), data, size, (unsigned)tar_octal (h + 100, 8)) < 0)
            return -1;
        }
      off += 512 + (size + 511) / 512 * 512;
    }
  return 0;
}

static const struct sf_file *
files_find (const struct sf_files *f, const char *name)
{
  for (size_t i = 0; i < f->n; i++)
    if (strcmp (f->v[i].name, name) == 0)
      return &f->v[i];
  return NULL;
}

/* ---- replies ---- */

static void
sf_reply (struct evhttp_request *req, int status, json_t *j)
{
  struct evbuffer *b = evbuffer_new ();
  char *text = json_dumps (j, JSON_COMPACT | JSON_ENCODE_ANY);
  if (text)
    evbuffer_add (b, text, strlen (text));
  free (text);
  json_decref (j);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type", "application/json");
  evhttp_send_reply (req, status, NULL, b);
  evbuffer_free (b);
}

/* FastAPI's shape for a request that fails validation. */
static void
sf_reply_invalid (struct evhttp_request *req, const char *field, const char *msg)
{
  sf_reply (req, 422,
            json_pack ("{s:[{s:s,s:[s,s],s:s}]}", "detail", "type", "value_error", "loc", "body",
                       field, "msg", msg));
}

static void
req_free (struct sf_req *r)
{
  if (r->evcon)
    evhttp_connection_set_closecb (r->evcon, NULL, NULL);
  if (r->bev)
    bufferevent_free (r->bev);
  if (r->hangup)
    event_free (r->hangup);
  wrd_fncall_unstage (r->s->d, r->in_ref); /* if its call never took it */
  json_decref (r->code);
  json_decref (r->cells);
  json_decref (r->fetch);
  json_decref (r->compile_result);
  json_decref (r->run_result);
  json_decref (r->out_files);
  free (r->in);
  files_free (&r->files);
  files_free (&r->arts);
  free (r);
}

static json_t *
stage_error (const char *msg)
{
  return json_pack ("{s:s,s:n,s:n,s:n,s:s}", "status", "Error", "execution_time", "return_code",
                    "stdout", "stderr", msg);
}

/* sandbox_api.py's parse_run_status: an Error stage is a SandboxError (its
 * stderr the message), then any time limit or non-zero code is Failed. */
static void
reply_run_code (struct sf_req *r)
{
  const char *status = "Success", *message = "";
  json_t *stages[2] = { r->compile_result, r->run_result };
  for (int pass = 0; pass < 3 && strcmp (status, "Success") == 0; pass++)
    for (size_t i = 0; i < 2; i++)
      {
        json_t *st = stages[i];
        if (st == NULL || json_is_null (st))
          continue;
        const char *s = json_string_value (json_object_get (st, "status"));
        json_t *rc = json_object_get (st, "return_code");
        if (pass == 0 && s && strcmp (s, "Error") == 0)
          {
            status = "SandboxError";
            message = json_string_value (json_object_get (st, "stderr"));
            break;
          }
        if ((pass == 1 && s && strcmp (s, "TimeLimitExceeded") == 0)
            || (pass == 2 && json_is_integer (rc) && json_integer_value (rc) != 0))
          {
            status = "Failed";
            break;
          }
      }
  json_t *j = json_pack ("{s:s,s:s,s:O?,s:O?,s:n,s:O?}", "status", status, "message",
                         message ? message : "", "compile_result", r->compile_result, "run_result",
                         r->run_result, "executor_pod_name", "files", r->out_files);
  if (r->out_files == NULL)
    json_object_set_new (j, "files", json_object ());
  sf_reply (r->req, 200, j);
  req_free (r);
}

static void
reply_sandbox_error (struct sf_req *r, const char *msg)
{
  if (r->cells)
    {
      sf_reply (r->req, 200,
                json_pack ("{s:s,s:s,s:n,s:[],s:n,s:{}}", "status", "SandboxError", "message", msg,
                           "driver", "cells", "executor_pod_name", "files"));
      req_free (r);
      return;
    }
  json_decref (r->run_result);
  r->run_result = r->stage == STAGE_COMPILE ? NULL : stage_error (msg);
  if (r->stage == STAGE_COMPILE)
    {
      json_decref (r->compile_result);
      r->compile_result = stage_error (msg);
    }
  reply_run_code (r);
}

/* ---- the loopback call ---- */

static void stage_done (struct sf_req *r, int http_status, json_t *res, const char *errmsg);

static void
loop_event (struct bufferevent *bev, short what, void *arg)
{
  struct sf_req *r = arg;
  if (what & BEV_EVENT_CONNECTED)
    return;
  struct evbuffer *in = bufferevent_get_input (bev);
  size_t n = evbuffer_get_length (in);
  const char *buf = n ? (const char *)evbuffer_pullup (in, -1) : NULL;
  int status = 0;
  json_t *res = NULL;
  if ((what & BEV_EVENT_EOF) && buf && n > 12 && strncmp (buf, "HTTP/1.", 7) == 0)
    {
      status = atoi (buf + 9);
      const char *body = memmem (buf, n, "\r\n\r\n", 4);
      if (body)
        res = json_loadb (body + 4, n - (size_t)(body + 4 - buf), 0, NULL);
    }
  bufferevent_free (bev);
  r->bev = NULL;
  if (res == NULL || !json_is_object (res))
    {
      json_decref (res);
      stage_done (r, 0, NULL, "the node's fncall API did not answer");
      return;
    }
  stage_done (r, status, res, NULL);
  json_decref (res);
}

/* POST body to the daemon's /v1/calls; stage_done gets the answer. */
static int
loop_call (struct sf_req *r, json_t *body)
{
  char *text = json_dumps (body, JSON_COMPACT);
  json_decref (body);
  if (text == NULL)
    return -ENOMEM;
  size_t len = strlen (text);
  struct bufferevent *bev
      = bufferevent_socket_new (r->s->d->base, -1, BEV_OPT_CLOSE_ON_FREE | BEV_OPT_DEFER_CALLBACKS);
  if (bev == NULL)
    {
      free (text);
      return -ENOMEM;
    }
  evbuffer_add_printf (bufferevent_get_output (bev),
                       "POST /v1/calls HTTP/1.0\r\nHost: warren\r\nContent-Type: "
                       "application/json\r\nContent-Length: %zu\r\n\r\n",
                       len);
  evbuffer_add (bufferevent_get_output (bev), text, len);
  free (text);
  bufferevent_setcb (bev, NULL, NULL, loop_event, r);
  bufferevent_enable (bev, EV_READ | EV_WRITE);
  if (bufferevent_socket_connect (bev, (struct sockaddr *)&r->s->loop, sizeof r->s->loop) < 0)
    {
      bufferevent_free (bev);
      return -ECONNREFUSED;
    }
  r->bev = bev;
  return 0;
}

/* The SandboxFusion client hung up: drop the call (closing the loopback
 * connection makes fncall drop or kill it). */
static void
client_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct sf_req *r = arg;
  r->evcon = NULL;
  req_free (r);
}

/* evhttp stops reading a connection while its request is served, so it
 * would notice a hang-up only when the answer is written: watch the socket
 * for the peer's close (EPOLLRDHUP) meanwhile. */
static void
client_hangup (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sf_req *r = arg;
  wrd_log (WRD_LOG_DEBUG, "compat: client hung up, dropping its call");
  struct evhttp_connection *evcon = r->evcon;
  req_free (r); /* unhooks the close callback first */
  if (evcon)
    evhttp_connection_free (evcon); /* frees its pending request */
}

/* ---- stages ---- */

static json_t *
call_body (struct sf_req *r, double timeout_s)
{
  if (timeout_s < 0.001)
    timeout_s = 0.001;
  if (timeout_s > SF_MAX_TIMEOUT_S)
    timeout_s = SF_MAX_TIMEOUT_S;
  return json_pack ("{s:s,s:f,s:I,s:I,s:I}", "image", r->image, "timeout_s", timeout_s, "memory_mb",
                    (json_int_t)r->memory_mb, "stdout_cap", (json_int_t)SF_OUT_CAP, "stderr_cap",
                    (json_int_t)SF_OUT_CAP);
}

/* data (malloc'd, taken) becomes the stdin of the call posted next: staged
 * in-process and named by "stdin_ref" in the call's body. */
static int
stage_stdin (struct sf_req *r, json_t *body, char *data, size_t len)
{
  wr_err_t err;
  wrd_fncall_unstage (r->s->d, r->in_ref);
  r->in_ref[0] = '\0';
  if (wrd_fncall_stage (r->s->d, data, len, r->in_ref, &err) < 0)
    return -ENOMEM;
  json_object_set_new (body, "stdin_ref", json_string (r->in_ref));
  return 0;
}

/* A stage's inputs as the tar its shell unpacks (its stdin). */
static int
set_stage_input (struct sf_req *r, json_t *body, bool with_run_inputs)
{
  struct evbuffer *b = evbuffer_new ();
  if (b == NULL)
    return -ENOMEM;
  for (size_t i = 0; i < r->files.n; i++)
    tar_add (b, r->files.v[i].name, r->files.v[i].data, r->files.v[i].len, 0644);
  tar_add (b, r->lang->src, json_string_value (r->code), json_string_length (r->code), 0644);
  if (with_run_inputs)
    {
      for (size_t i = 0; i < r->arts.n; i++)
        tar_add (b, r->arts.v[i].name, r->arts.v[i].data, r->arts.v[i].len, r->arts.v[i].mode);
      tar_add (b, ".wr-sf-in", r->in ? r->in : "", r->in_len, 0600);
      struct evbuffer *list = evbuffer_new ();
      size_t i;
      json_t *v;
      json_array_foreach (r->fetch, i, v)
      {
        const char *p = json_string_value (v);
        while (*p == '/')
          p++; /* absolute paths are looked up in the scratch dir */
        evbuffer_add_printf (list, "%s\n", p);
      }
      tar_add (b, ".wr-sf-fetch", evbuffer_pullup (list, -1), evbuffer_get_length (list), 0600);
      evbuffer_free (list);
    }
  static const char zero[1024];
  evbuffer_add (b, zero, sizeof zero);
  size_t n = evbuffer_get_length (b);
  char *data = malloc (n);
  int rc = data && evbuffer_remove (b, data, n) == (int)n ? 0 : -ENOMEM;
  evbuffer_free (b);
  if (rc < 0)
    {
      free (data);
      return rc;
    }
  return stage_stdin (r, body, data, n);
}

static void
stage_start_failed (struct sf_req *r, int rc)
{
  char msg[200];
  snprintf (msg, sizeof msg, "cannot reach the node's fncall API: %s", strerror (-rc));
  reply_sandbox_error (r, msg);
}

static void
stage_start (struct sf_req *r, enum sf_stage stage)
{
  r->stage = stage;
  char script[2048];
  json_t *body;
  int rc = 0;
  /* a shell variable, not exported: SF_JVM's heap, a third of the limit */
  char heap[64];
  snprintf (heap, sizeof heap, "WR_SF_HEAP=-Xmx%um\n", r->memory_mb / 3 < 8 ? 8 : r->memory_mb / 3);
  if (stage == STAGE_COMPILE)
    {
      body = call_body (r, r->compile_timeout);
      /* the compiler's stdout joins its stderr: stdout carries the artifacts */
      snprintf (script, sizeof script, "%star xf - && { %s\n} 1>&2 && exec tar cf - %s", heap,
                r->lang->compile, r->lang->artifacts);
      rc = set_stage_input (r, body, false);
    }
  else if (stage == STAGE_FETCH_RUN)
    {
      body = call_body (r, r->run_timeout + SF_FETCH_SLACK_S);
      snprintf (script, sizeof script,
                "%s"
                "tar xf - && exec <.wr-sf-in && rm -f .wr-sf-in || exit 125\n"
                "timeout -k 1 %.3f %s >.wr-sf-out 2>.wr-sf-err\n"
                "echo $? >.wr-sf-rc\n"
                "while IFS= read -r f; do [ -f \"$f\" ] && printf '%%s\\n' \"$f\"; done "
                "<.wr-sf-fetch >.wr-sf-list\n"
                "exec tar cf - .wr-sf-out .wr-sf-err .wr-sf-rc -T .wr-sf-list\n",
                heap, r->run_timeout < 0.001 ? 0.001 : r->run_timeout, r->lang->run);
      rc = set_stage_input (r, body, true);
    }
  else
    {
      body = call_body (r, r->run_timeout);
      snprintf (script, sizeof script,
                "%star xf - && exec <.wr-sf-in && rm -f .wr-sf-in .wr-sf-fetch && exec %s", heap,
                r->lang->run);
      rc = set_stage_input (r, body, true);
    }
  json_object_set_new (body, "shell", json_string (script));
  if (rc == 0)
    rc = loop_call (r, body);
  else
    json_decref (body);
  if (rc < 0)
    stage_start_failed (r, rc);
}

/* CommandRunResult from a /v1/calls result. */
static json_t *
command_result (json_t *res, const char *out, size_t out_len, const char *err, size_t err_len)
{
  bool tle = json_is_true (json_object_get (res, "timed_out"));
  json_int_t code = json_integer_value (json_object_get (res, "exit_code"));
  json_t *sig = json_object_get (res, "signal");
  if (json_is_integer (sig) && json_integer_value (sig) > 0)
    code = -json_integer_value (sig); /* like Python's returncode */
  double secs = json_number_value (json_object_get (res, "duration_ms")) / 1000.0;
  return json_pack ("{s:s,s:f,s:o,s:o,s:o}", "status", tle ? "TimeLimitExceeded" : "Finished",
                    "execution_time", secs, "return_code", tle ? json_null () : json_integer (code),
                    "stdout", sf_string (out, out_len), "stderr", sf_string (err, err_len));
}

static void jupyter_done (struct sf_req *r, json_t *res);

static void
stage_done (struct sf_req *r, int http_status, json_t *res, const char *errmsg)
{
  if (errmsg || http_status != 200)
    {
      char msg[700];
      const char *m
          = json_string_value (json_object_get (json_object_get (res, "error"), "message"));
      snprintf (msg, sizeof msg, "warren fncall: %s (HTTP %d)",
                errmsg ? errmsg
                : m    ? m
                       : "error",
                http_status);
      reply_sandbox_error (r, msg);
      return;
    }
  if (r->stage == STAGE_JUPYTER)
    {
      jupyter_done (r, res);
      return;
    }
  size_t on = 0, en = 0;
  _cleanup_free_ char *out = result_bytes (res, "stdout", &on);
  _cleanup_free_ char *err = result_bytes (res, "stderr", &en);
  if (out == NULL || err == NULL)
    {
      reply_sandbox_error (r, "out of memory");
      return;
    }
  if (r->stage == STAGE_COMPILE)
    {
      r->compile_result = command_result (res, "", 0, err, en);
      json_t *rc = json_object_get (r->compile_result, "return_code");
      if (!json_is_integer (rc) || json_integer_value (rc) != 0)
        {
          reply_run_code (r);
          return;
        }
      if (tar_read (out, on, &r->arts) < 0 || r->arts.n == 0)
        {
          reply_sandbox_error (r, "the compile stage produced no artifact");
          return;
        }
      stage_start (r, json_array_size (r->fetch) ? STAGE_FETCH_RUN : STAGE_RUN);
      return;
    }
  if (r->stage == STAGE_RUN)
    {
      r->run_result = command_result (res, out, on, err, en);
      reply_run_code (r);
      return;
    }
  /* fetch mode: the program's output, status and files came back as a tar */
  struct sf_files got = { 0 };
  const struct sf_file *fo, *fe, *frc;
  if (json_is_true (json_object_get (res, "timed_out")) || tar_read (out, on, &got) < 0
      || (fo = files_find (&got, ".wr-sf-out")) == NULL
      || (fe = files_find (&got, ".wr-sf-err")) == NULL
      || (frc = files_find (&got, ".wr-sf-rc")) == NULL)
    {
      files_free (&got);
      char msg[400];
      snprintf (msg, sizeof msg, "the run stage did not report (exit %lld): %.*s",
                (long long)json_integer_value (json_object_get (res, "exit_code")),
                (int)(en < 300 ? en : 300), err);
      reply_sandbox_error (r, msg);
      return;
    }
  int rc = atoi (frc->data);
  bool tle = rc == 124; /* timeout(1)'s own status */
  if (rc > 128)
    rc = -(rc - 128); /* killed by a signal */
  r->run_result = json_pack (
      "{s:s,s:f,s:o,s:o,s:o}", "status", tle ? "TimeLimitExceeded" : "Finished", "execution_time",
      json_number_value (json_object_get (res, "duration_ms")) / 1000.0, "return_code",
      tle ? json_null () : json_integer (rc), "stdout", sf_string (fo->data, fo->len), "stderr",
      sf_string (fe->data, fe->len));
  r->out_files = json_object ();
  size_t i;
  json_t *v;
  json_array_foreach (r->fetch, i, v)
  {
    const char *p = json_string_value (v), *q = p;
    while (*q == '/')
      q++;
    const struct sf_file *f = files_find (&got, q);
    if (f == NULL)
      continue;
    char *enc = malloc (wr_b64_encoded_len (f->len) + 1);
    if (enc)
      {
        wr_b64_encode (f->data, f->len, enc);
        json_object_set_new (r->out_files, p, json_string (enc));
        free (enc);
      }
  }
  files_free (&got);
  reply_run_code (r);
}

/* ---- /run_jupyter: a driver script in the Python zygote ---- */

static const char jupyter_driver[]
    = "import ast, base64, io, json, os, sys, traceback\n"
      "R = json.loads(b''.join(iter(lambda: os.read(0, 1 << 20), b'')))\n"
      "for p, c in R['files'].items():\n"
      "    if os.path.dirname(p):\n"
      "        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
      "    with open(p, 'wb') as f:\n"
      "        f.write(base64.b64decode(c))\n"
      "g = {'__name__': '__main__', '__builtins__': __builtins__}\n"
      "so, se = sys.stdout, sys.stderr\n"
      "cells = []\n"
      "for src in R['cells']:\n"
      "    o, e = io.StringIO(), io.StringIO()\n"
      "    res = {'stdout': '', 'stderr': '', 'display': [], 'error': []}\n"
      "    sys.stdout, sys.stderr = o, e\n"
      "    try:\n"
      "        t = ast.parse(src, '<cell>', 'exec')\n"
      "        last = None\n"
      "        if t.body and isinstance(t.body[-1], ast.Expr):\n"
      "            last = ast.Expression(t.body.pop().value)\n"
      "        exec(compile(t, '<cell>', 'exec'), g)\n"
      "        if last is not None:\n"
      "            v = eval(compile(last, '<cell>', 'eval'), g)\n"
      "            if v is not None:\n"
      "                res['display'].append({'text/plain': repr(v)})\n"
      "    except BaseException as x:\n"
      "        res['error'].append({'ename': type(x).__name__, 'evalue': str(x),\n"
      "                             'traceback': traceback.format_exception(x)})\n"
      "    finally:\n"
      "        sys.stdout, sys.stderr = so, se\n"
      "    res['stdout'], res['stderr'] = o.getvalue(), e.getvalue()\n"
      "    cells.append(res)\n"
      "files = {}\n"
      "for p in R['fetch']:\n"
      "    try:\n"
      "        with open(p, 'rb') as f:\n"
      "            files[p] = base64.b64encode(f.read()).decode()\n"
      "    except OSError:\n"
      "        pass\n"
      "so.flush()\n"
      "os.write(1, b'" SF_JUPYTER_MARK
      "' + json.dumps({'cells': cells, 'files': files}).encode())\n";

static void
jupyter_done (struct sf_req *r, json_t *res)
{
  size_t on = 0, en = 0;
  _cleanup_free_ char *out = result_bytes (res, "stdout", &on);
  _cleanup_free_ char *err = result_bytes (res, "stderr", &en);
  if (out == NULL || err == NULL)
    {
      reply_sandbox_error (r, "out of memory");
      return;
    }
  /* the last mark: cells may print anything before it */
  const char *mark = NULL;
  size_t ml = sizeof SF_JUPYTER_MARK - 1;
  for (const char *p = out; (p = memmem (p, on - (size_t)(p - out), SF_JUPYTER_MARK, ml)); p += ml)
    mark = p;
  size_t driver_len = mark ? (size_t)(mark - out) : on;
  json_t *driver = command_result (res, out, driver_len, err, en);
  json_t *result = mark ? json_loadb (mark + ml, on - driver_len - ml, 0, NULL) : NULL;
  const char *st = json_string_value (json_object_get (driver, "status"));
  json_t *j;
  if (strcmp (st, "Finished") != 0 || result == NULL)
    j = json_pack ("{s:s,s:s,s:o,s:[],s:n,s:{}}", "status", "Failed", "message", "", "driver",
                   driver, "cells", "executor_pod_name", "files");
  else
    j = json_pack ("{s:s,s:s,s:o,s:O,s:n,s:O}", "status", "Success", "message", "", "driver",
                   driver, "cells", json_object_get (result, "cells"), "executor_pod_name", "files",
                   json_object_get (result, "files"));
  if (j == NULL)
    j = json_pack ("{s:s,s:s,s:n,s:[],s:n,s:{}}", "status", "SandboxError", "message",
                   "the Jupyter driver's result is malformed", "driver", "cells",
                   "executor_pod_name", "files");
  json_decref (result);
  sf_reply (r->req, 200, j);
  req_free (r);
}

static void
jupyter_start (struct sf_req *r, double total_timeout, json_t *files_b64)
{
  r->stage = STAGE_JUPYTER;
  json_t *payload
      = json_pack ("{s:O,s:O,s:O}", "cells", r->cells, "files", files_b64, "fetch", r->fetch);
  char *text = json_dumps (payload, JSON_COMPACT);
  json_decref (payload);
  json_t *body = call_body (r, total_timeout);
  json_object_set_new (body, "lang", json_string ("python"));
  json_object_set_new (body, "code", json_string (jupyter_driver));
  /* the cells and files reach the driver on its stdin */
  int rc = text ? stage_stdin (r, body, text, strlen (text)) : -ENOMEM;
  if (rc == 0)
    rc = loop_call (r, body);
  else
    json_decref (body);
  if (rc < 0)
    stage_start_failed (r, rc);
}

/* ---- request parsing ---- */

static const char *
image_for (struct sf *s, const char *lang)
{
  const char *any = SF_DEFAULT_IMAGE;
  for (size_t i = 0; i < s->n_images; i++)
    {
      if (strcmp (s->images[i].lang, lang) == 0)
        return s->images[i].ref;
      if (s->images[i].lang[0] == '\0')
        any = s->images[i].ref;
    }
  return any;
}

static bool
get_number (json_t *body, const char *field, double def, double *ret)
{
  json_t *v = json_object_get (body, field);
  if (v == NULL || json_is_null (v))
    {
      *ret = def;
      return true;
    }
  if (!json_is_number (v))
    return false;
  *ret = json_number_value (v);
  return true;
}

/* Why a request is refused: a 422 naming a field (pydantic's validation), or
 * a SandboxError (what SandboxFusion answers when its runner raises). */
struct sf_refusal
{
  const char *field; /* NULL: a SandboxError */
  char msg[400];
};

static bool refuse (struct sf_refusal *why, const char *field, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));
static bool
refuse (struct sf_refusal *why, const char *field, const char *fmt, ...)
{
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (why->msg, sizeof why->msg, fmt, ap);
  va_end (ap);
  why->field = field;
  return false;
}

/* Answer a refused request and free it. */
static void
reply_refusal (struct sf_req *r, const struct sf_refusal *why)
{
  if (why->field == NULL)
    {
      reply_sandbox_error (r, why->msg);
      return;
    }
  sf_reply_invalid (r->req, why->field, why->msg);
  req_free (r);
}

/* Fields common to /run_code and /run_jupyter. */
static bool
parse_common (struct sf_req *r, json_t *body, json_t **ret_files_b64, struct sf_refusal *why)
{
  double mem;
  if (!get_number (body, "memory_limit_MB", -1, &mem))
    {
      return refuse (why, "memory_limit_MB", "Input should be a valid integer");
    }
  r->memory_mb = mem > 0 ? (mem < 16      ? 16
                            : mem > 65536 ? 65536
                                          : (unsigned)mem)
                         : SF_DEFAULT_MEMORY_MB;
  json_t *files = json_object_get (body, "files");
  if (files && !json_is_null (files) && !json_is_object (files))
    {
      return refuse (why, "files", "Input should be a valid dictionary");
    }
  json_t *fetch = json_object_get (body, "fetch_files");
  r->fetch = json_array ();
  if (fetch && !json_is_null (fetch))
    {
      size_t i;
      json_t *v;
      if (!json_is_array (fetch))
        return refuse (why, "fetch_files", "Input should be a valid list");
      json_array_foreach (fetch, i, v)
      {
        if (!json_is_string (v))
          return refuse (why, "fetch_files", "Input should be a valid string");
        const char *p = json_string_value (v);
        while (*p == '/')
          p++;
        if (path_ok (p))
          json_array_append (r->fetch, v);
      }
    }
  json_t *b64 = json_object ();
  const char *name;
  json_t *v;
  json_object_foreach (files, name, v)
  {
    if (json_is_null (v))
      continue; /* SandboxFusion skips these too */
    if (!json_is_string (v))
      {
        json_decref (b64);
        return refuse (why, "files", "Input should be a valid string");
      }
    if (!path_ok (name) || strstr (name, "IGNORE_THIS_FILE"))
      {
        if (strstr (name, "IGNORE_THIS_FILE"))
          continue;
        json_decref (b64);
        return refuse (why, NULL,
                       "file path %.200s: Warren writes files relative to the run directory only "
                       "(no absolute paths, no ..)",
                       name);
      }
    size_t n = json_string_length (v);
    _cleanup_free_ char *data = malloc (n + 4);
    long k = data ? wr_b64_decode (json_string_value (v), n, data) : -1;
    if (k < 0 || files_add (&r->files, name, strlen (name), data, (size_t)k, 0644) < 0)
      {
        json_decref (b64);
        return refuse (why, NULL, "file %.200s: content is not valid base64", name);
      }
    json_object_set (b64, name, v);
  }
  *ret_files_b64 = b64;
  return true;
}

static void
handle_run_code (struct sf *s, struct sf_req *r, json_t *body)
{
  json_t *code = json_object_get (body, "code");
  if (!json_is_string (code))
    {
      sf_reply_invalid (r->req, "code", code ? "Input should be a valid string" : "Field required");
      req_free (r);
      return;
    }
  r->code = json_incref (code);
  json_t *lang = json_object_get (body, "language");
  const char *ln = json_is_string (lang) ? json_string_value (lang) : "python";
  if (lang && !json_is_null (lang) && !json_is_string (lang))
    {
      sf_reply_invalid (r->req, "language", "Input should be a valid string");
      req_free (r);
      return;
    }
  json_t *in = json_object_get (body, "stdin");
  if (in && !json_is_null (in) && !json_is_string (in))
    {
      sf_reply_invalid (r->req, "stdin", "Input should be a valid string");
      req_free (r);
      return;
    }
  if (!get_number (body, "compile_timeout", 10, &r->compile_timeout)
      || !get_number (body, "run_timeout", 10, &r->run_timeout))
    {
      sf_reply_invalid (r->req, "run_timeout", "Input should be a valid number");
      req_free (r);
      return;
    }
  r->stage = STAGE_RUN;
  for (size_t i = 0; i < WR_ARRAY_SIZE (langs); i++)
    if (strcmp (langs[i].name, ln) == 0)
      r->lang = &langs[i];
  if (r->lang == NULL)
    {
      char msg[300];
      snprintf (msg, sizeof msg, "language %.100s is not supported by this Warren node", ln);
      reply_sandbox_error (r, msg);
      return;
    }
  snprintf (r->image, sizeof r->image, "%s", image_for (s, r->lang->name));
  if (json_is_string (in))
    {
      r->in_len = json_string_length (in);
      r->in = malloc (r->in_len + 1);
      if (r->in)
        memcpy (r->in, json_string_value (in), r->in_len + 1);
    }
  json_t *files_b64 = NULL;
  struct sf_refusal why;
  if (!parse_common (r, body, &files_b64, &why))
    {
      reply_refusal (r, &why);
      return;
    }
  json_decref (files_b64);
  if (r->lang->zygote && r->files.n == 0 && json_array_size (r->fetch) == 0)
    {
      /* the fast path: a fork of the warm interpreter */
      json_t *b = call_body (r, r->run_timeout);
      json_object_set_new (b, "lang", json_string ("python"));
      json_object_set (b, "code", r->code);
      int rc = 0;
      if (r->in_len)
        {
          char *copy = malloc (r->in_len);
          if (copy)
            memcpy (copy, r->in, r->in_len);
          rc = copy ? stage_stdin (r, b, copy, r->in_len) : -ENOMEM;
        }
      if (rc == 0)
        rc = loop_call (r, b);
      else
        json_decref (b);
      if (rc < 0)
        stage_start_failed (r, rc);
      return;
    }
  if (r->lang->compile)
    stage_start (r, STAGE_COMPILE);
  else
    stage_start (r, json_array_size (r->fetch) ? STAGE_FETCH_RUN : STAGE_RUN);
}

static void
handle_run_jupyter (struct sf *s, struct sf_req *r, json_t *body)
{
  json_t *cells = json_object_get (body, "cells");
  size_t i;
  json_t *v;
  bool ok = json_is_array (cells);
  json_array_foreach (cells, i, v) ok &= json_is_string (v);
  if (!ok)
    {
      sf_reply_invalid (r->req, "cells", cells ? "Input should be a valid list" : "Field required");
      req_free (r);
      return;
    }
  json_t *kernel = json_object_get (body, "kernel");
  if (kernel && !json_is_null (kernel)
      && (!json_is_string (kernel) || strcmp (json_string_value (kernel), "python3") != 0))
    {
      sf_reply_invalid (r->req, "kernel", "Input should be 'python3'");
      req_free (r);
      return;
    }
  r->cells = json_incref (cells);
  double total;
  if (!get_number (body, "total_timeout", 45, &total))
    {
      sf_reply_invalid (r->req, "total_timeout", "Input should be a valid number");
      req_free (r);
      return;
    }
  snprintf (r->image, sizeof r->image, "%s", image_for (s, "python"));
  json_t *files_b64 = NULL;
  struct sf_refusal why;
  if (!parse_common (r, body, &files_b64, &why))
    {
      reply_refusal (r, &why);
      return;
    }
  jupyter_start (r, total, files_b64);
  json_decref (files_b64);
}

static void
sf_route (struct evhttp_request *req, void *arg)
{
  struct sf *s = arg;
  const char *uri = evhttp_request_get_uri (req);
  size_t plen = strcspn (uri, "?#");
  enum evhttp_cmd_type cmd = evhttp_request_get_command (req);
#define PATH_IS(p) (plen == sizeof (p) - 1 && strncmp (uri, p, plen) == 0)
  /* a body over the limit (sf_filter_in): SandboxFusion's shape, E2B's code */
  const char *too_large = evhttp_find_header (evhttp_request_get_input_headers (req), SF_TOO_LARGE);
  if (too_large)
    {
      char msg[200];
      snprintf (msg, sizeof msg, "the request body (%s bytes) is over Warren's %u MiB limit",
                too_large, SF_MAX_BODY >> 20);
      sf_reply (req, 413,
                json_pack ("{s:i,s:s,s:s,s:n,s:n,s:n,s:{}}", "code", 413, "status", "SandboxError",
                           "message", msg, "compile_result", "run_result", "executor_pod_name",
                           "files"));
      return;
    }
  if (PATH_IS ("/v1/ping") || PATH_IS ("/run_code") || PATH_IS ("/run_jupyter"))
    {
      bool ping = PATH_IS ("/v1/ping");
      if (cmd != (ping ? EVHTTP_REQ_GET : EVHTTP_REQ_POST))
        {
          sf_reply (req, 405, json_pack ("{s:s}", "detail", "Method Not Allowed"));
          return;
        }
      if (ping)
        {
          sf_reply (req, 200, json_string ("pong"));
          return;
        }
    }
  else
    {
      /* the same port serves E2B's APIs (docs/e2b.md) */
      if (!wrd_compat_e2b_route (req))
        sf_reply (req, 404, json_pack ("{s:s}", "detail", "Not Found"));
      return;
    }
  struct evbuffer *ib = evhttp_request_get_input_buffer (req);
  size_t n = evbuffer_get_length (ib);
  json_error_t jerr;
  json_t *body = json_loadb ((const char *)evbuffer_pullup (ib, -1), n, 0, &jerr);
  if (!json_is_object (body))
    {
      json_decref (body);
      sf_reply (req, 422,
                json_pack ("{s:[{s:s,s:[s],s:s}]}", "detail", "type", "json_invalid", "loc", "body",
                           "msg", "the body must be a JSON object"));
      return;
    }
  struct sf_req *r = calloc (1, sizeof *r);
  if (r == NULL)
    {
      json_decref (body);
      sf_reply (req, 503, json_pack ("{s:s}", "detail", "out of memory"));
      return;
    }
  r->s = s;
  r->req = req;
  r->evcon = evhttp_request_get_connection (req);
  evhttp_connection_set_closecb (r->evcon, client_closed, r);
  int cfd = bufferevent_getfd (evhttp_connection_get_bufferevent (r->evcon));
  if (cfd >= 0 && (r->hangup = event_new (s->d->base, cfd, EV_CLOSED, client_hangup, r)))
    event_add (r->hangup, NULL);
  if (PATH_IS ("/run_code"))
    handle_run_code (s, r, body);
  else
    handle_run_jupyter (s, r, body);
#undef PATH_IS
  json_decref (body);
}

/* ---- the listener ---- */

static void
sf_refused (struct evhttp_request *req, int status, const char *code WR_UNUSED, const char *msg,
            void *arg WR_UNUSED)
{
  sf_reply (req, status, json_pack ("{s:s}", "detail", msg));
}

static bool
sf_authorized (void *arg, const char *value, size_t len)
{
  struct sf *s = arg;
  return wr_bearer_matches (value, len, s->token);
}

/* E2B's SDK sends its API key as X-API-Key (and, once a sandbox answered
 * with an envdAccessToken, as X-Access-Token), never as a bearer token */
static bool
sf_key_authorized (void *arg, const char *value, size_t len)
{
  struct sf *s = arg;
  return wr_token_matches (value, len, s->token);
}

/* "tcp:ADDR:PORT", "tcp:PORT" or "PORT" -> "tcp:ADDR:PORT" (ADDR 127.0.0.1) */
static int
normalize_spec (const char *spec, char *out, size_t len, wr_err_t *err)
{
  const char *p = strncmp (spec, "tcp:", 4) == 0 ? spec + 4 : spec;
  if (strchr (p, ':') == NULL)
    snprintf (out, len, "tcp:127.0.0.1:%s", p);
  else if (p[0] == ':')
    snprintf (out, len, "tcp:127.0.0.1%s", p);
  else
    snprintf (out, len, "tcp:%s", p);
  const char *port = strrchr (out, ':') + 1;
  char *end;
  long v = strtol (port, &end, 10);
  if (*end || v <= 0 || v > 65535)
    return wr_error (err, 0, WR_E_INVALID, "--listen-compat wants tcp:ADDR:PORT, got %s", spec);
  return 0;
}

/* ---- bodies over SF_MAX_BODY ----
 *
 * evhttp answers a body over its limit with an HTML 413 and closes while
 * the client may still be sending (a reset). A filter under evhttp follows
 * the requests of each connection instead: the headers of one whose
 * Content-Length is over the limit are replaced, once its body has been
 * read and dropped, by a bodiless request that carries the length in
 * SF_TOO_LARGE, and sf_route answers that in SandboxFusion's shape. */

enum sf_conn_state
{
  SC_HEAD,  /* a request's header block, not complete yet */
  SC_BODY,  /* passing `left` body bytes to evhttp */
  SC_DRAIN, /* dropping `left` body bytes of a request over the limit */
  SC_PASS,  /* chunked or unparsable: evhttp's own limits from here on */
};

struct sf_conn
{
  enum sf_conn_state state;
  uint64_t left, too_large;
  size_t scanned;
  char path[128];
  struct bufferevent *bev; /* the filter, evhttp's side */
  struct event *kick;      /* flushes its output (sf_kick_cb) */
};

/* The header block's end in buf[0..n), or 0; its Content-Length (-1: none)
 * and whether it is chunked; the request line's path. */
static size_t
head_parse (struct sf_conn *t, const char *buf, size_t n, long long *ret_len, bool *ret_chunked)
{
  size_t end = 0;
  for (size_t i = t->scanned > 3 ? t->scanned - 3 : 0; i + 1 < n && end == 0; i++)
    if (buf[i] == '\n'
        && (buf[i + 1] == '\n' || (buf[i + 1] == '\r' && i + 2 < n && buf[i + 2] == '\n')))
      end = i + (buf[i + 1] == '\n' ? 2 : 3);
  if (end == 0)
    {
      t->scanned = n;
      return 0;
    }
  *ret_len = -1;
  *ret_chunked = false;
  t->path[0] = '\0';
  const char *sp = memchr (buf, ' ', end),
             *sp2 = sp ? memchr (sp + 1, ' ', end - (size_t)(sp + 1 - buf)) : NULL;
  if (sp && sp2)
    snprintf (t->path, sizeof t->path, "%.*s", (int)(sp2 - sp - 1), sp + 1);
  for (const char *p = memchr (buf, '\n', end); p && (size_t)(p - buf) + 1 < end;
       p = memchr (p + 1, '\n', end - (size_t)(p + 1 - buf)))
    {
      const char *h = p + 1;
      size_t room = end - (size_t)(h - buf);
      if (room > 15 && strncasecmp (h, "content-length:", 15) == 0)
        *ret_len = strtoll (h + 15, NULL, 10);
      else if (room > 18 && strncasecmp (h, "transfer-encoding:", 18) == 0)
        *ret_chunked = true;
    }
  t->scanned = 0;
  return end;
}

static enum bufferevent_filter_result
sf_filter_in (struct evbuffer *src, struct evbuffer *dst, ev_ssize_t lim WR_UNUSED,
              enum bufferevent_flush_mode mode WR_UNUSED, void *arg)
{
  struct sf_conn *t = arg;
  for (;;)
    {
      size_t len = evbuffer_get_length (src), k;
      if (len == 0)
        return BEV_OK;
      switch (t->state)
        {
        case SC_PASS:
          evbuffer_remove_buffer (src, dst, len);
          return BEV_OK;
        case SC_BODY:
        case SC_DRAIN:
          k = len < t->left ? len : (size_t)t->left;
          if (t->state == SC_BODY)
            evbuffer_remove_buffer (src, dst, k);
          else
            evbuffer_drain (src, k);
          t->left -= k;
          if (t->left == 0 && t->state == SC_DRAIN)
            {
              /* not "Connection: close": evhttp would free the connection
               * once its answer reached the socket's buffer, before it was
               * sent; the client closes after reading it */
              evbuffer_add_printf (dst,
                                   "POST %s HTTP/1.1\r\nHost: warren\r\n" SF_TOO_LARGE
                                   ": %llu\r\nContent-Length: 0\r\n\r\n",
                                   t->path, (unsigned long long)t->too_large);
              t->state = SC_HEAD;
            }
          else if (t->left == 0)
            t->state = SC_HEAD;
          continue;
        case SC_HEAD:
          break;
        }
      size_t n = len < WR_HTTPD_HEADER_MAX ? len : WR_HTTPD_HEADER_MAX;
      const char *buf = (const char *)evbuffer_pullup (src, (ev_ssize_t)n);
      long long cl;
      bool chunked;
      size_t end = head_parse (t, buf, n, &cl, &chunked);
      if (end == 0 && len < WR_HTTPD_HEADER_MAX)
        return BEV_NEED_MORE;
      if (end == 0 || chunked || t->path[0] != '/' || strchr (t->path, '\r'))
        {
          t->state = SC_PASS; /* evhttp refuses or bounds it */
          continue;
        }
      if (cl > (long long)SF_MAX_BODY)
        {
          evbuffer_drain (src, end);
          t->state = SC_DRAIN;
          t->left = t->too_large = (uint64_t)cl;
          continue;
        }
      evbuffer_remove_buffer (src, dst, end);
      if (cl > 0)
        {
          t->state = SC_BODY;
          t->left = (uint64_t)cl;
        }
    }
}

/* the filter holds output added before writing is enabled (common/httpd.h) */
static void
sf_kick_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sf_conn *t = arg;
  if (!wr_http_filter_closing (t->bev))
    bufferevent_flush (t->bev, EV_WRITE, BEV_NORMAL);
}

static void
sf_out_cb (struct evbuffer *b WR_UNUSED, const struct evbuffer_cb_info *info, void *arg)
{
  struct sf_conn *t = arg;
  if (info->n_added)
    event_active (t->kick, EV_TIMEOUT, 0);
}

static void
sf_conn_free (void *arg)
{
  struct sf_conn *t = arg;
  event_free (t->kick);
  free (t);
}

static struct bufferevent *
sf_bev_cb (struct event_base *base, void *arg WR_UNUSED)
{
  struct sf_conn *t = calloc (1, sizeof *t);
  struct bufferevent *u = t ? bufferevent_socket_new (base, -1, BEV_OPT_CLOSE_ON_FREE) : NULL;
  if (u)
    t->kick = event_new (base, -1, 0, sf_kick_cb, t);
  if (t && t->kick)
    t->bev
        = bufferevent_filter_new (u, sf_filter_in, wr_http_filter_out,
                                  BEV_OPT_CLOSE_ON_FREE | BEV_OPT_DEFER_CALLBACKS, sf_conn_free, t);
  if (t == NULL || t->bev == NULL)
    {
      if (u)
        bufferevent_free (u);
      if (t && t->kick)
        event_free (t->kick);
      free (t);
      return NULL;
    }
  evbuffer_add_cb (bufferevent_get_output (t->bev), sf_out_cb, t);
  evbuffer_add_cb (bufferevent_get_output (u), wr_http_sent_cb, t->bev);
  return t->bev;
}

/* Without a token: a plain evhttp on our own socket (a deep backlog for
 * bursts), with the daemon's setup calls. */
static int
listen_open (struct sf *s, const char *spec, wr_err_t *err)
{
  s->http = evhttp_new (s->d->base);
  if (s->http == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "evhttp_new");
  evhttp_set_gencb (s->http, sf_route, s);
  evhttp_set_max_body_size (s->http, SF_MAX_BODY);
  evhttp_set_bevcb (s->http, sf_bev_cb, s);
  evhttp_set_max_headers_size (s->http, WR_HTTPD_HEADER_MAX);
  evhttp_set_allowed_methods (s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD
                                           | EVHTTP_REQ_DELETE | EVHTTP_REQ_PUT);
  /* idle keep-alive connections close after this; a run may take an hour */
  evhttp_set_timeout (s->http, 3600);
  return wr_http_serve_tcp (s->http, spec, "--listen-compat", 4096, &s->port, err);
}

/* Our private socket on the daemon's owner-only unix server. */
static int
listen_loopback (struct sf *s, wr_err_t *err)
{
  struct wrd *d = s->d;
  if (d->http_unix == NULL)
    return wr_error (err, 0, WR_E_INTERNAL, "the daemon's unix listener is not up");
  s->loop.sun_family = AF_UNIX;
  if ((size_t)snprintf (s->loop.sun_path, sizeof s->loop.sun_path, "%s/compat-sf.sock", d->root)
      >= sizeof s->loop.sun_path)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "root path too long for a socket");
  _cleanup_close_ int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return wr_sys_error (err, "socket");
  unlink (s->loop.sun_path);
  mode_t old = umask (0077);
  int r = bind (fd, (struct sockaddr *)&s->loop, sizeof s->loop);
  umask (old);
  if (r < 0 || listen (fd, 4096) < 0)
    return wr_sys_error (err, "listen on %s", s->loop.sun_path);
  if (evhttp_accept_socket_with_handle (d->http_unix, fd) == NULL)
    return wr_error (err, 0, WR_E_INTERNAL, "cannot serve %s", s->loop.sun_path);
  fd = -1;
  return 0;
}

int
wrd_compat_sf_start (struct wrd *d, const struct wrd_compat_sf_config *cfg, wr_err_t *err)
{
  char spec[300];
  if (normalize_spec (cfg->listen, spec, sizeof spec, err) < 0)
    return -1;
  struct sf *s = calloc (1, sizeof *s);
  if (s == NULL)
    return wr_sys_error (err, "compat");
  s->d = d;
  for (size_t i = 0; i < cfg->n_images && i < WRD_COMPAT_SF_MAX_IMAGES; i++)
    {
      const char *eq = strchr (cfg->images[i], '=');
      struct sf_image *im = &s->images[s->n_images++];
      if (eq)
        snprintf (im->lang, sizeof im->lang, "%.*s", (int)(eq - cfg->images[i]), cfg->images[i]);
      snprintf (im->ref, sizeof im->ref, "%s", eq ? eq + 1 : cfg->images[i]);
    }
  int r = 0;
  if (cfg->token_file)
    {
      _cleanup_free_ char *tok = NULL;
      size_t len;
      if (wr_read_file_at (AT_FDCWD, cfg->token_file, &tok, &len, 4096) < 0)
        r = wr_sys_error (err, "cannot read %s", cfg->token_file);
      else
        {
          while (len && (tok[len - 1] == '\n' || tok[len - 1] == '\r' || tok[len - 1] == ' '))
            tok[--len] = '\0';
          if (len < 16 || len >= sizeof s->token)
            r = wr_error (err, 0, WR_E_INVALID, "token in %s must be 16..255 characters",
                          cfg->token_file);
          else
            memcpy (s->token, tok, len + 1);
        }
    }
  if (r == 0)
    r = listen_loopback (s, err);
  if (r == 0 && s->token[0])
    {
      struct wr_httpd_config hc = {
        .max_body = SF_MAX_BODY,
        .idle_timeout_s = 3600,
        .authorized = sf_authorized,
        .authorized_key = sf_key_authorized,
        .route = sf_route,
        .refused = sf_refused,
        .arg = s,
        .max_connections = 4096,
      };
      r = wr_httpd_new (d->base, &hc, &s->guard, err);
      if (r == 0)
        r = wr_httpd_bind (s->guard, spec, err);
      if (r == 0)
        s->port = wr_httpd_port (s->guard);
    }
  else if (r == 0)
    r = listen_open (s, spec, err);
  if (r < 0)
    {
      g_sf = s;
      wrd_compat_sf_stop (d);
      return -1;
    }
  g_sf = s;
  if (wrd_compat_e2b_attach (d, err) < 0)
    {
      wrd_compat_sf_stop (d);
      return -1;
    }
  if (s->token[0])
    wrd_compat_e2b_keyed (); /* sandboxes hand the key back as envdAccessToken */
  wrd_log (WRD_LOG_INFO, "SandboxFusion and E2B APIs on %s%s", spec, s->token[0] ? " (token)" : "");
  return 0;
}

int
wrd_compat_sf_port (void)
{
  return g_sf ? g_sf->port : 0;
}

void
wrd_compat_sf_stop (struct wrd *d WR_UNUSED)
{
  struct sf *s = g_sf;
  if (s == NULL)
    return;
  if (s->http)
    {
      wr_accept_guards_free (s->http);
      evhttp_free (s->http);
    }
  wr_httpd_free (s->guard);
  if (s->loop.sun_path[0])
    unlink (s->loop.sun_path);
  free (s);
  g_sf = NULL;
}
