/* Pieces shared by the fuzz targets (linked into every one of them). */
#ifndef WR_FUZZ_HARNESS_H
#define WR_FUZZ_HARNESS_H

#include <stddef.h>
#include <stdint.h>

struct wr_store;

/* A fresh directory from tmpl ("/tmp/...-XXXXXX", modified in place),
 * removed at exit. Aborts on failure. */
void fuzz_tmpdir (char *tmpl);

/* Move the fuzzer into a network namespace of its own (loopback up, TCP
 * metrics not saved), when it can (root): its loopback connections touch
 * no port of the host's and leave nothing in the host's tables. fuzz_http
 * connects from a new 127/8 source address each time, and each used to
 * leave a TCP metrics entry in the host's netns: ~75,000 per 15 s run,
 * which every network namespace teardown on the host then walked
 * (tcp_metrics_flush_all, ~6 ms per cleanup batch). */
void fuzz_private_netns (void);

/* A scratch image store in a fresh directory (tmpl as above), closed and
 * removed at exit. */
struct wr_store *fuzz_store (char *tmpl);

/* A fake HTTP server on listen_fd (a listening socket) in its own thread:
 * it reads each request's head and Content-Length body, then answers the
 * N-th connection since the last fuzz_server_set with part N of the input
 * (parts end with sep; sep NULL: every connection gets all of it), and
 * closes. */
void fuzz_server_start (int listen_fd);
void fuzz_server_set (const uint8_t *data, size_t size, const char *sep);

#endif
