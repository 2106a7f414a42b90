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
* where a cgroup can be made (:mod:`grpo_lab.instructor.tree_limits`), puts
  the kernel in one of its own before it execs (``--tree-memory``,
  ``--tree-processes``: the kernel's whole tree together), and as root mounts
  the student's folder (``--folder``) as a size-capped tmpfs in the kernel's
  own mount namespace;
* on SIGTERM (also sent when the grader dies), or when the kernel exits,
  kills every descendant with SIGKILL until none is left, removes the
  kernel's cgroup, then exits. SIGINT
  (the kernel manager's interrupt, sent to the process group) is ignored here
  and reaches the kernel.

As root, before the kernel's fence, the warden also bridges, in a mount
namespace of its own, the folders on the way to Python that the student's user
may not enter (:func:`bridge_for_solutions`).

The student's process (the kernel's forked child, see
:mod:`grpo_lab.instructor.grading_child`) confines itself before any of the
student's code runs (:func:`confine_solution`); so does a fresh Python process
a check starts for the student's function (``python -m
grpo_lab.instructor.sandbox --solution FOLDER -- COMMAND...``).
:func:`confinement_gaps` says what of it this system does not allow.

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
import stat
import sys
from pathlib import Path

from grpo_lab.instructor import tree_limits

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
_READ_FILE, _READ_DIR = 1 << 2, 1 << 3
_FILE_RIGHTS = (1 << 1) | _READ_FILE | _TRUNCATE
# Landlock network rights (ABI 4+): bind and connect TCP.
_TCP_RIGHTS = (1 << 0) | (1 << 1)
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1


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
    abi = landlock_abi()
    rights = _write_rights(abi)
    scope = _SCOPE_SIGNAL if abi >= 6 else 0
    _restrict(_RulesetAttr(rights, 0, scope), [(p, rights) for p in writable])


def _restrict(attr: _RulesetAttr, rules: list[tuple[str, int]]) -> None:
    """One Landlock ruleset (``attr``, then a path-beneath rule per ``rules``
    entry), applied to this process with no new privileges."""
    libc = _libc()
    abi = landlock_abi()
    # ABI 1-3 read the file-system field, 4-5 the network one too, 6+ all.
    size = 8 if abi < 4 else 16 if abi < 6 else ctypes.sizeof(_RulesetAttr)
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, rights in rules:
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
            rights &= _FILE_RIGHTS  # a file takes file rights only
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


# --- the solution's process ---------------------------------------------------------

# The user a solution's process runs as when the grader is root (nobody).
SOLUTION_USER = 65534
# Processes and threads of that user, all solutions of a batch together,
# where the kernel's tree has no cgroup (one that has caps each tree alone,
# so that one student's fork bomb leaves the others' processes be).
SOLUTION_PROCESSES = 64
# What a solution may read besides Python, this package and its own folder.
SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/sys")
SOLUTION_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 1 << 12, 1 << 14, 1 << 18
PR_SET_DUMPABLE = 4
# The folders a solution's HOME, TMPDIR and caches point to: its own.
_HOME_VARIABLES = ("HOME", "TMPDIR", "MPLCONFIGDIR", "XDG_CACHE_HOME", "HF_HOME")


def solution_readable() -> list[str]:
    """The folders a solution's process may read: the system's, Python's and
    this grpo_lab package's (not the checkout around it, whose notebooks hold
    the solutions, nor the working folder)."""
    package = Path(__file__).resolve().parents[1]
    outside = {str(package.parent), os.path.realpath(os.getcwd())}
    found = [*SYSTEM_FOLDERS, str(package)]
    found += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    found += [entry for entry in sys.path if entry]
    readable = []
    for path in found:
        real = os.path.realpath(path)
        above = any(
            o == real or o.startswith(real.rstrip(os.sep) + os.sep) for o in outside
        )
        if os.path.isdir(real) and not above and real not in readable:
            readable.append(real)
    return readable


def bridge_for_solutions() -> str:
    """As root, in a mount namespace of this process's own (the warden's, for
    its kernel): bridge the folders on the way to :func:`solution_readable`
    that SOLUTION_USER may not enter. "" when done or not needed; else why not."""
    if not (sys.platform.startswith("linux") and os.geteuid() == 0):
        return ""
    try:
        _unshare(CLONE_NEWNS)
        _mount("none", "/", None, MS_REC | MS_PRIVATE)
        _bridge_for(solution_readable())
    except OSError as error:
        return f"no bridge ({error.strerror})"
    return ""


def confine_solution(
    scratch: str, *, folder_bytes: int = tree_limits.FOLDER_BYTES
) -> list[str]:
    """Confine this process (a grading kernel's forked child, before any of the
    student's code runs); what could not be done, in words.

    As root: a network namespace of its own (no interface up, so no kernel's
    socket, nor any other, is reachable), then the user SOLUTION_USER (no
    capabilities; RLIMIT_NPROC holds for it, unless the kernel's tree has a
    cgroup that caps its processes). Always: no file past
    ``folder_bytes`` (RLIMIT_FSIZE), not dumpable, no new privileges, HOME
    and TMPDIR in ``scratch``, and with Landlock reads only
    from :func:`solution_readable` and ``scratch``, writes only in
    ``scratch``, no TCP (ABI 4+), no signal or abstract socket to a process
    outside (ABI 6+)."""
    missing: list[str] = []
    linux = sys.platform.startswith("linux")
    readable = solution_readable()
    tree_limits.cap_file_size(folder_bytes)
    if linux and os.geteuid() == 0:
        try:
            _unshare(CLONE_NEWNET)
        except OSError as error:
            missing.append(f"no network namespace ({error.strerror})")
        try:
            os.chown(scratch, SOLUTION_USER, SOLUTION_USER)
            os.setgroups([])
            os.setresgid(SOLUTION_USER, SOLUTION_USER, SOLUTION_USER)
            os.setresuid(SOLUTION_USER, SOLUTION_USER, SOLUTION_USER)
        except OSError as error:
            missing.append(f"still root ({error.strerror})")
    if linux:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # reset by setuid
        _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    if not tree_limits.in_tree_group():  # else its group caps its processes
        resource.setrlimit(resource.RLIMIT_NPROC, (SOLUTION_PROCESSES,) * 2)
    _own_folders(scratch)
    abi = landlock_abi()
    if abi >= 1:
        try:
            _fence_solution(abi, readable, scratch)
        except OSError as error:
            missing.append(f"no Landlock fence ({error.strerror})")
    else:
        missing.append("no Landlock")
    return missing


def _fence_solution(abi: int, readable: list[str], scratch: str) -> None:
    write = _write_rights(abi)
    read = _READ_FILE | _READ_DIR
    net = _TCP_RIGHTS if abi >= 4 else 0
    scope = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL if abi >= 6 else 0
    package_parent = str(Path(__file__).resolve().parents[2])
    rules = [(path, read) for path in readable] + [(scratch, read | write)]
    rules.append((package_parent, _READ_DIR))  # names only: `import grpo_lab`
    rules += [(d, read | write if d == "/dev/null" else read) for d in SOLUTION_DEVICES]
    rules = [(path, rights) for path, rights in rules if os.path.exists(path)]
    _restrict(_RulesetAttr(write | read, net, scope), rules)


def _own_folders(scratch: str) -> None:
    """HOME, TMPDIR and the caches in ``scratch``; work there."""
    import tempfile

    for name in _HOME_VARIABLES:
        os.environ[name] = scratch
    tempfile.tempdir = None
    os.chdir(scratch)


def _unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _mount(
    source: str, target: str, kind: str | None, flags: int, data: str = ""
) -> None:
    libc = _libc()
    encoded = [None if v is None else v.encode() for v in (source, target, kind)]
    if libc.mount(*encoded, ctypes.c_ulong(flags), data.encode() or None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {target}: {os.strerror(error)}")


def _bridge_for(paths: list[str]) -> None:
    """In this (private) mount namespace, a folder on the way to one of
    ``paths`` that others may not enter (``/root``, mode 0700) is covered by an
    empty one they may, holding only the way on, bound from the original."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).parts
        for depth in range(2, len(parts)):
            folder = os.path.join(*parts[:depth])
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                blocked.setdefault(folder, set()).add(parts[depth])
    for folder in sorted(blocked, key=lambda f: len(Path(f).parts)):
        ways = {}
        for name in sorted(blocked[folder]):
            with contextlib.suppress(OSError):
                ways[name] = os.open(os.path.join(folder, name), os.O_PATH)
        _mount("tmpfs", folder, "tmpfs", 0, "mode=0755")
        for name, descriptor in ways.items():
            target = os.path.join(folder, name)
            if stat.S_ISDIR(os.fstat(descriptor).st_mode):
                os.mkdir(target)
            else:
                open(target, "w").close()
            _mount(f"/proc/self/fd/{descriptor}", target, None, MS_BIND | MS_REC)
            os.close(descriptor)


def confinement_gaps() -> list[str]:
    """What :func:`confine_solution` cannot do on this system (tried once in
    a forked process), as sentences for the grade output."""
    import json
    import tempfile

    if not hasattr(os, "fork"):
        return ["the students' code is not confined on this system (no fork)"]
    with tempfile.TemporaryDirectory(prefix="grpo-lab-probe-") as scratch:
        os.chmod(scratch, 0o777)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                bridge = bridge_for_solutions()
                missing = [bridge] if bridge else []
                # The warden mounts the tmpfs only where the bridge was made.
                quota = "no bridge" if bridge else _probe_quota(scratch)
                missing += [f"no tmpfs ({quota})"] if quota else []
                missing += confine_solution(scratch)
                os.write(write_end, json.dumps(missing).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as handle:
            text = handle.read()
        os.waitpid(pid, 0)
    missing = json.loads(text or b'["the probe died"]')
    return [_GAP_TEXT.get(m.split(" (")[0], m) for m in missing]


def _probe_quota(scratch: str) -> str:
    """Mount (in the probe's namespace) and unmount a quota tmpfs; why not."""
    folder = os.path.join(scratch, "quota")
    why = tree_limits.mount_folder_quota(folder, 1 << 20, 16)
    if not why:
        _libc().umount2(folder.encode(), 0)
    return why


NO_TMPFS_TEXT = (
    "the students' folder is not a size-capped tmpfs (that needs root): each "
    "file it writes is capped by RLIMIT_FSIZE, and the folder is measured "
    "after each exercise (past the quota, an error)"
)
_GAP_TEXT = {
    "no bridge": "the students' code runs as another user who may not enter "
    "the folders on the way to Python; it may fail to import modules",
    "no network namespace": "the students' code is not in a network namespace "
    "of its own (Landlock's TCP rules alone fence it, where the kernel has them)",
    "still root": "the students' code runs as root without capabilities: the "
    "process limit does not hold (cap processes outside, e.g. docker "
    "--pids-limit)",
    "no Landlock": "without Landlock, the students' code can read whatever "
    "the grader's user can and write where it may, and (unless the grader "
    "runs as root) open network connections, the kernels' own included",
    "no Landlock fence": "Landlock refused the students' fence: reads, writes "
    "and connections are not fenced",
    "no tmpfs": NO_TMPFS_TEXT,
}


def _set_limits(memory: int, cpu: int, nproc: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if cpu:
        # The hard limit one second later: SIGXCPU first, then SIGKILL.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _exec_kernel(
    options: argparse.Namespace, group: tree_limits.TreeGroup | None
) -> None:
    """In the forked child: its cgroup, limits, the student's folder, fence,
    then exec the command (never returns)."""
    try:
        if group is not None:
            group.join()  # before anything is forked: the whole tree is in it
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
        # Before the fence: a fenced process may not mount.
        unbridged = bridge_for_solutions()
        if options.folder and not unbridged:  # in the kernel's own namespace
            tree_limits.mount_folder_quota(
                options.folder, options.folder_bytes, options.folder_files
            )
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
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--solution",
        default=None,
        metavar="SCRATCH",
        help="confine this process as a student's own is, then exec COMMAND",
    )
    parser.add_argument("--memory", type=int, default=0, help="RLIMIT_AS, bytes")
    parser.add_argument("--cpu", type=int, default=0, help="RLIMIT_CPU, seconds")
    parser.add_argument("--nproc", type=int, default=0, help="RLIMIT_NPROC")
    parser.add_argument(
        "--tree-memory", type=int, default=0, help="the whole tree's memory, bytes"
    )
    parser.add_argument(
        "--tree-processes",
        type=int,
        default=tree_limits.TREE_PROCESSES,
        help="the whole tree's processes and threads",
    )
    parser.add_argument(
        "--folder", default=None, help="the student's folder: a tmpfs as root"
    )
    parser.add_argument("--folder-bytes", type=int, default=tree_limits.FOLDER_BYTES)
    parser.add_argument("--folder-files", type=int, default=tree_limits.FOLDER_FILES)
    parser.add_argument("--write", action="append", default=[])
    parser.add_argument("--keep-fd", type=int, action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.command[:1] == ["--"]:
        options.command = options.command[1:]
    if not options.command:
        parser.error("a command to run is required after --")
    if options.workdir is None and options.solution is None:
        parser.error("--workdir (a kernel's) or --solution is required")
    return options


def main(argv: list[str] | None = None) -> int:
    """Start the kernel command contained; the kernel's exit status."""
    options = _arguments(sys.argv[1:] if argv is None else argv)
    if options.solution is not None:
        confine_solution(options.solution, folder_bytes=options.folder_bytes)
        os.execvp(options.command[0], options.command)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    if sys.platform.startswith("linux"):
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # Should the grader die, the warden is told and kills everything.
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    group = None
    if options.tree_memory:
        group, _ = tree_limits.tree_group(options.tree_memory, options.tree_processes)
    kernel = os.fork()
    if kernel == 0:
        _exec_kernel(options, group)
    try:
        return _warden(kernel)
    finally:
        if group is not None:
            group.remove()


if __name__ == "__main__":
    sys.exit(main())
