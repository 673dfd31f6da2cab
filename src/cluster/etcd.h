/* A small etcd v3 client over etcd's JSON gateway (HTTP/1.1 + JSON, keys and
 * values base64 on the wire). Blocking calls with a deadline, meant for
 * worker threads: the node's registration thread and the gateway's watch and
 * quota threads. Every call tries the endpoints in turn, starting from the
 * last one that answered, so one dead member costs one connect attempt. */
#ifndef WR_ETCD_H
#define WR_ETCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

#include "common/err.h"

struct wr_etcd;

/* urls: "http://H:P[,http://H:P...]" (https:// for TLS); timeout_ms bounds
 * each unary call. */
int wr_etcd_new (const char *urls, int timeout_ms, struct wr_etcd **ret, wr_err_t *err);
void wr_etcd_free (struct wr_etcd *e); /* accepts NULL */

/* TLS for https:// endpoints, for every client of the process: members are
 * verified against cacert (NULL: the system's CAs) and their name or
 * address; cert (and key, NULL: in cert) is presented as the client
 * certificate (etcd's --client-cert-auth). Call before wr_etcd_new. */
int wr_etcd_tls (const char *cacert, const char *cert, const char *key, wr_err_t *err);

/* Raw unary call: POST path (e.g. "/v3/kv/put") with body; *ret gets the
 * parsed answer. Fails with code "unavailable" when no endpoint answers. */
int wr_etcd_call (struct wr_etcd *e, const char *path, const json_t *body, json_t **ret,
                  wr_err_t *err);

/* Base64 helpers for building raw requests: a new JSON string. */
json_t *wr_etcd_b64 (const char *s, size_t len);
/* The end of the range of keys starting with prefix (prefix + 1 on the last byte). */
json_t *wr_etcd_prefix_end (const char *prefix);

int wr_etcd_put (struct wr_etcd *e, const char *key, const char *val, int64_t lease, wr_err_t *err);
int wr_etcd_delete (struct wr_etcd *e, const char *key, wr_err_t *err);
/* Value of key: 1 and *ret_val (malloc'd, NUL terminated) plus its
 * mod_revision when found, 0 when absent. */
int wr_etcd_get (struct wr_etcd *e, const char *key, char **ret_val, int64_t *ret_mod_rev,
                 wr_err_t *err);
/* Every key under prefix: *ret is an array of {"key","value","mod_revision"}
 * (decoded strings), *ret_rev the store revision of the read. */
int wr_etcd_get_prefix (struct wr_etcd *e, const char *prefix, json_t **ret, int64_t *ret_rev,
                        wr_err_t *err);
/* Put key = val only if its mod_revision is still mod_rev (0: the key must
 * not exist). 1 when written, 0 when someone else changed it first. */
int wr_etcd_cas (struct wr_etcd *e, const char *key, int64_t mod_rev, const char *val,
                 int64_t lease, wr_err_t *err);

int wr_etcd_lease_grant (struct wr_etcd *e, int64_t ttl_s, int64_t *ret_id, wr_err_t *err);
/* Refresh a lease; *ret_ttl is 0 when the lease no longer exists. */
int wr_etcd_lease_keepalive (struct wr_etcd *e, int64_t id, int64_t *ret_ttl, wr_err_t *err);
int wr_etcd_lease_revoke (struct wr_etcd *e, int64_t id, wr_err_t *err);

/* Watch every key under prefix from revision start_rev. cb gets each event
 * (deleted: val NULL); returning non-zero from cb stops the watch. Returns 0
 * when *stop became true or cb asked to stop, < 0 when the stream broke
 * (the caller re-reads and watches again). */
typedef int (*wr_etcd_watch_cb) (void *ud, const char *key, const char *val, int64_t rev);
int wr_etcd_watch (struct wr_etcd *e, const char *prefix, int64_t start_rev, wr_etcd_watch_cb cb,
                   void *ud, const volatile bool *stop, wr_err_t *err);

#endif
