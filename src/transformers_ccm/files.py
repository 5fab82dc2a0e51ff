"""Files written whole or not at all: every file the package writes (an adapter's, a memory, a report) is written
into a hidden staging folder beside its place, flushed to disk, then renamed over the earlier one.

A set of files that belong together (an adapter, a report) is swapped under an exclusive lock on their folder, the
earlier files kept aside until the last one is in place: a failed swap puts them back, and a reader that takes the
shared lock (`folder_lock`) sees the earlier set or the new one, never a mix. A process killed part way through a
swap can still leave a mix, which only a manifest the reader checks can tell (see `hub.py`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the adapter's manifest still refuses a mix
    fcntl = None  # type: ignore[assignment]

STAGING_PREFIX = ".ccm-saving-"

# What to do where a file operation failed because this process or the machine ran short of something, not because
# of the file: a memory or an adapter read then was reported damaged, with the fix to delete it or save it again.
_SHORT_OF = {
    errno.EMFILE: "this process has too many files open: close some, or raise its limit (ulimit -n)",
    errno.ENFILE: "the system has too many files open: close some",
    errno.ENOMEM: "the system is out of memory: free some",
}
# What to do where a write failed for want of room or rights.
_CANNOT_WRITE = {
    errno.ENOSPC: "make room on its disk",
    errno.EFBIG: "the file is larger than the file system or this process's file size limit (ulimit -f) allows: "
    "raise the limit or choose another disk",
    errno.EROFS: "the file system is read-only: choose a writable folder",
    errno.EACCES: "choose a writable folder",
    errno.EPERM: "choose a writable folder",
}


def checked_path(path: object, name: str, example: str) -> str:
    """`path` as a string, refused unless it is a non-empty str or `os.PathLike`: an empty one named the current
    folder (`Path("")` is `.`), where a save wrote over the files there, a README.md among them. `name` is the
    argument, `example` a path to suggest."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str):  # bytes paths too: the names written beside them are str
        raise TypeError(f"{name} must be a path (a str or os.PathLike) such as {example!r}, got {type(path).__name__}.")
    if not text:
        raise ValueError(f"{name} is empty; give a path such as {example!r} ('.' for the current folder).")
    return text


def nearest_existing(path: str | os.PathLike[str]) -> str:
    """The absolute path of `path`, or of the nearest of its parents that exists: where a folder made for `path` would
    begin. A file there (not a folder) means that none can be made."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def short_of(error: BaseException) -> str | None:
    """What to do where `error` is an OSError that says this process or the machine ran short (of descriptors, of
    memory), which is no fault of the file it was about; None for any other error."""
    return _SHORT_OF.get(error.errno) if isinstance(error, OSError) and isinstance(error.errno, int) else None


def raise_if_short_of(error: BaseException, path: str | os.PathLike[str]) -> None:
    """Raise, as an OSError that names `path` and what to do, an `error` of reading it that says the process or the
    machine ran short (`short_of`): a reader that takes any other OSError for a damaged file would tell to delete a
    good one, or to save it again."""
    if isinstance(error, OSError) and (fix := short_of(error)) is not None:
        raise OSError(
            error.errno,
            f"Cannot read {os.fspath(path)} ({error.strerror}); {fix}, then read it again: the file was not judged.",
        ) from error


def not_enough_memory(what: str, path: str | os.PathLike[str]) -> MemoryError:
    """The error to raise for a MemoryError while `what` (a memory file) at `path` was read whole: Python raised it
    bare, naming neither the file nor what to do."""
    return MemoryError(
        f"Not enough memory to read {what} {os.fspath(path)}, which is read whole; free some memory (or raise this "
        "process's limit, ulimit -v), then load it again: the file was not judged."
    )


def _write_error(error: OSError, target: str | os.PathLike[str]) -> OSError:
    """`error`, of a write into the staging folder, as an OSError of its errno that names `target` (the file or
    folder being saved, not the hidden staging path) and what to do: a full disk raised "[Errno 27] File too large"
    and nothing more."""
    fix = short_of(error) or _CANNOT_WRITE.get(error.errno, "fix the cause")
    message = (
        f"Cannot save {os.fspath(target)} ({error.strerror or error}); {fix}, then save again. Nothing there was "
        "replaced."
    )
    return OSError(error.errno, message) if isinstance(error.errno, int) else OSError(message)


def replace_file(path: str | os.PathLike[str], write: Callable[[str], object]) -> None:
    """Replace the file at `path` (or, for a symbolic link, the file it leads to) in one rename with what
    `write(temporary_path)` writes; a failed or interrupted write keeps the earlier file and leaves nothing behind."""
    replace_files({os.path.realpath(path): write})


def replace_files(writes: Mapping[str | os.PathLike[str], Callable[[str], object]]) -> None:
    """Replace the files at the keys of `writes` (paths in one folder) with what each `write(temporary_path)`
    writes (the temporary path keeps the file's name, so a plot's format follows its suffix): all of them, or, if
    anything fails, none. Files are written in the order given and swapped in the reverse order, so that the last
    written (a manifest of the others) is the first in place."""
    paths = {Path(path): write for path, write in writes.items()}
    folder = _one_folder(paths)
    for path in paths:
        # Moved aside, a folder of the user's would be deleted with the staging folder; renamed over, a device such
        # as /dev/null would be replaced by a file.
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file (a device, a pipe or a socket)"
            raise ValueError(f"{path} is {kind}; give the path of a file, or move it away to save a file there.")
    # A set is swapped under the exclusive lock; one file, replaced by one rename, needs only to keep out of a set's
    # swap (and its removal of staging folders) with the shared one, so that saves of many files there run at once.
    with folder_lock(folder, exclusive=len(paths) > 1) as locked:
        if locked and len(paths) > 1:
            remove_stale_staging(folder)
        with _staging(folder, [path.name for path in paths]) as staging:
            path = folder
            try:
                (staging / "new").mkdir()
                new_file_mode = _new_file_mode(staging / "new")
                for path, write in paths.items():
                    new = staging / "new" / path.name
                    write(os.fspath(new))
                    # Writers that stage a file of their own (safetensors) leave it readable by its owner alone. File
                    # systems without Unix permissions (FAT, some network ones) refuse to set them: it stays as is.
                    with suppress(PermissionError):
                        os.chmod(new, _mode(path, new_file_mode))
                    _fsync_file(new)
            except OSError as error:
                raise _write_error(error, path) from error
            _swap(list(reversed(paths)), staging)
            _fsync_folder(folder)


def new_folder(path: Path, write: Callable[[Path], object]) -> bool:
    """Make the folder `path` whole or not at all: `write(folder)` fills a new folder inside a hidden staging folder
    beside `path`, renamed into place once written. Returns False, what was written discarded, where `path` was made
    meanwhile (by another process or thread writing the same folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _staging(path.parent, [path.name]) as staging:
        made = staging / path.name
        made.mkdir()
        write(made)
        try:
            os.rename(made, path)
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise
    return True


@contextmanager
def made_folder(folder: str | os.PathLike[str], fix: str) -> Iterator[Path]:
    """Within the context, `folder` exists, made with its missing parents if needed; if the context fails, the folders
    it made are removed again (those still empty), so that a failed save leaves no empty folders behind. Raises a
    ValueError ending with `fix` where `folder` is a file (or a broken link), or inside one."""
    folder = Path(folder)
    made = []  # the innermost first
    missing = folder.absolute()
    while not os.path.lexists(missing):
        made.append(missing)
        missing = missing.parent
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(f"{folder} is a file (or a broken link), or inside one; {fix}") from None
        except OSError as error:  # a read-only place: it named the folder, not what to do
            raise _write_error(error, folder) from error
        yield folder
    except BaseException:
        for path in made:
            with suppress(OSError):  # not empty: another save put its files there meanwhile
                os.rmdir(path)
        raise


@contextmanager
def folder_lock(folder: str | os.PathLike[str], exclusive: bool) -> Iterator[bool]:
    """Hold an advisory lock on `folder` within the context: exclusive for a writer, shared for a reader. Yields
    whether it is held (not on a file system without locks, nor for a folder that cannot be opened)."""
    descriptor = _open_folder(folder)
    try:
        yield descriptor is not None and _flock(descriptor, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
        if descriptor is not None:
            os.close(descriptor)  # which releases the lock


def _open_folder(folder: str | os.PathLike[str]) -> int | None:
    """A descriptor of `folder` to lock or flush, or None where folders cannot be opened or locked (Windows)."""
    if fcntl is None:
        return None
    try:
        return os.open(folder, os.O_RDONLY)
    except OSError:
        return None


def _flock(descriptor: int, operation: int) -> bool:
    try:
        fcntl.flock(descriptor, operation)
    except OSError:  # a file system without flock (some network ones)
        return False
    return True


def _new_file_mode(folder: Path) -> int:
    """The permission bits a new file gets where `folder` was just made by `mkdir`: the folder's (0o777 less the
    umask, or less what a default ACL masks) without execution. Read from the folder, not from a probe file made and
    removed at every save, nor from `os.umask`, which is read only by setting it, for every thread at once."""
    return stat.S_IMODE(os.stat(folder).st_mode) & 0o666


def _mode(path: Path, new_file_mode: int) -> int:
    """The permission bits of the file at `path` once replaced: those it has, or those of a new file."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return new_file_mode


def _one_folder(paths: Mapping[Path, object]) -> Path:
    folders = {path.parent for path in paths}
    if len(folders) != 1:
        raise ValueError(f"The files of one save must share a folder, got {sorted(map(str, folders))}.")
    return folders.pop()


@contextmanager
def _staging(folder: Path, names: list[str]) -> Iterator[Path]:
    """A new hidden folder inside `folder` for the save of the files `names`, locked while it is in use (a later
    save removes it only once its writer is gone) and removed at the end, unless it holds the earlier files of a
    swap that could not be undone."""
    staging, descriptor = _new_staging(folder, names)
    kept = False
    try:
        yield staging
    except _KeptAside:
        kept = True
        raise
    finally:
        try:
            if not kept:
                _remove_to_the_end(staging, names)
        finally:
            if descriptor is not None:
                os.close(descriptor)


def _remove_to_the_end(staging: Path, names: list[str]) -> None:
    """Remove the staging folder `staging` of the save of the files `names` whole, also where an interrupt arrives
    meanwhile (Ctrl-C, or a signal handler's exit), which is raised once it is gone: one that landed in the removal (a
    save spends most of its time flushing to disk, so an interrupt often lands near it) left the folder behind, beside
    the files saved."""
    interrupt = None
    while True:
        try:
            _remove_staging(staging, names)
            break
        except (KeyboardInterrupt, SystemExit) as error:
            interrupt = error
    if interrupt is not None:
        raise interrupt


def _remove_staging(staging: Path, names: list[str]) -> None:
    """Remove the staging folder `staging` of the save of the files `names` (see `remove_folder`)."""
    remove_folder(staging, [f"{part}/{name}" for part in ("new", "old") for name in names])


def remove_folder(folder: str | os.PathLike[str], names: Iterable[str]) -> None:
    """Remove `folder`, which a save made to hold the files `names` (paths inside it): those files by their names
    first, and the folders they are in, which takes no file descriptor, then whatever else a writer left there.
    `shutil.rmtree` alone opens the folders to list them: where the process had no descriptor left (at its limit of
    open files, where the save's own writes still found one), it failed without a word and left the folder, with the
    earlier files of a set, beside the save."""
    folder = Path(folder)
    inner = set()
    for name in names:
        with suppress(OSError):
            os.remove(folder / name)
        inner.update(parent for parent in Path(name).parents if parent != Path("."))
    for parent in sorted(inner, key=lambda path: len(path.parts), reverse=True):  # the innermost first
        with suppress(OSError):
            os.rmdir(folder / parent)
    with suppress(OSError):
        os.rmdir(folder)
    if os.path.lexists(folder):
        shutil.rmtree(folder, ignore_errors=True)


def _new_staging(folder: Path, names: list[str]) -> tuple[Path, int | None]:
    """A new staging folder in `folder` for the save of the files `names`, and a descriptor that holds it locked
    (None where folders cannot be opened). Its name is the first free one of the saves of `names` (numbered), so
    that a save finds what a killed save of the same files left, and removes it, without listing the folder (which
    holds a file per user, say): a folder of that name that no writer holds locked."""
    owner = hashlib.sha256("/".join(sorted(names)).encode()).hexdigest()[:16]
    index = 0
    while True:
        staging = folder / f"{STAGING_PREFIX}{owner}-{index}"
        try:
            os.mkdir(staging, 0o700)
            descriptor = _open_folder(staging)
            if descriptor is not None:
                _flock(descriptor, fcntl.LOCK_EX)
        except FileExistsError:
            if not _remove_if_stale(staging):  # a live writer's, or one that could not be removed
                index += 1
            continue
        except OSError as error:
            raise type(error)(
                error.errno, f"Cannot write into {folder} ({error.strerror}); choose a writable folder."
            ) from None
        except (KeyboardInterrupt, SystemExit):
            # Made but not yet held: the clean-up of `_staging` does not cover it, and only a later save of the same
            # files would remove it.
            with suppress(OSError):  # not made, or another save's by now (no longer empty)
                os.rmdir(staging)
            raise
        if _is_opened(staging, descriptor):
            return staging, descriptor
        # Another save of these files took it, not locked yet, for a killed writer's and removed it: make another.
        if descriptor is not None:
            os.close(descriptor)


def _is_opened(path: Path, descriptor: int | None) -> bool:
    """Whether `path` is still the folder `descriptor` opened (whether it is there, where none could be opened)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    return descriptor is None or os.path.samestat(found, os.fstat(descriptor))


class _KeptAside(OSError):
    """A swap failed and could not put every earlier file back: they stay in the staging folder it names."""


def _swap(paths: list[Path], staging: Path) -> None:
    """Move each of `paths` aside into `staging`/old and the file of its name in `staging`/new into its place, in
    order; if one fails, put the earlier files back. The last needs no copy aside: its rename is the last step.

    What to undo is read from the staging folder, not from a list kept beside the renames: an interrupt (Ctrl-C)
    arrives when a rename returns, before such a list records it, and the earlier file it had moved aside was
    deleted with the staging folder (or, after the last rename, the earlier files were put back beside it)."""
    old, new = staging / "old", staging / "new"
    old.mkdir()
    try:
        for index, path in enumerate(paths):
            if index < len(paths) - 1 and os.path.lexists(path):
                os.replace(path, old / path.name)
            os.replace(new / path.name, path)
    except BaseException as error:
        if not os.path.lexists(new / paths[-1].name):  # the last rename was made: the new set is whole, in place
            raise
        not_restored = []
        for path in reversed(paths):
            if os.path.lexists(old / path.name):
                try:
                    os.replace(old / path.name, path)
                except OSError:
                    not_restored.append(path.name)
            elif not os.path.lexists(new / path.name):  # placed where there was no file before
                with suppress(OSError):
                    os.remove(path)
        if not_restored:
            raise _KeptAside(
                f"Saving into {staging.parent} failed ({error}), and its earlier {not_restored} could not be put "
                f"back: they are in {old}; move them back, or save again."
            ) from error
        raise


def _fsync_file(path: Path) -> None:
    """Flush a file's content to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (the renames into it) to disk, where the platform and file system can."""
    descriptor = _open_folder(folder)
    if descriptor is None:
        return
    try:
        # Some file systems cannot flush a folder; the renames are done, only their flush is left.
        with suppress(OSError):
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders that killed writers left in `folder` (ones no live writer holds locked). A folder
    that cannot be listed now (no file descriptor left) keeps them for a later save: this one goes on, and its own
    writes say what failed, if anything."""
    try:
        found = list(folder.glob(f"{STAGING_PREFIX}*"))
    except OSError:
        return
    for staging in found:
        _remove_if_stale(staging)


def _remove_if_stale(staging: Path) -> bool:
    """Remove the staging folder `staging` if no live writer holds it locked (a killed writer's). Returns whether
    it is gone; one that cannot be told apart from a live writer's (no lock here, a link, a file) is left alone."""
    descriptor = None if staging.is_symlink() or not staging.is_dir() else _open_folder(staging)
    if descriptor is None:
        return False
    try:
        if _flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB):
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        os.close(descriptor)
    return not os.path.lexists(staging)
