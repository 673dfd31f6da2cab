#include "err.h"

#include <stdio.h>
#include <string.h>

int
wr_verror (wr_err_t *err, int errnum, const char *code, const char *fmt, va_list ap)
{
  int ret = errnum > 0 ? -errnum : -EIO;
  if (err == NULL)
    return ret;
  err->errnum = errnum;
  err->code = code ? code : WR_E_INTERNAL;
  int n = vsnprintf (err->msg, sizeof err->msg, fmt, ap);
  if (n < 0)
    n = 0;
  if (errnum > 0 && (size_t)n < sizeof err->msg)
    snprintf (err->msg + n, sizeof err->msg - n, ": %s", strerror (errnum));
  return ret;
}

int
wr_error (wr_err_t *err, int errnum, const char *code, const char *fmt, ...)
{
  va_list ap;
  va_start (ap, fmt);
  int ret = wr_verror (err, errnum, code, fmt, ap);
  va_end (ap);
  return ret;
}

int
wr_error_wrap (wr_err_t *err, const char *fmt, ...)
{
  if (err == NULL)
    return -EIO;
  char prefix[256], old[sizeof err->msg];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (prefix, sizeof prefix, fmt, ap);
  va_end (ap);
  memcpy (old, err->msg, sizeof old);
  snprintf (err->msg, sizeof err->msg, "%s: %s", prefix, old);
  return err->errnum > 0 ? -err->errnum : -EIO;
}

void
wr_err_clear (wr_err_t *err)
{
  if (err == NULL)
    return;
  err->errnum = 0;
  err->code = NULL;
  err->msg[0] = '\0';
}

/* The one table: code, HTTP status, and whose failure it is. */
static const struct
{
  const char *code;
  int status;
  bool infra;
} code_table[] = {
  /* the caller's request: fixing it is the caller's job */
  { WR_E_INVALID, 400, false },
  { WR_E_TOO_LARGE, 413, false },
  { WR_E_UNAUTHORIZED, 401, false },
  { WR_E_FORBIDDEN, 403, false },
  { WR_E_NOT_FOUND, 404, false },
  { WR_E_CONFLICT, 409, false },
  { WR_E_UNSUPPORTED, 501, false },
  /* the sandbox's agent died under the request, or the sandbox is dead */
  { WR_E_GONE, 410, true },
  /* out of capacity or over one of the platform's own limits */
  { WR_E_EXHAUSTED, 429, true },
  { WR_E_UNAVAILABLE, 503, true },
  /* the platform's internal timeouts (a task's timeout is a result) */
  { WR_E_TIMEOUT, 504, true },
  { WR_E_INTERNAL, 500, true },
  { WR_E_NODE_LOST, 503, true },
  { WR_E_CONTROL_PLANE_UNAVAILABLE, 503, true },
  /* the client's own (libwarren, the SDK): the platform never answered */
  { WR_E_CONNECTION_LOST, 503, true },
  { "connect_failed", 503, true },
  { "protocol_error", 502, true },
};

static int
code_index (const char *code)
{
  if (code == NULL)
    return -1;
  for (size_t i = 0; i < sizeof code_table / sizeof code_table[0]; i++)
    if (strcmp (code_table[i].code, code) == 0)
      return (int)i;
  return -1;
}

int
wr_code_http_status (const char *code)
{
  if (code == NULL)
    return 500;
  int i = code_index (code);
  return i < 0 ? 400 : code_table[i].status;
}

bool
wr_code_is_infra (const char *code)
{
  if (code == NULL)
    return true; /* no code: the platform could not even say what failed */
  int i = code_index (code);
  return i < 0 ? false : code_table[i].infra;
}

bool
wr_err_is_infra (const wr_err_t *err)
{
  return wr_code_is_infra (err ? err->code : NULL);
}

int
wr_err_http_status (const wr_err_t *err)
{
  return wr_code_http_status (err ? err->code : NULL);
}
