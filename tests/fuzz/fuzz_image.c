/* Image archives (src/image/oci.c): a tarball holding a docker-save archive
 * (manifest.json, config, layer tars) or an OCI image layout (oci-layout,
 * index.json, blobs/sha256/...) imported into a scratch store. Inputs that
 * do not name those files are skipped (a plain rootfs import would only
 * exercise mkfs.erofs; compressed streams are fuzz_tar's). */
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "image/store.h"
#include "harness.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);

static char root[] = "/tmp/warren-fuzz-image-XXXXXX";
static char input[sizeof root + 16];
static struct wr_store *store;

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
  store = fuzz_store (root);
  snprintf (input, sizeof input, "%s/in.tar", root);
  return 0;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  if (!memmem (data, size, "manifest.json", 13) && !memmem (data, size, "oci-layout", 10))
    return 0;
  int fd = open (input, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || wr_write_all (fd, data, size) < 0)
    abort ();
  close (fd);
  struct wr_image *img = NULL;
  wr_err_t err;
  if (wr_image_import_any (store, "fuzz:latest", input, NULL, NULL, &img, &err) == 0)
    {
      wr_image_free (img);
      wr_image_remove (store, "fuzz:latest", &err);
      wr_store_gc (store, &err);
    }
  return 0;
}
