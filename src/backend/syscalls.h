/* Raw system calls and kernel-header fallbacks for the container backend.
 *
 * Two flavours:
 *  - wr_sys_* : thin syscall(2) wrappers (set errno, return -1) for code that
 *    runs in the daemon.
 *  - wr_raw*  : inline syscall instructions returning -errno WITHOUT touching
 *    errno or any other libc state. The sandbox child runs in the daemon's
 *    address space (CLONE_VM) concurrently with the daemon, so it may only use
 *    these (see container.c). */
#ifndef WR_SYSCALLS_H
#define WR_SYSCALLS_H

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_clone3
#define __NR_clone3 435
#endif
#ifndef __NR_pidfd_open
#define __NR_pidfd_open 434
#endif
#ifndef __NR_pidfd_send_signal
#define __NR_pidfd_send_signal 424
#endif
#ifndef __NR_open_tree
#define __NR_open_tree 428
#endif
#ifndef __NR_move_mount
#define __NR_move_mount 429
#endif
#ifndef __NR_fsopen
#define __NR_fsopen 430
#endif
#ifndef __NR_fsconfig
#define __NR_fsconfig 431
#endif
#ifndef __NR_fsmount
#define __NR_fsmount 432
#endif
#ifndef __NR_close_range
#define __NR_close_range 436
#endif
#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef FSOPEN_CLOEXEC
#define FSOPEN_CLOEXEC 0x00000001
#endif
#ifndef FSMOUNT_CLOEXEC
#define FSMOUNT_CLOEXEC 0x00000001
#endif
#ifndef FSCONFIG_SET_FLAG
#define FSCONFIG_SET_FLAG 0
#define FSCONFIG_SET_STRING 1
#define FSCONFIG_SET_FD 5
#define FSCONFIG_CMD_CREATE 6
#endif
#ifndef MOUNT_ATTR_NOSUID
#define MOUNT_ATTR_NOSUID 0x00000002
#define MOUNT_ATTR_NODEV 0x00000004
#define MOUNT_ATTR_NOEXEC 0x00000008
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
struct mount_attr
{
  uint64_t attr_set;
  uint64_t attr_clr;
  uint64_t propagation;
  uint64_t userns_fd;
};
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef P_PIDFD
#define P_PIDFD 3
#endif

struct wr_clone_args
{
  uint64_t flags;
  uint64_t pidfd;
  uint64_t child_tid;
  uint64_t parent_tid;
  uint64_t exit_signal;
  uint64_t stack;
  uint64_t stack_size;
  uint64_t tls;
  uint64_t set_tid;
  uint64_t set_tid_size;
  uint64_t cgroup;
};

static inline int
wr_sys_pidfd_open (pid_t pid, unsigned flags)
{
  return (int)syscall (__NR_pidfd_open, pid, flags);
}
static inline int
wr_sys_pidfd_send_signal (int pidfd, int sig)
{
  return (int)syscall (__NR_pidfd_send_signal, pidfd, sig, NULL, 0);
}
static inline int
wr_sys_open_tree (int dfd, const char *path, unsigned flags)
{
  return (int)syscall (__NR_open_tree, dfd, path, flags);
}
static inline int
wr_sys_move_mount (int from_dfd, const char *from, int to_dfd, const char *to, unsigned flags)
{
  return (int)syscall (__NR_move_mount, from_dfd, from, to_dfd, to, flags);
}
static inline int
wr_sys_mount_setattr (int dfd, const char *path, unsigned flags, struct mount_attr *attr)
{
  return (int)syscall (__NR_mount_setattr, dfd, path, flags, attr, sizeof *attr);
}

/* ---- raw syscalls for the CLONE_VM child (x86_64 and aarch64 inline; other
 * architectures go through syscall(2), which is safe there because the child
 * is created without CLONE_VM, see container.c). ---- */
#if defined(__x86_64__)
#define WR_HAVE_RAW_SYSCALL 1
static inline long
wr_raw6 (long n, long a, long b, long c, long d, long e, long f)
{
  long ret;
  register long r10 __asm__("r10") = d;
  register long r8 __asm__("r8") = e;
  register long r9 __asm__("r9") = f;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                   : "rcx", "r11", "memory");
  return ret;
}
#elif defined(__aarch64__)
#define WR_HAVE_RAW_SYSCALL 1
static inline long
wr_raw6 (long n, long a, long b, long c, long d, long e, long f)
{
  register long x8 __asm__("x8") = n;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = d;
  register long x4 __asm__("x4") = e;
  register long x5 __asm__("x5") = f;
  __asm__ volatile("svc 0"
                   : "+r"(x0)
                   : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5)
                   : "memory");
  return x0;
}
#else
#define WR_HAVE_RAW_SYSCALL 0
#include <errno.h>
static inline long
wr_raw6 (long n, long a, long b, long c, long d, long e, long f)
{
  long r = syscall (n, a, b, c, d, e, f);
  return r < 0 ? -errno : r;
}
#endif

#define wr_raw0(n) wr_raw6 ((n), 0, 0, 0, 0, 0, 0)
#define wr_raw1(n, a) wr_raw6 ((n), (long)(a), 0, 0, 0, 0, 0)
#define wr_raw2(n, a, b) wr_raw6 ((n), (long)(a), (long)(b), 0, 0, 0, 0)
#define wr_raw3(n, a, b, c) wr_raw6 ((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define wr_raw4(n, a, b, c, d) wr_raw6 ((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define wr_raw5(n, a, b, c, d, e)                                                                  \
  wr_raw6 ((n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), 0)

/* clone3 that runs fn(arg) on `stack` in the child and never returns there.
 * Returns the child pid or -errno in the parent. */
#if defined(__x86_64__)
static inline long
wr_clone3_run (struct wr_clone_args *args, int (*fn) (void *), void *arg)
{
  long ret;
  register long r12 __asm__("r12") = (long)fn;
  register long r13 __asm__("r13") = (long)arg;
  __asm__ volatile("syscall\n\t"
                   "test %%rax, %%rax\n\t"
                   "jnz 1f\n\t"
                   "xor %%ebp, %%ebp\n\t"
                   "mov %%r13, %%rdi\n\t"
                   "call *%%r12\n\t"
                   "mov %%eax, %%edi\n\t"
                   "mov $60, %%eax\n\t" /* exit */
                   "syscall\n\t"
                   "hlt\n"
                   "1:"
                   : "=a"(ret)
                   : "a"((long)__NR_clone3), "D"(args), "S"(sizeof *args), "r"(r12), "r"(r13)
                   : "rcx", "r11", "memory");
  return ret;
}
#define WR_HAVE_CLONE3_RUN 1
#else
#define WR_HAVE_CLONE3_RUN 0
#endif

#endif
