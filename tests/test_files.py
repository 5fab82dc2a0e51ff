"""Everything written to disk is whole or absent: adapters, memories and reports under failures injected at the
file system (the k-th write, flush or rename fails, or the process dies there), and under threads that save and
load the same folder at once."""

import asyncio
import builtins
import errno
import importlib
import itertools
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_hub import ADAPTER_FILES, FakeHfApi
from tiny_models import randomize_adapter, tiny_base
from transformers_ccm import CCMConfig, CCMForCausalLM
from transformers_ccm import hub as hub_module
from transformers_ccm.files import STAGING_PREFIX, replace_files

# The renames of a save over an earlier adapter: each file but the last moved aside, then each new one moved in.
ADAPTER_RENAMES = 2 * len(ADAPTER_FILES) - 1


def _adapter(seed, **config):
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(**config)), seed=seed)


@pytest.fixture(scope="module")
def adapters():
    """Two adapters of one structure (a mix of their files passes every content check) and a model to load into."""
    return _adapter(1), _adapter(2, update="merge"), _adapter(9)


def _which(target, adapters):
    """Load-adapter result of `target`: "old" or "new" when its weights and update rule are exactly one of them."""
    old, new, _ = adapters
    for name, source in (("old", old), ("new", new)):
        if target.config.update == source.config.update and all(
            torch.equal(value, source.adapter_tensors()[key]) for key, value in target.adapter_tensors().items()
        ):
            return name
    return "a mix"


def _contents(folder):
    return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}


@contextmanager
def _failing(module, name, k, error=None):
    """`module.name` raises `error` (a full disk) at its k-th call (from 0) within the context."""
    original, calls = getattr(module, name), itertools.count()

    def fail_at_k(*args, **kwargs):
        if next(calls) == k:
            raise error or OSError(28, "No space left on device (injected)")
        return original(*args, **kwargs)

    with patch.object(module, name, fail_at_k):
        yield


_FILE_SYSTEM_CALLS = {
    "open": (builtins, "open"),
    "os.replace": (os, "replace"),
    "os.fsync": (os, "fsync"),
    "save_file": (hub_module, "save_file"),
    "os.mkdir": (os, "mkdir"),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(sorted(_FILE_SYSTEM_CALLS)), k=st.integers(0, 12))
def test_an_adapter_save_that_fails_at_any_file_operation_keeps_the_old_adapter_whole(
    tmp_path_factory, adapters, call, k
):
    """The files were moved into place one by one: a failed rename left the new weights beside the old config,
    which loaded silently as an adapter nobody saved."""
    old, new, target = adapters
    folder = tmp_path_factory.mktemp("adapter")
    old.save_pretrained(folder)
    (folder / "notes.txt").write_text("the user's own file")
    (folder / "checkpoint-2").mkdir()
    before = _contents(folder)
    try:
        with _failing(*_FILE_SYSTEM_CALLS[call], k):
            new.save_pretrained(folder)
    except OSError as error:
        assert "injected" in str(error)
        assert _contents(folder) == before
        expected = "old"
    else:
        expected = "new"
    assert {path.name for path in folder.iterdir()} == {*ADAPTER_FILES, "notes.txt", "checkpoint-2"}
    target.load_adapter(folder)
    assert _which(target, adapters) == expected


class _Killed(BaseException):
    """The saving process died."""


@contextmanager
def _killed_at_rename(k):
    """From the k-th rename on, as in a process killed there, no file operation takes effect (no undo, no cleanup);
    the k-th raises `_Killed` (the kernel closes the descriptors, which releases their locks)."""
    renames, dead = itertools.count(), []
    replace, remove, rmtree = os.replace, os.remove, shutil.rmtree

    def killable(operation):
        def run(*args, **kwargs):
            return None if dead else operation(*args, **kwargs)

        return run

    def rename(*args, **kwargs):
        if next(renames) == k:
            dead.append(True)
            raise _Killed
        return killable(replace)(*args, **kwargs)

    with (
        patch.object(os, "replace", rename),
        patch.object(os, "remove", killable(remove)),
        patch.object(shutil, "rmtree", killable(rmtree)),
        pytest.raises(_Killed),
    ):
        yield


@pytest.mark.parametrize("k", range(ADAPTER_RENAMES))
def test_a_save_killed_at_any_rename_never_loads_as_a_mix(tmp_path, adapters, k):
    """A process killed during a save leaves the old adapter, the new one, or files the manifest refuses; the next
    save removes what the killed one left behind."""
    old, new, target = adapters
    old.save_pretrained(tmp_path)
    with _killed_at_rename(k):
        new.save_pretrained(tmp_path)
    try:
        target.load_adapter(tmp_path)
    except (ValueError, FileNotFoundError) as error:
        assert "mixes files of different saves" in str(error) or "incomplete" in str(error), error
    else:
        assert _which(target, adapters) in ("old", "new")
    new.save_pretrained(tmp_path)
    assert {path.name for path in tmp_path.iterdir()} == ADAPTER_FILES
    target.load_adapter(tmp_path)
    assert _which(target, adapters) == "new"


# What reaches a save between two of its steps: Ctrl-C, a task's cancellation, sys.exit() from a signal handler.
INTERRUPTS = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "CancelledError": asyncio.CancelledError,
    "SystemExit": SystemExit,
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(0, ADAPTER_RENAMES - 1), interrupt=st.sampled_from(sorted(INTERRUPTS)))
def test_an_interrupt_right_after_any_rename_leaves_the_old_adapter_or_the_new_one_whole(
    tmp_path_factory, adapters, k, interrupt
):
    """An interrupt arrives when a rename returns, before the save notes it: the earlier file that rename had moved
    aside was deleted with the staging folder, and one after the last rename put the earlier files back beside the
    new weights."""
    old, new, target = adapters
    folder = tmp_path_factory.mktemp("adapter")
    old.save_pretrained(folder)
    before = _contents(folder)
    original, calls = os.replace, itertools.count()

    def rename_then_interrupt(*args, **kwargs):
        original(*args, **kwargs)
        if next(calls) == k:
            raise INTERRUPTS[interrupt]

    with patch.object(os, "replace", rename_then_interrupt), pytest.raises(INTERRUPTS[interrupt]):
        new.save_pretrained(folder)
    assert {path.name for path in folder.iterdir()} == ADAPTER_FILES  # no staging folder, no file missing
    if k < ADAPTER_RENAMES - 1:
        assert _contents(folder) == before
    target.load_adapter(folder)
    assert _which(target, adapters) == ("old" if k < ADAPTER_RENAMES - 1 else "new")


def _in_the_middle_of_a_save(k, during):
    """Patch os.replace so that `during()` runs in another thread right after the k-th rename, while the save
    goes on (a thread that waits for the save to finish is left to do so). Returns the patch and the thread."""
    original, calls, threads = os.replace, itertools.count(), []

    def rename_then_run(*args, **kwargs):
        original(*args, **kwargs)
        if next(calls) == k:
            thread = threading.Thread(target=during)
            thread.start()
            thread.join(timeout=0.3)  # long enough for a thread that is not held back to finish its step
            threads.append(thread)

    return patch.object(os, "replace", rename_then_run), threads


def _load_during_save(folder, adapters, k, flock=True):
    """Save the new adapter over the old one in `folder`, a load of it running in another thread right after the
    k-th rename (with file locks or, `flock=False`, as on a file system without them): which adapter the load got,
    or what it raised."""
    old, new, target = adapters
    old.save_pretrained(folder)
    outcome = []

    def load():
        try:
            target.load_adapter(folder)
            outcome.append(_which(target, adapters))
        except Exception as error:  # what a load raises is the outcome looked at
            outcome.append(error)

    patched, threads = _in_the_middle_of_a_save(k, load)
    with patch("transformers_ccm.files._flock", return_value=False) if not flock else nullcontext(), patched:
        new.save_pretrained(folder)
    threads[0].join()
    return outcome[0]


@pytest.mark.parametrize("k", range(ADAPTER_RENAMES - 1))
def test_a_load_in_another_thread_during_a_save_gets_the_old_or_the_new_adapter(tmp_path, adapters, k):
    assert _load_during_save(tmp_path, adapters, k) in ("old", "new")


@pytest.mark.parametrize("k", range(ADAPTER_RENAMES - 1))
def test_without_locks_a_load_during_a_save_gets_one_adapter_or_refuses_the_mix(tmp_path, adapters, k):
    """On a file system without flock (some network ones) a load can see the swap half done: the manifest then
    refuses what it reads, and never gives weights of one save with the config of another."""
    outcome = _load_during_save(tmp_path, adapters, k, flock=False)
    if not isinstance(outcome, str):
        assert isinstance(outcome, (ValueError, FileNotFoundError)), outcome
        outcome = str(outcome)
    assert (
        outcome in ("old", "new")
        or "mixes files of different saves" in outcome
        or "the adapter is incomplete" in outcome
    ), outcome


@pytest.mark.parametrize("k", range(ADAPTER_RENAMES - 1))
def test_two_threads_saving_into_one_folder_leave_one_whole_adapter(tmp_path, adapters, k):
    old, new, target = adapters
    errors = []

    def save_other():
        try:
            old.save_pretrained(tmp_path)
        except Exception as error:
            errors.append(error)

    new.save_pretrained(tmp_path)
    patched, threads = _in_the_middle_of_a_save(k, save_other)
    with patched:
        new.save_pretrained(tmp_path)
    threads[0].join()
    assert not errors
    assert {path.name for path in tmp_path.iterdir()} == ADAPTER_FILES
    target.load_adapter(tmp_path)
    assert _which(target, adapters) in ("old", "new")


def test_saving_into_a_file_or_over_a_folder_of_the_user_is_refused_and_changes_nothing(tmp_path, adapters):
    old, new, _ = adapters
    (tmp_path / "a-file").write_text("the user's")
    (tmp_path / "broken-link").symlink_to(tmp_path / "nowhere")
    for path in (tmp_path / "a-file", tmp_path / "a-file" / "adapter", tmp_path / "broken-link"):
        with pytest.raises(ValueError, match=r"is a file \(or a broken link\), or inside one; save the adapter into"):
            new.save_pretrained(path)
    assert (tmp_path / "a-file").read_text() == "the user's"
    old.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "README.md").unlink()
    (tmp_path / "adapter" / "README.md").mkdir()
    (tmp_path / "adapter" / "README.md" / "draft.md").write_text("the user's card")
    before = _contents(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"README\.md is a folder; give the path of a file, or move it away"):
        new.save_pretrained(tmp_path / "adapter")
    assert _contents(tmp_path / "adapter") == before
    assert (tmp_path / "adapter" / "README.md" / "draft.md").read_text() == "the user's card"
    assert not list((tmp_path / "adapter").glob(f"{STAGING_PREFIX}*"))


def test_a_folder_that_cannot_be_written_is_named_and_left_as_it_was(tmp_path, adapters):
    old, new, _ = adapters
    old.save_pretrained(tmp_path)
    before = _contents(tmp_path)
    with (
        patch("os.mkdir", side_effect=PermissionError(13, "Permission denied")),  # a read-only folder
        pytest.raises(PermissionError, match=rf"Cannot write into {tmp_path} \(Permission denied\); choose a writa"),
    ):
        new.save_pretrained(tmp_path)
    assert _contents(tmp_path) == before and {path.name for path in tmp_path.iterdir()} == ADAPTER_FILES


def test_a_new_folder_in_a_read_only_place_is_refused_naming_it_and_the_fix(tmp_path, adapters):
    """Making the adapter's folder failed with the system's bare "[Errno 13] Permission denied: '...'"."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # The superuser writes into read-only folders; /sys refuses everyone.
    place = locked if not os.access(locked, os.W_OK) else Path("/sys")
    _, new, _ = adapters
    with pytest.raises(PermissionError) as refused:
        new.save_pretrained(place / "ccm-adapter" / "deeper")
    code = refused.value.errno
    assert str(refused.value) == (
        f"[Errno {code}] Cannot save {place / 'ccm-adapter' / 'deeper'} ({os.strerror(code)}); choose a writable "
        "folder, then save again. Nothing there was replaced."
    )
    assert not (place / "ccm-adapter").exists()


def test_a_symlink_to_a_folder_saves_into_that_folder(tmp_path, adapters):
    _, new, target = adapters
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    new.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and {path.name for path in (tmp_path / "real").iterdir()} == ADAPTER_FILES
    target.load_adapter(tmp_path / "link")
    assert _which(target, adapters) == "new"


def _memory(model, context):
    cache = model.new_cache()
    model.compress(cache, torch.tensor([context]))
    return cache


@contextmanager
def _recorded_flushes():
    """Record the flushes to disk (by the path of the flushed file or folder) and renames, in order."""
    events, fsync, replace = [], os.fsync, os.replace

    def recorded_fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        return fsync(descriptor)

    def recorded_replace(source, target):
        events.append(("replace", os.fspath(source), os.fspath(target)))
        return replace(source, target)

    with patch.object(os, "fsync", recorded_fsync), patch.object(os, "replace", recorded_replace):
        yield events


def _flushed_then_renamed(events, target):
    """Whether the file renamed last to `target` was flushed before, and its folder after (else a power cut can
    leave an empty file, or the earlier one, under the name)."""
    renames = [index for index, event in enumerate(events) if event[0] == "replace" and event[2] == os.fspath(target)]
    if not renames:
        return False
    source = events[renames[-1]][1]
    return ("fsync", source) in events[: renames[-1]] and ("fsync", os.path.dirname(target)) in events[renames[-1] :]


def test_every_file_is_flushed_to_disk_before_it_replaces_the_earlier_one(tmp_path, adapters):
    _, new, _ = adapters
    with _recorded_flushes() as events:
        new.save_pretrained(tmp_path / "adapter")
        _memory(new, [5, 6, 7]).save(tmp_path / "memory.safetensors")
    for name in ADAPTER_FILES:
        assert _flushed_then_renamed(events, tmp_path / "adapter" / name), name
    assert _flushed_then_renamed(events, tmp_path / "memory.safetensors")


def test_saved_files_get_the_permissions_of_a_new_file_or_keep_those_they_had(tmp_path, adapters):
    """safetensors stages its file readable by its owner alone: the adapter's weights and every memory file were
    saved 0600 whatever the umask, unreadable to the serving user of a folder shared with the training one."""
    _, new, _ = adapters
    umask = os.umask(0o022)
    os.umask(umask)
    new.save_pretrained(tmp_path / "adapter")
    _memory(new, [5, 6, 7]).save(tmp_path / "memory.safetensors")
    for path in [*(tmp_path / "adapter").iterdir(), tmp_path / "memory.safetensors"]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    (tmp_path / "memory.safetensors").chmod(0o640)
    (tmp_path / "adapter" / "adapter_model.safetensors").chmod(0o640)
    new.save_pretrained(tmp_path / "adapter")
    _memory(new, [5, 6]).save(tmp_path / "memory.safetensors")
    assert (tmp_path / "memory.safetensors").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o640


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(umask=st.sampled_from([0o000, 0o002, 0o007, 0o022, 0o027, 0o077, 0o177]), setgid=st.booleans())
def test_a_save_gives_a_new_file_the_mode_of_the_umask_and_creates_no_other_file(
    tmp_path_factory, adapters, umask, setgid
):
    """Each save made, read and removed a file to learn the mode a new file gets: three more file system operations
    (round trips on a network file system) to save one memory."""
    _, new, _ = adapters
    folder = tmp_path_factory.mktemp("saves")
    if setgid:  # a folder shared by a group: its folders inherit the bit, which a file does not take
        folder.chmod(0o2775)
    cache, opened, open_file = _memory(new, [5, 6]), [], os.open

    def recorded_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            opened.append(os.fspath(path))
        return open_file(path, flags, *args, **kwargs)

    earlier = os.umask(umask)
    try:
        with patch.object(os, "open", recorded_open):
            cache.save(folder / "memory.safetensors")
    finally:
        os.umask(earlier)
    assert (folder / "memory.safetensors").stat().st_mode & 0o7777 == 0o666 & ~umask
    assert opened == []  # safetensors writes its file itself


def _staging_folders(folder: Path) -> set[Path]:
    return {path for path in folder.iterdir() if path.name.startswith(STAGING_PREFIX)}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(killed=st.integers(1, 3), live=st.booleans())
def test_a_memory_save_removes_what_killed_saves_of_the_file_left_but_not_a_live_save_s_folder(
    tmp_path_factory, adapters, killed, live
):
    """A memory save killed part way left its `.ccm-saving-*` folder beside the file for ever: only adapter saves
    removed such folders, and memory saves never did."""
    from transformers_ccm import CompressedMemoryCache, memory_file

    _, new, _ = adapters
    folder = tmp_path_factory.mktemp("memories")
    target = folder / "memory.safetensors"
    memories = [_memory(new, list(range(5, 7 + index))) for index in range(4)]
    memories[0].save(target)
    for _ in range(killed):
        with _killed_at_rename(0):
            memories[1].save(target)
    assert len(_staging_folders(folder)) == 1  # each killed save removed the one before it
    entered, release, threads, save_file = threading.Event(), threading.Event(), [], memory_file.save_file

    def paused_in_another_thread(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait()
        return save_file(*args, **kwargs)

    try:
        with patch.object(memory_file, "save_file", paused_in_another_thread):
            if live:  # a save of the same file, writing it as the next one starts
                threads.append(threading.Thread(target=memories[3].save, args=(target,)))
                threads[0].start()
                assert entered.wait(timeout=60)
            writing = _staging_folders(folder)  # the killed saves' folder, or the live save's in its place
            assert len(writing) == 1
            memories[2].save(target)
            assert _staging_folders(folder) == (writing if live else set())
    finally:
        release.set()
        for thread in threads:
            thread.join()
    assert _staging_folders(folder) == set()
    loaded = CompressedMemoryCache.load(target, new)
    expected = memories[3 if live else 2]
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, expected.layers, strict=True))


def test_a_save_whose_staging_folder_another_save_removed_before_it_was_locked_makes_another(tmp_path, adapters):
    """A staging folder is unlocked between its `mkdir` and its lock, where another save of the file takes it for
    a killed writer's and removes it: the first save must not write into a folder that is gone."""
    from transformers_ccm import CompressedMemoryCache
    from transformers_ccm import files as files_module

    _, new, _ = adapters
    target = tmp_path / "memory.safetensors"
    first, second = _memory(new, [5, 6]), _memory(new, [7, 8, 9])
    flock, other = files_module._flock, []

    def another_save_before_the_lock(descriptor, operation):
        if operation == files_module.fcntl.LOCK_EX and not other:  # the first save locking its new folder
            other.append(threading.Thread(target=second.save, args=(target,)))
            other[0].start()
            other[0].join()
        return flock(descriptor, operation)

    with patch.object(files_module, "_flock", another_save_before_the_lock):
        first.save(target)
    assert other and _staging_folders(tmp_path) == set()
    loaded = CompressedMemoryCache.load(target, new)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, first.layers, strict=True))


def test_a_memory_saved_through_a_symbolic_link_replaces_the_file_it_leads_to(tmp_path, adapters):
    """safetensors renamed its file over the link itself: the link became a separate file and the one it led to
    kept the old memory, which the next load through another path read."""
    from transformers_ccm import CompressedMemoryCache

    _, new, _ = adapters
    _memory(new, [5, 6]).save(tmp_path / "real.safetensors")
    (tmp_path / "link.safetensors").symlink_to("real.safetensors")
    longer = _memory(new, [5, 6, 7, 8])
    longer.save(tmp_path / "link.safetensors")
    assert (tmp_path / "link.safetensors").is_symlink()
    assert (tmp_path / "real.safetensors").read_bytes() == (tmp_path / "link.safetensors").read_bytes()
    loaded = CompressedMemoryCache.load(tmp_path / "real.safetensors", new)
    assert loaded.memory_length == longer.memory_length
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link.safetensors", "real.safetensors"]


_MEMORY_CALLS = {**_FILE_SYSTEM_CALLS, "save_file": ("transformers_ccm.memory_file", "save_file")}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(sorted(_MEMORY_CALLS)), k=st.integers(0, 6))
def test_a_memory_save_that_fails_at_any_file_operation_keeps_the_earlier_file(tmp_path_factory, adapters, call, k):
    from transformers_ccm import CompressedMemoryCache

    _, new, _ = adapters
    folder = tmp_path_factory.mktemp("memory")
    path = folder / "user.safetensors"
    _memory(new, [5, 6]).save(path)
    before = path.read_bytes()
    longer = _memory(new, [5, 6, 7, 8])
    module, name = _MEMORY_CALLS[call]
    try:
        with _failing(importlib.import_module(module) if isinstance(module, str) else module, name, k):
            longer.save(path)
    except OSError as error:
        assert "injected" in str(error)
        assert path.read_bytes() == before
    else:
        assert CompressedMemoryCache.load(path, new).memory_length == longer.memory_length
    assert [entry.name for entry in folder.iterdir()] == ["user.safetensors"]


def run_python(script: str, *arguments: str) -> subprocess.CompletedProcess:
    """`python -c script arguments` in a new process that imports what this one does, its output captured."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", script, *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@contextmanager
def file_size_limit(limit):
    """Within the context, this process can write no file past `limit` bytes (a full disk as `ulimit -f` makes one):
    a write past it fails with EFBIG (Python ignores the SIGXFSZ that would kill the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0, 0.99), kind=st.sampled_from(["memory", "adapter"]))
def test_a_save_onto_a_full_disk_raises_an_os_error_and_keeps_the_earlier_files(
    tmp_path_factory, adapters, fraction, kind
):
    """safetensors refuses a write past the disk's end with its own SafetensorError, which callers that take a failed
    write (`ccm chat` keeps the memory for the next turn) let through: the save raises the OSError of the disk."""
    from transformers_ccm import CompressedMemoryCache

    old, new, _ = adapters
    folder = tmp_path_factory.mktemp(kind)
    if kind == "memory":
        path = folder / "user.safetensors"
        earlier, longer = _memory(new, [5, 6]), _memory(new, [5, 6, 7, 8])
        earlier.save(path)
        save, size = (lambda: longer.save(path)), path.stat().st_size
    else:
        path = folder / "adapter_model.safetensors"
        old.save_pretrained(folder)
        save, size = (lambda: new.save_pretrained(folder)), path.stat().st_size
    before = _contents(folder)
    with pytest.raises(OSError) as error, file_size_limit(int(fraction * size)):
        save()
    assert error.value.errno == errno.EFBIG
    # The file being saved and the fix, not the hidden staging file (or nothing at all: "[Errno 27] File too large").
    assert re.fullmatch(
        rf"\[Errno 27\] Cannot save {re.escape(str(folder))}/\S+ \(File too large\); the file is larger than the file "
        r"system or this process's file size limit \(ulimit -f\) allows: raise the limit or choose another disk, then "
        r"save again\. Nothing there was replaced\.",
        str(error.value),
    ), error.value
    assert _contents(folder) == before and not list(folder.glob(f"{STAGING_PREFIX}*"))
    if kind == "memory":
        assert CompressedMemoryCache.load(path, new).memory_length == earlier.memory_length


@contextmanager
def open_files_limit(free: int) -> Iterator[None]:
    """Within the context, this process can open `free` more files and no more (`ulimit -n` reached, as by a server
    holding many connections): the next open fails with EMFILE. The limit bounds descriptor numbers, so the free numbers
    below it are taken first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(name) for name in os.listdir("/dev/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + free, hard))
    taken = []
    try:
        with suppress(OSError):
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        for descriptor in taken[len(taken) - free :]:
            os.close(descriptor)
        del taken[len(taken) - free :]
        yield
    finally:
        for descriptor in taken:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("kind", ["memory", "adapter"])
def test_a_save_at_the_limit_of_open_files_is_whole_or_named_and_leaves_no_staging_folder(tmp_path, adapters, kind):
    """The staging folder was removed by listing it, which takes descriptors of its own: with the few that the save's
    writes still found, a save reported done (or failed) left it behind, an adapter's earlier files in it. A failed
    save named the hidden staging file, or nothing ("[Errno 24] Too many open files"), and no fix."""
    from transformers_ccm import CompressedMemoryCache

    old, new, _ = adapters
    if kind == "memory":
        path = tmp_path / "user.safetensors"
        earlier, later = _memory(new, [5, 6]), _memory(new, [7, 8, 9])

        def start() -> None:
            earlier.save(path)

        def save() -> None:
            later.save(path)

        def saved() -> str:
            loaded = CompressedMemoryCache.load(path, new)
            return "new" if torch.equal(loaded.layers[0].keys, later.layers[0].keys) else "old"
    else:
        path = tmp_path

        def start() -> None:
            old.save_pretrained(tmp_path)

        def save() -> None:
            new.save_pretrained(tmp_path)

        def saved() -> str:
            return _which(CCMForCausalLM.from_pretrained(tmp_path, base_model=tiny_base("llama")), adapters)

    outcomes = set()
    for free in range(6):
        start()
        before = _contents(tmp_path)
        try:
            with open_files_limit(free):
                save()
        except OSError as error:
            outcomes.add("refused")
            assert error.errno == errno.EMFILE
            assert re.fullmatch(
                rf"\[Errno 24\] Cannot save {re.escape(str(path))}\S* \(Too many open files\); this process has too "
                r"many files open: close some, or raise its limit \(ulimit -n\), then save again\. Nothing there was "
                r"replaced\.",
                str(error),
            ), error
            assert _contents(tmp_path) == before and saved() == "old"
        else:
            outcomes.add("saved")
            assert saved() == "new"
        assert not [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(STAGING_PREFIX)]
    assert outcomes == {"refused", "saved"}


@pytest.mark.parametrize("kind", ["memory", "adapter"])
def test_a_load_at_the_limit_of_open_files_is_no_damaged_file(tmp_path, adapters, kind):
    """A good file that the process could not open for want of a descriptor was reported damaged: "not a readable
    safetensors memory file", or, for an adapter, "save the adapter again, or delete .../ccm_manifest.json". A load
    refused so leaves the model as it was."""
    from transformers_ccm import CompressedMemoryCache

    old, new, target = adapters
    if kind == "memory":
        path = tmp_path / "user.safetensors"
        _memory(new, [5, 6]).save(path)
        expected = _memory(new, [5, 6]).layers[0].keys

        def load() -> str:
            return "new" if torch.equal(CompressedMemoryCache.load(path, new).layers[0].keys, expected) else "a mix"
    else:
        path = tmp_path / "new" / "ccm_manifest.json"  # the first file an adapter's load opens
        for name, model in (("old", old), ("new", new), ("target", target)):
            model.save_pretrained(tmp_path / name)

        def load() -> str:
            target.load_adapter(tmp_path / "new")
            return _which(target, adapters)

    outcomes = set()
    try:
        for free in range(3):
            if kind == "adapter":
                target.load_adapter(tmp_path / "old")
            try:
                with open_files_limit(free):
                    got = load()
            except OSError as error:
                outcomes.add("refused")
                assert str(error) == (
                    f"[Errno 24] Cannot read {path} (Too many open files); this process has too many files open: "
                    "close some, or raise its limit (ulimit -n), then read it again: the file was not judged."
                )
                assert kind == "memory" or _which(target, adapters) == "old"
            else:
                outcomes.add("loaded")
                assert got == "new"
    finally:
        if kind == "adapter":
            target.load_adapter(tmp_path / "target")
    assert outcomes == {"refused", "loaded"}


def test_a_push_to_hub_at_the_limit_of_open_files_or_onto_a_full_disk_leaves_no_staged_adapter(
    tmp_path, adapters, monkeypatch
):
    """The adapter was staged in a TemporaryDirectory, whose removal lists it: at the process's limit of open files it
    failed, left the folder and the adapter's files in the temporary folder, and raised in place of the save's error.
    And it was staged once the repo was made: a disk that could not take it left a repo made for nothing."""
    monkeypatch.setattr(hub_module, "HfApi", FakeHfApi)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    _, new, _ = adapters
    outcomes = set()
    for limit in [*(partial(open_files_limit, free) for free in range(5)), partial(file_size_limit, 1000)]:
        FakeHfApi.calls = []
        try:
            with limit():
                new.push_to_hub("me/tiny-ccm")
        except OSError as error:
            outcomes.add("refused")
            assert error.errno in (errno.EMFILE, errno.EFBIG)
            assert FakeHfApi.calls == []  # staged first: no repo made for nothing
        else:
            outcomes.add("pushed")
            assert set(FakeHfApi.calls[1][3]) == ADAPTER_FILES
        assert list(tmp_path.iterdir()) == []
    assert outcomes == {"refused", "pushed"}


# Run in a process of its own: a limit of the address space would fail whatever else the test runner allocates. The
# process makes no large tensor before each load, so that no freed memory of its own can take the file's bytes.
_LOAD_UNDER_A_MEMORY_LIMIT = """
import os, resource, sys
import torch
from tiny_models import tiny_base
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache

memory, adapter = sys.argv[1:]
model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(num_comp_tokens=8, r=2048))
before = {key: value.clone() for key, value in model.adapter_tensors().items()}


def under_a_memory_limit(path, load):
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    # Room for what a load takes besides the file's bytes (a JSON file is read into a buffer of 1 MB).
    resource.setrlimit(resource.RLIMIT_AS, (used + os.path.getsize(path) // 2, resource.RLIM_INFINITY))
    try:
        load()
    except MemoryError as error:
        print(error)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


under_a_memory_limit(os.path.join(adapter, "adapter_model.safetensors"), lambda: model.load_adapter(adapter))
print(all(torch.equal(value, before[key]) for key, value in model.adapter_tensors().items()))
model.load_adapter(adapter)
under_a_memory_limit(memory, lambda: CompressedMemoryCache.load(memory, model))
print(CompressedMemoryCache.load(memory, model).memory_length)
"""


@pytest.mark.slow  # a new process: its imports take about 7 s
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the address space used from /proc")
def test_a_file_too_large_for_the_memory_left_is_named_with_the_fix_and_changes_nothing(tmp_path):
    """The process's memory limit (`ulimit -v`) hit while a memory or adapter file was read raised a bare MemoryError,
    naming neither the file nor what to do."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(num_comp_tokens=8, r=2048))
    randomize_adapter(model, seed=1).save_pretrained(tmp_path / "adapter")  # 4 MB
    cache = model.new_cache(1024)
    for _ in range(4):
        model.compress(cache, torch.full((1024, 2), 5))
    cache.save(tmp_path / "user.safetensors")  # 8 MB: more than the adapter's load freed
    result = run_python(_LOAD_UNDER_A_MEMORY_LIMIT, str(tmp_path / "user.safetensors"), str(tmp_path / "adapter"))
    assert result.returncode == 0, result.stderr
    fix = "which is read whole; free some memory (or raise this process's limit, ulimit -v), then load it again: the "
    assert result.stdout.splitlines() == [
        f"Not enough memory to read the adapter weights file {tmp_path / 'adapter' / 'adapter_model.safetensors'}, "
        f"{fix}file was not judged.",
        "True",
        f"Not enough memory to read the memory file {tmp_path / 'user.safetensors'}, {fix}file was not judged.",
        str(cache.memory_length),
    ]


# Not os.close: shutil.rmtree itself closes a folder twice when interrupted right after closing it.
_MEMORY_SAVE_CALLS = ["mkdir", "open", "fsync", "replace", "unlink", "rmdir"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(_MEMORY_SAVE_CALLS), k=st.integers(0, 8))
def test_ctrl_c_right_after_any_file_operation_of_a_memory_save_leaves_the_old_file_or_the_new_one_alone(
    tmp_path_factory, adapters, call, k
):
    """Ctrl-C arrives when a system call returns: one during the removal of the staging folder (`ccm chat` spends
    most of a save flushing to disk, so an interrupt often lands there) left that folder behind, beside the memory."""
    from transformers_ccm import CompressedMemoryCache

    _, new, _ = adapters
    folder = tmp_path_factory.mktemp("memory")
    path = folder / "user.safetensors"
    earlier, longer = _memory(new, [5, 6]), _memory(new, [5, 6, 7, 8])
    earlier.save(path)
    original, calls = getattr(os, call), itertools.count()

    def then_interrupted(*args, **kwargs):
        result = original(*args, **kwargs)
        if next(calls) == k:
            raise KeyboardInterrupt
        return result

    with patch.object(os, call, then_interrupted), suppress(KeyboardInterrupt):
        longer.save(path)
    assert [entry.name for entry in folder.iterdir()] == ["user.safetensors"]
    assert CompressedMemoryCache.load(path, new).memory_length in (earlier.memory_length, longer.memory_length)


def _report_writes(folder, label):
    """The writes of a report of three files, each holding `label` and its name."""

    def write(name):
        def to(path):
            with open(path, "w") as file:
                file.write(f"{label} {name}")

        return to

    return {folder / name: write(name) for name in ("eval.json", "eval.png", "eval.md")}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(["open", "os.replace", "os.fsync", "os.mkdir"]), k=st.integers(0, 8))
def test_the_files_of_a_report_are_replaced_all_or_none(tmp_path_factory, call, k):
    folder = tmp_path_factory.mktemp("report")
    replace_files(_report_writes(folder, "old"))
    (folder / "notes.txt").write_text("the user's own file")
    try:
        with _failing(*_FILE_SYSTEM_CALLS[call], k):
            replace_files(_report_writes(folder, "new"))
    except OSError as error:
        assert "injected" in str(error)
        expected = "old"
    else:
        expected = "new"
    assert {path.name: path.read_text() for path in folder.iterdir()} == {
        **{name: f"{expected} {name}" for name in ("eval.json", "eval.png", "eval.md")},
        "notes.txt": "the user's own file",
    }


def test_two_threads_writing_one_report_leave_the_files_of_one_of_them(tmp_path):
    """Staged under one name per process (`eval.<pid>.tmp.json`), two threads wrote into the same temporary files,
    and one removed the other's before its rename."""
    errors, threads = [], []

    def write_other():
        try:
            replace_files(_report_writes(tmp_path, "second"))
        except Exception as error:
            errors.append(error)

    writes = _report_writes(tmp_path, "first")
    first_write = writes[tmp_path / "eval.json"]

    def write_while_another_thread_saves(path):
        first_write(path)
        thread = threading.Thread(target=write_other)
        thread.start()
        thread.join(timeout=0.3)  # long enough for a thread that is not held back to write its report
        threads.append(thread)

    replace_files({**writes, tmp_path / "eval.json": write_while_another_thread_saves})
    threads[0].join()
    assert not errors
    labels = {path.read_text().split()[0] for path in tmp_path.iterdir()}
    assert len(labels) == 1 and {path.name for path in tmp_path.iterdir()} == {"eval.json", "eval.png", "eval.md"}


@pytest.mark.parametrize("k", range(1, ADAPTER_RENAMES - 1))
def test_a_swap_that_cannot_be_undone_says_where_the_earlier_files_are(tmp_path, adapters, k):
    """Every rename from the k-th on fails (a disk gone read-only): the earlier files that were moved aside stay
    where the error says, and moving them back gives the earlier adapter."""
    old, new, _ = adapters
    old.save_pretrained(tmp_path)
    before = _contents(tmp_path)
    calls, rename = itertools.count(), os.replace

    def fails_from_k(*args):
        if next(calls) >= k:
            raise OSError(30, "Read-only file system (injected)")
        return rename(*args)

    with patch.object(os, "replace", fails_from_k), pytest.raises(OSError) as raised:
        new.save_pretrained(tmp_path)
    (staging,) = [path for path in tmp_path.iterdir() if path.name.startswith(STAGING_PREFIX)]
    assert f"could not be put back: they are in {staging / 'old'}; move them back" in str(raised.value)
    for path in (staging / "old").iterdir():
        path.rename(tmp_path / path.name)
    assert _contents(tmp_path) == before
    new.save_pretrained(tmp_path)  # and the next save removes the staging folder
    assert {path.name for path in tmp_path.iterdir()} == ADAPTER_FILES


def test_a_file_system_that_refuses_permissions_still_takes_the_save(tmp_path, adapters):
    """FAT (a USB stick) refuses chmod with EPERM: keeping a file's permissions must not make every save fail."""
    _, new, target = adapters
    with patch.object(os, "chmod", side_effect=PermissionError(1, "Operation not permitted")):
        new.save_pretrained(tmp_path)
    target.load_adapter(tmp_path)
    assert _which(target, adapters) == "new"


def test_a_memory_saved_to_a_pipe_or_device_is_refused_and_leaves_it_in_place(tmp_path, adapters):
    """safetensors renamed its file over whatever the path named: as root, cache.save("/dev/null") replaced the
    device with a regular file."""
    _, new, _ = adapters
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to(tmp_path / "pipe")
    for path in (tmp_path / "pipe", tmp_path / "link"):
        with pytest.raises(ValueError, match=r"pipe is not a regular file \(a device, a pipe or a socket\); give the"):
            _memory(new, [5, 6]).save(path)
    assert (tmp_path / "pipe").is_fifo() and sorted(path.name for path in tmp_path.iterdir()) == ["link", "pipe"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    call=st.sampled_from(sorted(_FILE_SYSTEM_CALLS)),
    k=st.integers(0, 12),
    depth=st.integers(1, 3),
    saved=st.sampled_from(["adapter", "config"]),
)
def test_a_failed_save_into_new_folders_leaves_no_folder_behind(tmp_path_factory, adapters, call, k, depth, saved):
    """The folders a save made for itself stayed after it failed: a server retrying saves of many users' adapters
    filled the disk with empty folders."""
    old, _, target = adapters
    root = tmp_path_factory.mktemp("root")
    folder = root.joinpath(*[f"level-{level}" for level in range(depth)])
    save = old.save_pretrained if saved == "adapter" else old.config.save_pretrained
    try:
        with _failing(*_FILE_SYSTEM_CALLS[call], k):
            save(folder)
    except OSError as error:
        assert "injected" in str(error)
        assert list(root.iterdir()) == []
    else:
        if saved == "adapter":
            target.load_adapter(folder)
            assert _which(target, adapters) == "old"
        else:
            assert CCMConfig.from_pretrained(folder) == old.config


def test_a_failed_save_keeps_the_folders_that_were_there_and_their_files(tmp_path, adapters):
    old, _, _ = adapters
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("the user's own file")
    with pytest.raises(OSError, match="injected"), _failing(hub_module, "save_file", 0):
        old.save_pretrained(tmp_path / "existing" / "new" / "adapter")
    assert [path.name for path in tmp_path.iterdir()] == ["existing"]
    assert [path.name for path in (tmp_path / "existing").iterdir()] == ["notes.txt"]
