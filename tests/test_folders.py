"""The staged-folder writer every folder-writing command uses (``conversion/folders.py``), against its faults once: an
exception or interrupt inside the write, a process killed with SIGKILL while it writes and between the two renames
that put the folder in place, a full disk while it writes and while it flushes, an existing OUTPUT (refused unless
empty or ``--overwrite``) and a folder carried from the old OUTPUT into the new. The commands keep their own tests of
the same faults through their own code (test_conversion.py, test_export.py, test_training_faults.py)."""

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fiber_bundle.conversion import folders
from fiber_bundle.conversion.folders import require_new_or_empty, settle_replacements, staged_folder, staging_folders

ROOT = Path(__file__).resolve().parent.parent


def contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative name -> text)."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def previous_output(tmp_path: Path) -> Path:
    """An OUTPUT that a write must keep whole until the new one is complete."""
    output = tmp_path / "out"
    (output / "sub").mkdir(parents=True)
    (output / "old.txt").write_text("old")
    (output / "sub" / "kept.txt").write_text("kept")
    return output


def beside(output: Path) -> list[str]:
    """The names in OUTPUT's parent folder: OUTPUT and whatever a write left next to it."""
    return sorted(p.name for p in output.parent.iterdir())


def test_a_complete_write_replaces_output_and_leaves_nothing_beside_it(tmp_path):
    output = previous_output(tmp_path)
    with staged_folder(output, "testing") as staging:
        assert staging == tmp_path / f".out.testing-{os.getpid()}" and list(staging.iterdir()) == []
        (staging / "new.txt").write_text("new")
        assert contents(output) == {"old.txt": "old", "sub/kept.txt": "kept"}  # untouched until the block ends
    assert contents(output) == {"new.txt": "new"} and beside(output) == ["out"]
    with staged_folder(tmp_path / "deep" / "fresh", "testing") as staging:  # a missing parent is created
        (staging / "a.txt").write_text("a")
    assert contents(tmp_path / "deep" / "fresh") == {"a.txt": "a"}


@pytest.mark.parametrize("stop", [RuntimeError("a bug in the writer"), KeyboardInterrupt()])
def test_an_exception_or_interrupt_inside_the_write_leaves_output_as_it_was(tmp_path, stop):
    output = previous_output(tmp_path)
    with pytest.raises(type(stop)):
        with staged_folder(output, "testing") as staging:
            (staging / "half.txt").write_text("half")
            raise stop
    assert contents(output) == {"old.txt": "old", "sub/kept.txt": "kept"} and beside(output) == ["out"]
    with pytest.raises(type(stop)):  # no previous OUTPUT: none afterwards either
        with staged_folder(tmp_path / "new", "testing"):
            raise stop
    assert beside(output) == ["out"]


class WriteFailed(Exception):
    """A command's own error for a write that failed (what ``write_error`` makes of the cause)."""


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_writing_leaves_output_as_it_was(tmp_path):
    output = previous_output(tmp_path)
    with pytest.raises(OSError) as raised:
        with staged_folder(output, "testing") as staging:
            (staging / "weights.bin").write_bytes(b"0" * 1024)
            disk_full()  # the next file's write finds the disk full
    assert raised.value.errno == errno.ENOSPC
    assert contents(output) == {"old.txt": "old", "sub/kept.txt": "kept"} and beside(output) == ["out"]


def test_a_full_disk_while_flushing_becomes_the_commands_error(tmp_path, monkeypatch):
    """A file system with delayed allocation reports ENOSPC at fsync, after every write succeeded: ``write_error``
    turns it into the command's error as it does a failed write, and OUTPUT is kept."""
    output = previous_output(tmp_path)
    monkeypatch.setattr(folders, "fsync_path", disk_full)
    with pytest.raises(WriteFailed, match="No space left") as raised:
        with staged_folder(output, "testing", write_error=lambda error: WriteFailed(str(error))) as staging:
            (staging / "new.txt").write_text("new")
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert contents(output) == {"old.txt": "old", "sub/kept.txt": "kept"} and beside(output) == ["out"]


# A child Python that writes through staged_folder and is killed with SIGKILL at a known point. It loads folders.py by
# path (the module imports only the standard library), so that it starts in milliseconds without torch.
CHILD = """
import importlib.util, os, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("folders", sys.argv[1])
folders = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folders)
output, point = Path(sys.argv[2]), sys.argv[3]
if point == "between-renames":  # the kill falls after OUTPUT was renamed aside, before the new folder took its place
    rename = Path.rename
    def rename_then_die(self, target):
        result = rename(self, target)
        if ".replaced-" in Path(target).name:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    Path.rename = rename_then_die
with folders.staged_folder(output, "testing") as staging:
    (staging / "new.txt").write_text("new")
    if point == "while-writing":
        print("written", flush=True)
        signal.pause()  # killed here by the test
"""


def killed_child(output: Path, point: str) -> int:
    """Run ``CHILD`` writing OUTPUT and kill it with SIGKILL at ``point``; return its pid (in its staging's name)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT / "conversion" / "folders.py"), str(output),
                              point], stdout=subprocess.PIPE, text=True)
    if point == "while-writing":
        assert child.stdout.readline() == "written\n"
        child.kill()
    child.wait(timeout=60)
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return child.pid


def test_a_kill_while_writing_leaves_output_as_it_was_and_its_staging_beside_it(tmp_path):
    """SIGKILL runs no cleanup: OUTPUT is untouched and the killed process's hidden staging folder stays (the
    documented leftover); the next write goes through its own staging folder and leaves only that one behind."""
    output = previous_output(tmp_path)
    pid = killed_child(output, "while-writing")
    assert contents(output) == {"old.txt": "old", "sub/kept.txt": "kept"}
    assert beside(output) == [f".out.testing-{pid}", "out"] and staging_folders(output, "testing") == [
        tmp_path / f".out.testing-{pid}"]
    with staged_folder(output, "testing") as staging:
        (staging / "next.txt").write_text("next")
    assert contents(output) == {"next.txt": "next"} and beside(output) == [f".out.testing-{pid}", "out"]


def test_a_kill_between_the_two_renames_is_settled_to_the_previous_output(tmp_path):
    """Killed after OUTPUT was renamed aside and before the new folder took its place: no OUTPUT, the previous one
    whole as ``.out.replaced-PID``, which ``settle_replacements`` puts back (and removes once OUTPUT is there again)."""
    output = previous_output(tmp_path)
    pid = killed_child(output, "between-renames")
    assert not output.exists() and contents(tmp_path / f".out.replaced-{pid}") == {"old.txt": "old",
                                                                                  "sub/kept.txt": "kept"}
    settle_replacements(tmp_path, "out")
    assert contents(output) == {"old.txt": "old", "sub/kept.txt": "kept"} and beside(output) == [
        f".out.testing-{pid}", "out"]
    (tmp_path / ".out.replaced-7").mkdir()  # killed after the swap, before the old copy was removed
    settle_replacements(tmp_path, "out")
    assert beside(output) == [f".out.testing-{pid}", "out"]


def test_a_carried_folder_moves_into_the_new_output_and_back_when_the_rename_fails(tmp_path, monkeypatch):
    output = previous_output(tmp_path)
    with staged_folder(output, "testing", carry="sub") as staging:
        (staging / "new.txt").write_text("new")
    assert contents(output) == {"new.txt": "new", "sub/kept.txt": "kept"} and beside(output) == ["out"]

    def rename_fails(staging, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(folders, "replace_folder", rename_fails)
    with pytest.raises(OSError, match="cross-device"):
        with staged_folder(output, "testing", carry="sub", write_error=WriteFailed) as staging:
            (staging / "newer.txt").write_text("newer")
    assert contents(output) == {"new.txt": "new", "sub/kept.txt": "kept"} and beside(output) == ["out"]


def test_an_existing_output_is_refused_unless_empty_or_overwrite(tmp_path):
    message = (f"OUTPUT {tmp_path / 'out'} exists and is not empty; pass --overwrite to replace it, or choose another "
               "folder.")
    output = tmp_path / "out"
    require_new_or_empty(output, False, WriteFailed)  # absent
    output.mkdir()
    require_new_or_empty(output, False, WriteFailed)  # empty
    (output / "keep.txt").write_text("mine")
    with pytest.raises(WriteFailed) as raised:
        require_new_or_empty(output, False, WriteFailed)
    assert str(raised.value) == message and (output / "keep.txt").read_text() == "mine"
    require_new_or_empty(output, True, WriteFailed)
    (output / "keep.txt").unlink()
    output.rmdir()
    output.write_text("a file")
    with pytest.raises(WriteFailed) as raised:
        require_new_or_empty(output, False, WriteFailed)
    assert str(raised.value) == message and output.read_text() == "a file"
    require_new_or_empty(output, True, WriteFailed)


def test_an_existing_empty_output_is_replaced(tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    require_new_or_empty(output, False, WriteFailed)
    with staged_folder(output, "testing") as staging:
        (staging / "new.txt").write_text("new")
    assert contents(output) == {"new.txt": "new"} and beside(output) == ["out"]
