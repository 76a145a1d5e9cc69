"""The sandbox's seccomp filter: a classic-BPF program, built here by hand (no libseccomp), that bubblewrap loads
(``bwrap --seccomp FD``) into the candidate just before it execs the interpreter.

It blocks what a candidate never needs and what would reach the host kernel's shared state even from inside the
namespaces (see the sandbox module docstring): debugging other processes (``ptrace``, ``process_vm_*``,
``kcmp``, ``pidfd_getfd``), mounts and new namespaces (the ``mount`` family, ``unshare``, ``setns``,
``clone``/``clone3`` with namespace flags), kernel keyrings, ``bpf``, ``perf_event_open``, anonymous memory files
(``memfd_create``, ``memfd_secret``, which escape ``RLIMIT_AS``), ``userfaultfd``, ``io_uring`` (its operations
bypass seccomp), module and ``kexec`` loading, clock/host settings, NUMA page moves, and every socket family but
``AF_UNIX`` (no ``AF_INET``, ``AF_VSOCK``, ``AF_NETLINK``, ``AF_PACKET``: the network namespace does not cover
``AF_VSOCK``). Denied calls fail with ``EPERM`` (``EAFNOSUPPORT`` for sockets; ``ENOSYS`` for ``clone3``, so the C
library falls back to ``clone``, whose flags the filter can read). A system call of another architecture (i386,
x32) kills the process.

Only x86_64 is described here: on other machines :func:`program` returns None and the sandbox says so (a WARNING,
or an error with ``VPO_SANDBOX_STRICT=1``).
"""

from __future__ import annotations

import platform
import struct

# classic BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_AF_UNIX = 1
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl)
X86_64_DENY = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135, "ustat": 136, "sysfs": 139,
    "vhangup": 153, "modify_ldt": 154, "pivot_root": 155, "_sysctl": 156, "adjtimex": 159, "chroot": 161,
    "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "create_module": 174,
    "init_module": 175, "delete_module": 176, "get_kernel_syms": 177, "query_module": 178, "quotactl": 179,
    "nfsservctl": 180, "lookup_dcookie": 212, "vserver": 236, "mbind": 237, "set_mempolicy": 238,
    "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "migrate_pages": 256, "unshare": 272, "move_pages": 279, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "memfd_create": 319,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443,
    "memfd_secret": 447, "set_mempolicy_home_node": 450, "open_tree_attr": 467,
}
_X86_64 = {"socket": 41, "socketpair": 53, "clone": 56, "clone3": 435}


def _op(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def _ret(value: int) -> bytes:
    return _op(_RET_K, value)


def program(machine: str | None = None) -> bytes | None:
    """The filter as bytes (an array of ``struct sock_filter``), or None for a machine it does not describe."""
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return None
    # struct seccomp_data: int nr (offset 0), u32 arch (4), u64 ip (8), u64 args[6] (16 + 8 i; low word first)
    ops = [_op(_LD_W_ABS, 4), _op(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1), _ret(_KILL_PROCESS),
           _op(_LD_W_ABS, 0), _op(_JGE_K, _X32_BIT, jf=1), _ret(_KILL_PROCESS)]
    for nr in sorted(X86_64_DENY.values()):
        ops += [_op(_JEQ_K, nr, jf=1), _ret(_ERRNO | _EPERM)]
    ops += [_op(_JEQ_K, _X86_64["clone3"], jf=1), _ret(_ERRNO | _ENOSYS)]
    # socket(family, ...) / socketpair(family, ...): AF_UNIX only (the accumulator is reloaded with nr after)
    for name in ("socket", "socketpair"):
        ops += [_op(_JEQ_K, _X86_64[name], jf=4), _op(_LD_W_ABS, 16), _op(_JEQ_K, _AF_UNIX, jf=1), _ret(_ALLOW),
                _ret(_ERRNO | _EAFNOSUPPORT)]
    # clone(flags, ...): no new namespaces (flags is the first argument on x86_64)
    ops += [_op(_JEQ_K, _X86_64["clone"], jf=3), _op(_LD_W_ABS, 16), _op(_JSET_K, _CLONE_NAMESPACES, jf=1),
            _ret(_ERRNO | _EPERM)]
    ops.append(_ret(_ALLOW))
    return b"".join(ops)
