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

int
wr_code_http_status (const char *code)
{
  static const struct
  {
    const char *code;
    int status;
  } map[] = {
    { WR_E_INVALID, 400 },   { WR_E_TOO_LARGE, 413 }, { WR_E_UNAUTHORIZED, 401 },
    { WR_E_FORBIDDEN, 403 }, { WR_E_NOT_FOUND, 404 }, { WR_E_CONFLICT, 409 },
    { WR_E_GONE, 410 },      { WR_E_EXHAUSTED, 429 }, { WR_E_UNAVAILABLE, 503 },
    { WR_E_TIMEOUT, 504 },   { WR_E_INTERNAL, 500 },  { WR_E_UNSUPPORTED, 501 },
  };
  if (code == NULL)
    return 500;
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
    if (strcmp (map[i].code, code) == 0)
      return map[i].status;
  return 400;
}

int
wr_err_http_status (const wr_err_t *err)
{
  return wr_code_http_status (err ? err->code : NULL);
}
