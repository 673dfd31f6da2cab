/* microvm and vm backends on QEMU (vm.h, docs/vm.md).
 *
 * A VM sandbox is one QEMU process in the sandbox's cgroups, started with its
 * cwd in the sandbox state dir, which holds:
 *   agent.sock   chardev (server) of the virtio-serial port the agent uses
 *   qmp.sock     QMP, for pause/resume and snapshots
 *   console.log  the guest's serial console; qemu.log  QEMU's stderr
 * Node-wide, ROOT/vm holds the initrd (the guest kit's initramfs with the
 * daemon's own agent prepended), the accelerator probe result, and restore
 * snapshots keyed by everything that must match for a restore. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../common/proto.h"
#include "backend.h"
#include "syscalls.h"
#include "jail.h"
#include "vm.h"
#include "../common/util.h"
#include "../image/sha256.h"

#define AGENT_SOCK "agent.sock"
#define QMP_SOCK "qmp.sock"
#define OVERLAY "overlay.qcow2" /* per-VM overlay on a disk image's shared base */
#define MIN_GUEST_MB 128
/* guest RAM beyond the tasks' memory limit: kernel, agent, page cache */
#define GUEST_RESERVE_MB 64
/* QEMU's own threads; the guest's processes are bounded inside the guest */
#define QEMU_PIDS_MAX 512
#define UPPER "upper.img"    /* the writable layer: an ext4 disk of disk_mb */
#define QEMU_OVERHEAD_MB 384 /* QEMU itself + the TCG translation cache */
#define PROBE_TIMEOUT_MS 8000
#define RESTORE_TIMEOUT_MS 30000
#define TEMPLATE_READY_TIMEOUT_MS 300000
#define VM_TAP_FD 5 /* a networked VM's tap: -netdev tap,fd=5 */

/* ---- node-wide state, set up on first use ---- */

static pthread_mutex_t vm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct
{
  struct wr_runtime *rt;
  bool ready;
  char qemu[PATH_MAX];
  char kernel[PATH_MAX];
  char initrd[PATH_MAX];      /* ROOT/vm/initrd.img */
  char vmdir[PATH_MAX];       /* ROOT/vm */
  char jaildir[PATH_MAX + 8]; /* ROOT/vm/jail: where each jail's root is mounted */
  char accel[4];
  uint64_t tsc_khz;
  bool has_net;   /* the kit packs virtio_net (its modules list names it) */
  char ident[65]; /* hash of qemu + kernel + initrd: part of every snapshot key */
  char building[16][65];
  char seen[64][65]; /* keys booted once (ring): the second boot builds */
  unsigned seen_next;
} vm;

static int
vm_file_ident (const char *path, struct wr_sha256 *h)
{
  struct stat st;
  if (stat (path, &st) < 0)
    return -errno;
  char buf[PATH_MAX + 64];
  int n = snprintf (buf, sizeof buf, "%s|%lld|%lld.%ld|", path, (long long)st.st_size,
                    (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  wr_sha256_update (h, buf, (size_t)n);
  return 0;
}

static bool
find_in_path (const char *name, char *out, size_t len)
{
  const char *env = getenv ("WARREN_QEMU");
  if (env && env[0] == '/')
    {
      snprintf (out, len, "%s", env);
      return access (out, X_OK) == 0;
    }
  const char *dirs[] = { "/usr/bin", "/usr/local/bin", "/bin" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (dirs); i++)
    {
      snprintf (out, len, "%s/%s", dirs[i], name);
      if (access (out, X_OK) == 0)
        return true;
    }
  return false;
}

/* The guest kit (scripts/mk-guest.sh): WARREN_GUEST_DIR, else build/guest
 * next to the daemon binary's bin/. */
static int
guest_dir (char *out, size_t len)
{
  const char *env = getenv ("WARREN_GUEST_DIR");
  if (env && env[0] == '/')
    {
      snprintf (out, len, "%s", env);
      return 0;
    }
  char exe[PATH_MAX];
  ssize_t n = readlink ("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0)
    return -errno;
  exe[n] = '\0';
  char *slash = strrchr (exe, '/');
  if (slash)
    *slash = '\0';
  slash = strrchr (exe, '/');
  if (slash)
    *slash = '\0';
  snprintf (out, len, "%s/guest", exe);
  return 0;
}

bool
wr_vm_available (enum wr_vm_kind kind, wr_err_t *err)
{
  char q[PATH_MAX], g[PATH_MAX], k[PATH_MAX + 32];
  if (!find_in_path ("qemu-system-x86_64", q, sizeof q))
    {
      wr_error (err, ENOENT, WR_E_UNSUPPORTED, "qemu-system-x86_64 not found (scripts/setup.sh)");
      return false;
    }
  if (guest_dir (g, sizeof g) < 0)
    {
      wr_error (err, ENOENT, WR_E_UNSUPPORTED, "no guest kit directory");
      return false;
    }
  snprintf (k, sizeof k, "%s/vmlinuz", g);
  if (access (k, R_OK) < 0)
    {
      wr_error (err, errno, WR_E_UNSUPPORTED, "guest kernel %s missing (scripts/mk-guest.sh)", k);
      return false;
    }
  snprintf (k, sizeof k, "%s/initramfs.img", g);
  if (access (k, R_OK) < 0)
    {
      wr_error (err, errno, WR_E_UNSUPPORTED, "guest initramfs %s missing (scripts/mk-guest.sh)",
                k);
      return false;
    }
  (void)kind;
  return true;
}

/* One newc cpio member: the daemon's agent as /warren-agent. It goes first:
 * the kernel unpacks concatenated archives, and an uncompressed one is only
 * recognised reliably before the compressed kit. */
static int
write_agent_cpio (int out, int agent_fd, wr_err_t *err)
{
  struct stat st;
  if (fstat (agent_fd, &st) < 0)
    return wr_sys_error (err, "stat agent");
  static const char name[] = "warren-agent";
  char hdr[111 + sizeof name + 4];
  int n = snprintf (hdr, sizeof hdr, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%s",
                    1u, 0100755u, 0u, 0u, 1u, (unsigned)st.st_mtime, (unsigned)st.st_size, 0u, 0u,
                    0u, 0u, (unsigned)sizeof name, 0u, name);
  n++; /* the name's NUL */
  while (n % 4)
    hdr[n++] = '\0';
  if (wr_write_all (out, hdr, (size_t)n) < 0)
    return wr_sys_error (err, "write initrd");
  char buf[65536];
  off_t off = 0;
  for (;;)
    {
      ssize_t r = pread (agent_fd, buf, sizeof buf, off);
      if (r < 0)
        return wr_sys_error (err, "read agent");
      if (r == 0)
        break;
      if (wr_write_all (out, buf, (size_t)r) < 0)
        return wr_sys_error (err, "write initrd");
      off += r;
    }
  static const char zeros[512];
  if (off % 4 && wr_write_all (out, zeros, (size_t)(4 - off % 4)) < 0)
    return wr_sys_error (err, "write initrd");
  static const char tname[] = "TRAILER!!!";
  n = snprintf (hdr, sizeof hdr, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%s", 0u,
                0u, 0u, 0u, 1u, 0u, 0u, 0u, 0u, 0u, 0u, (unsigned)sizeof tname, 0u, tname);
  n++;
  while (n % 4)
    hdr[n++] = '\0';
  if (wr_write_all (out, hdr, (size_t)n) < 0)
    return wr_sys_error (err, "write initrd");
  return 0;
}

static int
build_initrd (struct wr_runtime *rt, const char *kit_initramfs, wr_err_t *err)
{
  char tmp[PATH_MAX + 16];
  snprintf (tmp, sizeof tmp, "%s.%d.tmp", vm.initrd, (int)getpid ());
  _cleanup_close_ int out = open (tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0)
    return wr_sys_error (err, "create %s", tmp);
  int r = write_agent_cpio (out, rt->agent_fd, err);
  /* the compressed kit starts on a 512-byte boundary, as cpio -o pads */
  if (r == 0)
    {
      static const char zeros[512];
      off_t pos = lseek (out, 0, SEEK_CUR);
      if (pos % 512 && wr_write_all (out, zeros, (size_t)(512 - pos % 512)) < 0)
        r = wr_sys_error (err, "write initrd");
    }
  if (r == 0)
    {
      _cleanup_close_ int in = open (kit_initramfs, O_RDONLY | O_CLOEXEC);
      if (in < 0)
        r = wr_sys_error (err, "open %s", kit_initramfs);
      char buf[65536];
      ssize_t n;
      while (r == 0 && (n = read (in, buf, sizeof buf)) != 0)
        if (n < 0 || wr_write_all (out, buf, (size_t)n) < 0)
          r = wr_sys_error (err, "copy %s", kit_initramfs);
    }
  if (r == 0 && rename (tmp, vm.initrd) < 0)
    r = wr_sys_error (err, "rename %s", vm.initrd);
  if (r < 0)
    unlink (tmp);
  return r;
}

static uint64_t
host_tsc_khz (void)
{
  /* "cpu MHz" of an invariant-TSC host is the TSC rate; the guest kernel
   * otherwise calibrates against a PIT that microvm may not have and can
   * hang there under TCG */
  _cleanup_fclose_ FILE *f = fopen ("/proc/cpuinfo", "re");
  char line[256];
  while (f && fgets (line, sizeof line, f))
    if (strncmp (line, "cpu MHz", 7) == 0)
      {
        char *c = strchr (line, ':');
        if (c)
          return (uint64_t)(strtod (c + 1, NULL) * 1000.0 + 0.5);
      }
  return 0;
}

static int spawn_qemu (char **argv, int dirfd, int logfd, const struct wr_cg_sandbox *cgs,
                       int tap_fd, bool die_with_parent, const struct wr_jail *j, int confd,
                       int incoming_fd, pid_t *ret_pid, int *ret_pidfd, wr_err_t *err);

static bool
wait_exit (int pidfd, int timeout_ms)
{
  struct pollfd p = { .fd = pidfd, .events = POLLIN };
  int r;
  while ((r = poll (&p, 1, timeout_ms)) < 0 && errno == EINTR)
    ;
  return r > 0;
}

/* Does KVM boot this kernel here? /dev/kvm opening is not enough: nested
 * setups exist where KVM_RUN works and a Linux guest still hangs. */
static bool
probe_kvm (const char *kit_initramfs)
{
  int kfd = open ("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (kfd < 0)
    return false;
  close (kfd);
  char cmdline[256];
  snprintf (cmdline, sizeof cmdline,
            "console=ttyS0 quiet panic=-1 tsc_early_khz=%" PRIu64 " warren.probe=1", vm.tsc_khz);
  char *argv[] = { vm.qemu,
                   "-nodefaults",
                   "-no-user-config",
                   "-nographic",
                   "-no-reboot",
                   "-machine",
                   "microvm",
                   "-accel",
                   "kvm",
                   "-m",
                   "128",
                   "-kernel",
                   vm.kernel,
                   "-initrd",
                   (char *)kit_initramfs,
                   "-append",
                   cmdline,
                   "-serial",
                   "file:probe.log",
                   NULL };
  _cleanup_close_ int dirfd = open (vm.vmdir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0)
    return false;
  unlinkat (dirfd, "probe.log", 0);
  pid_t pid;
  int pidfd;
  _cleanup_close_ int logfd = open ("/dev/null", O_WRONLY | O_CLOEXEC);
  if (spawn_qemu (argv, dirfd, logfd, NULL, -1, true, NULL, -1, -1, &pid, &pidfd, NULL) < 0)
    return false;
  bool exited = wait_exit (pidfd, PROBE_TIMEOUT_MS);
  wr_kill_reap (pidfd);
  close (pidfd);
  if (!exited)
    return false;
  _cleanup_free_ char *log = NULL;
  size_t len = 0;
  if (wr_read_file_at (dirfd, "probe.log", &log, &len, 1 << 20) < 0)
    return false;
  return memmem (log, len, "warren-probe-ok", 15) != NULL;
}

static int
vm_setup (struct wr_runtime *rt, wr_err_t *err)
{
  if (vm.ready && vm.rt == rt)
    return 0;
  memset (&vm, 0, sizeof vm);
  if (!wr_vm_available (WR_VM_MICRO, err))
    return -ENOENT;
  find_in_path ("qemu-system-x86_64", vm.qemu, sizeof vm.qemu);
  char g[PATH_MAX], kit_initramfs[PATH_MAX + 32];
  guest_dir (g, sizeof g);
  snprintf (vm.kernel, sizeof vm.kernel, "%s/vmlinuz", g);
  snprintf (kit_initramfs, sizeof kit_initramfs, "%s/initramfs.img", g);
  snprintf (vm.vmdir, sizeof vm.vmdir, "%s/vm", rt->root);
  snprintf (vm.initrd, sizeof vm.initrd, "%s/initrd.img", vm.vmdir);
  if (mkdir (vm.vmdir, 0700) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s", vm.vmdir);
  snprintf (vm.jaildir, sizeof vm.jaildir, "%s/jail", vm.vmdir);
  if (mkdir (vm.jaildir, 0755) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s", vm.jaildir);
  int r = build_initrd (rt, kit_initramfs, err);
  if (r < 0)
    return r;
  vm.tsc_khz = host_tsc_khz ();
  /* kits made before VM networking lack the NIC's driver; mk-guest.sh
   * lists what it packed in OUT/modules */
  char mods[PATH_MAX + 16];
  snprintf (mods, sizeof mods, "%s/modules", g);
  _cleanup_free_ char *ml = NULL;
  size_t mlen = 0;
  vm.has_net = wr_read_file_at (AT_FDCWD, mods, &ml, &mlen, 65536) == 0 && ml
               && memmem (ml, mlen, "virtio_net.ko", 13) != NULL;

  /* accelerator: WARREN_VM_ACCEL, else the cached probe, else probe */
  const char *env = getenv ("WARREN_VM_ACCEL");
  char cache[PATH_MAX + 16];
  snprintf (cache, sizeof cache, "%s/accel", vm.vmdir);
  if (env && (strcmp (env, "kvm") == 0 || strcmp (env, "tcg") == 0))
    snprintf (vm.accel, sizeof vm.accel, "%s", env);
  else
    {
      _cleanup_free_ char *c = NULL;
      size_t clen = 0;
      if (wr_read_file_at (AT_FDCWD, cache, &c, &clen, 16) == 0 && clen >= 3
          && (strncmp (c, "kvm", 3) == 0 || strncmp (c, "tcg", 3) == 0))
        snprintf (vm.accel, sizeof vm.accel, "%.3s", c);
      else
        {
          snprintf (vm.accel, sizeof vm.accel, "%s", probe_kvm (kit_initramfs) ? "kvm" : "tcg");
          _cleanup_close_ int cfd
              = open (cache, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
          if (cfd >= 0)
            wr_write_all (cfd, vm.accel, strlen (vm.accel));
        }
    }

  struct wr_sha256 h;
  wr_sha256_init (&h);
  vm_file_ident (vm.qemu, &h);
  vm_file_ident (vm.kernel, &h);
  vm_file_ident (kit_initramfs, &h);
  struct stat st;
  if (fstat (rt->agent_fd, &st) == 0)
    {
      char b[64];
      int n = snprintf (b, sizeof b, "agent|%lld|%lld", (long long)st.st_size,
                        (long long)st.st_mtime);
      wr_sha256_update (&h, b, (size_t)n);
    }
  wr_sha256_update (&h, vm.accel, strlen (vm.accel));
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, vm.ident);
  vm.rt = rt;
  vm.ready = true;
  return 0;
}

const char *
wr_vm_accel (struct wr_runtime *rt)
{
  pthread_mutex_lock (&vm_lock);
  int r = vm_setup (rt, NULL);
  pthread_mutex_unlock (&vm_lock);
  return r < 0 ? "none" : vm.accel;
}

/* ---- QEMU command line ---- */

struct strv
{
  char **v;
  size_t n, cap;
  bool oom;
};

static void
strv_free (struct strv *s)
{
  for (size_t i = 0; i < s->n; i++)
    free (s->v[i]);
  free (s->v);
}

static void __attribute__ ((format (printf, 2, 3))) strv_addf (struct strv *s, const char *fmt, ...)
{
  if (s->n + 2 > s->cap)
    {
      size_t cap = s->cap ? s->cap * 2 : 64;
      char **nv = realloc (s->v, cap * sizeof *nv);
      if (nv == NULL)
        {
          s->oom = true;
          return;
        }
      s->v = nv;
      s->cap = cap;
    }
  va_list ap;
  va_start (ap, fmt);
  char *p = NULL;
  if (vasprintf (&p, fmt, ap) < 0)
    {
      s->oom = true;
      p = NULL;
    }
  va_end (ap);
  if (p == NULL)
    return;
  s->v[s->n++] = p;
  s->v[s->n] = NULL;
}

/* QEMU option values split on ','; a literal comma is doubled. */
static char *
qemu_escape (const char *s)
{
  size_t n = strlen (s), commas = 0;
  for (size_t i = 0; i < n; i++)
    commas += s[i] == ',';
  char *o = malloc (n + commas + 1), *p = o;
  if (o == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++)
    {
      *p++ = s[i];
      if (s[i] == ',')
        *p++ = ',';
    }
  *p = '\0';
  return o;
}

struct vm_params
{
  enum wr_vm_kind kind;
  uint64_t guest_mb, disk_mb;
  unsigned vcpus;
  /* enforced inside the guest by its agent (LIMITS frame); not part of
   * the snapshot key: a clone gets its own after restore */
  uint64_t task_mem_bytes, pids_max;
  double cpus;
  const char **layers;
  size_t n_layers;
  char hostname[65];
  /* a disk image (vm_disk.c): the VM boots it through SeaBIOS from its own
   * qcow2 overlay; the layers and the kit are then unused */
  char disk[PATH_MAX];
  char disk_fmt[8];
  /* a networked VM (spec->vm_net): its tap's fd (the caller's; QEMU gets
   * its own as VM_TAP_FD) and eth0's configuration; -1: no NIC */
  int tap_fd;
  char net_addr[16], net_gw[16];
  unsigned char mac[6];
};

/* eth0 of a networked guest: its init (scripts/guest-init.sh) sets the
 * address, route and resolv.conf from warren.net=ADDR,GW on the command
 * line; a disk image runs its own init and kernel, and its agent sets them
 * from the MAC (src/agent/vmnet.c). */
static int
vm_params_net (const struct wr_vm_net *net, struct vm_params *p, wr_err_t *err)
{
  if (!p->disk[0] && !vm.has_net)
    return wr_error (err, ENOENT, WR_E_UNSUPPORTED,
                     "the guest kit has no virtio_net: rebuild it (scripts/mk-guest.sh)");
  p->tap_fd = net->tap_fd;
  inet_ntop (AF_INET, &net->address, p->net_addr, sizeof p->net_addr);
  inet_ntop (AF_INET, &net->gateway, p->net_gw, sizeof p->net_gw);
  /* locally administered, from the address: stable for the slot */
  uint32_t a = ntohl (net->address.s_addr);
  unsigned char mac[6] = { 0x02,
                           0x57,
                           (unsigned char)(a >> 24),
                           (unsigned char)(a >> 16),
                           (unsigned char)(a >> 8),
                           (unsigned char)a };
  memcpy (p->mac, mac, sizeof mac);
  return 0;
}

static int
vm_params (enum wr_vm_kind kind, const struct wr_container_spec *spec, struct vm_params *p,
           wr_err_t *err)
{
  memset (p, 0, sizeof *p);
  p->kind = kind;
  p->tap_fd = -1;
  if (spec->n_layer_files == 0 || spec->layer_files == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "no layer files");
  size_t max_layers = kind == WR_VM_MICRO ? WR_MICROVM_MAX_LAYERS : WR_VM_MAX_LAYERS;
  if (spec->n_layer_files > max_layers)
    return wr_error (err, E2BIG, WR_E_INVALID, "%zu layers: a %s attaches at most %zu",
                     spec->n_layer_files, kind == WR_VM_MICRO ? "microvm" : "vm", max_layers);
  for (size_t i = 0; i < spec->n_layer_files; i++)
    if (spec->layer_files[i] == NULL || spec->layer_files[i][0] != '/')
      return wr_error (err, EINVAL, WR_E_INVALID, "layer files must be absolute");
  p->layers = spec->layer_files;
  p->n_layers = spec->n_layer_files;
  uint64_t mem = spec->memory_mb ? spec->memory_mb : 1024;
  if (mem > (1ull << 20) || spec->disk_mb > (1ull << 20) || spec->cpus < 0 || spec->cpus > 1024)
    return wr_error (err, EINVAL, WR_E_INVALID, "limit out of range");
  /* the kernel, modules and agent need ~100 MiB before any workload */
  p->guest_mb = mem + GUEST_RESERVE_MB < MIN_GUEST_MB ? MIN_GUEST_MB : mem + GUEST_RESERVE_MB;
  p->task_mem_bytes = mem << 20;
  p->pids_max = spec->pids_max ? spec->pids_max : 1024;
  p->cpus = spec->cpus;
  p->disk_mb = spec->disk_mb ? spec->disk_mb : 1024;
  long ncpu = sysconf (_SC_NPROCESSORS_ONLN);
  double c = spec->cpus > 0 ? ceil (spec->cpus) : 1;
  if (ncpu > 0 && c > (double)ncpu)
    c = (double)ncpu;
  p->vcpus = c < 1 ? 1 : (unsigned)c;
  /* a deterministic sandbox's fixed hostname, else its id: on the kernel
   * command line of a boot, in the restore ping of a clone */
  snprintf (p->hostname, sizeof p->hostname, "%s", spec->hostname ? spec->hostname : spec->id);
  int r = wr_vm_disk_from_config (vm.rt->root, spec->image_config, p->disk, sizeof p->disk,
                                  p->disk_fmt, err);
  if (r < 0)
    return r;
  if (r > 0 && kind != WR_VM_FULL)
    return wr_error (err, EINVAL, WR_E_INVALID,
                     "disk images boot through firmware: use backend \"vm\"");
  return spec->vm_net ? vm_params_net (spec->vm_net, p, err) : 0;
}

/* incoming: restore from the snapshot state on fd 3 (else boot). No QEMU
 * may spawn: the template build migrates to an fd passed over QMP. */
static int
build_argv (const struct vm_params *p, const char *hostname, bool incoming, struct strv *a,
            wr_err_t *err)
{
  bool micro = p->kind == WR_VM_MICRO;
  strv_addf (a, "%s", vm.qemu);
  strv_addf (a, "-sandbox");
  strv_addf (a, "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny");
  strv_addf (a, "-name");
  strv_addf (a, "warren-%s", hostname);
  strv_addf (a, "-nodefaults");
  strv_addf (a, "-no-user-config");
  strv_addf (a, "-nographic");
  strv_addf (a, "-no-reboot");
  strv_addf (a, "-machine");
  /* microvm keeps ACPI: the Debian cloud kernel finds virtio-mmio devices
   * only through ACPI (no VIRTIO_MMIO_CMDLINE_DEVICES); q35 boots SeaBIOS */
  strv_addf (a, "%s", micro ? "microvm" : "q35");
  strv_addf (a, "-accel");
  if (strcmp (vm.accel, "kvm") == 0)
    strv_addf (a, "kvm");
  else
    strv_addf (a, "tcg,tb-size=128");
  strv_addf (a, "-m");
  strv_addf (a, "%" PRIu64, p->guest_mb);
  strv_addf (a, "-smp");
  strv_addf (a, "%u", p->vcpus);
  if (p->disk[0] == '\0')
    {
      strv_addf (a, "-kernel");
      strv_addf (a, "%s", vm.kernel);
      strv_addf (a, "-initrd");
      strv_addf (a, "%s", vm.initrd);
      strv_addf (a, "-append");
      strv_addf (a,
                 "console=ttyS0 quiet loglevel=4 panic=-1 tsc_early_khz=%" PRIu64
                 " warren.layers=%zu warren.disk_mb=%" PRIu64
                 " warren.upper=disk warren.hostname=%s%s%s%s%s",
                 vm.tsc_khz, p->n_layers, p->disk_mb, hostname,
                 p->tap_fd >= 0 ? " warren.net=" : "", p->tap_fd >= 0 ? p->net_addr : "",
                 p->tap_fd >= 0 ? "," : "", p->tap_fd >= 0 ? p->net_gw : "");
    }
  if (p->tap_fd >= 0)
    {
      /* the host side is the daemon's tap (docs/network.md, "VMs"): QEMU
       * only moves frames; no vhost (it would need /dev/vhost-net) */
      strv_addf (a, "-netdev");
      strv_addf (a, "tap,id=n0,fd=%d,vhost=off", VM_TAP_FD);
      strv_addf (a, "-device");
      strv_addf (a, "%s,netdev=n0,mac=%02x:%02x:%02x:%02x:%02x:%02x",
                 micro ? "virtio-net-device" : "virtio-net-pci", p->mac[0], p->mac[1], p->mac[2],
                 p->mac[3], p->mac[4], p->mac[5]);
    }
  strv_addf (a, "-serial");
  /* a pipe to the log pump, which keeps the first WR_JAIL_LOG_CAP bytes */
  strv_addf (a, "file:/proc/self/fd/%d", WR_JAIL_FD_CONSOLE);
  strv_addf (a, "-qmp");
  strv_addf (a, "unix:" QMP_SOCK ",server=on,wait=off");
  strv_addf (a, "-chardev");
  strv_addf (a, "socket,id=agent,path=" AGENT_SOCK ",server=on,wait=off");
  strv_addf (a, "-device");
  strv_addf (a, "%s", micro ? "virtio-serial-device" : "virtio-serial-pci");
  strv_addf (a, "-device");
  strv_addf (a, "virtserialport,chardev=agent,name=org.warren.agent");
  if (p->disk[0])
    {
      /* SeaBIOS boots the overlay (in the cwd = state dir); its backing
       * file, the shared base, is opened read-only */
      strv_addf (a, "-drive");
      strv_addf (a, "id=disk,file=" OVERLAY ",format=qcow2,if=none");
      strv_addf (a, "-device");
      strv_addf (a, "virtio-blk-pci,drive=disk,bootindex=0");
    }
  for (size_t i = 0; p->disk[0] == '\0' && i < p->n_layers; i++)
    {
      _cleanup_free_ char *f = qemu_escape (p->layers[i]);
      if (f == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "argv");
      strv_addf (a, "-drive");
      strv_addf (a, "id=wl%zu,file=%s,format=raw,if=none,readonly=on", i, f);
      strv_addf (a, "-device");
      strv_addf (a, "%s,drive=wl%zu,serial=wl%zu", micro ? "virtio-blk-device" : "virtio-blk-pci",
                 i, i);
    }
  if (p->disk[0] == '\0')
    {
      /* the writable layer lives on the host's disk, bounded by its size,
       * not in guest RAM */
      strv_addf (a, "-drive");
      strv_addf (a, "id=wupper,file=" UPPER ",format=raw,if=none,discard=unmap");
      strv_addf (a, "-device");
      strv_addf (a, "%s,drive=wupper,serial=wupper",
                 micro ? "virtio-blk-device" : "virtio-blk-pci");
    }
  strv_addf (a, "-device");
  strv_addf (a, "%s", micro ? "virtio-rng-device" : "virtio-rng-pci");
  if (incoming)
    {
      strv_addf (a, "-incoming");
      strv_addf (a, "fd:%d", WR_JAIL_FD_INCOMING);
    }
  if (a->oom)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "argv");
  return 0;
}

/* ---- processes ---- */

/* QEMU reads the shared inputs as its own uid: they stay root's, read-only */
static void
make_world_readable (const char *path)
{
  struct stat st;
  if (stat (path, &st) == 0 && S_ISREG (st.st_mode) && (st.st_mode & S_IROTH) == 0)
    chmod (path, 0444);
}

static void
jail_init (struct wr_jail *j, const struct vm_params *p, const char *state_dir, uid_t uid)
{
  memset (j, 0, sizeof *j);
  j->uid = uid;
  j->gid = (gid_t)uid;
  j->root = vm.jaildir;
  j->state_dir = state_dir;
  j->kvm = strcmp (vm.accel, "kvm") == 0;
  if (strncmp (vm.qemu, "/usr/", 5) != 0)
    j->ro[j->n_ro++] = vm.qemu;
  if (p->disk[0])
    {
      make_world_readable (p->disk);
      j->ro[j->n_ro++] = p->disk;
      return;
    }
  j->ro[j->n_ro++] = vm.kernel;
  j->ro[j->n_ro++] = vm.initrd;
  for (size_t i = 0; i < p->n_layers && j->n_ro < WR_JAIL_MAX_RO; i++)
    {
      make_world_readable (p->layers[i]);
      j->ro[j->n_ro++] = p->layers[i];
    }
}

/* the jailed QEMU owns its state dir and the disks it writes */
static int
chown_state (int dirfd, uid_t uid, wr_err_t *err)
{
  if (fchownat (dirfd, "", uid, (gid_t)uid, AT_EMPTY_PATH) < 0)
    return wr_sys_error (err, "chown state dir");
  const char *files[] = { UPPER, OVERLAY };
  for (size_t i = 0; i < WR_ARRAY_SIZE (files); i++)
    if (fchownat (dirfd, files[i], uid, (gid_t)uid, AT_SYMLINK_NOFOLLOW) < 0 && errno != ENOENT)
      return wr_sys_error (err, "chown %s", files[i]);
  return 0;
}

/* qemu.log opens with the command line, as libvirt's logs do: the record of
 * how each QEMU, the template build's too, was sandboxed */
static void
log_argv (int logfd, char **argv)
{
  char *line = NULL;
  size_t len = 0;
  FILE *f = open_memstream (&line, &len);
  if (f == NULL)
    return;
  fputs ("warren: exec", f);
  for (size_t i = 0; argv[i]; i++)
    fprintf (f, " %s", argv[i]);
  fputc ('\n', f);
  if (fclose (f) == 0)
    (void)wr_write_all (logfd, line, len);
  free (line);
}

/* Start argv[0]. Unjailed (j == NULL: the KVM probe, qemu-img): in the
 * state dir, stdout/stderr to logfd. Jailed: in new mount/pid/net/ipc/uts
 * namespaces as j->uid, with QEMU's stdout/stderr and console (fd 4) on
 * pipes that a pump copies to logfd and confd up to WR_JAIL_LOG_CAP, and
 * incoming_fd (or /dev/null) as fd 3. */
static int
spawn_qemu (char **argv, int dirfd, int logfd, const struct wr_cg_sandbox *cgs, int tap_fd,
            bool die_with_parent, const struct wr_jail *j, int confd, int incoming_fd,
            pid_t *ret_pid, int *ret_pidfd, wr_err_t *err)
{
  static char *const envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };
  int cg_fds[1 + WR_V1_N];
  size_t n_cg = 0;
  if (cgs)
    {
      if (cgs->v2_fd >= 0)
        cg_fds[n_cg++] = cgs->v2_fd;
      for (int i = 0; i < WR_V1_N; i++)
        if (cgs->v1_fd[i] >= 0)
          cg_fds[n_cg++] = cgs->v1_fd[i];
    }
  _cleanup_close_ int nul = open ("/dev/null", O_RDONLY | O_CLOEXEC);
  if (nul < 0)
    return wr_sys_error (err, "open /dev/null");
  int errp[2];
  if (pipe2 (errp, O_CLOEXEC) < 0)
    return wr_sys_error (err, "pipe");
  _cleanup_close_ int err_r = errp[0], err_w = errp[1];
  _cleanup_close_ int con_r = -1, con_w = -1, log_r = -1, log_w = -1;
  if (j)
    {
      int cp[2], lp[2];
      if (pipe2 (cp, O_CLOEXEC) < 0)
        return wr_sys_error (err, "pipe");
      con_r = cp[0];
      con_w = cp[1];
      if (pipe2 (lp, O_CLOEXEC) < 0)
        return wr_sys_error (err, "pipe");
      log_r = lp[0];
      log_w = lp[1];
      /* QEMU reopens the console pipe through /proc/self/fd as its own uid */
      if (fchown (con_w, j->uid, j->gid) < 0)
        return wr_sys_error (err, "chown console pipe");
    }
  if (j)
    log_argv (logfd, argv);
  pid_t parent = getpid ();
  pid_t pid;
  if (j)
    pid = (pid_t)syscall (
        SYS_clone,
        (long)(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD),
        0L, 0L, 0L, 0L);
  else
    pid = fork ();
  if (pid < 0)
    return wr_sys_error (err, j ? "clone (namespaces)" : "fork");
  if (pid == 0)
    {
      /* async-signal-safe calls only: the daemon has threads */
      int step = 0;
      if (die_with_parent)
        {
          prctl (PR_SET_PDEATHSIG, SIGKILL);
          if (!j && getppid () != parent)
            _exit (127);
        }
      setsid ();
      for (size_t i = 0; i < n_cg; i++)
        {
          step = 1;
          int fd = openat (cg_fds[i], "cgroup.procs", O_WRONLY | O_CLOEXEC);
          if (fd < 0 || write (fd, "0", 1) != 1)
            goto fail;
          close (fd);
        }
      step = 2;
      if (j == NULL)
        {
          if (fchdir (dirfd) < 0 || dup2 (nul, 0) < 0 || dup2 (logfd, 1) < 0 || dup2 (logfd, 2) < 0)
            goto fail;
        }
      else
        {
          /* out of the way of the fd numbers QEMU gets (0-4) */
          int fds[8] = { nul, err_w, con_r, con_w, log_r, log_w, logfd, confd };
          for (int i = 0; i < 8; i++)
            if ((fds[i] = fcntl (fds[i], F_DUPFD_CLOEXEC, 100)) < 0)
              goto fail;
          int inc = incoming_fd >= 0 ? fcntl (incoming_fd, F_DUPFD_CLOEXEC, 100) : fds[0];
          int tap = tap_fd >= 0 ? fcntl (tap_fd, F_DUPFD_CLOEXEC, 100) : -1;
          if (inc < 0 || (tap_fd >= 0 && tap < 0))
            goto fail;
          err_w = fds[1];
          step = 4;
          int r = wr_jail_enter (j);
          if (r < 0)
            {
              errno = -r;
              goto fail;
            }
          /* credentials changed: the parent-death signal was cleared */
          if (die_with_parent)
            prctl (PR_SET_PDEATHSIG, SIGKILL);
          step = 5;
          r = wr_jail_pump (fds[2], fds[7], fds[4], fds[6]);
          if (r < 0)
            {
              errno = -r;
              goto fail;
            }
          step = 2;
          if (dup2 (fds[0], 0) < 0 || dup2 (fds[5], 1) < 0 || dup2 (fds[5], 2) < 0
              || dup2 (inc, WR_JAIL_FD_INCOMING) < 0 || dup2 (fds[3], WR_JAIL_FD_CONSOLE) < 0
              || (tap >= 0 && dup2 (tap, VM_TAP_FD) < 0))
            goto fail;
          /* nothing else of the daemon's crosses the exec */
          syscall (__NR_close_range, VM_TAP_FD + (tap >= 0), ~0u, 4u /* CLOSE_RANGE_CLOEXEC */);
        }
      struct sigaction sa = { .sa_handler = SIG_DFL };
      for (int s = 1; s < 65; s++)
        if (s != SIGKILL && s != SIGSTOP)
          sigaction (s, &sa, NULL);
      sigset_t none;
      sigemptyset (&none);
      sigprocmask (SIG_SETMASK, &none, NULL);
      step = 3;
      execve (argv[0], argv, envp);
    fail:;
      int e[2] = { step, errno };
      ssize_t wn = write (err_w, e, sizeof e);
      (void)wn;
      _exit (127);
    }
  close (TAKE_FD (err_w));
  if (j)
    {
      close (TAKE_FD (con_w));
      close (TAKE_FD (log_w));
    }
  int e[2];
  ssize_t n = wr_read_all (err_r, e, sizeof e);
  int pidfd = wr_sys_pidfd_open (pid, 0);
  if (n == (ssize_t)sizeof e)
    {
      waitpid (pid, NULL, 0);
      if (pidfd >= 0)
        close (pidfd);
      static const char *steps[]
          = { "start", "join cgroup", "set up fds", "exec qemu", "enter jail", "start log pump" };
      return wr_error (err, e[1], WR_E_INTERNAL, "qemu child: %s",
                       steps[e[0] >= 0 && e[0] < 6 ? e[0] : 0]);
    }
  if (pidfd < 0)
    {
      int r = wr_sys_error (err, "pidfd_open");
      kill (pid, SIGKILL);
      waitpid (pid, NULL, 0);
      return r;
    }
  *ret_pid = pid;
  *ret_pidfd = pidfd;
  return 0;
}

/* sockaddr for dir/name; through /proc/self/fd when the path is too long */
static int
sock_addr (const char *dir, int dirfd, const char *name, struct sockaddr_un *sa, socklen_t *len)
{
  memset (sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  int n = snprintf (sa->sun_path, sizeof sa->sun_path, "%s/%s", dir, name);
  if (n < 0 || (size_t)n >= sizeof sa->sun_path)
    n = snprintf (sa->sun_path, sizeof sa->sun_path, "/proc/self/fd/%d/%s", dirfd, name);
  if (n < 0 || (size_t)n >= sizeof sa->sun_path)
    return -ENAMETOOLONG;
  *len = (socklen_t)(offsetof (struct sockaddr_un, sun_path) + (size_t)n + 1);
  return 0;
}

/* Connect to a socket QEMU creates at startup; gives up when QEMU exits. */
static int
connect_qemu_sock (const char *dir, int dirfd, const char *name, int pidfd, int timeout_ms,
                   wr_err_t *err)
{
  struct sockaddr_un sa;
  socklen_t salen;
  if (sock_addr (dir, dirfd, name, &sa, &salen) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "state dir path too long");
  uint64_t deadline = wr_now_ms () + (uint64_t)timeout_ms;
  for (;;)
    {
      int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0)
        return wr_sys_error (err, "socket");
      if (connect (fd, (struct sockaddr *)&sa, salen) == 0)
        return fd;
      int e = errno;
      close (fd);
      if (e != ENOENT && e != ECONNREFUSED)
        return wr_error (err, e, WR_E_INTERNAL, "connect %s/%s", dir, name);
      if (pidfd >= 0 && wait_exit (pidfd, 0))
        return wr_error (err, 0, WR_E_INTERNAL, "qemu exited at startup (see %s/qemu.log)", dir);
      if (wr_now_ms () > deadline)
        return wr_error (err, ETIMEDOUT, WR_E_TIMEOUT, "qemu did not create %s", name);
      struct timespec ts = { 0, 2000000 };
      nanosleep (&ts, NULL);
    }
}

/* ---- QMP: blocking, one short-lived connection per operation ---- */

struct qmp
{
  int fd;
  char buf[65536];
  size_t len;
};

static int
qmp_read_msg (struct qmp *q, int timeout_ms, json_t **ret, wr_err_t *err)
{
  uint64_t deadline = wr_now_ms () + (uint64_t)timeout_ms;
  for (;;)
    {
      char *nl = memchr (q->buf, '\n', q->len);
      if (nl)
        {
          size_t n = (size_t)(nl - q->buf) + 1;
          json_t *j = json_loadb (q->buf, n, 0, NULL);
          memmove (q->buf, q->buf + n, q->len - n);
          q->len -= n;
          if (j == NULL)
            continue;
          *ret = j;
          return 0;
        }
      if (q->len == sizeof q->buf)
        return wr_error (err, EMSGSIZE, WR_E_INTERNAL, "qmp message too long");
      uint64_t now = wr_now_ms ();
      if (now >= deadline)
        return wr_error (err, ETIMEDOUT, WR_E_TIMEOUT, "qmp timeout");
      struct pollfd p = { .fd = q->fd, .events = POLLIN };
      int r = poll (&p, 1, (int)(deadline - now));
      if (r < 0 && errno != EINTR)
        return wr_sys_error (err, "poll qmp");
      if (r <= 0)
        continue;
      ssize_t got = read (q->fd, q->buf + q->len, sizeof q->buf - q->len);
      if (got < 0 && errno != EINTR && errno != EAGAIN)
        return wr_sys_error (err, "read qmp");
      if (got == 0)
        return wr_error (err, EPIPE, WR_E_UNAVAILABLE, "qmp closed");
      if (got > 0)
        q->len += (size_t)got;
    }
}

/* Write buf with pass_fd attached (SCM_RIGHTS) to its first byte. */
static int
send_with_fd (int sock, const char *buf, size_t len, int pass_fd)
{
  union
  {
    char buf[CMSG_SPACE (sizeof (int))];
    struct cmsghdr align;
  } ctl;
  memset (&ctl, 0, sizeof ctl);
  struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
  struct msghdr mh = {
    .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf
  };
  struct cmsghdr *c = CMSG_FIRSTHDR (&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN (sizeof (int));
  memcpy (CMSG_DATA (c), &pass_fd, sizeof (int));
  ssize_t n;
  do
    n = sendmsg (sock, &mh, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  if (n < 0)
    return -1;
  /* the fd went with the first bytes; a short send finishes plainly */
  return wr_write_all (sock, buf + n, len - (size_t)n) < 0 ? -1 : 0;
}

/* Send one command, with pass_fd (unless -1) attached for QMP's getfd;
 * *ret (may be NULL) gets its "return" value. */
static int
qmp_cmd_fd (struct qmp *q, const char *cmd, json_t *args, int pass_fd, int timeout_ms, json_t **ret,
            wr_err_t *err)
{
  json_t *m = json_pack ("{s:s}", "execute", cmd);
  if (args)
    json_object_set (m, "arguments", args);
  _cleanup_free_ char *text = json_dumps (m, JSON_COMPACT);
  json_decref (m);
  if (text == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "qmp");
  size_t tl = strlen (text);
  text[tl] = '\n';
  if ((pass_fd >= 0 ? send_with_fd (q->fd, text, tl + 1, pass_fd)
                    : wr_write_all (q->fd, text, tl + 1))
      < 0)
    return wr_sys_error (err, "write qmp");
  for (;;)
    {
      json_t *j = NULL;
      int r = qmp_read_msg (q, timeout_ms, &j, err);
      if (r < 0)
        return r;
      json_t *e = json_object_get (j, "error");
      if (e)
        {
          r = wr_error (err, 0, WR_E_INTERNAL, "qmp %s: %s", cmd,
                        json_string_value (json_object_get (e, "desc")) ?: "error");
          json_decref (j);
          return r;
        }
      json_t *rv = json_object_get (j, "return");
      if (rv)
        {
          if (ret)
            *ret = json_incref (rv);
          json_decref (j);
          return 0;
        }
      json_decref (j); /* an event */
    }
}

static int
qmp_cmd (struct qmp *q, const char *cmd, json_t *args, int timeout_ms, json_t **ret, wr_err_t *err)
{
  return qmp_cmd_fd (q, cmd, args, -1, timeout_ms, ret, err);
}

static int
qmp_open (const char *dir, int pidfd, struct qmp *q, wr_err_t *err)
{
  _cleanup_close_ int dirfd = open (dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0)
    return wr_sys_error (err, "open %s", dir);
  q->len = 0;
  q->fd = connect_qemu_sock (dir, dirfd, QMP_SOCK, pidfd, 5000, err);
  if (q->fd < 0)
    return q->fd;
  json_t *greeting = NULL;
  int r = qmp_read_msg (q, 10000, &greeting, err);
  json_decref (greeting);
  if (r == 0)
    r = qmp_cmd (q, "qmp_capabilities", NULL, 10000, NULL, err);
  if (r < 0)
    close (TAKE_FD (q->fd));
  return r;
}

/* Wait until the VM runs (a restore finished) or fails. */
static int
qmp_wait_running (struct qmp *q, int timeout_ms, wr_err_t *err)
{
  uint64_t deadline = wr_now_ms () + (uint64_t)timeout_ms;
  for (;;)
    {
      json_t *st = NULL;
      int r = qmp_cmd (q, "query-status", NULL, 10000, &st, err);
      if (r < 0)
        return r;
      const char *s = json_string_value (json_object_get (st, "status"));
      bool running = s && strcmp (s, "running") == 0;
      bool bad = s
                 && (strcmp (s, "internal-error") == 0 || strcmp (s, "shutdown") == 0
                     || strcmp (s, "guest-panicked") == 0);
      /* the template was stopped before its migration: a finished restore
       * stays paused until told to run */
      bool paused = s && (strcmp (s, "paused") == 0 || strcmp (s, "postmigrate") == 0);
      r = bad ? wr_error (err, 0, WR_E_INTERNAL, "vm status %s", s) : 0;
      json_decref (st);
      if (paused && r == 0)
        {
          r = qmp_cmd (q, "cont", NULL, 10000, NULL, err);
          if (r < 0)
            return r;
          continue;
        }
      if (running || r < 0)
        return r;
      if (wr_now_ms () > deadline)
        return wr_error (err, ETIMEDOUT, WR_E_TIMEOUT, "vm did not resume from its snapshot");
      struct timespec ts = { 0, 5000000 };
      nanosleep (&ts, NULL);
    }
}

/* ---- snapshots ---- */

/* Copy a sparse file's data ranges only (a fresh ext4 is mostly holes). */
static int
copy_sparse (int src, int dst, wr_err_t *err)
{
  struct stat st;
  if (fstat (src, &st) < 0 || ftruncate (dst, st.st_size) < 0)
    return wr_sys_error (err, "upper disk size");
  off_t off = 0;
  while (off < st.st_size)
    {
      off_t data = lseek (src, off, SEEK_DATA);
      if (data < 0 && errno == ENXIO)
        break;
      if (data < 0)
        data = off; /* no SEEK_DATA: copy everything */
      off_t hole = lseek (src, data, SEEK_HOLE);
      if (hole < 0)
        hole = st.st_size;
      while (data < hole)
        {
          loff_t in = data, out = data;
          ssize_t n = copy_file_range (src, &in, dst, &out, (size_t)(hole - data), 0);
          if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL))
            {
              static uint8_t buf[1 << 16];
              size_t want = (size_t)(hole - data) < sizeof buf ? (size_t)(hole - data) : sizeof buf;
              n = pread (src, buf, want, data);
              if (n > 0 && pwrite (dst, buf, (size_t)n, data) != n)
                n = -1;
            }
          if (n <= 0)
            return wr_sys_error (err, "copy upper disk");
          data += n;
        }
      off = hole;
    }
  return 0;
}

static pthread_mutex_t blank_lock = PTHREAD_MUTEX_INITIALIZER;

/* vmdir/upper-MB.img: an empty ext4 of MB MiB, formatted once per size
 * (no journal: the layer dies with its VM; lazy init: few blocks written). */
static int
blank_upper (uint64_t disk_mb, char *out, size_t len, wr_err_t *err)
{
  snprintf (out, len, "%s/upper-%" PRIu64 ".img", vm.vmdir, disk_mb);
  pthread_mutex_lock (&blank_lock);
  int r = 0;
  if (access (out, R_OK) < 0)
    {
      char tmp[PATH_MAX + 32], size[32];
      snprintf (tmp, sizeof tmp, "%s.tmp", out);
      snprintf (size, sizeof size, "%" PRIu64 "M", disk_mb);
      unlink (tmp);
      char *argv[] = { "mkfs.ext4",
                       "-q",
                       "-F",
                       "-m",
                       "0",
                       "-O",
                       "^has_journal",
                       "-E",
                       "lazy_itable_init=1,nodiscard",
                       tmp,
                       size,
                       NULL };
      static char *const envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };
      pid_t pid;
      r = posix_spawnp (&pid, argv[0], NULL, NULL, argv, envp);
      int status = 0;
      if (r == 0)
        while (waitpid (pid, &status, 0) < 0 && errno == EINTR)
          ;
      if (r != 0 || !WIFEXITED (status) || WEXITSTATUS (status) != 0)
        r = wr_error (err, r ? r : EIO, WR_E_UNSUPPORTED,
                      "mkfs.ext4 of the writable layer failed (e2fsprogs)");
      else if (rename (tmp, out) < 0)
        r = wr_sys_error (err, "rename %s", out);
      if (r < 0)
        unlink (tmp);
    }
  pthread_mutex_unlock (&blank_lock);
  return r;
}

/* dirfd/upper.img from `from` (a snapshot's upper disk) or a blank one */
static int
create_upper (const struct vm_params *p, int dirfd, const char *from, wr_err_t *err)
{
  char blank[PATH_MAX + 64];
  if (from == NULL)
    {
      int r = blank_upper (p->disk_mb, blank, sizeof blank, err);
      if (r < 0)
        return r;
      from = blank;
    }
  _cleanup_close_ int src = open (from, O_RDONLY | O_CLOEXEC);
  if (src < 0)
    return wr_sys_error (err, "open %s", from);
  unlinkat (dirfd, UPPER, 0);
  _cleanup_close_ int dst = openat (dirfd, UPPER, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (dst < 0)
    return wr_sys_error (err, "create " UPPER);
  int r = copy_sparse (src, dst, err);
  if (r < 0)
    unlinkat (dirfd, UPPER, 0);
  return r;
}

/* The tasks' limits, enforced by the guest's agent in its own cgroup tree
 * (agent/cgroup.c); sent before any request, so every exec runs under them. */
static int
send_limits (int fd, const struct vm_params *p, wr_err_t *err)
{
  json_int_t quota = p->cpus > 0 ? (json_int_t)(p->cpus * 100000.0) : 0;
  json_t *j = json_pack ("{s:I,s:I,s:I,s:I}", "pids_max", (json_int_t)p->pids_max, "memory_bytes",
                         (json_int_t)p->task_mem_bytes, "cpu_quota_us", quota, "cpu_period_us",
                         (json_int_t)(quota ? 100000 : 0));
  _cleanup_free_ char *s = j ? json_dumps (j, JSON_COMPACT) : NULL;
  json_decref (j);
  if (s == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "limits");
  uint8_t hdr[WR_FRAME_HDR];
  wr_frame_hdr_encode (hdr, (uint32_t)strlen (s), 0, WR_MSG_LIMITS);
  if (wr_write_all (fd, hdr, sizeof hdr) < 0 || wr_write_all (fd, s, strlen (s)) < 0)
    return wr_sys_error (err, "write limits");
  return 0;
}

static void
snapshot_key (const struct vm_params *p, char key[65])
{
  struct wr_sha256 h;
  wr_sha256_init (&h);
  char b[256];
  int n = snprintf (b, sizeof b, "%s|%d|%" PRIu64 "|%" PRIu64 "|%u|%zu|", vm.ident, (int)p->kind,
                    p->guest_mb, p->disk_mb, p->vcpus, p->n_layers);
  wr_sha256_update (&h, b, (size_t)n);
  for (size_t i = 0; i < p->n_layers; i++)
    {
      wr_sha256_update (&h, p->layers[i], strlen (p->layers[i]) + 1);
    }
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, key);
}

static bool
snapshots_enabled (void)
{
  const char *e = getenv ("WARREN_VM_SNAPSHOTS");
  return !(e && strcmp (e, "0") == 0);
}

static void
snapshot_path (const char *key, char *out, size_t len)
{
  snprintf (out, len, "%s/snap/%s/state", vm.vmdir, key);
}

/* Read whole frames until one of `type` has been consumed completely. */
static int
wait_frame (int fd, int pidfd, uint8_t type, int timeout_ms, wr_err_t *err)
{
  uint64_t deadline = wr_now_ms () + (uint64_t)timeout_ms;
  uint8_t hdr[WR_FRAME_HDR];
  size_t have = 0;
  uint32_t skip = 0;
  bool found = false;
  for (;;)
    {
      if (found && skip == 0)
        return 0;
      uint64_t now = wr_now_ms ();
      if (now >= deadline)
        return wr_error (err, ETIMEDOUT, WR_E_TIMEOUT, "guest agent not ready");
      struct pollfd p[2] = { { .fd = fd, .events = POLLIN }, { .fd = pidfd, .events = POLLIN } };
      int r = poll (p, 2, (int)(deadline - now));
      if (r < 0 && errno != EINTR)
        return wr_sys_error (err, "poll");
      if (p[1].revents)
        return wr_error (err, 0, WR_E_INTERNAL, "qemu exited while booting");
      if (!(p[0].revents & (POLLIN | POLLHUP)))
        continue;
      if (skip)
        {
          uint8_t junk[4096];
          ssize_t n = read (fd, junk, skip < sizeof junk ? skip : sizeof junk);
          if (n <= 0)
            return wr_error (err, EPIPE, WR_E_INTERNAL, "agent channel closed");
          skip -= (uint32_t)n;
          continue;
        }
      ssize_t n = read (fd, hdr + have, sizeof hdr - have);
      if (n <= 0)
        return wr_error (err, EPIPE, WR_E_INTERNAL, "agent channel closed");
      have += (size_t)n;
      if (have < sizeof hdr)
        continue;
      have = 0;
      skip = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16
             | (uint32_t)hdr[3] << 24;
      if (skip > WR_FRAME_MAX)
        return wr_error (err, EPROTO, WR_E_INTERNAL, "bad frame from the agent");
      found = hdr[8] == type;
    }
}

/* The template must be snapshotted idle: nothing half-written on the port
 * (a clone would deliver the rest to its daemon as garbage). HELLO, then a
 * PING answered in full, proves the agent's output queue is empty. */
static int
wait_agent_idle (int fd, int pidfd, int timeout_ms, wr_err_t *err)
{
  int r = wait_frame (fd, pidfd, WR_MSG_HELLO, timeout_ms, err);
  if (r < 0)
    return r;
  uint8_t ping[WR_FRAME_HDR + 4];
  wr_frame_hdr_encode (ping, 4, 0, WR_MSG_PING);
  memcpy (ping + WR_FRAME_HDR, "idle", 4);
  if (wr_write_all (fd, ping, sizeof ping) < 0)
    return wr_sys_error (err, "write ping");
  return wait_frame (fd, pidfd, WR_MSG_PONG, 30000, err);
}

/* Boot a template VM for p (no cgroup: it is the daemon's own work, killed
 * with the building thread), wait for its agent, and migrate it to
 * snap/KEY/state. Clones restore from that file. */
static int
snapshot_build (const struct vm_params *p, const char *key, wr_err_t *err)
{
  char dir[PATH_MAX + 128], final_dir[PATH_MAX + 128];
  char rnd[9];
  wr_random_hex (rnd, 8);
  snprintf (final_dir, sizeof final_dir, "%s/snap/%s", vm.vmdir, key);
  snprintf (dir, sizeof dir, "%s/snap/build-%s", vm.vmdir, rnd);
  char snapdir[PATH_MAX + 16];
  snprintf (snapdir, sizeof snapdir, "%s/snap", vm.vmdir);
  if (mkdir (snapdir, 0700) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s", snapdir);
  if (mkdir (dir, 0700) < 0)
    return wr_sys_error (err, "mkdir %s", dir);
  struct strv a = { 0 };
  int r = build_argv (p, "warren", false, &a, err);
  _cleanup_close_ int dirfd = open (dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  _cleanup_close_ int logfd = -1, confd = -1, statefd = -1;
  if (r == 0 && dirfd < 0)
    r = wr_sys_error (err, "open %s", dir);
  if (r == 0)
    {
      logfd = openat (dirfd, "qemu.log", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      confd = openat (dirfd, "console.log", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (logfd < 0 || confd < 0)
        r = wr_sys_error (err, "qemu.log");
    }
  /* root's from the start: QEMU (spawn=deny) writes it through the fd it
   * gets over QMP, never by path */
  if (r == 0)
    {
      statefd = openat (dirfd, "state", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (statefd < 0)
        r = wr_sys_error (err, "create %s/state", dir);
    }
  char uid_key[32];
  snprintf (uid_key, sizeof uid_key, "build-%s", rnd);
  uid_t uid = 0;
  bool have_uid = false;
  if (r == 0)
    r = create_upper (p, dirfd, NULL, err);
  if (r == 0)
    r = wr_jail_uid_get (uid_key, &uid, err);
  have_uid = r == 0;
  if (r == 0)
    r = chown_state (dirfd, uid, err);
  struct wr_jail j;
  jail_init (&j, p, dir, uid);
  pid_t pid = 0;
  int pidfd = -1;
  if (r == 0)
    r = spawn_qemu (a.v, dirfd, logfd, NULL, -1, true, &j, confd, -1, &pid, &pidfd, err);
  strv_free (&a);
  _cleanup_close_ int afd = -1;
  if (r == 0)
    {
      afd = connect_qemu_sock (dir, dirfd, AGENT_SOCK, pidfd, 10000, err);
      r = afd < 0 ? afd : 0;
    }
  if (r == 0)
    r = wait_agent_idle (afd, pidfd, TEMPLATE_READY_TIMEOUT_MS, err);
  struct qmp q = { .fd = -1 };
  if (r == 0)
    r = qmp_open (dir, pidfd, &q, err);
  if (r == 0)
    r = qmp_cmd (&q, "stop", NULL, 10000, NULL, err);
  if (r == 0)
    {
      json_t *args = json_pack ("{s:s}", "fdname", "snapfd");
      r = qmp_cmd_fd (&q, "getfd", args, statefd, 10000, NULL, err);
      json_decref (args);
    }
  if (r == 0)
    {
      json_t *args = json_pack ("{s:s}", "uri", "fd:snapfd");
      r = qmp_cmd (&q, "migrate", args, 10000, NULL, err);
      json_decref (args);
    }
  uint64_t deadline = wr_now_ms () + 600000;
  while (r == 0)
    {
      json_t *st = NULL;
      r = qmp_cmd (&q, "query-migrate", NULL, 10000, &st, err);
      if (r < 0)
        break;
      const char *s = json_string_value (json_object_get (st, "status"));
      bool done = s && strcmp (s, "completed") == 0;
      if (s && (strcmp (s, "failed") == 0 || strcmp (s, "cancelled") == 0))
        r = wr_error (err, 0, WR_E_INTERNAL, "snapshot migration %s", s);
      json_decref (st);
      if (done || r < 0)
        break;
      if (wr_now_ms () > deadline)
        r = wr_error (err, ETIMEDOUT, WR_E_TIMEOUT, "snapshot migration");
      struct timespec ts = { 0, 10000000 };
      nanosleep (&ts, NULL);
    }
  if (q.fd >= 0)
    close (q.fd);
  wr_kill_reap (pidfd);
  if (pidfd >= 0)
    close (pidfd);
  if (have_uid)
    {
      /* the build dir is root's again before anyone restores from it */
      chown_state (dirfd, 0, NULL);
      wr_jail_uid_put (uid_key);
    }
  if (r == 0)
    {
      /* QEMU could write its dir: publish the file the daemon created, or
       * nothing */
      struct stat mine, now;
      if (fstat (statefd, &mine) < 0 || fstatat (dirfd, "state", &now, AT_SYMLINK_NOFOLLOW) < 0
          || mine.st_dev != now.st_dev || mine.st_ino != now.st_ino || now.st_nlink != 1
          || now.st_uid != 0 || mine.st_size == 0)
        r = wr_error (err, EPERM, WR_E_INTERNAL, "snapshot state was replaced");
    }
  if (r == 0)
    {
      /* publish: snap/KEY appears whole or not at all */
      unlinkat (dirfd, AGENT_SOCK, 0);
      unlinkat (dirfd, QMP_SOCK, 0);
      if (rename (dir, final_dir) < 0 && errno != ENOTEMPTY && errno != EEXIST)
        r = wr_sys_error (err, "rename %s", final_dir);
    }
  wr_rm_rf_at (AT_FDCWD, dir);
  return r;
}

struct build_job
{
  struct vm_params p;
  char key[65];
  char **layers;
};

static void
building_set (const char *key, bool on)
{
  for (size_t i = 0; i < WR_ARRAY_SIZE (vm.building); i++)
    if (on ? vm.building[i][0] == '\0' : strcmp (vm.building[i], key) == 0)
      {
        snprintf (vm.building[i], sizeof vm.building[i], "%s", on ? key : "");
        return;
      }
}

static bool
building_has (const char *key)
{
  for (size_t i = 0; i < WR_ARRAY_SIZE (vm.building); i++)
    if (strcmp (vm.building[i], key) == 0)
      return true;
  return false;
}

static void *
build_thread (void *arg)
{
  struct build_job *j = arg;
  wr_err_t err;
  if (snapshot_build (&j->p, j->key, &err) < 0)
    fprintf (stderr, "warrend: vm snapshot %.12s: %s\n", j->key, err.msg);
  pthread_mutex_lock (&vm_lock);
  building_set (j->key, false);
  pthread_mutex_unlock (&vm_lock);
  for (size_t i = 0; i < j->p.n_layers; i++)
    free (j->layers[i]);
  free (j->layers);
  free (j);
  return NULL;
}

/* vm_lock held. A configuration booted once may never come back (images
 * are many and rarely reused): the template is built on its second boot. */
static void
kick_build (const struct vm_params *p, const char *key)
{
  if (building_has (key))
    return;
  bool seen = false;
  for (size_t i = 0; i < WR_ARRAY_SIZE (vm.seen) && !seen; i++)
    seen = strcmp (vm.seen[i], key) == 0;
  if (!seen)
    {
      snprintf (vm.seen[vm.seen_next++ % WR_ARRAY_SIZE (vm.seen)], sizeof vm.seen[0], "%s", key);
      return;
    }
  struct build_job *j = calloc (1, sizeof *j);
  if (j == NULL)
    return;
  j->p = *p;
  snprintf (j->key, sizeof j->key, "%s", key);
  j->layers = calloc (p->n_layers, sizeof *j->layers);
  for (size_t i = 0; j->layers && i < p->n_layers; i++)
    j->layers[i] = strdup (p->layers[i]);
  j->p.layers = (const char **)j->layers;
  pthread_t t;
  pthread_attr_t at;
  pthread_attr_init (&at);
  pthread_attr_setdetachstate (&at, PTHREAD_CREATE_DETACHED);
  if (j->layers && pthread_create (&t, &at, build_thread, j) == 0)
    building_set (key, true);
  else
    {
      for (size_t i = 0; j->layers && i < p->n_layers; i++)
        free (j->layers[i]);
      free (j->layers);
      free (j);
    }
  pthread_attr_destroy (&at);
}

/* Restored clones share the template's RNG state, clock and hostname: one
 * control PING tells the agent (device mode) to credit 64 bytes of host
 * entropy and reseed, set the clock and the hostname ("WRVM1" + 64 bytes
 * entropy + u64 unix ns LE + hostname; agent/main.c). */
static int
send_restore_ping (int fd, const char *hostname, wr_err_t *err)
{
  uint8_t payload[5 + 64 + 8 + 64];
  memcpy (payload, "WRVM1", 5);
  _cleanup_close_ int ur = open ("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (ur < 0 || wr_read_all (ur, payload + 5, 64) != 64)
    return wr_sys_error (err, "read /dev/urandom");
  struct timespec ts;
  clock_gettime (CLOCK_REALTIME, &ts);
  uint64_t ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  for (int i = 0; i < 8; i++)
    payload[69 + i] = (uint8_t)(ns >> (8 * i));
  size_t hl = strnlen (hostname, 64);
  memcpy (payload + 77, hostname, hl);
  uint8_t hdr[WR_FRAME_HDR];
  wr_frame_hdr_encode (hdr, (uint32_t)(77 + hl), 0, WR_MSG_PING);
  if (wr_write_all (fd, hdr, sizeof hdr) < 0 || wr_write_all (fd, payload, 77 + hl) < 0)
    return wr_sys_error (err, "write restore ping");
  return 0;
}

bool
wr_vm_snapshot_exists (struct wr_runtime *rt, enum wr_vm_kind kind,
                       const struct wr_container_spec *spec)
{
  struct vm_params p;
  pthread_mutex_lock (&vm_lock);
  bool ok = vm_setup (rt, NULL) == 0 && vm_params (kind, spec, &p, NULL) == 0 && p.disk[0] == '\0';
  char key[65], path[PATH_MAX + 160];
  if (ok)
    {
      snapshot_key (&p, key);
      snapshot_path (key, path, sizeof path);
      ok = access (path, R_OK) == 0;
    }
  pthread_mutex_unlock (&vm_lock);
  return ok;
}

int
wr_vm_snapshot_build (struct wr_runtime *rt, enum wr_vm_kind kind,
                      const struct wr_container_spec *spec, wr_err_t *err)
{
  struct vm_params p;
  pthread_mutex_lock (&vm_lock);
  int r = vm_setup (rt, err);
  if (r == 0)
    r = vm_params (kind, spec, &p, err);
  pthread_mutex_unlock (&vm_lock);
  if (r < 0)
    return r;
  if (p.disk[0])
    return wr_error (err, EINVAL, WR_E_UNSUPPORTED, "disk image VMs have no snapshots");
  p.tap_fd = -1; /* snapshots are of VMs without a NIC (wr_vm_create) */
  char key[65], path[PATH_MAX + 160];
  snapshot_key (&p, key);
  snapshot_path (key, path, sizeof path);
  if (access (path, R_OK) == 0)
    return 0;
  return snapshot_build (&p, key, err);
}

/* ---- the backend ---- */

/* qemu-img next to the QEMU binary, else from PATH's usual places */
static bool
find_qemu_img (char *out, size_t len)
{
  snprintf (out, len, "%s", vm.qemu);
  char *slash = strrchr (out, '/');
  if (slash && (size_t)(slash - out) + sizeof "/qemu-img" <= len)
    {
      strcpy (slash, "/qemu-img");
      if (access (out, X_OK) == 0)
        return true;
    }
  const char *dirs[] = { "/usr/bin", "/usr/local/bin", "/bin" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (dirs); i++)
    {
      snprintf (out, len, "%s/qemu-img", dirs[i]);
      if (access (out, X_OK) == 0)
        return true;
    }
  return false;
}

/* state_dir/overlay.qcow2 on the shared read-only base (qemu-img create) */
static int
create_overlay (const struct vm_params *p, int dirfd, int logfd, wr_err_t *err)
{
  char img[PATH_MAX];
  if (!find_qemu_img (img, sizeof img))
    return wr_error (err, ENOENT, WR_E_UNSUPPORTED, "qemu-img not found (scripts/setup.sh)");
  unlinkat (dirfd, OVERLAY, 0);
  char *argv[] = { img,  "create",        "-q",    "-f", "qcow2", "-F", (char *)p->disk_fmt,
                   "-b", (char *)p->disk, OVERLAY, NULL };
  pid_t pid;
  int pidfd;
  int r = spawn_qemu (argv, dirfd, logfd, NULL, -1, true, NULL, -1, -1, &pid, &pidfd, err);
  if (r < 0)
    return r;
  int status = 0;
  while (waitpid (pid, &status, 0) < 0 && errno == EINTR)
    ;
  close (pidfd);
  if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
    {
      unlinkat (dirfd, OVERLAY, 0);
      return wr_error (err, 0, WR_E_INTERNAL, "qemu-img create failed (see qemu.log)");
    }
  return 0;
}

static int
vm_start (struct wr_runtime *rt, const struct vm_params *p, const struct wr_container_spec *spec,
          const char *incoming, struct wr_container *ret, wr_err_t *err)
{
  _cleanup_close_ int dirfd = open (spec->state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0)
    return wr_sys_error (err, "open state dir %s", spec->state_dir);
  unlinkat (dirfd, AGENT_SOCK, 0);
  unlinkat (dirfd, QMP_SOCK, 0);
  _cleanup_close_ int logfd
      = openat (dirfd, "qemu.log", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (logfd < 0)
    return wr_sys_error (err, "create %s/qemu.log", spec->state_dir);
  _cleanup_close_ int confd
      = openat (dirfd, "console.log", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (confd < 0)
    return wr_sys_error (err, "create %s/console.log", spec->state_dir);
  _cleanup_close_ int infd = -1;
  if (incoming)
    {
      infd = open (incoming, O_RDONLY | O_CLOEXEC);
      if (infd < 0)
        return wr_sys_error (err, "open %s", incoming);
    }
  struct strv a = { 0 };
  int r = build_argv (p, p->hostname, incoming != NULL, &a, err);
  if (r == 0 && p->disk[0])
    r = create_overlay (p, dirfd, logfd, err);
  if (r == 0 && p->disk[0] == '\0')
    {
      /* a clone starts from its template's upper disk, as it was when the
       * template's memory was saved */
      char from[PATH_MAX + 160] = "";
      if (incoming)
        {
          snprintf (from, sizeof from, "%s", incoming);
          char *slash = strrchr (from, '/');
          if (slash)
            snprintf (slash + 1, sizeof from - (size_t)(slash + 1 - from), UPPER);
        }
      r = create_upper (p, dirfd, incoming ? from : NULL, err);
    }
  if (r < 0)
    {
      strv_free (&a);
      return r;
    }
  struct wr_cg_limits lim = {
    .memory_bytes = (p->guest_mb + QEMU_OVERHEAD_MB) << 20,
    .pids_max = QEMU_PIDS_MAX,
    .cpus = spec->cpus,
  };
  uid_t uid = 0;
  r = wr_jail_uid_get (spec->id, &uid, err);
  if (r == 0)
    r = chown_state (dirfd, uid, err);
  if (r < 0)
    {
      wr_jail_uid_put (spec->id);
      strv_free (&a);
      unlinkat (dirfd, OVERLAY, 0);
      return r;
    }
  struct wr_cg_sandbox cgs;
  r = wr_cg_create (&rt->cg, spec->id, &lim, &cgs, err);
  if (r < 0)
    {
      wr_jail_uid_put (spec->id);
      strv_free (&a);
      unlinkat (dirfd, OVERLAY, 0);
      return r;
    }
  struct wr_jail j;
  jail_init (&j, p, spec->state_dir, uid);
  pid_t pid = 0;
  int pidfd = -1;
  r = spawn_qemu (a.v, dirfd, logfd, &cgs, p->tap_fd, false, &j, confd, infd, &pid, &pidfd, err);
  strv_free (&a);
  _cleanup_close_ int afd = -1;
  if (r == 0)
    {
      afd = connect_qemu_sock (spec->state_dir, dirfd, AGENT_SOCK, pidfd, 10000, err);
      r = afd < 0 ? afd : 0;
    }
  if (r == 0 && incoming)
    {
      struct qmp q = { .fd = -1 };
      r = qmp_open (spec->state_dir, pidfd, &q, err);
      if (r == 0)
        r = qmp_wait_running (&q, RESTORE_TIMEOUT_MS, err);
      if (q.fd >= 0)
        close (q.fd);
      if (r == 0)
        r = send_restore_ping (afd, p->hostname, err);
    }
  /* a disk image boots with its own name and no host entropy: the same
   * control PING (queued until the agent opens the port) sets both */
  if (r == 0 && !incoming && p->disk[0])
    r = send_restore_ping (afd, p->hostname, err);
  if (r == 0)
    r = send_limits (afd, p, err);
  if (r == 0 && fcntl (afd, F_SETFL, O_NONBLOCK) < 0)
    r = wr_sys_error (err, "O_NONBLOCK");
  uint64_t st = 0;
  if (r == 0)
    wr_read_start_time (pid, &st);
  if (r < 0)
    {
      wr_kill_reap (pidfd);
      if (pidfd >= 0)
        close (pidfd);
      wr_cg_kill (&rt->cg, &cgs, NULL);
      wr_cg_sandbox_close (&cgs);
      wr_cg_remove (&rt->cg, spec->id, NULL);
      unlinkat (dirfd, AGENT_SOCK, 0);
      unlinkat (dirfd, QMP_SOCK, 0);
      unlinkat (dirfd, OVERLAY, 0);
      unlinkat (dirfd, UPPER, 0);
      wr_jail_uid_put (spec->id);
      return r;
    }
  wr_cg_sandbox_close (&cgs);
  wr_container_fill (ret, spec->id, pid, pidfd, st, TAKE_FD (afd));
  return 0;
}

int
wr_vm_create (struct wr_runtime *rt, enum wr_vm_kind kind, const struct wr_container_spec *spec,
              struct wr_container *ret, wr_err_t *err)
{
  if (spec == NULL || !wr_valid_id (spec->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  if (spec->state_dir == NULL || spec->state_dir[0] != '/')
    return wr_error (err, EINVAL, WR_E_INVALID, "state_dir must be absolute");
  struct vm_params p;
  char key[65] = "", snap[PATH_MAX + 160] = "";
  bool restore = false, snaps;
  pthread_mutex_lock (&vm_lock);
  int r = vm_setup (rt, err);
  if (r == 0)
    r = vm_params (kind, spec, &p, err);
  /* a disk VM's state includes its overlay: no memory-only snapshots */
  /* a networked VM boots: a clone would wake with its template's address */
  snaps = r == 0 && snapshots_enabled () && p.disk[0] == '\0' && p.tap_fd < 0;
  if (snaps)
    {
      snapshot_key (&p, key);
      snapshot_path (key, snap, sizeof snap);
      restore = access (snap, R_OK) == 0;
    }
  pthread_mutex_unlock (&vm_lock);
  if (r < 0)
    return r;
  if (restore)
    {
      wr_err_t rerr;
      r = vm_start (rt, &p, spec, snap, ret, &rerr);
      if (r == 0)
        return 0;
      /* a snapshot that does not restore is dropped; boot instead */
      char dir[PATH_MAX + 128];
      snprintf (dir, sizeof dir, "%s/snap/%s", vm.vmdir, key);
      wr_rm_rf_at (AT_FDCWD, dir);
      fprintf (stderr, "warrend: vm snapshot %.12s dropped: %s\n", key, rerr.msg);
    }
  r = vm_start (rt, &p, spec, NULL, ret, err);
  if (r == 0 && snaps)
    {
      pthread_mutex_lock (&vm_lock);
      kick_build (&p, key);
      pthread_mutex_unlock (&vm_lock);
    }
  return r;
}

int
wr_vm_destroy (struct wr_runtime *rt, struct wr_container *c, const char *state_dir, wr_err_t *err)
{
  if (c == NULL || !wr_valid_id (c->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  int r = wr_sandbox_kill (rt, c, err);
  if (r < 0)
    return r;
  r = wr_cg_remove (&rt->cg, c->id, err);
  wr_jail_uid_put (c->id);
  if (state_dir)
    {
      _cleanup_close_ int dfd = open (state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
      if (dfd >= 0)
        {
          unlinkat (dfd, AGENT_SOCK, 0);
          unlinkat (dfd, QMP_SOCK, 0);
          unlinkat (dfd, OVERLAY, 0);
          unlinkat (dfd, UPPER, 0);
        }
    }
  return r;
}

int
wr_vm_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uint64_t start_time,
             const char *state_dir, struct wr_container *ret, wr_err_t *err)
{
  _cleanup_close_ int pidfd = -1, dirfd = -1;
  int r = wr_adopt_open ("vm", id, pid, start_time, state_dir, &pidfd, &dirfd, err);
  if (r < 0)
    return r;
  int fd = connect_qemu_sock (state_dir, dirfd, AGENT_SOCK, pidfd, 2000, err);
  if (fd < 0)
    return fd;
  if (fcntl (fd, F_SETFL, O_NONBLOCK) < 0)
    {
      close (fd);
      return wr_sys_error (err, "O_NONBLOCK");
    }
  /* the adopted QEMU keeps its uid; no new VM may take it */
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/status", (int)pid);
  _cleanup_fclose_ FILE *f = fopen (path, "re");
  char line[256];
  unsigned ruid;
  while (f && fgets (line, sizeof line, f))
    if (sscanf (line, "Uid: %u", &ruid) == 1)
      {
        if (ruid != 0)
          wr_jail_uid_claim (id, (uid_t)ruid);
        break;
      }
  wr_container_fill (ret, id, pid, TAKE_FD (pidfd), start_time, fd);
  (void)rt;
  return 0;
}

int
wr_vm_freeze (struct wr_runtime *rt, const char *state_dir, bool frozen, wr_err_t *err)
{
  struct qmp q = { .fd = -1 };
  int r = qmp_open (state_dir, -1, &q, err);
  if (r < 0)
    return r;
  r = qmp_cmd (&q, frozen ? "stop" : "cont", NULL, 10000, NULL, err);
  close (q.fd);
  (void)rt;
  return r;
}
