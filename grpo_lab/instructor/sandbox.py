"""Run one grading kernel contained: limits, a write fence, and no survivor.

``python -m grpo_lab.instructor.sandbox OPTIONS -- COMMAND...`` is the command the
grader's kernel manager starts (see :mod:`grpo_lab.instructor.grading`). This
process (the warden) is trusted and runs no student code. It

* marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every process
  the kernel starts, a double-forked ``setsid`` daemon included, stays its
  descendant: an orphan is handed to the warden, not to init;
* forks the kernel, which before it execs COMMAND closes every inherited file
  descriptor but 0-2 and ``--keep-fd``, sets ``RLIMIT_AS`` (``--memory``),
  ``RLIMIT_CPU`` (``--cpu``), ``RLIMIT_NPROC`` (``--nproc``; not enforced for
  root), no core files, and, where the Linux kernel offers Landlock, a fence:
  files may be written, created or removed only under the ``--write`` paths,
  and no process outside the fence may be signalled;
* on SIGTERM (also sent when the grader dies), or when the kernel exits,
  kills every descendant with SIGKILL until none is left, then exits. SIGINT
  (the kernel manager's interrupt, sent to the process group) is ignored here
  and reaches the kernel.

POSIX only; the fence and the subreaper are Linux only (elsewhere the limits
alone apply, and :func:`fence_available` says so).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# Landlock system calls (the same numbers on x86-64 and arm64).
LANDLOCK_CREATE_RULESET = 444
LANDLOCK_ADD_RULE = 445
LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock file-system rights that change the file system, by ABI version.
_WRITE_RIGHTS_ABI1 = (1 << 1) | sum(1 << bit for bit in range(4, 13))
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_SCOPE_SIGNAL = 1 << 1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The Landlock ABI version this Linux kernel offers; 0 when it offers none."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc().syscall(
        LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(version), 0)


def fence_available() -> bool:
    """Whether kernels can be fenced (writes only in their folder)."""
    return landlock_abi() >= 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def _write_rights(abi: int) -> int:
    rights = _WRITE_RIGHTS_ABI1
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def apply_write_fence(writable: list[str]) -> None:
    """Allow this process and its descendants to change files only under
    ``writable``, and (Landlock ABI 6+) to signal only processes fenced with it.
    Raises OSError when Landlock refuses."""
    libc = _libc()
    abi = landlock_abi()
    rights = _write_rights(abi)
    # ABI 1-5 read only the first field(s); the size tells the kernel which.
    attr = _RulesetAttr(rights, 0, _SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 8
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path in writable:
            _allow_beneath(libc, ruleset, path, rights)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


def _allow_beneath(libc: ctypes.CDLL, ruleset: int, path: str, rights: int) -> None:
    descriptor = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not os.path.isdir(path):
            rights &= (1 << 1) | _TRUNCATE  # a file takes file rights only
        rule = _PathBeneathAttr(rights, descriptor)
        if (
            libc.syscall(
                LANDLOCK_ADD_RULE,
                ruleset,
                LANDLOCK_RULE_PATH_BENEATH,
                ctypes.byref(rule),
                0,
            )
            != 0
        ):
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
    finally:
        os.close(descriptor)


def _set_limits(memory: int, cpu: int, nproc: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if cpu:
        # The hard limit one second later: SIGXCPU first, then SIGKILL.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _exec_kernel(options: argparse.Namespace) -> None:
    """In the forked child: limits, fence, then exec the command (never returns)."""
    try:
        keep = set(options.keep_fd)
        for descriptor in _open_descriptors():
            if descriptor > 2 and descriptor not in keep:
                with contextlib.suppress(OSError):
                    os.close(descriptor)
        for descriptor in keep:
            os.set_inheritable(descriptor, True)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _set_limits(options.memory, options.cpu, options.nproc)
        if options.write and fence_available():
            apply_write_fence(options.write)
        os.chdir(options.workdir)
        os.execvp(options.command[0], options.command)
    except BaseException as error:  # report, never fall back into the warden
        os.write(2, f"grpo_lab sandbox: {error}\n".encode())
        os._exit(127)


def _open_descriptors() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def children(pid: int | None = None) -> list[int]:
    """The direct children of ``pid`` (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                found += [int(child) for child in text.split()]
    return found


def kill_descendants() -> None:
    """SIGKILL every descendant of this (subreaper) process until none is left."""
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        alive = children()
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, 0)


class _Stop(Exception):
    """Raised by the SIGTERM handler to end the warden's wait."""


def _stop(*_: object) -> None:
    raise _Stop


def _warden(kernel: int) -> int:
    status = 1
    try:
        while True:
            pid, code = os.waitpid(-1, 0)
            if pid == kernel:
                status = os.waitstatus_to_exitcode(code)
                break
    except (_Stop, ChildProcessError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_descendants()
    return status if status >= 0 else 128 - status


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grpo_lab.instructor.sandbox")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--memory", type=int, default=0, help="RLIMIT_AS, bytes")
    parser.add_argument("--cpu", type=int, default=0, help="RLIMIT_CPU, seconds")
    parser.add_argument("--nproc", type=int, default=0, help="RLIMIT_NPROC")
    parser.add_argument("--write", action="append", default=[])
    parser.add_argument("--keep-fd", type=int, action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.command[:1] == ["--"]:
        options.command = options.command[1:]
    if not options.command:
        parser.error("a command to run is required after --")
    return options


def main(argv: list[str] | None = None) -> int:
    """Start the kernel command contained; the kernel's exit status."""
    options = _arguments(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    if sys.platform.startswith("linux"):
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # Should the grader die, the warden is told and kills everything.
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    kernel = os.fork()
    if kernel == 0:
        _exec_kernel(options)
    return _warden(kernel)


if __name__ == "__main__":
    sys.exit(main())
