/* VM disk images (vm.h, docs/vm.md "Disk images"): a bootable qcow2 or raw
 * disk is stored once, read-only, as ROOT/vm/disks/<sha256>.<fmt>, and named
 * by an ordinary store image (one tiny marker layer, so the store's rules
 * hold) whose config labels point at it. `--backend vm` boots each sandbox
 * from its own qcow2 overlay on that shared base. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vm.h"
#include "../common/util.h"
#include "../image/sha256.h"

#define LABEL_DISK "warren.vm_disk"
#define LABEL_FMT "warren.vm_disk_format"

static uint64_t
be64 (const uint8_t *p)
{
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = v << 8 | p[i];
  return v;
}

static uint32_t
be32 (const uint8_t *p)
{
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* By content: qcow2 magic, or a raw disk with an MBR/GPT boot signature and
 * a plausible partition table. fd: an open regular file. */
static int
sniff_fd (int fd, char fmt[8], wr_err_t *err)
{
  struct stat st;
  if (fstat (fd, &st) < 0)
    return wr_sys_error (err, "stat");
  if (!S_ISREG (st.st_mode))
    return 0;
  uint8_t h[1024];
  ssize_t n = pread (fd, h, sizeof h, 0);
  if (n < 0)
    return wr_sys_error (err, "read");
  if (n >= 104 && memcmp (h, "QFI\xfb", 4) == 0)
    {
      uint32_t version = be32 (h + 4);
      if (version != 2 && version != 3)
        return wr_error (err, EINVAL, WR_E_INVALID, "qcow2 version %u is not supported", version);
      /* a backing file or an external data file would make the daemon's
       * QEMU open a path the importer chose: refuse both */
      if (be64 (h + 8) != 0 || be32 (h + 16) != 0)
        return wr_error (err, EINVAL, WR_E_INVALID,
                         "qcow2 images with a backing file cannot be imported (qemu-img convert)");
      if (version == 3 && (be64 (h + 72) & ~(uint64_t)1) != 0)
        return wr_error (err, EINVAL, WR_E_INVALID,
                         "qcow2 image uses unsupported incompatible features (external data "
                         "file?): qemu-img convert it");
      snprintf (fmt, 8, "qcow2");
      return 1;
    }
  if (n < 1024 || st.st_size < (1 << 20) || st.st_size % 512 || h[510] != 0x55 || h[511] != 0xaa)
    return 0;
  if (memcmp (h + 512, "EFI PART", 8) == 0)
    {
      snprintf (fmt, 8, "raw");
      return 1;
    }
  /* MBR: status bytes 0x00/0x80 and at least one used entry */
  bool used = false;
  for (int i = 0; i < 4; i++)
    {
      const uint8_t *e = h + 446 + 16 * i;
      if (e[0] != 0 && e[0] != 0x80)
        return 0;
      used = used || e[4] != 0;
    }
  if (!used)
    return 0;
  snprintf (fmt, 8, "raw");
  return 1;
}

int
wr_vm_disk_sniff (const char *path, char fmt[8], wr_err_t *err)
{
  _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0)
    return 0; /* not ours to report: the generic import says what is wrong */
  return sniff_fd (fd, fmt, err);
}

static bool
hex64 (const char *s)
{
  for (int i = 0; i < 64; i++)
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return false;
  return s[64] == '\0';
}

int
wr_vm_disk_from_config (const char *root, const json_t *config, char *path, size_t len, char fmt[8],
                        wr_err_t *err)
{
  json_t *labels = json_object_get (config, "labels");
  const char *d = json_string_value (json_object_get (labels, LABEL_DISK));
  if (d == NULL)
    return 0;
  const char *f = json_string_value (json_object_get (labels, LABEL_FMT));
  if (strncmp (d, "sha256:", 7) != 0 || !hex64 (d + 7) || f == NULL
      || (strcmp (f, "qcow2") != 0 && strcmp (f, "raw") != 0))
    return wr_error (err, EINVAL, WR_E_INVALID, "image has an invalid VM disk label");
  int n = snprintf (path, len, "%s/vm/disks/%s.%s", root, d + 7, f);
  if (n < 0 || (size_t)n >= len)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "daemon root too long");
  if (access (path, R_OK) < 0)
    return wr_error (err, errno, WR_E_NOT_FOUND, "VM disk %.19s of the image is not on this node",
                     d);
  snprintf (fmt, 8, "%s", f);
  return 1;
}

static bool
all_zero (const uint8_t *p, size_t n)
{
  for (size_t i = 0; i < n; i++)
    if (p[i])
      return false;
  return true;
}

/* Copy in to dir/.import-XXXXXX while hashing; zero blocks become holes
 * (raw disks are mostly empty). Returns the temp name in tmp. */
static int
copy_hash (int in, int dirfd, char tmp[32], char hex[65], wr_err_t *err)
{
  char rnd[17];
  wr_random_hex (rnd, 16);
  snprintf (tmp, 32, ".import-%s", rnd);
  _cleanup_close_ int out
      = openat (dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (out < 0)
    return wr_sys_error (err, "create disk file");
  struct wr_sha256 h;
  wr_sha256_init (&h);
  _cleanup_free_ uint8_t *buf = malloc (1 << 20);
  if (buf == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  off_t off = 0;
  for (;;)
    {
      ssize_t n = read (in, buf, 1 << 20);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        return wr_sys_error (err, "read disk");
      if (n == 0)
        break;
      wr_sha256_update (&h, buf, (size_t)n);
      for (size_t done = 0; !all_zero (buf, (size_t)n) && done < (size_t)n;)
        {
          ssize_t w = pwrite (out, buf + done, (size_t)n - done, off + (off_t)done);
          if (w < 0 && errno != EINTR)
            return wr_sys_error (err, "write disk");
          done += w > 0 ? (size_t)w : 0;
        }
      off += n;
    }
  if (ftruncate (out, off) < 0 || fchmod (out, 0444) < 0 || fsync (out) < 0)
    return wr_sys_error (err, "finish disk file");
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, hex);
  return 0;
}

int
wr_vm_disk_import (struct wr_store *s, const char *ref, const char *path, struct wr_image **ret,
                   wr_err_t *err)
{
  _cleanup_close_ int in = open (path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (in < 0)
    return wr_sys_error (err, "open %s", path);
  char fmt[8];
  int r = sniff_fd (in, fmt, err);
  if (r < 0)
    return r;
  if (r == 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "%s is not a qcow2 or raw disk image", path);
  const char *root = wr_store_root (s);
  char dir[4096];
  snprintf (dir, sizeof dir, "%s/vm", root);
  if (mkdir (dir, 0700) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s", dir);
  snprintf (dir, sizeof dir, "%s/vm/disks", root);
  if (mkdir (dir, 0700) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s", dir);
  _cleanup_close_ int dirfd = open (dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0)
    return wr_sys_error (err, "open %s", dir);
  char tmp[32], hex[65], name[80];
  r = copy_hash (in, dirfd, tmp, hex, err);
  if (r < 0)
    {
      unlinkat (dirfd, tmp, 0);
      return r;
    }
  snprintf (name, sizeof name, "%s.%s", hex, fmt);
  /* content-addressed: an existing file with this name is this disk */
  if (renameat2 (dirfd, tmp, dirfd, name, RENAME_NOREPLACE) < 0)
    {
      int e = errno;
      unlinkat (dirfd, tmp, 0);
      if (e != EEXIST)
        return wr_error (err, e, WR_E_INTERNAL, "store disk %s", name);
    }

  /* the image: one marker layer (the store wants a layer) + the labels */
  char ldir[4096], marker[4200];
  r = wr_store_tmpdir (s, "vmdisk", ldir, sizeof ldir, err);
  if (r < 0)
    return r;
  snprintf (marker, sizeof marker, "%s/.warren-vm-disk", ldir);
  char text[128];
  int tn = snprintf (text, sizeof text, "sha256:%s %s\n", hex, fmt);
  _cleanup_close_ int mfd
      = open (marker, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0444);
  if (mfd < 0 || wr_write_all (mfd, text, (size_t)tn) < 0)
    r = wr_sys_error (err, "write %s", marker);
  if (r == 0)
    {
      char digest[72];
      snprintf (digest, sizeof digest, "sha256:%s", hex);
      json_t *config = json_pack ("{s:{s:s,s:s}}", "labels", LABEL_DISK, digest, LABEL_FMT, fmt);
      struct wr_import_opts opts = { .config = config };
      r = config ? wr_image_import_ex (s, ref, ldir, &opts, ret, err)
                 : wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      json_decref (config);
    }
  wr_rm_rf_at (AT_FDCWD, ldir);
  return r;
}
