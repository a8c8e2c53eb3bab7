"""Training loses nothing (issue 16): a run killed with SIGKILL during a checkpoint write or between checkpoints, or
stopped by SIGTERM (once: it saves and stops; twice: it stops at once), resumed with the same command, ends with the
weights of an uninterrupted run, bit for bit, under AdamW and a Riemannian optimiser; torn checkpoints are set aside;
an existing OUTPUT is refused and left unchanged; bad data, a mode this model cannot train and a full disk give one
clear line, before the model is loaded where the check does not need it, and leave no model-like folder.

How a run is paused at a known point, only under test: the interrupted runs are ``fiber-bundle train`` in a child
Python (``HELD_CLI`` below) that first patches the Trainer from outside, as ``FBT_HOLD`` says: ``write:N`` waits
inside the write of checkpoint-N (after the model weights, before the optimiser state), ``step:N`` waits at the end
of step N (these two write the ``FBT_READY`` file, and the test then kills the child with SIGKILL), ``sigterm:N`` /
``sigterm2:N`` send the child one / two SIGTERMs at the end of step N. The resumed runs are the same command line with
no patch. The library holds no test hook.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import tiny_model, tiny_tokenizer
from fiber_bundle.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

HELD_CLI = r"""
import os, signal, sys, time
from pathlib import Path

import torch
from transformers import TrainerCallback

from fiber_bundle.cli import main
from fiber_bundle.training.geometry_logging import GeometryLoggingTrainer

torch.set_num_threads(int(os.environ["FBT_THREADS"]))  # the parent's: the same kernels, the same rounding
where, step = os.environ.get("FBT_HOLD", "none:0").split(":")
step = int(step)


def hold():
    Path(os.environ["FBT_READY"]).write_text(str(os.getpid()))
    while True:
        time.sleep(1)


class AtStepEnd(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == step and where == "step":
            hold()
        if state.global_step == step and where.startswith("sigterm"):
            for _ in range(2 if where == "sigterm2" else 1):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs


original_init, original_save = GeometryLoggingTrainer.__init__, GeometryLoggingTrainer._save_optimizer_and_scheduler


def init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self.add_callback(AtStepEnd())


def save_optimizer_and_scheduler(self, output_dir):
    if where == "write" and self.state.global_step == step:
        hold()  # the checkpoint's model weights are written, its optimiser and trainer state are not
    return original_save(self, output_dir)


GeometryLoggingTrainer.__init__ = init
GeometryLoggingTrainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
sys.exit(main(sys.argv[1:]))
"""


def model_folder(root: Path, **overrides) -> Path:
    folder = root / "model"
    tiny_model(dtype=torch.float32, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def train_text(root: Path, words: int = 3000) -> Path:
    path = root / "train.txt"
    path.write_text(" ".join(f"w{3 + (7 * i) % 90}" for i in range(words)) + "\n")
    return path


def child_env(**extra) -> dict:
    return {**os.environ, "FBT_THREADS": str(torch.get_num_threads()), **extra}


def run_child(argv, cwd, hold="none:0") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HELD_CLI, *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=child_env(FBT_HOLD=hold, FBT_READY=str(cwd / "ready")))


def kill_when_held(argv, cwd, hold) -> str:
    """Start the child, wait until it holds at ``hold``, SIGKILL it; returns its stderr."""
    ready = cwd / "ready"
    ready.unlink(missing_ok=True)
    err = cwd / "child.err"
    with open(err, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", HELD_CLI, *map(str, argv)], cwd=cwd, stdout=subprocess.DEVNULL,
                                 stderr=stderr, env=child_env(FBT_HOLD=hold, FBT_READY=str(ready)))
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert child.poll() is None, f"the child ended before it held at {hold}:\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the child never held at {hold}"
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    ready.unlink()
    return err.read_text()


def weights(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


def assert_same_weights(folder: Path, reference: Path, start: Path):
    got, want, initial = weights(folder), weights(reference), weights(start)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(want[k], initial[k]) for k in want)  # the comparison is of trained weights


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def message_of(stderr: str) -> str:
    """The command's one message, with no traceback and no other error or warning line (a progress bar that a stop
    left open may still be drawn after it)."""
    lines = [line for line in stderr.splitlines() if line.startswith("fiber-bundle train: ")]
    assert len(lines) == 1 and "Traceback" not in stderr and "rror" not in stderr.replace(lines[0], ""), stderr[-3000:]
    return lines[0]


def checkpoint_names(output: Path) -> set:
    return {p.name for p in (output / "checkpoints").iterdir()}


# ---------------------------------------------------------------------------------------------------------------------
# kills, preemption
# ---------------------------------------------------------------------------------------------------------------------
OPTIMIZERS = [pytest.param([], id="adamw"),
              pytest.param(["--optimizer", "grassmann", "--riemannian-learning-rate", "0.1"], id="grassmann")]


@pytest.mark.heavy  # three fresh processes (about 8 s of imports each on 2 cores)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sigkill_during_and_between_checkpoint_writes_resumes_exactly(tmp_path, capsys, optimizer):
    """The same command (with --resume) run three times: killed while checkpoint-4 is being written, killed between
    checkpoint-4 and checkpoint-6, then to the end: the weights of one uninterrupted run, bit for bit."""
    model, data = model_folder(tmp_path), train_text(tmp_path)
    argv = lambda out: ["train", model, out, "--data", data, "--block-size", "32", "--batch-size", "4",  # noqa: E731
                        "--max-steps", "8", "--save-steps", "2", "--learning-rate", "0.05", "--resume", *optimizer]
    assert main(list(map(str, argv(tmp_path / "whole")))) == 0
    capsys.readouterr()
    out = tmp_path / "out"

    err = kill_when_held(argv(out), tmp_path, "write:4")
    assert "no complete checkpoint" in err and "starts from the beginning" in err  # the first run of the command
    assert checkpoint_names(out) == {"checkpoint-2", ".staging"}  # checkpoint-4 is absent, not torn
    assert not (out / "config.json").exists()

    err = kill_when_held(argv(out), tmp_path, "step:5")
    assert "removed the unfinished checkpoint-4" in err
    assert checkpoint_names(out) == {"checkpoint-2", "checkpoint-4"}

    result = run_child(argv(out), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint_names(out) == {f"checkpoint-{n}" for n in (2, 4, 6, 8)}
    assert json.loads((out / "training_metrics.json").read_text())["steps"] == 8
    assert_same_weights(out, tmp_path / "whole", model)


@pytest.mark.heavy  # three fresh processes
def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes_exactly(tmp_path, capsys):
    """SIGTERM at step 3 of a run that keeps no checkpoints (no --save-steps): checkpoint-4 is saved at the next step
    boundary, the exit is 143 with how to resume; a second run gets two SIGTERMs at step 6 and stops at once, losing
    only steps 5-6; the third run ends with the uninterrupted run's weights."""
    model, data = model_folder(tmp_path), train_text(tmp_path)
    argv = lambda out: ["train", model, out, "--data", data, "--block-size", "32", "--batch-size", "4",  # noqa: E731
                        "--max-steps", "8", "--learning-rate", "0.05", "--resume"]
    assert main(list(map(str, argv(tmp_path / "whole")))) == 0
    capsys.readouterr()
    out = tmp_path / "out"

    first = run_child(argv(out), tmp_path, hold="sigterm:3")
    assert first.returncode == 143, first.stderr[-3000:]
    line = message_of(first.stderr)
    assert line.startswith("fiber-bundle train: stopped by SIGTERM at step 4 of 8; checkpoint saved to ")
    assert "checkpoint-4" in line and "--resume" in line
    assert checkpoint_names(out) == {"checkpoint-4"} and not (out / "config.json").exists()

    second = run_child(argv(out), tmp_path, hold="sigterm2:6")
    assert second.returncode == 143, second.stderr[-3000:]
    line = message_of(second.stderr)
    assert "stopped at once by a second SIGTERM after step 6; run the same command with --resume" in line
    assert line.endswith("to continue from " + str(out / "checkpoints" / "checkpoint-4") + ".")
    assert checkpoint_names(out) == {"checkpoint-4"} and not (out / "config.json").exists()

    third = run_child(argv(out), tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert_same_weights(out, tmp_path / "whole", model)


def test_torn_checkpoints_are_set_aside_and_rotation_still_works(tmp_path, caplog):
    """Through the Python API: save_total_limit rotation and the best checkpoint work with staging; a torn
    checkpoint (as a version without staging left it) and an unfinished staged write are reported and skipped, and
    resume_from_checkpoint=True picks the newest complete checkpoint; with none yet it starts from the beginning."""
    from fiber_bundle.training.errors import TrainingError
    from fiber_bundle.training.trainer import train_model
    from test_training import pattern_dataset

    common = dict(mode="metric-only", learning_rate=3e-2, batch_size=4, use_cpu=True, quiet=True, save_strategy="steps",
                  save_steps=2)
    with caplog.at_level("WARNING", logger="fiber_bundle.training.checkpoints"):
        trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path / "best", max_steps=4,
                              eval_dataset=pattern_dataset(n=8, seed=3), eval_strategy="steps", eval_steps=2,
                              load_best_model_at_end=True, metric_for_best_model="loss", resume_from_checkpoint=True,
                              **common)
    assert "training starts from the beginning" in caplog.text
    best = Path(trainer.state.best_model_checkpoint)
    assert best.parent == tmp_path / "best" and best.is_dir()  # named where it is, not in the staging folder
    assert json.loads((best / "trainer_state.json").read_text())["best_model_checkpoint"] in (str(best), None)

    run, common = tmp_path / "run", {**common, "save_total_limit": 1}
    train_model(tiny_model(dtype=torch.float32), pattern_dataset(), run, max_steps=4, **common)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4"]  # rotated, and no staging folder left
    shutil.copytree(run / "checkpoint-4", run / "checkpoint-6")
    (run / "checkpoint-6" / "trainer_state.json").unlink()  # torn: cut off before its trainer state
    (run / ".staging" / "checkpoint-8").mkdir(parents=True)  # a staged write cut off by a kill
    with pytest.raises(TrainingError, match="cannot resume from .*checkpoint-6: it has no trainer_state.json"):
        train_model(tiny_model(dtype=torch.float32), pattern_dataset(), run, max_steps=6,
                    resume_from_checkpoint=str(run / "checkpoint-6"), **common)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fiber_bundle.training.checkpoints"):
        trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), run, max_steps=6,
                              resume_from_checkpoint=True, **common)
    assert trainer.state.global_step == 6
    assert "ignoring the torn checkpoint" in caplog.text and "checkpoint-6" in caplog.text
    assert (run / ".checkpoint-6.torn").is_dir() and not (run / ".staging").exists()
    assert {p.name for p in run.iterdir() if p.name.startswith("checkpoint-")} == {"checkpoint-6"}
    assert json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6


def test_a_kill_while_the_final_model_moves_into_place_is_undone(tmp_path):
    """write_output moves the run's checkpoints into its staging folder and renames that into place; whatever a kill
    between those renames left, the next run finds the previous OUTPUT and the checkpoints where they were."""
    from fiber_bundle.training.checkpoints import prepare_output

    out = tmp_path / "out"
    (tmp_path / ".out.replaced-123").mkdir()  # the previous OUTPUT, renamed aside
    (tmp_path / ".out.replaced-123" / "config.json").write_text("{}")
    staged = tmp_path / ".out.saving-123" / "checkpoints" / "checkpoint-2"
    staged.mkdir(parents=True)
    (staged / "trainer_state.json").write_text("{}")
    prepare_output(out, resume=True, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "config.json").is_file() and (out / "checkpoints" / "checkpoint-2" / "trainer_state.json").is_file()

    (tmp_path / ".out.replaced-7").mkdir()  # killed after the swap, before the old copy was removed
    prepare_output(out, resume=True, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------------------------------------------------------------
# OUTPUT, data, modes, disk
# ---------------------------------------------------------------------------------------------------------------------
def test_an_existing_output_is_refused_and_left_unchanged(tmp_path, capsys):
    model, data = model_folder(tmp_path), train_text(tmp_path, 800)
    argv = ["train", str(model), str(tmp_path / "out"), "--data", str(data), "--block-size", "32", "--batch-size",
            "4", "--max-steps", "2", "--save-steps", "1", "--learning-rate", "0.05"]
    assert main(argv) == 0
    before = snapshot(tmp_path / "out")
    capsys.readouterr()
    for extra in ([], ["--resume"], ["--learning-rate", "0.5"]):
        assert main(argv + extra) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"fiber-bundle train: error: OUTPUT {tmp_path / 'out'} already holds a model "
                              "(config.json); pass --overwrite")
        assert err.count("\n") == 1 and snapshot(tmp_path / "out") == before

    earlier = tmp_path / "earlier"  # only an earlier run's checkpoints: continue it (--resume) or start again
    shutil.copytree(tmp_path / "out" / "checkpoints", earlier / "checkpoints")
    assert main(argv[:2] + [str(earlier)] + argv[3:]) == 1
    assert "holds the checkpoints of an earlier run (newest: checkpoint-2); pass --resume" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(argv[:2] + [str(other)] + argv[3:]) == 1
    assert "holds files that are not this run's checkpoints (notes.txt)" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"

    assert main(argv + ["--overwrite", "--data", str(tmp_path / "missing.txt")]) == 1  # a check fails: nothing goes
    assert snapshot(tmp_path / "out") == before
    assert main(argv + ["--learning-rate", "0.5", "--overwrite"]) == 0  # replaced, once the new model is complete
    after = snapshot(tmp_path / "out")
    assert after["model.safetensors"] != before["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def refuse_loading(monkeypatch):
    """The checks that need no weights must come before the model is loaded."""
    from modeling_fiber_bundle import FiberBundleForCausalLM

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was found")

    monkeypatch.setattr(FiberBundleForCausalLM, "from_pretrained", loaded)


def test_data_errors_name_the_file_the_line_and_the_problem(tmp_path, capsys, monkeypatch):
    model = model_folder(tmp_path)
    refuse_loading(monkeypatch)
    files = {
        "corrupt.jsonl": '{"text": "w3 w4 w5"}\n{"text": "w6 w7"\n{"text": "w8"}\n',
        "column.jsonl": '{"body": "w3 w4 w5"}\n',
        "null.jsonl": '{"text": "w3 w4"}\n{"text": null}\n',
        "short.txt": "w3 w4 w5\n",
        "list.jsonl": '{"text": "w3"}\n["w4"]\n',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.txt").write_bytes(b"w3 w4\nw5 \xe9t\xe9\n")
    expected = {
        "corrupt.jsonl": f"data file {tmp_path / 'corrupt.jsonl'}, line 2: not valid JSON (Expecting ',' delimiter",
        "column.jsonl": f"training data {tmp_path / 'column.jsonl'}: no 'text' column (the records have ['body'])",
        "null.jsonl": f"training data {tmp_path / 'null.jsonl'}: record 2: 'text' is null, not a string.",
        "short.txt": f"training data {tmp_path / 'short.txt'} holds 4 tokens, fewer than one block of --block-size 64",
        "list.jsonl": f"data file {tmp_path / 'list.jsonl'}, line 2: a JSON list, where each line must be an object",
        "latin1.txt": f"data file {tmp_path / 'latin1.txt'}, line 2: not UTF-8 text",
    }
    for name, message in expected.items():
        code = main(["train", str(model), str(tmp_path / "out"), "--data", str(tmp_path / name), "--block-size", "64"])
        assert code == 1 and message_of(capsys.readouterr().err).startswith(f"fiber-bundle train: error: {message}")
        assert not (tmp_path / "out").exists()
    assert main(["train", str(model), str(tmp_path / "out"), "--data", str(tmp_path / "short.txt"), "--eval-data",
                 str(tmp_path / "column.jsonl"), "--block-size", "2"]) == 1
    assert f"error: eval data {tmp_path / 'column.jsonl'}: no 'text' column" in capsys.readouterr().err
    assert main(["train", str(model), str(tmp_path / "out"), "--data", str(tmp_path / "corrupt.jsonl"),
                 "--traceback"]) == 1
    assert "Traceback" in capsys.readouterr().err  # asked for


def test_modes_the_model_cannot_train_are_refused_before_loading(tmp_path, capsys, monkeypatch):
    data = train_text(tmp_path, 800)
    flat = model_folder(tmp_path / "flat", metric_rank=0, ffn_metric_rank=0)
    quantised = model_folder(tmp_path / "q")
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantised / "config.json").write_text(json.dumps(config))
    refuse_loading(monkeypatch)
    cases = [(flat, "metric-only", "metric-only training needs a model with a metric"),
             (quantised, "full", "the model's weights are quantised (bitsandbytes) and --mode full trains every "
                                 "weight, which needs full-precision weights"),
             (quantised, "metric-only", "the model's weights are quantised (bitsandbytes) including its fiber (metric) "
                                        "modules, which --mode metric-only trains")]
    for folder, mode, message in cases:
        code = main(["train", str(folder), str(tmp_path / "out"), "--data", str(data), "--mode", mode])
        assert code == 1 and f"fiber-bundle train: error: {message}" in capsys.readouterr().err, (folder, mode)
    assert main(["train", str(flat), str(tmp_path / "out"), "--data", str(data), "--mode", "full", "--block"]) == 1
    assert "apply to a Riemannian optimizer" in capsys.readouterr().err


def test_disk_full_during_the_final_save_keeps_output_as_it_was(tmp_path, capsys, monkeypatch):
    """The weights' writer raises ENOSPC: OUTPUT (here holding an earlier model, replaced only with --overwrite) keeps
    exactly what it held, nothing model-like is left beside it, and the message says what a rerun does."""
    import transformers.modeling_utils

    model, data = model_folder(tmp_path), train_text(tmp_path, 800)
    out = tmp_path / "out"
    shutil.copytree(model, out)  # the model trained there before
    before = snapshot(out)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    for target in (out, tmp_path / "new"):
        code = main(["train", str(model), str(target), "--data", str(data), "--block-size", "32", "--batch-size", "4",
                     "--max-steps", "2", "--overwrite"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and err[-1] == (
            f"fiber-bundle train: error: could not write the trained model (No space left on device (errno 28)); "
            f"OUTPUT {target} holds no new model and nothing it held was changed. Free space (or fix the cause), then "
            "run the same command again (no checkpoint was kept, so it trains from the beginning).")
    assert snapshot(out) == before
    assert not (tmp_path / "new" / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".saving-" in p.name or ".replaced-" in p.name]


def test_disk_full_on_a_small_tmpfs_leaves_no_model_like_folder(tmp_path):
    """The real thing where this machine lets the test mount a tmpfs (root, in a private mount namespace): OUTPUT on a
    256 KiB tmpfs has room for config.json and the modeling files but not the weights."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    model, data = model_folder(tmp_path), train_text(tmp_path, 800)
    small = tmp_path / "small"
    small.mkdir()
    script = (f'mount -t tmpfs -o size=256k tmpfs "{small}" || exit 99; "$@"; echo "exit=$?"; '
              f'find "{small}" -mindepth 1 -printf "%P\\n"')
    command = ["unshare", "--mount", "--", "sh", "-c", script, "sh", sys.executable, "-m", "fiber_bundle.cli",
               "train", str(model), str(small / "out"), "--data", str(data), "--block-size", "32", "--batch-size", "4",
               "--max-steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())
    if result.returncode == 99 or "exit=" not in result.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()[-300:]}")
    lines = result.stdout.strip().splitlines()
    exit_line = next(i for i, line in enumerate(lines) if line.startswith("exit="))
    assert lines[exit_line] == "exit=1", result.stderr[-3000:]
    left = set(lines[exit_line + 1:])
    assert left <= {"out", "out/checkpoints"}, left  # no config.json, no staging folder
    line = message_of(result.stderr)
    assert line.startswith("fiber-bundle train: error: could not write the trained model (") and (
        "No space left on device" in line)
