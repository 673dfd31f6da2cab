/* The default seccomp profile (docs/containers.md "seccomp"), built once per
 * runtime with libseccomp and kept as a BPF program the sandbox child loads
 * with one prctl right before exec. */
#include <errno.h>
#include <sched.h>
#include <seccomp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "../common/util.h"
#include "backend.h"
#include "syscalls.h"

/* Denied with EPERM: kernel keyrings, BPF, module/kexec loading, every mount
 * API (the sandbox's mounts are final), namespace entry/creation, swap,
 * reboot, clock setting, perf/userfaultfd (kernel attack surface and side
 * channels), handle-based open (escapes mount confinement), accounting,
 * quotas, raw I/O ports, the kernel log. */
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
  /* personality: only the values Docker allows (query, PER_LINUX, LINUX32,
   * UNAME26 combinations); ADDR_NO_RANDOMIZE etc. are denied. */
  static const unsigned long personas[] = { 0x0, 0x8, 0x20000, 0x20008, 0xffffffff };
  nr = SCMP_SYS (personality);
  /* "deny unless one of": express as EPERM for each arg outside the set by
   * giving the allowed values a higher-priority ALLOW is not possible with a
   * default-ALLOW filter, so add the deny as ne-chains: arg0 != each value. */
  r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EPERM), nr, 5, SCMP_A0 (SCMP_CMP_NE, personas[0]),
                        SCMP_A0 (SCMP_CMP_NE, personas[1]), SCMP_A0 (SCMP_CMP_NE, personas[2]),
                        SCMP_A0 (SCMP_CMP_NE, personas[3]), SCMP_A0 (SCMP_CMP_NE, personas[4]));
  if (r < 0)
    {
      /* libseccomp refuses several comparisons of one argument in one rule on
       * some versions: fall back to denying the dangerous bit explicitly. */
      r = seccomp_rule_add (ctx, SCMP_ACT_ERRNO (EPERM), nr, 1,
                            SCMP_A0 (SCMP_CMP_MASKED_EQ, 0x0040000, 0x0040000));
      if (r < 0)
        return wr_error (err, -r, WR_E_INTERNAL, "seccomp rule personality");
    }
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
      || st.st_size / sizeof (struct sock_filter) > BPF_MAXINSNS)
    return wr_error (err, EINVAL, WR_E_INTERNAL, "seccomp program of %lld bytes",
                     (long long)st.st_size);
  _cleanup_free_ struct sock_filter *prog = malloc ((size_t)st.st_size);
  if (prog == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "seccomp program");
  if (pread (mfd, prog, (size_t)st.st_size, 0) != st.st_size)
    return wr_sys_error (err, "read seccomp program");
  ret->len = (unsigned short)(st.st_size / sizeof (struct sock_filter));
  ret->filter = TAKE_PTR (prog);
  return 0;
}
