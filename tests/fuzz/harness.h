/* Pieces shared by the fuzz targets (linked into every one of them). */
#ifndef WR_FUZZ_HARNESS_H
#define WR_FUZZ_HARNESS_H

#include <stddef.h>
#include <stdint.h>

struct wr_store;

/* A fresh directory from tmpl ("/tmp/...-XXXXXX", modified in place),
 * removed at exit. Aborts on failure. */
void fuzz_tmpdir (char *tmpl);

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
