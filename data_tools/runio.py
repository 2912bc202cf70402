"""Run directories, atomic file writes and run locks.

Everything a run writes lives under its scratch directory (``OUTPUT_DIR``), never inside the repo.
Files are written to a temporary name in the same directory and renamed, so a reader never takes
a half-written parquet or JSON file as complete (``os.replace`` is atomic on POSIX filesystems).

The lock CLI (``python -m data_tools.runio lock``) needs the standard library only: ``run.sh`` takes the lock first,
before set-up, with the system's python3 where the venv does not exist yet (pyarrow loads where a table is written).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

# the defaults of the run's directories, one rule with run.sh (which asks data_tools.rundirs for them)
from data_tools.rundirs import cache_root, default_ckpt_dir, default_output_dir  # noqa: F401 - re-exported

if TYPE_CHECKING:
    import pyarrow as pa

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Exit code of a run that finds another run holding its lock (BSD ``EX_TEMPFAIL``).
EXIT_LOCKED = 75
#: Exit code of a run stopped by an I/O failure such as a full disk (BSD ``EX_IOERR``).
EXIT_IO = 74


def check_outside_repo(path: Path, what: str = "OUTPUT_DIR") -> Path:
    """Raise ``ValueError`` if ``path`` lies inside the repository: run outputs never land in the repo."""
    p = Path(path).expanduser().resolve()
    if p == REPO_ROOT or REPO_ROOT in p.parents:
        raise ValueError(f"{what}={p} is inside the repository {REPO_ROOT}; point it to a scratch directory")
    return p


class RunDirError(ValueError):
    """A run directory cannot be written (read-only, no permission, disk full); the message says which."""


def describe_os_error(e: BaseException, path: Path | str) -> str:
    """One line for an I/O failure under ``path``: "disk full" when it is, else the system's reason.

    ``torch.save`` reports a full disk as ``RuntimeError: ... unexpected pos ...`` (its zip writer
    loses the errno), so a full disk is also recognised from the free space left.
    """
    code = getattr(e, "errno", None)
    full = code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)
    if not full and isinstance(e, (OSError, RuntimeError)):
        try:
            p = Path(path)
            while not p.exists() and p != p.parent:
                p = p.parent
            full = shutil.disk_usage(p).free < 1 << 20
        except OSError:
            pass
    if full:
        return f"disk full: no space left on the device of {path}"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{path} is not writable: {os.strerror(code).lower()}"
    return f"cannot write to {path}: {e}"


def io_failure(e: BaseException, dirs) -> str | None:
    """One line for a full disk or an unwritable directory under one of ``dirs``, else None: an ``OSError`` of
    another kind (transformers' "no file named model.safetensors" for a model folder without weights, say) is the
    input's fault, not the disk's, and is reported as itself."""
    whys = [describe_os_error(e, d) for d in dirs]
    full = next((w for w in whys if w.startswith("disk full")), None)
    if full or (isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)):
        return full or whys[0]
    return None


def check_writable(directory: Path | str) -> Path:
    """Create ``directory`` if needed and write (then remove) a probe file in it; returns it.

    Called before a stage spends time on work it could not save. Raises :class:`RunDirError`
    (read-only file system, no permission, disk full).
    """
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".opd-write-probe-") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise RunDirError(describe_os_error(e, d)) from None
    return d


@contextmanager
def _atomic_path(dest: Path) -> Iterator[Path]:
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would survive the rename and hide the file from other readers
    try:
        yield Path(tmp)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_parquet(table: pa.Table | list[dict[str, Any]], dest: Path, schema: pa.Schema | None = None) -> Path:
    """Write ``table`` (an Arrow table or a list of row dicts) to ``dest`` atomically; returns ``dest``."""
    import pyarrow as pa  # here: the lock CLI (run.sh, before set-up) runs on the system's python, standard library only
    import pyarrow.parquet as pq

    if not isinstance(table, pa.Table):
        table = pa.Table.from_pylist(list(table), schema=schema)
    with _atomic_path(dest) as tmp:
        pq.write_table(table, tmp)
    return Path(dest)


def write_text(text: str, dest: Path) -> Path:
    """Write ``text`` to ``dest`` atomically; returns ``dest``."""
    with _atomic_path(dest) as tmp:
        tmp.write_text(text)
    return Path(dest)


def write_json(obj: Any, dest: Path) -> Path:
    """Write ``obj`` as indented JSON to ``dest`` atomically; returns ``dest``."""
    with _atomic_path(dest) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return Path(dest)


def _cmdline(pid: int) -> str:
    """The command line of ``pid`` (from /proc where there is one), for the lock holder's message."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return " ".join(os.sys.argv)[:200] if pid == os.getpid() else "?"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockHeld(RuntimeError):
    """Another live process holds the run lock; ``holder`` is its lock record."""

    def __init__(self, lock_path: Path, holder: dict):
        self.lock_path, self.holder = lock_path, holder
        super().__init__(
            f"{lock_path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')} "
            f"(command: {holder.get('cmd')}, since {holder.get('started')}); lock file {lock_path}"
        )


def acquire_lock(directory: Path, name: str = ".opd.lock", owner_pid: int | None = None) -> Path:
    """Take the run lock of ``directory``: a file created with O_EXCL holding pid, host and command.

    A lock whose pid is dead (same host) is stale and is taken over, so a crashed run never blocks
    the next one. Raises :class:`LockHeld` if a live process holds it. ``owner_pid`` (default: this
    process) is the pid recorded, so a shell script can lock on behalf of its own long-lived pid.
    """
    directory = check_writable(directory)
    lock = directory / name
    pid = owner_pid or os.getpid()
    record = {"pid": pid, "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cmd": _cmdline(pid)}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                holder = {}
            same_host = holder.get("host") == socket.gethostname()
            if holder.get("pid") == pid:
                return lock  # re-entrant: the same owner (e.g. run.sh then its stage) already holds it
            if holder and same_host and not _pid_alive(int(holder.get("pid", -1))):
                lock.unlink(missing_ok=True)  # stale: its process is gone
                continue
            if not holder:  # being written right now, or garbage: give the writer a moment
                time.sleep(0.2)
                if lock.exists() and not lock.read_text().strip():
                    lock.unlink(missing_ok=True)
                continue
            raise LockHeld(lock, holder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
        except OSError as e:
            lock.unlink(missing_ok=True)
            raise RunDirError(describe_os_error(e, directory)) from None
        return lock
    raise LockHeld(lock, {"pid": "?", "host": "?", "cmd": "unknown (lock file keeps reappearing)"})


def release_lock(lock: Path, owner_pid: int | None = None) -> None:
    """Remove ``lock`` if it is ours (its pid is ``owner_pid`` or this process)."""
    try:
        holder = json.loads(Path(lock).read_text())
    except (OSError, json.JSONDecodeError):
        return
    if holder.get("pid") == (owner_pid or os.getpid()):
        Path(lock).unlink(missing_ok=True)


@contextmanager
def run_lock(*directories: Path) -> Iterator[None]:
    """Hold the locks of several directories (e.g. OUTPUT_DIR and CKPT_DIR) for a block.

    If ``OPD_LOCK_OWNER`` is set (``run.sh`` exports its own pid) the stage runs under its parent's
    lock: the lock is taken with that pid, which is re-entrant, and left for the parent to release.
    On a node of rank > 0 of a run over several nodes (``NODE_RANK``, shared directories) node 0 holds
    the lock for the whole run and nothing is taken here.
    """
    if int(os.environ.get("NODE_RANK") or 0) > 0:
        yield
        return
    owner = int(os.environ["OPD_LOCK_OWNER"]) if os.environ.get("OPD_LOCK_OWNER") else None
    taken: list[Path] = []
    try:
        for d in dict.fromkeys(Path(x).resolve() for x in directories):
            taken.append(acquire_lock(d, owner_pid=owner))
        yield
    finally:
        if owner is None:
            for lock in taken:
                release_lock(lock)


def main(argv: list[str] | None = None) -> int:
    """``python -m data_tools.runio lock DIR... --pid PID`` / ``unlock DIR... --pid PID`` for shell scripts."""
    ap = argparse.ArgumentParser(prog="python -m data_tools.runio")
    ap.add_argument("action", choices=["lock", "unlock"])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--pid", type=int, required=True, help="pid recorded as the lock's owner")
    args = ap.parse_args(argv)
    if args.action == "unlock":
        for d in args.dirs:
            release_lock(Path(d) / ".opd.lock", owner_pid=args.pid)
        return 0
    try:
        for d in args.dirs:
            check_outside_repo(d, "run directory")
    except ValueError as e:
        print(f"opd: {e}", file=os.sys.stderr)
        return 2
    taken = []
    try:
        for d in dict.fromkeys(p.resolve() for p in args.dirs):
            taken.append(acquire_lock(d, owner_pid=args.pid))
    except LockHeld as e:
        for lock in taken:
            release_lock(lock, owner_pid=args.pid)
        print(f"opd: {e}", file=os.sys.stderr)
        return EXIT_LOCKED
    except RunDirError as e:
        for lock in taken:
            release_lock(lock, owner_pid=args.pid)
        print(f"opd: error: {e}", file=os.sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
