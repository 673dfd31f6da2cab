/* Image and layer store (docs/images.md).
 *
 * A layer is a content-addressed read-only EROFS file under
 * ROOT/layers/sha256/<hex>.erofs; an image is a manifest (ordered layer
 * digests, top-most last, plus config) stored in SQLite and named NAME:TAG.
 * Layers are mounted once per node (file-backed EROFS, then an idmapped clone
 * for the sandbox uid range) and shared by every sandbox that uses them. */
#ifndef WR_STORE_H
#define WR_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <sqlite3.h>
#include <jansson.h>

#include "../common/err.h"

struct wr_store;

/* root: daemon state root; db: open handle (the store creates its tables);
 * userns_fd: user namespace for idmapped layer mounts, -1 for none. */
int wr_store_open (const char *root, sqlite3 *db, int userns_fd, struct wr_store **ret,
                   wr_err_t *err);
void wr_store_close (struct wr_store *s); /* unmounts every layer it mounted */

struct wr_image
{
  char digest[72];      /* "sha256:<hex>" of the manifest */
  char name[256];       /* as resolved: "name:tag" */
  size_t n_layers;
  char (*layers)[72];   /* "sha256:<hex>", bottom-most first */
  json_t *config;       /* {"env":[...],"workdir":"/","user":"0","entrypoint":[...],"labels":{}} */
};
void wr_image_free (struct wr_image *img);

/* Import a rootfs directory or tarball (plain, gzip, zstd) as a one-layer
 * image called ref ("name[:tag]", tag defaults to "latest"). Unsafe tar
 * entries (absolute, "..", links leaving the root, device nodes) are
 * rejected and nothing is left behind on any failure. Blocking. */
int wr_image_import (struct wr_store *s, const char *ref, const char *path,
                     struct wr_image **ret, wr_err_t *err);

/* Resolve "name[:tag]" or "name@sha256:..." or "sha256:..." to its manifest. */
int wr_image_resolve (struct wr_store *s, const char *ref, struct wr_image **ret, wr_err_t *err);

/* JSON array of {"name","digest","layers":[...],"size","created"} */
int wr_image_list (struct wr_store *s, json_t **ret, wr_err_t *err);
int wr_image_remove (struct wr_store *s, const char *ref, wr_err_t *err);

/* Mount (once, refcounted) the layer and return the directory to use as an
 * overlay lowerdir in sandboxes (idmapped when the store has a userns). */
int wr_layer_acquire (struct wr_store *s, const char *digest, const char **ret_dir, wr_err_t *err);
void wr_layer_release (struct wr_store *s, const char *digest);

/* Validate a reference without touching the store: [a-z0-9][a-z0-9._/-]*(:tag)?(@sha256:hex)? */
int wr_ref_valid (const char *ref);

#endif
