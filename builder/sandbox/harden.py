"""OS hardening applied inside a sandbox process: rlimits, uid drop, Landlock, seccomp (stdlib + ctypes only).

This module is imported by the zygote (a separate interpreter started with a clean environment), so it must
not import anything outside the standard library. Each `apply_*` function returns a short detail string when
the layer was applied, or raises `OSError` when the machine does not allow it; the caller records which layers
took effect. The order matters (docs/sandbox.md): rlimits, uid drop, Landlock, then seccomp last,
because the filter denies `setresuid` and `prlimit`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
CLONE_NEWNET = 0x40000000
NOBODY = 65534

# x86_64 syscall numbers (from asm/unistd_64.h). The filter kills any other architecture or the x32 ABI, so
# a wrong table can never silently allow a call.
AUDIT_ARCH_X86_64 = 0xC000003E
DENIED_SYSCALLS = {
    # processes, threads, programs
    "fork": 57, "vfork": 58, "clone": 56, "execve": 59, "execveat": 322, "unshare": 272, "setns": 308,
    # network and IPC
    "socket": 41, "socketpair": 53, "connect": 42, "bind": 49, "listen": 50, "accept": 43, "accept4": 288,
    "msgget": 68, "semget": 64, "shmget": 29, "mq_open": 240,
    # files: no opening at all (the worker has everything it needs preloaded) and no changes
    "open": 2, "openat": 257, "creat": 85, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "unlink": 87, "unlinkat": 263, "rename": 82, "renameat": 264, "renameat2": 316, "mkdir": 83,
    "mkdirat": 258, "rmdir": 84, "symlink": 88, "symlinkat": 266, "link": 86, "linkat": 265, "chmod": 90,
    "fchmod": 91, "fchmodat": 268, "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260, "truncate": 76,
    "ftruncate": 77, "utime": 132, "utimes": 235, "utimensat": 280, "futimesat": 261, "mknod": 133,
    "mknodat": 259, "memfd_create": 319, "sendfile": 40, "splice": 275, "tee": 276, "vmsplice": 278,
    "copy_file_range": 326, "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300,
    # other processes, the kernel and the machine
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_open": 434, "pidfd_getfd": 438,
    "pidfd_send_signal": 424, "tkill": 200, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "kcmp": 312,
    "process_madvise": 440, "move_pages": 279, "migrate_pages": 256, "mbind": 237, "set_mempolicy": 238,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 321,
    "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176, "reboot": 169,
    "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "personality": 135,
    # identity and limits
    "setrlimit": 160, "setuid": 105, "setgid": 106, "setreuid": 113, "setregid": 114, "setresuid": 117,
    "setresgid": 119, "setgroups": 116, "setfsuid": 122, "setfsgid": 123, "capset": 126,
}  # fmt: skip
NR_KILL, NR_TGKILL, NR_PRLIMIT64, NR_CLONE3, NR_OPENAT2 = 62, 234, 302, 435, 437

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_OFF_NR, _OFF_ARCH = 0, 4


def _arg_low(i: int) -> int:
    return 16 + 8 * i


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def seccomp_program(own_pid: int) -> bytes:
    """The BPF program: default allow, EPERM on the denied list, signals only to `own_pid`, limits read-only.

    Threads are denied with processes (`clone` is refused), which also stops a spinning background thread
    from outliving its call. `clone3` and `openat2` answer ENOSYS so libc falls back to the denied forms.
    """
    eperm = _RET_ERRNO | errno.EPERM
    enosys = _RET_ERRNO | errno.ENOSYS
    prog = [
        _insn(_LD_W_ABS, _OFF_ARCH),
        _insn(_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        _insn(_RET_K, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _OFF_NR),
        _insn(_JGE_K, 0x40000000, 0, 1),  # x32 ABI
        _insn(_RET_K, _RET_KILL_PROCESS),
    ]
    for nr in sorted(set(DENIED_SYSCALLS.values())):
        prog += [_insn(_JEQ_K, nr, 0, 1), _insn(_RET_K, eperm)]
    for nr in (NR_CLONE3, NR_OPENAT2):
        prog += [_insn(_JEQ_K, nr, 0, 1), _insn(_RET_K, enosys)]
    for nr in (NR_KILL, NR_TGKILL):  # first argument must be our own pid
        prog += [
            _insn(_JEQ_K, nr, 0, 4),
            _insn(_LD_W_ABS, _arg_low(0)),
            _insn(_JEQ_K, own_pid, 0, 1),
            _insn(_RET_K, _RET_ALLOW),
            _insn(_RET_K, eperm),
        ]
    prog += [  # prlimit64(pid, resource, new_limit, old_limit): reading is fine, setting is not
        _insn(_JEQ_K, NR_PRLIMIT64, 0, 6),
        _insn(_LD_W_ABS, _arg_low(2)),
        _insn(_JEQ_K, 0, 0, 3),
        _insn(_LD_W_ABS, _arg_low(2) + 4),
        _insn(_JEQ_K, 0, 0, 1),
        _insn(_RET_K, _RET_ALLOW),
        _insn(_RET_K, eperm),
        _insn(_RET_K, _RET_ALLOW),
    ]
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_supported() -> bool:
    """Whether this build of the filter fits the machine (x86_64 Linux)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def apply_seccomp() -> str:
    """Install the filter on the calling process (irreversible). Raises OSError if the kernel refuses."""
    if not seccomp_supported():
        raise OSError(errno.ENOSYS, f"seccomp filter is built for x86_64, not {platform.machine()}")
    program = seccomp_program(os.getpid())
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))
    return f"{len(program) // 8} BPF instructions"


def _prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    if _libc.prctl(option, arg2, arg3, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl({option}) failed: {os.strerror(code)}")


def set_parent_death_signal(signal_number: int) -> None:
    """Ask the kernel to send `signal_number` to this process when its parent dies."""
    _prctl(PR_SET_PDEATHSIG, signal_number)


def set_not_dumpable() -> None:
    """Make /proc/<pid>/{mem,environ} of this process unreadable by its siblings."""
    _prctl(PR_SET_DUMPABLE, 0)


def apply_rlimits(memory_mb: int, cpu_s: int, open_files: int) -> str:
    """Address space, CPU seconds, no file writes, few descriptors, no core dumps."""
    memory = memory_mb * 1024 * 1024
    limits = {
        resource.RLIMIT_AS: memory,
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_FSIZE: 0,
        resource.RLIMIT_NOFILE: open_files,
        resource.RLIMIT_CORE: 0,
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    return f"AS={memory_mb}MiB CPU={cpu_s}s FSIZE=0 NOFILE={open_files}"


def drop_uid() -> str:
    """Become `nobody` when running as root; raises OSError otherwise (there is nothing to drop to)."""
    if os.getuid() != 0:
        raise OSError(errno.EPERM, "not root: no uid to drop to")
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    return f"uid={NOBODY}"


def unshare_network() -> str:
    """Move the calling process into a new, empty network namespace (root only, not inside Docker)."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}")
    return "empty network namespace"


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


_NR_LANDLOCK_CREATE, _NR_LANDLOCK_RESTRICT = 444, 446


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is unavailable."""
    abi = _libc.syscall(_NR_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def apply_landlock() -> str:
    """Deny every filesystem access, TCP bind/connect (ABI >= 4) and signals/abstract sockets outside (ABI >= 6).

    No path is allowed at all: the worker has already imported everything it may use.
    """
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, "Landlock is not available on this kernel")
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net = 0b11 if abi >= 4 else 0
    scoped = 0b11 if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = _libc.syscall(_NR_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"landlock_create_ruleset: {os.strerror(code)}")
    try:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if _libc.syscall(_NR_LANDLOCK_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"landlock_restrict_self: {os.strerror(code)}")
    finally:
        os.close(fd)
    parts = ["fs"] + (["tcp"] if net else []) + (["signal+abstract-unix scope"] if scoped else [])
    return f"ABI {abi}: " + ", ".join(parts)
