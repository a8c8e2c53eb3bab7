"""Folders written whole or not at all: every command that writes a folder (convert, export, train's final model and
its checkpoints, merge) builds it in a hidden staging folder beside OUTPUT and renames it into place when complete.

A rename inside one file system is atomic, so OUTPUT is at every moment absent, the previous folder, or the new one
complete. What a failure leaves:

* an exception or an interrupt (Ctrl-C) while the folder is written: nothing; the staging folder is removed and
  OUTPUT is as it was;
* a kill (SIGKILL, power loss) while the folder is written: OUTPUT as it was, and beside it the hidden staging folder
  ``.{name}.{purpose}-{pid}`` (a later write does not read it; training removes its own, ``.{name}.saving-*``, when it
  next starts);
* a kill between the two renames of ``replace_folder``: the previous OUTPUT waits as ``.{name}.replaced-{pid}``, which
  ``settle_replacements`` puts back or removes.

Only the standard library: conversion, training and analysis can all use it.
"""

import contextlib
import glob
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


def require_new_or_empty(output: Path, overwrite: bool, error: type[Exception]) -> None:
    """Refuse (raise ``error``) an OUTPUT that exists and is a file or a non-empty folder, unless ``overwrite``: a
    command never replaces what someone kept there without being asked."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise error(f"OUTPUT {output} exists and is not empty; pass --overwrite to replace it, or choose another "
                    "folder.")


def staging_folder(output: Path, purpose: str) -> Path:
    """Where this process builds OUTPUT for ``purpose`` ("converting", "exporting", "saving"): hidden, beside OUTPUT
    (one file system, so the final rename is atomic), named by process so that two writers never share one."""
    return output.parent / f".{output.name}.{purpose}-{os.getpid()}"


def staging_folders(output: Path, purpose: str) -> list[Path]:
    """Every process's staging folder for OUTPUT and ``purpose`` (``staging_folder``'s names): what kills left."""
    return sorted(output.parent.glob(f".{glob.escape(output.name)}.{purpose}-*"))


def fsync_path(path: Path) -> None:
    """Flush one file (or folder, where the file system allows) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` to disk (and the folders, where the file system allows), so that a rename
    publishes complete data even across a power loss."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
        with contextlib.suppress(OSError):  # some file systems refuse to fsync a folder
            fsync_path(Path(root))


def replace_folder(staging: Path, output: Path) -> None:
    """Move the finished folder ``staging`` into place at ``output`` (same file system). An existing ``output`` is
    renamed aside to ``.{name}.replaced-{pid}`` first and removed only after the new one is in place, so that a kill
    at any moment loses neither; then the parent folder is flushed, so that the renames themselves survive a power
    loss."""
    backup = None
    if output.exists():
        backup = output.parent / f".{output.name}.replaced-{os.getpid()}"
        output.rename(backup)
    staging.rename(output)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    with contextlib.suppress(OSError):  # some file systems refuse to fsync a folder
        fsync_path(output.parent)


def settle_replacements(parent: Path, pattern: str) -> None:
    """Finish what a kill cut off in ``replace_folder``: a ``.{name}.replaced-*`` copy (``name`` matching the glob
    ``pattern``) whose folder is there again is removed; one whose folder is missing (the kill fell between the two
    renames) becomes that folder again."""
    for backup in parent.glob(f".{pattern}.replaced-*"):
        target = parent / backup.name[1:].rsplit(".replaced-", 1)[0]
        if target.exists():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.rename(target)


@contextlib.contextmanager
def staged_folder(output: Path, purpose: str, *, carry: str | None = None,
                  write_error: Callable[[Exception], BaseException] | None = None) -> Iterator[Path]:
    """Build OUTPUT in ``staging_folder(output, purpose)``, yielded empty; when the block ends normally the folder is
    flushed to disk and renamed into place (``replace_folder``); when it raises (an interrupt included) the staging
    folder is removed and OUTPUT is left as it was.

    Arguments:
        carry: the name of a folder inside an existing OUTPUT that belongs in the new one too (a run's checkpoints): it
            moves into the complete staging folder just before the rename, and back if the rename fails.
        write_error: what an ``Exception`` raised while the folder is written or flushed becomes (raised from it); a
            full disk can show at either. An error of the rename itself is raised as it is.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output, purpose)
    shutil.rmtree(staging, ignore_errors=True)  # this process's own leftover: the pid was reused after a kill
    staging.mkdir()
    carried, kept = (output / carry, staging / carry) if carry is not None else (None, None)
    try:
        try:
            yield staging
            fsync_tree(staging)
        except Exception as error:
            if write_error is None:
                raise
            raise write_error(error) from error
        if carried is not None and carried.is_dir():
            carried.rename(kept)
        replace_folder(staging, output)
    except BaseException:
        if kept is not None and kept.is_dir() and not carried.exists():  # the carried folder goes back first
            output.mkdir(exist_ok=True)
            kept.rename(carried)
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written is left behind, whatever happened
        raise
