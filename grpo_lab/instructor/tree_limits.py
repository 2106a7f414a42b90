"""Limits that hold for a grading kernel's whole process tree, and the
student's folder quota.

**The tree.** A grading kernel and every process it starts (the student's
process, and whatever that forks) share one memory budget and one process
budget when the grader can make a cgroup for them: cgroup v2 where this
process's own cgroup has the ``memory`` and ``pids`` controllers delegated to
its children (or is the hierarchy's root, where they can be turned on), else
the v1 ``memory`` and ``pids`` hierarchies (as root, on hosts that mount
them). The warden (:mod:`grpo_lab.instructor.sandbox`) makes one group per
kernel (:func:`tree_group`), the kernel joins it before it execs, and the
warden removes it once every process in it is dead. Past the memory limit the
Linux OOM killer ends the largest process of that tree only (the student's
hog; should it be the kernel, the exercise is an ``error`` and the kernel is
replaced); past the process limit ``fork`` fails. Where no group can be made
the limits hold per process (``RLIMIT_AS``, ``RLIMIT_CPU``) and per user
(``RLIMIT_NPROC``), and :func:`tree_limits_note` says so.

**The student's folder** (its HOME and TMPDIR, the only place its process may
write) is, as root, a tmpfs of ``folder_bytes`` and ``folder_files`` mounted in
the kernel's own mount namespace (:func:`mount_folder_quota`), so it is empty
when each kernel starts and vanishes with it; writes past it fail with
``ENOSPC``. Elsewhere each file the student's process writes is capped by
``RLIMIT_FSIZE`` (:func:`cap_file_size`) and the grading kernel measures the
folder after each exercise (:func:`folder_over`): a folder past the quota
makes the exercise an ``error``.

Linux only; elsewhere there is no group and no tmpfs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass

# The name of each kernel's group, followed by its warden's process id.
GROUP_PREFIX = "grpo-lab-kernel-"
# Processes and threads of one kernel's whole tree (a kernel and its student's
# process use about 15).
TREE_PROCESSES = 128
# The student's folder: bytes and files (tmpfs inodes, or counted).
FOLDER_BYTES = 256 << 20
FOLDER_FILES = 4096
MS_NOSUID, MS_NODEV = 2, 4
FOLDER_TMPFS_TEXT = (
    f"each student's folder is a tmpfs of {FOLDER_BYTES >> 20} MiB and "
    f"{FOLDER_FILES} files, gone with its kernel"
)
_TREE_CONTROLLERS = ("memory", "pids")


@dataclass(frozen=True)
class TreeGroup:
    """One kernel tree's cgroup: its folder in each hierarchy it spans."""

    kind: str
    folders: tuple[str, ...]

    def join(self) -> None:
        """Put this process (the kernel, before it execs) in the group."""
        for folder in self.folders:
            _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))

    def remove(self) -> None:
        """Kill whatever is still in the group, then remove it (the warden, once
        its descendants are dead)."""
        for folder in self.folders:
            _kill_members(folder)
            for _ in range(200):
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(-1, os.WNOHANG)
                    time.sleep(0.01)


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _kill_members(folder: str) -> None:
    kill = os.path.join(folder, "cgroup.kill")
    with contextlib.suppress(OSError):
        if os.path.exists(kill):
            _write(kill, "1")
            return
        with open(os.path.join(folder, "cgroup.procs")) as handle:
            members = [int(pid) for pid in handle.read().split()]
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _mounts() -> list[tuple[str, str, str, str]]:
    """``(root, mount point, type, super options)`` of each mount."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as handle:
        for line in handle:
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) >= 5 and len(tail) >= 3:
                found.append((fields[3], fields[4], tail[0], tail[2]))
    return found


def _own_cgroups() -> dict[str, str]:
    """``{hierarchy: path}`` of this process: "0" for v2, else the v1
    controllers' names (comma-separated as the kernel lists them)."""
    found = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as handle:
        for line in handle:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            found["0" if number == "0" else controllers] = path
    return found


def _folder(mount_root: str, mount_point: str, path: str) -> str | None:
    """The folder of cgroup ``path`` under a mount of ``mount_root``."""
    if mount_root == "/":
        return mount_point + path.rstrip("/")
    if path == mount_root or path.startswith(mount_root + "/"):
        return mount_point + path[len(mount_root) :].rstrip("/")
    return None


def _v2_parent() -> str | None:
    path = _own_cgroups().get("0")
    if path is None:
        return None
    for root, point, kind, _ in _mounts():
        folder = _folder(root, point, path) if kind == "cgroup2" else None
        if folder and os.path.isdir(folder):
            return folder
    return None


def _v1_parents() -> dict[str, str]:
    own = _own_cgroups()
    parents = {}
    for controller in _TREE_CONTROLLERS:
        path = next(
            (p for names, p in own.items() if controller in names.split(",")), None
        )
        for root, point, kind, options in _mounts():
            if kind != "cgroup" or controller not in options.split(","):
                continue
            folder = None if path is None else _folder(root, point, path)
            if folder and os.path.isdir(folder):
                parents[controller] = folder
    return parents


def _make_v2(memory_bytes: int, processes: int, name: str) -> TreeGroup:
    parent = _v2_parent()
    if parent is None:
        raise OSError("no cgroup v2 mount of this process's cgroup")
    with open(os.path.join(parent, "cgroup.subtree_control")) as handle:
        enabled = set(handle.read().split())
    if not set(_TREE_CONTROLLERS) <= enabled:
        if _own_cgroups().get("0") != "/":
            raise OSError("memory and pids are not delegated to this cgroup")
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
    folder = os.path.join(parent, name)
    os.mkdir(folder)
    try:
        _write(os.path.join(folder, "memory.max"), str(memory_bytes))
        with contextlib.suppress(FileNotFoundError):
            _write(os.path.join(folder, "memory.swap.max"), "0")
        _write(os.path.join(folder, "pids.max"), str(processes))
    except OSError:
        os.rmdir(folder)
        raise
    return TreeGroup("cgroup v2", (folder,))


def _make_v1(memory_bytes: int, processes: int, name: str) -> TreeGroup:
    parents = _v1_parents()
    if set(parents) != set(_TREE_CONTROLLERS):
        raise OSError("no v1 memory and pids hierarchies")
    limits = {
        "memory": [
            ("memory.limit_in_bytes", memory_bytes),
            ("memory.memsw.limit_in_bytes", memory_bytes),
        ],
        "pids": [("pids.max", processes)],
    }
    made: list[str] = []
    try:
        for controller, parent in parents.items():
            folder = os.path.join(parent, name)
            os.mkdir(folder)
            made.append(folder)
            for file, value in limits[controller]:
                if file.startswith("memory.memsw"):  # absent without swap accounting
                    with contextlib.suppress(OSError):
                        _write(os.path.join(folder, file), str(value))
                    continue
                _write(os.path.join(folder, file), str(value))
    except OSError:
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    return TreeGroup("cgroup v1", tuple(made))


def tree_group(
    memory_bytes: int, processes: int, name: str | None = None
) -> tuple[TreeGroup | None, str]:
    """A new cgroup capping ``memory_bytes`` and ``processes`` (v2, else v1),
    and ""; or None and why none could be made."""
    if not sys.platform.startswith("linux"):
        return None, "not Linux"
    name = name or f"{GROUP_PREFIX}{os.getpid()}"
    reasons = []
    for make in (_make_v2, _make_v1):
        try:
            return make(memory_bytes, processes, name), ""
        except OSError as error:
            reasons.append(error.strerror or str(error))
    return None, "; ".join(reasons)


def tree_limits_note(memory_bytes: int, processes: int = TREE_PROCESSES) -> str:
    """The grade output's sentence on the tree's limits (a group is made and
    removed to find out)."""
    group, _ = tree_group(memory_bytes, processes, f"{GROUP_PREFIX}probe-{os.getpid()}")
    if group is None:
        return (
            "memory and CPU limits hold per process of a kernel (RLIMIT_AS, "
            "RLIMIT_CPU), not for its whole tree (no cgroup could be made); "
            "processes are limited per user"
        )
    group.remove()
    return (
        f"each kernel's whole process tree is capped by a {group.kind}: "
        f"{memory_bytes / (1 << 30):g} GiB of memory, {processes} processes"
    )


def in_tree_group() -> bool:
    """Whether this process is in a kernel tree's group (its processes capped)."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as handle:
        for line in handle:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            capped = number == "0" or "pids" in controllers.split(",")
            if capped and path.rsplit("/", 1)[-1].startswith(GROUP_PREFIX):
                return True
    return False


# --- the student's process and folder ------------------------------------------


def cap_file_size(folder_bytes: int) -> None:
    """No file this process (and what it starts) writes grows past
    ``folder_bytes``: a write past it fails with EFBIG (SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (folder_bytes, folder_bytes))


def mount_folder_quota(folder: str, folder_bytes: int, folder_files: int) -> str:
    """As root, in this process's own mount namespace: ``folder`` becomes a
    tmpfs of ``folder_bytes`` and ``folder_files``. "" when done, else why not."""
    if not (sys.platform.startswith("linux") and os.geteuid() == 0):
        return "not root"
    os.makedirs(folder, mode=0o700, exist_ok=True)
    options = f"size={folder_bytes},nr_inodes={folder_files},mode=0700"
    libc = ctypes.CDLL(None, use_errno=True)
    flags = ctypes.c_ulong(MS_NOSUID | MS_NODEV)
    if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", flags, options.encode()) != 0:
        return os.strerror(ctypes.get_errno())
    return ""


def folder_over(folder: str, folder_bytes: int, folder_files: int) -> str:
    """What of ``folder`` is past the quota ("" when nothing is): its files'
    bytes and its entries, counted without following links, stopping as soon
    as one is past."""
    size, entries = 0, 0
    for top, folders, files in os.walk(folder):
        for name in folders + files:
            entries += 1
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(top, name)).st_blocks * 512
            if entries > folder_files:
                return f"more than {folder_files} files"
            if size > folder_bytes:
                return f"more than {folder_bytes >> 20} MiB"
    return ""
