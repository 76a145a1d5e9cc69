"""The sandbox's seccomp filter: a classic-BPF program, built here by hand (no libseccomp), that bubblewrap loads
(``bwrap --seccomp FD``) into the sandbox just before it starts the interpreter.

Default deny (issue 54): only the system calls in :data:`X86_64_ALLOW` are allowed, the ones the candidate's Python
interpreter, its standard library and bubblewrap's own init need (files, memory, threads, signals, pipes, waiting,
``fork``/``execve`` of the interpreter, AF_UNIX sockets), as Docker's default profile and nsjail do. Anything else
fails, whether or not anyone thought of it: among others the AIO family (``io_setup``: ``fs.aio-max-nr`` is one
machine-wide pool), System V IPC (``shmget``: memory outside ``RLIMIT_AS``), POSIX message queues, ``inotify`` and
``fanotify`` (which see opens by other sandboxes on the shared read-only standard library), ``memfd_create``,
``userfaultfd``, ``io_uring``, ``bpf``, ``perf_event_open``, keyrings, ``ptrace``, the mount family, new namespaces,
``sync``/``syncfs`` and ``mlock``. The calls in :data:`X86_64_DENY` (named because they were attacks or host
settings) fail with ``EPERM``; every other call not allowed fails with ``ENOSYS``, as if this kernel lacked it, so a
C library that tries a newer call first falls back to an older one that is allowed.

Some allowed calls are allowed only with certain arguments: ``socket``/``socketpair`` for ``AF_UNIX`` only
(``EAFNOSUPPORT`` otherwise: the network namespace does not cover ``AF_VSOCK``), ``clone`` without namespace flags,
``clone3`` never (``ENOSYS``, so the C library uses ``clone``, whose flags the filter can read), and ``prctl`` for a
few harmless options, where ``PR_SET_PDEATHSIG`` may only set ``SIGKILL``: a process cannot clear or weaken its
parent-death signal. A system call of another architecture (i386, x32) kills the process.

Only x86_64 is described here: on other machines :func:`program` returns None and the sandbox refuses to run
(unless the missing layer is accepted by name, see :mod:`._modes`).

Layout: a few argument checks, then a binary search over the sorted ranges of system-call numbers (about 7
comparisons per call), each leaf returning ALLOW, ``EPERM`` or ``ENOSYS``.
"""

from __future__ import annotations

import platform
import struct

# classic BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _JA, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x05, 0x06
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_AF_UNIX = 1
_SIGKILL = 9
_SOL_SOCKET, _SOCKET_BUFFERS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
# prctl options allowed: PR_GET_PDEATHSIG 2, PR_GET/SET_DUMPABLE 3/4, PR_SET/GET_NAME 15/16, PR_GET_SECCOMP 21,
# PR_CAPBSET_READ 23, PR_GET_SECUREBITS 27, PR_SET/GET_NO_NEW_PRIVS 38/39, PR_CAP_AMBIENT 47, PR_SET_VMA (glibc names
# its anonymous mappings); PR_SET_PDEATHSIG (1) only with SIGKILL
_PR_SET_PDEATHSIG = 1
_PRCTL_ALLOW = (2, 3, 4, 15, 16, 21, 23, 27, 38, 39, 47, 0x53564D41)

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl): what the interpreter and bubblewrap's init need
X86_64_ALLOW = {
    "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6, "poll": 7, "lseek": 8,
    "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13, "rt_sigprocmask": 14, "rt_sigreturn": 15,
    "ioctl": 16, "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20, "access": 21, "pipe": 22, "select": 23,
    "sched_yield": 24, "mremap": 25, "msync": 26, "mincore": 27, "madvise": 28, "dup": 32, "dup2": 33, "pause": 34,
    "nanosleep": 35, "getitimer": 36, "alarm": 37, "setitimer": 38, "getpid": 39, "sendfile": 40, "connect": 42,
    "accept": 43, "sendto": 44, "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "shutdown": 48, "bind": 49,
    "listen": 50, "getsockname": 51, "getpeername": 52, "getsockopt": 55, "fork": 57, "vfork": 58,
    "execve": 59, "exit": 60, "wait4": 61, "kill": 62, "uname": 63, "fcntl": 72, "flock": 73, "fsync": 74,
    "fdatasync": 75, "truncate": 76, "ftruncate": 77, "getdents": 78, "getcwd": 79, "chdir": 80, "fchdir": 81,
    "rename": 82, "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "readlink": 89,
    "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "umask": 95, "gettimeofday": 96,
    "getrlimit": 97, "getrusage": 98, "sysinfo": 99, "times": 100, "getuid": 102, "getgid": 104, "geteuid": 107,
    "getegid": 108, "setpgid": 109, "getppid": 110, "getpgrp": 111, "setsid": 112, "getgroups": 115,
    "getresuid": 118, "getresgid": 120, "getpgid": 121, "getsid": 124, "capget": 125, "capset": 126,
    "rt_sigpending": 127, "rt_sigtimedwait": 128, "rt_sigqueueinfo": 129, "rt_sigsuspend": 130, "sigaltstack": 131,
    "utime": 132, "mknod": 133, "statfs": 137, "fstatfs": 138, "getpriority": 140, "setpriority": 141,
    "sched_getparam": 143, "sched_getscheduler": 145, "sched_get_priority_max": 146, "sched_get_priority_min": 147,
    "sched_rr_get_interval": 148, "arch_prctl": 158, "setrlimit": 160, "gettid": 186, "readahead": 187,
    "getxattr": 191, "lgetxattr": 192, "fgetxattr": 193, "listxattr": 194, "llistxattr": 195, "flistxattr": 196,
    "tkill": 200, "time": 201, "futex": 202, "sched_setaffinity": 203, "sched_getaffinity": 204, "epoll_create": 213,
    "getdents64": 217, "set_tid_address": 218, "restart_syscall": 219, "fadvise64": 221, "timer_create": 222,
    "timer_settime": 223, "timer_gettime": 224, "timer_getoverrun": 225, "timer_delete": 226, "clock_gettime": 228,
    "clock_getres": 229, "clock_nanosleep": 230, "exit_group": 231, "epoll_wait": 232, "epoll_ctl": 233,
    "tgkill": 234, "utimes": 235, "waitid": 247, "openat": 257, "mkdirat": 258, "mknodat": 259, "fchownat": 260,
    "futimesat": 261, "newfstatat": 262, "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266,
    "readlinkat": 267, "fchmodat": 268, "faccessat": 269, "pselect6": 270, "ppoll": 271, "set_robust_list": 273,
    "get_robust_list": 274, "splice": 275, "tee": 276, "utimensat": 280, "epoll_pwait": 281, "signalfd": 282,
    "timerfd_create": 283, "eventfd": 284, "fallocate": 285, "timerfd_settime": 286, "timerfd_gettime": 287,
    "accept4": 288, "signalfd4": 289, "eventfd2": 290, "epoll_create1": 291, "dup3": 292, "pipe2": 293,
    "preadv": 295, "pwritev": 296, "rt_tgsigqueueinfo": 297, "recvmmsg": 299, "prlimit64": 302, "sendmmsg": 307,
    "getcpu": 309, "renameat2": 316, "getrandom": 318, "execveat": 322, "copy_file_range": 326, "preadv2": 327,
    "pwritev2": 328, "statx": 332, "rseq": 334, "close_range": 436, "faccessat2": 439, "epoll_pwait2": 441,
    "futex_waitv": 449, "fchmodat2": 452, "map_shadow_stack": 453,
}
# allowed after an argument check (see the module docstring)
X86_64_CHECKED = {"socket": 41, "socketpair": 53, "setsockopt": 54, "clone": 56, "prctl": 157, "clone3": 435}
# refused with EPERM rather than ENOSYS: attacks of earlier rounds and host settings, named for the reader
X86_64_DENY = {
    "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66, "shmdt": 67, "msgget": 68,
    "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135,
    "ustat": 136, "sysfs": 139, "mlock": 149, "munlock": 150, "mlockall": 151, "munlockall": 152, "vhangup": 153,
    "modify_ldt": 154, "pivot_root": 155, "_sysctl": 156, "adjtimex": 159, "chroot": 161, "sync": 162, "acct": 163,
    "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "create_module": 174, "init_module": 175,
    "delete_module": 176, "get_kernel_syms": 177, "query_module": 178, "quotactl": 179, "nfsservctl": 180,
    "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210,
    "lookup_dcookie": 212, "semtimedop": 220, "clock_settime": 227, "vserver": 236, "mbind": 237,
    "set_mempolicy": 238, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
    "mq_notify": 244, "mq_getsetattr": 245, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "inotify_init": 253, "inotify_add_watch": 254, "inotify_rm_watch": 255, "migrate_pages": 256, "unshare": 272,
    "move_pages": 279, "inotify_init1": 294, "perf_event_open": 298, "fanotify_init": 300, "fanotify_mark": 301,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "syncfs": 306, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "memfd_create": 319,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "membarrier": 324, "mlock2": 325, "io_pgetevents": 333,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_getfd": 438, "process_madvise": 440,
    "mount_setattr": 442, "quotactl_fd": 443, "memfd_secret": 447, "set_mempolicy_home_node": 450,
    "open_tree_attr": 467,
}


def _op(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def _ret(value: int) -> bytes:
    return _op(_RET_K, value)


def _segments() -> list[tuple[int, int]]:
    """(first number, action) for consecutive ranges of system-call numbers covering 0..2**32-1."""
    action = dict.fromkeys(X86_64_ALLOW.values(), _ALLOW) | dict.fromkeys(X86_64_DENY.values(), _ERRNO | _EPERM)
    segments: list[tuple[int, int]] = []
    for nr in range(max(action) + 2):
        act = action.get(nr, _ERRNO | _ENOSYS)
        if not segments or segments[-1][1] != act:
            segments.append((nr, act))
    return segments


def _search(segments: list[tuple[int, int]]) -> list[bytes]:
    """A binary search (the accumulator holds the number) whose leaves return each segment's action."""
    if len(segments) == 1:
        return [_ret(segments[0][1])]
    mid = len(segments) // 2
    left, right = _search(segments[:mid]), _search(segments[mid:])
    # number >= the right half's first: fall through to the jump over the left half; else skip that jump
    return [_op(_JGE_K, segments[mid][0], jt=0, jf=1), _op(_JA, len(left)), *left, *right]


def _argument_checks() -> list[bytes]:
    """socket/socketpair (AF_UNIX only), clone (no namespaces), clone3 (ENOSYS), prctl (listed options, and
    PR_SET_PDEATHSIG only with SIGKILL). The accumulator holds the number on entry and after each block."""
    nrs = X86_64_CHECKED
    ops: list[bytes] = []
    # struct seccomp_data: int nr (offset 0), u32 arch (4), u64 ip (8), u64 args[6] (16 + 8 i; low word first)
    for name in ("socket", "socketpair"):
        ops += [_op(_JEQ_K, nrs[name], jf=4), _op(_LD_W_ABS, 16), _op(_JEQ_K, _AF_UNIX, jf=1), _ret(_ALLOW),
                _ret(_ERRNO | _EAFNOSUPPORT)]
    # setsockopt(fd, SOL_SOCKET, SO_SNDBUF | SO_RCVBUF | SO_SNDBUFFORCE | SO_RCVBUFFORCE, ...): refused, so every
    # socket keeps the default buffer (net.core.wmem_default), not up to net.core.wmem_max
    buffers = [_op(_JEQ_K, opt, jt=len(_SOCKET_BUFFERS) - i) for i, opt in enumerate(_SOCKET_BUFFERS)]
    ops += [_op(_JEQ_K, nrs["setsockopt"], jf=5 + len(buffers)), _op(_LD_W_ABS, 24),
            _op(_JEQ_K, _SOL_SOCKET, jf=1 + len(buffers)), _op(_LD_W_ABS, 32), *buffers, _ret(_ALLOW),
            _ret(_ERRNO | _EPERM)]
    ops += [_op(_JEQ_K, nrs["clone"], jf=4), _op(_LD_W_ABS, 16), _op(_JSET_K, _CLONE_NAMESPACES, jf=1),
            _ret(_ERRNO | _EPERM), _ret(_ALLOW)]
    ops += [_op(_JEQ_K, nrs["clone3"], jf=1), _ret(_ERRNO | _ENOSYS)]
    # prctl(option, arg2): option is an int (low word); arg2 is checked in both words
    options = [_op(_JEQ_K, opt, jt=len(_PRCTL_ALLOW) - i) for i, opt in enumerate(_PRCTL_ALLOW)]
    pdeathsig = [_op(_JEQ_K, _PR_SET_PDEATHSIG, jf=5), _op(_LD_W_ABS, 24), _op(_JEQ_K, _SIGKILL, jf=3),
                 _op(_LD_W_ABS, 28), _op(_JEQ_K, 0, jf=1)]
    body = [_op(_LD_W_ABS, 16), *pdeathsig, _ret(_ALLOW), _op(_LD_W_ABS, 16), *options, _ret(_ERRNO | _EPERM),
            _ret(_ALLOW)]
    ops += [_op(_JEQ_K, nrs["prctl"], jt=0, jf=len(body)), *body]
    return ops


def program(machine: str | None = None) -> bytes | None:
    """The filter as bytes (an array of ``struct sock_filter``), or None for a machine it does not describe."""
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return None
    ops = [_op(_LD_W_ABS, 4), _op(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1), _ret(_KILL_PROCESS),
           _op(_LD_W_ABS, 0), _op(_JGE_K, _X32_BIT, jf=1), _ret(_KILL_PROCESS)]
    ops += _argument_checks()
    ops += _search(_segments())
    return b"".join(ops)
