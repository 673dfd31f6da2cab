/* The default seccomp profile (docs/containers.md "seccomp"), built once per
 * runtime with libseccomp and kept as a BPF program the sandbox child loads
 * with one prctl right before exec. */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <seccomp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "../common/util.h"
#include "backend.h"
#include "syscalls.h"

/* Denied with EPERM: kernel keyrings, BPF, module/kexec loading, every mount
 * API (the sandbox's mounts are final), namespace entry/creation, swap,
 * reboot, clock setting, perf/userfaultfd/io_uring (kernel attack surface and
 * side channels; io_uring also runs operations a filter never sees),
 * fanotify (unprivileged since 5.13) and the NUMA placement calls (Docker
 * allows neither without CAP_SYS_ADMIN / CAP_SYS_NICE, which we drop),
 * handle-based open (escapes mount confinement), accounting, quotas, raw I/O
 * ports, the kernel log. */
static const char *const denied[] = {
  "keyctl",
  "add_key",
  "request_key",
  "bpf",
  "kexec_load",
  "kexec_file_load",
  "init_module",
  "finit_module",
  "delete_module",
  "mount",
  "umount",
  "umount2",
  "pivot_root",
  "move_mount",
  "open_tree",
  "fsopen",
  "fsmount",
  "fsconfig",
  "fspick",
  "mount_setattr",
  "swapon",
  "swapoff",
  "reboot",
  "setns",
  "unshare",
  "perf_event_open",
  "userfaultfd",
  "io_uring_setup",
  "io_uring_enter",
  "io_uring_register",
  "fanotify_init",
  "mbind",
  "get_mempolicy",
  "set_mempolicy",
  "set_mempolicy_home_node",
  "migrate_pages",
  "move_pages",
  "open_by_handle_at",
  "name_to_handle_at",
  "acct",
  "settimeofday",
  "clock_settime",
  "clock_adjtime",
  "adjtimex",
  "stime",
  "lookup_dcookie",
  "quotactl",
  "quotactl_fd",
  "iopl",
  "ioperm",
  "syslog",
  "vhangup",
  "nfsservctl",
  "kcmp",
  "get_kernel_syms",
  "query_module",
  "create_module",
  "uselib",
  "ustat",
  "sysfs",
  "_sysctl",
  "vm86",
  "vm86old",
  "pciconfig_read",
  "pciconfig_write",
  "pciconfig_iobase",
};

static const unsigned long ns_flags[] = {
  CLONE_NEWNS,  CLONE_NEWUTS, CLONE_NEWIPC,    CLONE_NEWUSER,
  CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP,
};

#if defined(__x86_64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

#ifdef NATIVE_AUDIT_ARCH
/* A few hand-written instructions in front of libseccomp's program, for what
 * a default-ALLOW libseccomp filter cannot say:
 *
 * - personality(2) only with the values Docker allows: query (0xffffffff),
 *   PER_LINUX, PER_LINUX32, UNAME26 and their combination; everything else
 *   (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ...) gets EPERM. libseccomp cannot
 *   say "arg0 not in a set" (one comparison per argument per rule, and an
 *   ALLOW rule equal to the default action is refused). The kernel reads the
 *   argument as an unsigned int; any high bit is denied.
 * - syscalls newer than the last one reviewed for this profile get ENOSYS
 *   (what an older kernel answers, so libc falls back): a deny-list must not
 *   let a kernel upgrade add attack surface (listns, 470, appeared after
 *   469). Since 424 new syscalls have one number on every architecture.
 * - open_tree_attr (467), a mount API call libseccomp 2.5 has no name for. */
static const uint32_t personas[] = { 0x0, 0x8, 0x20000, 0x20008, 0xffffffff };
#define LAST_REVIEWED_NR 469 /* file_setattr */
#define NR_OPEN_TREE_ATTR 467
#define X32_SYSCALL_BIT 0x40000000u
#define PREFIX_LEN (12 + WR_ARRAY_SIZE (personas))
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define ARG0_LO offsetof (struct seccomp_data, args[0])
#define ARG0_HI (offsetof (struct seccomp_data, args[0]) + 4)
#else
#define ARG0_LO (offsetof (struct seccomp_data, args[0]) + 4)
#define ARG0_HI offsetof (struct seccomp_data, args[0])
#endif

static void
filter_prefix (struct sock_filter *f)
{
  /* jump targets: the two returns at the end, then libseccomp's program */
  const unsigned deny = PREFIX_LEN - 2, enosys = PREFIX_LEN - 1, end = PREFIX_LEN;
  unsigned n = 0;
#define LD(off) f[n++] = (struct sock_filter)BPF_STMT (BPF_LD | BPF_W | BPF_ABS, (off))
#define JMP(op, k, t, e)                                                                           \
  do                                                                                               \
    {                                                                                              \
      f[n] = (struct sock_filter)BPF_JUMP (BPF_JMP | (op) | BPF_K, (k), (t) ? (t) - (n + 1) : 0,   \
                                           (e) ? (e) - (n + 1) : 0);                               \
      n++;                                                                                         \
    }                                                                                              \
  while (0)
  /* a foreign arch or x32 numbering falls through to libseccomp's program,
   * which kills it, as do all other syscalls and allowed values */
  LD (offsetof (struct seccomp_data, arch));
  JMP (BPF_JEQ, NATIVE_AUDIT_ARCH, 0, end);
  LD (offsetof (struct seccomp_data, nr));
  JMP (BPF_JGE, X32_SYSCALL_BIT, end, 0);
  JMP (BPF_JGT, LAST_REVIEWED_NR, enosys, 0);
  JMP (BPF_JEQ, NR_OPEN_TREE_ATTR, deny, 0);
  JMP (BPF_JEQ, __NR_personality, 0, end);
  LD (ARG0_HI);
  JMP (BPF_JEQ, 0, 0, deny);
  LD (ARG0_LO);
  for (size_t i = 0; i < WR_ARRAY_SIZE (personas); i++)
    JMP (BPF_JEQ, personas[i], end, 0);
  f[n++] = (struct sock_filter)BPF_STMT (BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
  f[n++] = (struct sock_filter)BPF_STMT (BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS);
#undef LD
#undef JMP
}
#else
#define PREFIX_LEN 0
#endif

static void
ctx_releasep (scmp_filter_ctx *c)
{
  if (*c)
    seccomp_release (*c);
}

int
wr_seccomp_build (struct sock_fprog *ret, wr_err_t *err)
{
  _cleanup_ (ctx_releasep) scmp_filter_ctx ctx = seccomp_init (SCMP_ACT_ALLOW);
  if (ctx == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "seccomp_init");
  int r;
  /* Foreign ABIs (i386/x32 on x86_64) are killed: the filter only speaks the
   * native syscall numbers (SCMP_FLTATR_ACT_BADARCH defaults to KILL). */
  for (size_t i = 0; i < WR_ARRAY_SIZE (denied); i++)
    {
      int nr = seccomp_syscall_resolve_name (denied[i]);
      if (nr == __NR_SCMP_ERROR || nr < 0)
        continue; /* not on this architecture */
      r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EPERM), nr, 0);
      if (r < 0)
        return wr_error (err, -r, WR_E_INTERNAL, "seccomp rule %s", denied[i]);
    }
  /* clone3 passes flags in memory a filter cannot read: ENOSYS makes libc
   * fall back to clone(2), whose flags register we can filter. */
  int nr = seccomp_syscall_resolve_name ("clone3");
  if (nr != __NR_SCMP_ERROR && nr >= 0
      && (r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (ENOSYS), nr, 0)) < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "seccomp rule clone3");
  for (size_t i = 0; i < WR_ARRAY_SIZE (ns_flags); i++)
    {
      r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EPERM), SCMP_SYS (clone), 1,
                            SCMP_A0 (SCMP_CMP_MASKED_EQ, ns_flags[i], ns_flags[i]));
      if (r < 0)
        return wr_error (err, -r, WR_E_INTERNAL, "seccomp rule clone");
    }
  /* AF_VSOCK reaches the hypervisor's host side (Docker denies it too). The
   * kernel reads the domain as an int: compare the low 32 bits only. */
  r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EPERM), SCMP_SYS (socket), 1,
                        SCMP_A0 (SCMP_CMP_MASKED_EQ, 0xffffffffu, AF_VSOCK));
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "seccomp rule socket");
#ifndef NATIVE_AUDIT_ARCH
  /* no hand-written personality prefix for this architecture: deny the
   * dangerous bits one rule each */
  static const unsigned long persona_bits[] = { 0x0040000, 0x0400000, 0x4000000, 0x0200000 };
  for (size_t i = 0; i < WR_ARRAY_SIZE (persona_bits); i++)
    if ((r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EPERM), SCMP_SYS (personality), 1,
                               SCMP_A0 (SCMP_CMP_MASKED_EQ, persona_bits[i], persona_bits[i])))
        < 0)
      return wr_error (err, -r, WR_E_INTERNAL, "seccomp rule personality");
#endif
  /* Note: ptrace stays allowed; the pid namespace already limits it to the
   * sandbox's own processes. */

  _cleanup_close_ int mfd = memfd_create ("warren-seccomp", MFD_CLOEXEC);
  if (mfd < 0)
    return wr_sys_error (err, "memfd_create");
  r = seccomp_export_bpf (ctx, mfd);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "seccomp_export_bpf");
  struct stat st;
  if (fstat (mfd, &st) < 0)
    return wr_sys_error (err, "fstat seccomp memfd");
  if (st.st_size <= 0 || st.st_size % sizeof (struct sock_filter) != 0
      || st.st_size / sizeof (struct sock_filter) + PREFIX_LEN > BPF_MAXINSNS)
    return wr_error (err, EINVAL, WR_E_INTERNAL, "seccomp program of %lld bytes",
                     (long long)st.st_size);
  size_t len = (size_t)st.st_size / sizeof (struct sock_filter) + PREFIX_LEN;
  _cleanup_free_ struct sock_filter *prog = calloc (len, sizeof *prog);
  if (prog == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "seccomp program");
  if (pread (mfd, prog + PREFIX_LEN, (size_t)st.st_size, 0) != st.st_size)
    return wr_sys_error (err, "read seccomp program");
#ifdef NATIVE_AUDIT_ARCH
  filter_prefix (prog);
#endif
  ret->len = (unsigned short)len;
  ret->filter = TAKE_PTR (prog);
  return 0;
}
