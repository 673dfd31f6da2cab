/* Image and layer store (docs/images.md).
 *
 * A layer is a content-addressed read-only EROFS file under
 * ROOT/layers/sha256/<hex>.erofs; an image is a manifest (ordered layer
 * digests, top-most last, plus config) stored in SQLite and named NAME:TAG.
 * Layers are mounted once per node (file-backed EROFS, then an idmapped clone
 * for the sandbox uid range) and shared by every sandbox that uses them. */
#ifndef WR_STORE_H
#define WR_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sqlite3.h>
#include <jansson.h>

#include "../common/err.h"
#include "../common/limits.h"

struct wr_store;

/* root: daemon state root; db: open handle (the store creates its tables);
 * userns_fd: user namespace for idmapped layer mounts, -1 for none (the
 * store keeps its own dup).
 *
 * Threads: every function may be called from any thread; the store
 * serializes them with its own mutex. For a file database the store opens
 * its own serialized connection to the same file (so the daemon's handle is
 * never used from two threads); open the database in WAL mode so the
 * store's short commits do not block readers, and give the daemon's handle
 * a busy timeout. With an in-memory database the store shares db: the
 * daemon must then not hold a transaction open across store calls.
 * Crash recovery runs here: ROOT/tmp is emptied, layer files without a row
 * are deleted, rows without a file and images that need them are dropped. */
int wr_store_open (const char *root, sqlite3 *db, int userns_fd, struct wr_store **ret,
                   wr_err_t *err);
void wr_store_close (struct wr_store *s); /* unmounts every layer it mounted */

struct wr_image
{
  char digest[72]; /* "sha256:<hex>" of the manifest */
  char name[336];  /* as resolved: "name:tag" (the digest when no tag names it) */
  size_t n_layers;
  char (*layers)[72]; /* "sha256:<hex>", bottom-most first */
  json_t *config; /* {"env":[...],"workdir":"/","user":"0","entrypoint":[...]|null,"labels":{}} */
  uint64_t size;  /* bytes of all its layer files */
  uint64_t skipped_special; /* import only: device nodes, fifos, sockets left out */
};
void wr_image_free (struct wr_image *img);

/* Import a rootfs directory or tarball (plain, gzip, zstd, xz, bzip2, by
 * magic) as a one-layer image called ref ("name[:tag]", tag defaults to
 * "latest"; an existing tag is moved). Unsafe tar entries (absolute paths,
 * "..", anything passing through a symlink, hard links leaving the tree)
 * are rejected with WR_E_INVALID; device nodes, fifos and sockets in a
 * tarball are skipped and counted in ret->skipped_special. Nothing is left
 * behind on any failure. Blocking and slow: call it from a worker thread;
 * it holds the store lock only for the final commit. ret may be NULL. */
int wr_image_import (struct wr_store *s, const char *ref, const char *path, struct wr_image **ret,
                     wr_err_t *err);

struct wr_import_opts
{
  /* existing layers the new one is stacked on, bottom-most first (pack,
   * build: base image layers + the new layer on top) */
  const char *const *base_layers;
  size_t n_base_layers;
  /* image config merged over the defaults (env PATH, workdir "/", user "0");
   * keys: env, workdir, user, entrypoint, labels. NULL: defaults. */
  const json_t *config;
};
int wr_image_import_ex (struct wr_store *s, const char *ref, const char *path,
                        const struct wr_import_opts *opts, struct wr_image **ret, wr_err_t *err);

/* 0 when n layers fit in one image or sandbox (1 to WR_MAX_LAYERS), else
 * WR_E_INVALID "WHAT has N layers, at most 64 allowed". */
int wr_layers_check (size_t n, const char *what, wr_err_t *err);

/* A layer built under ROOT/tmp and not yet visible to anyone: it becomes
 * part of the store only through wr_image_commit, in the same transaction
 * as the manifest naming it. wr_layer_stage_free removes its files. */
struct wr_staged_layer
{
  char digest[72];   /* "sha256:<hex>" of the EROFS image */
  char blob[72];     /* caller may set: the source blob it came from (OCI), for pull skips */
  char source[72];   /* tarballs: "sha256:<hex>" of the bytes extracted, hashed as they were read */
  uint64_t unpacked; /* tarballs: bytes of the files extracted (the limits' measure) */
  uint64_t size;     /* bytes of the EROFS image */
  uint64_t skipped_special, whiteouts;
  char dir[4096]; /* work dir under ROOT/tmp, holding layer.erofs */
};
#define WR_STAGE_OCI 1u /* tar layer of an OCI image: convert .wh.* whiteouts */

/* Build a layer from a directory (taken as is) or a tarball (safe
 * extraction, as wr_image_import). Slow; call from a worker thread. */
int wr_layer_stage (struct wr_store *s, const char *path, unsigned flags,
                    struct wr_staged_layer **ret, wr_err_t *err);
/* Same from an open directory or tarball (label names it in errors). */
int wr_layer_stage_fd (struct wr_store *s, int fd, const char *label, unsigned flags,
                       struct wr_staged_layer **ret, wr_err_t *err);
void wr_layer_stage_free (struct wr_staged_layer *l);
/* A layer from an EROFS blob (a Warren push, docs/images.md): copied as is,
 * its digest is its sha256. */
int wr_layer_stage_erofs (struct wr_store *s, int src, struct wr_staged_layer **ret, wr_err_t *err);

/* One layer of an image being committed: a staged layer, or the digest of
 * a layer already stored (re-checked under the lock). */
struct wr_layer_ref
{
  const char *digest;
  struct wr_staged_layer *staged;
  const char *blob; /* existing layers: source blob digest to remember, or NULL */
};

/* Make the image ref (name[:tag]) from layers (bottom-most first) and config
 * (merged over the defaults) in one transaction: staged layer files are
 * renamed into place, rows, blob mappings, manifest and tag committed
 * together. A layer listed twice is kept once (its top-most position). On
 * failure nothing is visible and no file is left in ROOT/layers. The staged
 * layers still belong to the caller (free them either way). */
int wr_image_commit (struct wr_store *s, const char *ref, const struct wr_layer_ref *layers,
                     size_t n, const json_t *config, struct wr_image **ret, wr_err_t *err);

/* Point dst (name[:tag]) at the manifest src resolves to; ret may be NULL. */
int wr_image_tag (struct wr_store *s, const char *src, const char *dst, struct wr_image **ret,
                  wr_err_t *err);

/* The stored layer made from source blob (an OCI layer digest): 1 and its
 * digest, 0 when none is stored. */
int wr_blob_layer (struct wr_store *s, const char *blob, char ret_layer[72], wr_err_t *err);

/* A fresh private directory ROOT/tmp/PREFIX-XXXXXX (emptied by the next
 * wr_store_open after a crash). The caller removes it. */
int wr_store_tmpdir (struct wr_store *s, const char *prefix, char *buf, size_t size, wr_err_t *err);
const char *wr_store_root (struct wr_store *s);

/* Import any supported source as ref (docs/images.md): a rootfs directory
 * or tarball, an OCI image layout directory (oci-layout + index.json), a
 * docker-save directory or tarball (manifest.json), by content, never by
 * name. progress (may be NULL) is called from the importing thread. */
typedef void (*wr_progress_fn) (void *ud, const char *what, uint64_t done, uint64_t total);
int wr_image_import_any (struct wr_store *s, const char *ref, const char *path,
                         wr_progress_fn progress, void *ud, struct wr_image **ret, wr_err_t *err);

/* Pull ref ("host[:port]/repo[:tag|@sha256:...]") from an OCI distribution
 * (v2) registry over https (insecure: plain http; docs/images.md for CAs,
 * credentials and mirrors)
 * and store it as name (NULL: "repo:tag"). Blobs are verified against their
 * digests, fetched in parallel, and layers already stored are skipped. */
int wr_image_pull (struct wr_store *s, const char *ref, const char *name, bool insecure,
                   wr_progress_fn progress, void *ud, struct wr_image **ret, wr_err_t *err);

/* Push the stored image ref to target ("host[:port]/repo[:tag]"): its
 * EROFS layers as application/vnd.warren.layer.v1.erofs blobs (what
 * wr_image_pull takes back without conversion), an OCI config and
 * manifest; blobs the registry has are skipped. The upload runs in the
 * unprivileged fetcher. ret: {"ref","target","digest","uploaded","skipped",
 * "bytes"}. */
int wr_image_push (struct wr_store *s, const char *ref, const char *target, bool insecure,
                   wr_progress_fn progress, void *ud, json_t **ret, wr_err_t *err);

/* A stopping daemon: end every registry pull and push under way (they
 * fail) and refuse new ones. */
void wr_registry_cancel_all (void);

/* Fetch on first use (docs/cluster.md): 1 and the local name
 * ("HOST-PORT/REPO:TAG") when ref is a registry reference
 * ("HOST[:PORT]/REPO[:TAG]", HOST with a dot or a port, or localhost), else
 * 0. */
int wr_registry_local_name (const char *ref, char *buf, size_t size);
/* Pull ref as name unless a concurrent call already does: one pull per
 * name at a time, its waiters share its result (the same error, or the
 * image). Plain HTTP for the hosts WARREN_REGISTRY_INSECURE lists. */
int wr_image_fetch_once (struct wr_store *s, const char *ref, const char *name,
                         struct wr_image **ret, wr_err_t *err);

/* Resolve "name[:tag]" or "name@sha256:..." or "sha256:..." to its manifest. */
int wr_image_resolve (struct wr_store *s, const char *ref, struct wr_image **ret, wr_err_t *err);

/* JSON array of {"name","digest","layers":[...],"size","created"} */
int wr_image_list (struct wr_store *s, json_t **ret, wr_err_t *err);
/* "name[:tag]" removes that tag; "name@sha256:..." the name's tags on that
 * digest; "sha256:..." the manifest and every tag on it. Then collects
 * garbage (wr_store_gc). Layers acquired by sandboxes are kept. */
int wr_image_remove (struct wr_store *s, const char *ref, wr_err_t *err);

/* Drop manifests no tag names and layer files no manifest uses, unless
 * acquired (mounted but released layers are unmounted and removed). */
int wr_store_gc (struct wr_store *s, wr_err_t *err);

/* {"root","layers","images","tags","mounted","acquired","idmapped",
 *  "recovered":{"tmp_entries","orphan_layers","missing_layers","dropped_images"}}:
 * counts, and what wr_store_open cleaned up after a crash. */
int wr_store_describe (struct wr_store *s, json_t **ret, wr_err_t *err);

/* Mount (once, refcounted) the layer and return the directory to use as an
 * overlay lowerdir in sandboxes (idmapped when the store has a userns). The
 * string stays valid until the matching release. Released layers stay
 * mounted as a cache until gc removes them or the store closes. */
int wr_layer_acquire (struct wr_store *s, const char *digest, const char **ret_dir, wr_err_t *err);
void wr_layer_release (struct wr_store *s, const char *digest);

/* The layer's EROFS image file, for backends that attach layers as block
 * devices or files (the VM backends) instead of mounting them. The store
 * owns the layout: callers never build layer paths themselves. */
int wr_layer_file (struct wr_store *s, const char *digest, char *buf, size_t size, wr_err_t *err);

/* Validate a reference without touching the store:
 * name(:tag)?(@sha256:hex)? or sha256:hex; name is [a-z0-9] with separators
 * [._/-] inside (not leading/trailing, no "//"), <= 200 chars; tag is
 * [A-Za-z0-9_.-]{1,128}. */
int wr_ref_valid (const char *ref);

/* How much untrusted input may unpack to (docs/images.md, Limits); 0: no
 * limit. Exceeding one is WR_E_TOO_LARGE, detected while writing. Defaults
 * from the environment at wr_store_open (WARREN_IMAGE_LAYER_BYTES,
 * WARREN_IMAGE_BYTES, WARREN_IMAGE_ENTRIES, WARREN_IMAGE_RATIO), else 8 GiB,
 * 32 GiB, 1000000, 100. */
struct wr_store_limits
{
  uint64_t layer_bytes; /* one layer's files (sizes, holes included); one registry blob */
  uint64_t image_bytes; /* an image archive unpacked; all blobs of one pull */
  uint64_t entries;     /* archive entries of one layer or image archive */
  uint32_t ratio;       /* unpacked bytes per compressed byte, past the first 64 MiB */
  /* registry blob redirects may go to loopback, local and link-local
   * addresses even when the registry is not on loopback
   * (WARREN_REGISTRY_PRIVATE_REDIRECTS=1) */
  bool private_redirects;
};
void wr_store_get_limits (struct wr_store *s, struct wr_store_limits *ret);
void wr_store_set_limits (struct wr_store *s, const struct wr_store_limits *l);

/* Fuzzing only: parse archives in this process instead of the confined
 * helper (docs/images.md), so that the fuzzer sees the parser's coverage
 * and sanitizer reports. Never in warrend. */
void wr_store_set_unpack_in_process (struct wr_store *s, bool on);

/* Testing: mount layers through a loop device even when file-backed EROFS
 * mounts work, to exercise the fallback. */
void wr_store_set_force_loop (struct wr_store *s, int on);

#endif
