"""The sandbox's system-call filter, compiled once per process by libseccomp (``pyseccomp``).

The pool compiles it and hands the classic-BPF program to its workers, which load it into
each run with one ``prctl``: the workers then never map libseccomp, which keeps the process
that every run is forked from small.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# System calls a test program never needs. Denied with EPERM (a clean OSError in the program)
# rather than a kill, so a library that probes for them keeps working. ptrace and
# process_vm_* also keep the program away from the checker; the namespace and mount calls
# keep it from undoing its own confinement.
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "mount_setattr", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "personality", "vhangup", "lookup_dcookie", "fanotify_init",
    "iopl", "ioperm", "mbind", "migrate_pages", "move_pages", "set_mempolicy",
    # SysV IPC and POSIX message queues: objects that would outlive a run in the slot's IPC
    # namespace, which its runs share one after another.
    "shmget", "semget", "msgget", "mq_open",
)  # fmt: skip
_NS_CLONE_FLAGS = (
    CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
    CLONE_NEWNET,
)  # fmt: skip


@functools.cache
def seccomp_program() -> bytes:
    """The filter as classic BPF, compiled once by libseccomp (through ``pyseccomp``).

    Loading the exported program with one prctl in each run costs microseconds, where
    building it again with libseccomp would cost a compilation per run. Calls are denied
    with EPERM (a clean OSError in the program) rather than a kill, so a library that probes
    for one keeps working.
    """
    import pyseccomp

    flt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    deny = pyseccomp.ERRNO(errno.EPERM)
    for name in _DENIED_SYSCALLS:
        with contextlib.suppress(Exception):  # a call this architecture does not have
            flt.add_rule(deny, name)
    for flag in _NS_CLONE_FLAGS:
        flt.add_rule(deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, out of a filter's reach; ENOSYS makes libc fall back
    # to clone, whose flags the rules above see.
    flt.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
    with open(fd, "w+b") as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()
