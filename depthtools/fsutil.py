"""Filesystem helpers without heavy imports (the data pipeline uses them before torch is loaded)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from depthtools.errors import DepthToolsError


def read_json_object(path: str | os.PathLike, what: str = "metadata", error: type[Exception] = DepthToolsError,
                     hint: str = "") -> dict:
    """Parse a JSON file that must hold an object; every way it can fail is one `error` line naming the file.

    Unreadable (OSError), not UTF-8, not JSON, nested too deeply for the parser (RecursionError) or not
    an object: `what` says what the file is ("the checkpoint config"), `hint` what to do (appended)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}{hint}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path} ({what}) is not UTF-8 text (byte {exc.start}){hint}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"corrupt JSON {path}: {exc.msg} at line {exc.lineno} column {exc.colno}{hint}") from None
    except RecursionError:
        raise error(f"{path} ({what}) is JSON nested too deeply to read{hint}") from None
    if not isinstance(obj, dict):
        raise error(f"{path} ({what}) must hold a JSON object, not a {type(obj).__name__}{hint}")
    return obj


def json_section(obj: dict, key: str, path: str | os.PathLike, kind: type = dict,
                 error: type[Exception] = DepthToolsError, required: bool = True):
    """obj[key], which must be a `kind` (dict by default): a one-line `error` naming the file and the key
    otherwise. Not required: a missing key gives None."""
    if key not in obj:
        if not required:
            return None
        raise error(f"{path} has no {key!r} section")
    value = obj[key]
    if not isinstance(value, kind):
        raise error(f"{path}: {key!r} must be a {_kind_name(kind)}, not a {type(value).__name__}")
    return value


def _kind_name(kind) -> str:
    names = {dict: "JSON object", list: "JSON list", str: "string", int: "integer"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


# -- names that become one path component -----------------------------------------------------------
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}"
NAME_RULE = "1-128 characters from letters, digits, '.', '_', '+', '-', starting with a letter or digit, without '..'"


def check_name(name, what: str) -> str:
    """`name` if it can be one folder or file name inside a root, else a one-line DepthToolsError.

    Every user string that depthtools turns into a path component goes through here — grid and cell
    names of a grid spec, `import-hf --name`, `data prepare --name`, analysis table names — so that no
    name can reach outside its root (`../x`, `/abs`, `a/b`), hide (`.x`), be empty or be ambiguous.
    The rule (NAME_PATTERN, NAME_RULE): 1 to 128 characters from [A-Za-z0-9._+-], the first a letter or
    a digit, and no `..` anywhere. `what` names the thing, e.g. "cell name" or "--name (the dataset folder)".
    """
    if not isinstance(name, str):
        raise DepthToolsError(f"{what} must be a string, not {type(name).__name__} {name!r}; use {NAME_RULE}")
    if re.fullmatch(NAME_PATTERN, name) is None or ".." in name:
        raise DepthToolsError(f"{what} {name!r} is not a valid name: use {NAME_RULE} (it becomes one folder name)")
    return name


_WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EFBIG, getattr(errno, "EDQUOT", -1)}


def os_error_line(exc: BaseException) -> str | None:
    """One line for an OSError a user can fix (a permission, a full or read-only disk, a path that is
    not what it should be), naming the path and the cause: "cannot write PATH: No space left on device".
    None for OSErrors that are not about a file (a broken pipe, ...): those stay tracebacks."""
    if not isinstance(exc, OSError):
        return None
    cause = exc.strerror or str(exc)
    verb = "cannot write" if exc.errno in _WRITE_ERRNOS or isinstance(exc, WriteError) else "cannot use"
    if exc.filename is not None:
        where = f"{os.fsdecode(exc.filename)}" + (f" -> {os.fsdecode(exc.filename2)}" if exc.filename2 else "")
        return f"{verb} {where}: {cause}"
    if exc.errno in _WRITE_ERRNOS:
        return f"cannot write: {cause}"
    return None


class WriteError(OSError):
    """An OSError met while writing the file it names (see `write_error`)."""


def write_error(exc: BaseException, path: str | os.PathLike) -> OSError:
    """`exc` (an OSError, or a SafetensorError wrapping one) as an OSError naming `path` — the file the
    caller meant to write, not the hidden temporary file of an atomic write."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return WriteError(exc.errno, exc.strerror or str(exc), os.fspath(path))
    text = str(exc)  # safetensors: "... I/O error: File too large (os error 27)" or "... code: 28, ..."
    code = re.search(r"os error (\d+)|code: (\d+)", text)
    if code is None:  # e.g. numpy's "21255 requested and 10000 written"
        return WriteError(errno.EIO, f"{text.splitlines()[0] if text else type(exc).__name__} (is the disk full?)",
                          os.fspath(path))
    number = int(code.group(1) or code.group(2))
    return WriteError(number, os.strerror(number), os.fspath(path))


_UMASK: int | None = None


def umask() -> int:
    """The process umask, read without changing it (Linux: /proc/self/status; elsewhere the classic
    set-and-restore, done once and cached, since it briefly changes the mask for every thread)."""
    global _UMASK
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return _UMASK


def file_mode() -> int:
    """The mode an ordinary new file gets (0o666 less the umask): temporary files behind atomic writes
    are created 0600 and get this before they are renamed into place."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode an ordinary new folder gets (0o777 less the umask), for folders made with mkdtemp (0700)."""
    return 0o777 & ~umask()


# -- atomic file writes: a hidden temporary file in the same folder, then one rename ----------------------
class AtomicFile:
    """A file written under a hidden temporary name beside `path` (`.<name>.<random>.tmp`) and renamed over
    `path` by `commit()`: readers, and a crash at any moment, see the old file or the whole new one, never half.

    Write through `write()` (an OSError there is one naming `path`, not the hidden file), or let a writer that
    wants a path (safetensors) write `temp` itself. `commit()` fsyncs the data first when `fsync` (checkpoints:
    a power cut must not rename an empty file into place; liveness hints and files inside a staging folder skip
    it), gives the file an ordinary file's mode (mkstemp's 0600 would make it private whatever the umask) and
    renames it. `discard()` removes it. As a context manager: commit on a clean exit, discard on an exception,
    which propagates unchanged. The folder is created when missing; creating it fails as an OSError naming the
    folder, creating the temporary file as one naming `path` (`write_error`), so the CLI prints one line."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True):
        self.path, self.fsync = Path(path), fsync
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # the folder is what cannot be made (e.g. a file stands where it goes): name it
            raise write_error(exc, self.path.parent) from None
        try:
            fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        except OSError as exc:
            raise write_error(exc, self.path) from None
        self.temp = Path(temp)
        self._handle = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        """Append `data` to the temporary file."""
        try:
            self._handle.write(data)
        except OSError as exc:
            raise write_error(exc, self.path) from None

    def commit(self) -> Path:
        """Flush, fsync (when asked), chmod and rename over `path`; on failure the temporary file is removed."""
        try:
            self._handle.flush()
            if self.fsync:
                os.fsync(self._handle.fileno())
            self._handle.close()
            os.chmod(self.temp, file_mode())  # after any writer that re-created the file by path
            os.replace(self.temp, self.path)
        except OSError as exc:
            self.discard()
            raise write_error(exc, self.path) from None
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        """Close and remove the temporary file (idempotent; nothing is renamed)."""
        try:
            self._handle.close()
        except OSError:
            pass
        self.temp.unlink(missing_ok=True)

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    """Write `data` to `path` atomically (`AtomicFile`); returns the path."""
    with AtomicFile(path, fsync=fsync) as out:
        out.write(data)
    return out.path


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> Path:
    """Write `text` as UTF-8 to `path` atomically (`AtomicFile`); returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int | None = 2, sort_keys: bool = True,
                      fsync: bool = True) -> Path:
    """Write `obj` as JSON plus a final newline to `path` atomically (`AtomicFile`); returns the path."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n", fsync=fsync)


def _blocking_parent(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a folder (mkdir below it would fail)."""
    for parent in Path(path).parents:
        if parent.exists() or parent.is_symlink():
            return None if parent.is_dir() else parent
    return None


def check_dir_target(path: str | os.PathLike, what: str) -> None:
    """A one-line DepthToolsError when `path` cannot be (or become) a folder: it, or one of its parents,
    is an existing file. `what` names the option, e.g. "--out (the cell folder)"."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DepthToolsError(f"{what} {path} is an existing file, not a folder; give a folder path")
    blocker = _blocking_parent(path)
    if blocker is not None:
        raise DepthToolsError(f"{what} {path} cannot be created: {blocker} is a file, not a folder")


def check_file_target(path: str | os.PathLike, what: str) -> None:
    """A one-line DepthToolsError when `path` cannot be written as a file: it is a folder, or one of its
    parents is an existing file."""
    path = Path(path)
    if path.is_dir():
        raise DepthToolsError(f"{what} {path} is a folder; give a file name")
    blocker = _blocking_parent(path)
    if blocker is not None:
        raise DepthToolsError(f"{what} {path} cannot be created: {blocker} is a file, not a folder")


def replace_dir(staging: Path, target: Path) -> None:
    """Move a fully written `staging` folder to `target`; an old `target` is removed only once the new one is in place.

    Both renames are atomic on one filesystem, so a crash leaves either the old or the new folder
    (plus, at worst, a hidden `.<name>.old-<pid>` leftover), never a half-written one; a second rename that
    fails puts the old folder back before the error propagates.
    """
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


# -- exclusive locks (one trainer per cell, one preparation per dataset) -------------------------
LOCK_BEAT_S = 15.0  # the holder's lock thread refreshes the lock file's mtime this often
LOCK_STALE_S = 120.0  # a lock file whose mtime is older than this is taken over (its holder stopped beating)


class LockHeldError(DepthToolsError):
    """Another live process holds the lock; the message names it (pid, host, since when)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _read_lock_info(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 65536, 0).decode("utf-8")
        info = json.loads(text) if text.strip() else None
    except (OSError, ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def _describe_holder(info: dict | None, age_s: float | None) -> str:
    if not info:
        return "another process (its lock file holds no readable owner)"
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    beat = f", last heartbeat {age_s:.0f} s ago" if age_s is not None else ""
    return f"pid {info.get('pid')} on host {info.get('host')} since {when}{beat}"


class _Lock:
    """A held lock: the open, flock'ed file plus a heartbeat thread; `release()` is idempotent."""

    def __init__(self, path: Path, fd: int, beat_s: float):
        self.path, self.fd = path, fd
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(beat_s,), daemon=True, name=f"lock-beat {path.name}")
        self._thread.start()

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                os.utime(self.fd)
            except OSError:
                pass

    def release(self) -> None:
        import fcntl  # optional: POSIX-only module

        if self.fd < 0:
            return
        self._stop.set()
        try:  # unlink while still holding it: a waiter that opened this inode re-checks it (see exclusive_lock)
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def acquire_lock(path: Path, what: str, error: type[Exception] = LockHeldError, stale_after: float = LOCK_STALE_S,
                 beat_s: float = LOCK_BEAT_S, log=None) -> _Lock:
    """Take the exclusive lock `path` (created if absent) or raise `error` naming its holder.

    The lock is an flock on the open file, so the kernel drops it when its holder dies, however it dies
    (a lock file left by a killed process on this host is simply taken over, with a log line). The file
    holds the holder's pid, host and start time for the message, and a thread of the holder refreshes
    its mtime every `beat_s`. Where flock does not reach (another host on a shared filesystem whose
    locks are local, a filesystem without flock), the file decides: a lock whose heartbeat is younger
    than `stale_after` seconds and whose holder may be alive (another host; or this host and its pid
    runs) is still refused; an older one, or one whose pid is gone, is taken over.
    """
    import fcntl  # optional: POSIX-only module

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info, age = _read_lock_info(fd), time.time() - os.fstat(fd).st_mtime
            os.close(fd)
            raise error(f"{what} is locked by {_describe_holder(info, age)} ({path}); wait for it to finish, "
                        "or stop that process") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            if not os.path.exists(path) or os.stat(path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)  # its holder unlinked it on release while we waited: lock the new file
                continue
            info, age = _read_lock_info(fd), time.time() - os.fstat(fd).st_mtime
            pid = info.get("pid") if info else None
            here = bool(info) and info.get("host") == host
            dead = here and isinstance(pid, int) and (pid == os.getpid() or not _pid_alive(pid))
            if info and age < stale_after and not dead:  # flock did not stop us, but its holder may be alive
                raise error(f"{what} is locked by {_describe_holder(info, age)} ({path}); wait for it to finish, "
                            f"or stop that process (a lock is taken over after {stale_after:.0f} s without a "
                            "heartbeat)")
            if info and log is not None:
                gone = "its process is gone" if dead else f"no heartbeat for {age:.0f} s"
                log(f"{what}: taking over the stale lock of {_describe_holder(info, age)} ({gone})")
            record = json.dumps({"pid": os.getpid(), "host": host, "since": time.time(), "what": what}) + "\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
            os.fsync(fd)
            return _Lock(path, fd, beat_s)
        except BaseException:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise


class exclusive_lock:  # noqa: N801 - used as a context manager
    """`with exclusive_lock(path, what, error=...):` hold `acquire_lock`'s lock for the block; released on
    any exit, exceptions included (and by the kernel if the process dies)."""

    def __init__(self, path: Path, what: str, error: type[Exception] = LockHeldError, **kwargs):
        self.args = (path, what, error)
        self.kwargs = kwargs
        self.lock: _Lock | None = None

    def __enter__(self) -> _Lock:
        self.lock = acquire_lock(*self.args, **self.kwargs)
        return self.lock

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()


# -- staging folders owned by a live process (imports): a killed import's leftover is removed later ------
STAGING_OWNER = ".owner.lock"  # inside a staging folder: its writer's flock'ed record (pid, host, since)
STAGING_NOTE_AFTER_S = 60.0  # an ownerless staging folder older than this is named (never removed)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _own(folder: Path) -> _Lock:
    """Take ownership of the new, empty `folder`: an flock'ed `STAGING_OWNER` with this process's pid, host and
    start time and a heartbeat (`_Lock`). The record is written under another name and renamed, so a cleaner
    never sees an owner file that is not yet locked and filled in."""
    import fcntl  # optional: POSIX-only module

    fd, temp = tempfile.mkstemp(dir=folder, prefix=".owner.", suffix=".new")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": "import staging"}
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.replace(temp, folder / STAGING_OWNER)
    except BaseException:
        os.close(fd)
        Path(temp).unlink(missing_ok=True)
        raise
    return _Lock(folder / STAGING_OWNER, fd, LOCK_BEAT_S)


def _dead_owner(folder: Path, stale_after: float = LOCK_STALE_S) -> str | None:
    """Why `folder`'s owner is gone ("its process is gone", "no heartbeat for N s"), or None when it may be alive.

    The owner's flock is dropped by the kernel however it dies, so a held flock means a live writer; a free
    one is then checked as `acquire_lock` checks a lock (a pid of this host that no longer runs, or no heartbeat
    for `stale_after` seconds, for a writer on another host whose flock does not reach here). No owner file
    (an older depthtools, or a writer between two steps): None, the folder is left alone."""
    import fcntl  # optional: POSIX-only module

    try:
        fd = os.open(folder / STAGING_OWNER, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        except OSError:
            pass  # no flock on this filesystem: the record and its heartbeat decide
        info, age = _read_lock_info(fd), time.time() - os.fstat(fd).st_mtime
        pid = info.get("pid") if info else None
        here = bool(info) and info.get("host") == socket.gethostname()
        if here and isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid):
            return f"{_describe_holder(info, age)}; its process is gone"
        if age >= stale_after:
            return f"{_describe_holder(info, age)}; no heartbeat for {age:.0f} s"
        return None
    finally:
        os.close(fd)


def remove_dead_staging(parent: Path, prefix: str, suffix: str, log=_stderr_line) -> list[Path]:
    """Remove the staging folders `parent/<prefix>*<suffix>` whose owner is gone (`_dead_owner`), one `log` line
    each; returns them. A live owner's folder is never touched; an ownerless one (written by a depthtools
    before owner records) is only named, once it is `STAGING_NOTE_AFTER_S` old, for the user to remove."""
    removed = []
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix) and n.endswith(suffix)
                       and len(n) > len(prefix) + len(suffix))
    except OSError:
        return removed
    for name in names:
        folder = Path(parent) / name
        if folder.is_symlink() or not folder.is_dir():
            continue
        why = _dead_owner(folder)
        if why is not None:
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
                log(f"removed {folder}: the staging folder of an import that stopped ({why})")
        elif not (folder / STAGING_OWNER).exists() and _age_s(folder) > STAGING_NOTE_AFTER_S:
            log(f"left {folder}: a staging folder without an owner record (an earlier depthtools's?); "
                "remove it by hand if no import is writing it")
    return removed


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


class StagingFolder:
    """`with StagingFolder(target, suffix) as staging:` a hidden folder `.<target name>.<random><suffix>` beside
    `target`, owned by this process (`STAGING_OWNER`: flock, pid, host, heartbeat), swapped in for `target`
    (`replace_dir`) on a clean exit and removed on an exception.

    Creating one first removes the dead leftovers of earlier writers of the same target (a killed import:
    `remove_dead_staging`, one `log` line each), never a live writer's. The owner file is removed just before
    the swap, so it never lands in `target`."""

    def __init__(self, target: str | os.PathLike, suffix: str, log=_stderr_line):
        self.target = Path(target)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{self.target.name}."
        remove_dead_staging(self.target.parent, prefix, suffix, log=log)
        self.path = Path(tempfile.mkdtemp(dir=self.target.parent, prefix=prefix, suffix=suffix))
        try:
            self.path.chmod(dir_mode())  # mkdtemp's 0700 would make the result private whatever the umask
            self._lock = _own(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def commit(self) -> Path:
        """Drop the owner record and swap the folder in for `target` (`replace_dir`); returns `target`."""
        self._lock.release()
        replace_dir(self.path, self.target)
        return self.target

    def discard(self) -> None:
        """Drop the owner record and remove the folder (idempotent)."""
        self._lock.release()
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in blocks (checkpoint provenance, GGUF sources, shard manifests)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()

