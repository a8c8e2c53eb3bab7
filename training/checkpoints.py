"""Training that loses nothing: checkpoints that are complete or absent, preemption by SIGTERM, and a final model that
is written whole and never replaces an existing one unasked.

* ``StagedCheckpointTrainer``: transformers' Trainer whose ``checkpoint-N`` folders are written into
  ``<output_dir>/.staging/checkpoint-N`` and renamed into place when complete, so a kill at any moment leaves every
  ``checkpoint-N`` whole; the Trainer's own save_strategy, save_total_limit rotation and resume work as before.
  ``train(resume_from_checkpoint=True)`` resumes from the newest complete checkpoint, sets torn ones aside with a
  warning, and starts from the beginning (saying so) when there is none yet, so that a preempted job can be re-run
  with the same command. On SIGTERM (``PreemptionCallback``) it saves a checkpoint at the next step boundary and
  raises ``TrainingStopped``; a second SIGTERM stops at once, losing the steps since the last checkpoint.
* ``prepare_output`` / ``write_output``: OUTPUT of ``run_training`` (the final model, with the run's checkpoints in
  ``OUTPUT/checkpoints``) is refused when it holds anything but those checkpoints, unless overwrite; the final model
  is written into a staging folder beside OUTPUT and renamed into place when complete, through the writer conversion
  and export use (``fiber_bundle.conversion.folders.staged_folder``).

One run writes into one OUTPUT at a time.
"""

import contextlib
import glob
import json
import logging
import re
import shutil
import signal
import threading
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from fiber_bundle.conversion.folders import (fsync_tree, replace_folder, settle_replacements, staged_folder,
                                             staging_folders)

from .errors import TrainingError, TrainingStopped, describe

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # run_training's checkpoint folder inside OUTPUT
STAGING = ".staging"  # inside a Trainer's output_dir: where a checkpoint is written before it is renamed into place
SAVING = "saving"  # the purpose in the name of write_output's staging folder beside OUTPUT (.{name}.saving-{pid})
TRAINER_STATE = "trainer_state.json"  # the last file the Trainer writes into a checkpoint
MODEL_FILES = ("config.json", "adapter_config.json")  # what makes a folder look like a model
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoint folders
# ----------------------------------------------------------------------------------------------------------------------
def checkpoints_in(folder) -> list[Path]:
    """The ``checkpoint-N`` folders in ``folder`` (complete or not), oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def torn_reason(checkpoint) -> str | None:
    """Why ``checkpoint`` cannot be resumed from, or None when it is complete. The Trainer writes trainer_state.json
    last, so a checkpoint without a readable one was cut off while it was written (by a version without staging)."""
    try:
        json.loads((Path(checkpoint) / TRAINER_STATE).read_text())
    except FileNotFoundError:
        return f"it has no {TRAINER_STATE}"
    except (OSError, ValueError) as error:
        return f"its {TRAINER_STATE} is unreadable ({describe(error)})"
    return None


def newest_complete_checkpoint(folder) -> Path | None:
    return next((p for p in reversed(checkpoints_in(folder)) if torn_reason(p) is None), None)


def resume_hint(folder) -> str:
    """What to run next, given the checkpoints in ``folder`` (a clause: "run the same command ...")."""
    newest = newest_complete_checkpoint(folder)
    if newest is None:
        return "run the same command again (no checkpoint was kept, so it trains from the beginning)"
    return f"run the same command with --resume (resume_from_checkpoint=True) to continue from {newest}"


def set_aside_partial_writes(folder) -> list[str]:
    """Clear what a killed run left in a Trainer's checkpoint folder: the staging folder (checkpoints never completed)
    is removed, and torn ``checkpoint-N`` folders are renamed ``.checkpoint-N.torn`` (kept for inspection, out of sight
    of the Trainer's rotation and resume). Returns what was done, a line each."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    notes = []
    staged = folder / STAGING
    if staged.is_dir():
        names = sorted(p.name for p in staged.iterdir())
        shutil.rmtree(staged)
        if names:
            notes.append(f"removed the unfinished {', '.join(names)} in {staged} (a write cut off by a kill)")
    settle_replacements(folder, f"{PREFIX_CHECKPOINT_DIR}-*")
    for checkpoint in checkpoints_in(folder):
        reason = torn_reason(checkpoint)
        if reason is not None:
            aside = folder / f".{checkpoint.name}.torn"
            shutil.rmtree(aside, ignore_errors=True)
            checkpoint.rename(aside)
            notes.append(f"ignoring the torn checkpoint {checkpoint} ({reason}); moved it to {aside}")
    return notes


# ----------------------------------------------------------------------------------------------------------------------
# The Trainer
# ----------------------------------------------------------------------------------------------------------------------
class PreemptionCallback(TrainerCallback):
    """SIGTERM (what SLURM and Kubernetes send before they kill a job): save a checkpoint at the next step boundary
    and stop training (``stopped_at`` is that step); a second SIGTERM raises ``TrainingStopped`` at once. In
    distributed training every process stops at the same step (the flag is all-reduced at each step's end)."""

    def __init__(self):
        self.received, self.stopped_at, self.step = False, None, 0

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGTERM for the duration of the block (only the main thread can set a handler)."""
        self.received, self.stopped_at = False, None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, signum, frame):
        if self.received:
            raise TrainingStopped(f"stopped at once by a second SIGTERM after step {self.step}", step=self.step)
        self.received = True

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        if _in_any_process(self.received, args.device) and self.stopped_at is None:
            logger.warning(f"SIGTERM: saving a checkpoint at step {state.global_step}, then stopping")
            control.should_save = control.should_training_stop = True
            self.stopped_at = state.global_step
        return control


def _in_any_process(flag: bool, device) -> bool:
    """Whether ``flag`` is set in any process of a distributed run (so that all stop at the same step)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


class StagedCheckpointTrainer(Trainer):
    """transformers' Trainer whose checkpoints are complete or absent, which resumes from the newest complete one and
    stops cleanly on SIGTERM (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._staging: str | None = None  # while a checkpoint is written: the folder the Trainer writes it into
        self.preemption = PreemptionCallback()
        self.add_callback(self.preemption)

    def _get_output_dir(self, trial) -> str:
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's own checkpoint (model, optimiser, scheduler, RNG and trainer state), written into the staging
        folder and renamed into place when complete; then the Trainer's rotation, on the real folder."""
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staged, final = run_dir / STAGING / name, run_dir / name
        self._staging = str(staged.parent)
        try:
            super()._save_checkpoint(model, trial)  # its rotation runs in the staging folder, where it has nothing to do
            self.accelerator.wait_for_everyone()  # every process's files (its RNG state) are in
            if self.args.should_save:
                best = self.state.best_model_checkpoint
                if best is not None and Path(best).parent == staged.parent:  # found in staging: name its real place
                    self.state.best_model_checkpoint = str(run_dir / Path(best).name)
                    self.state.save_to_json(str(staged / TRAINER_STATE))
                fsync_tree(staged)
                replace_folder(staged, final)
                with contextlib.suppress(OSError):
                    staged.parent.rmdir()  # empty again (another process's leftovers stay until the next start)
        except BaseException as error:
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
            if isinstance(error, Exception) and not isinstance(error, (TrainingError, TrainingStopped)):
                raise TrainingError(f"could not write checkpoint {final} ({describe(error)}); nothing of it was kept. "
                                    f"Free space (or fix the cause), then {resume_hint(run_dir)}.") from error
            raise
        finally:
            self._staging = None
        if self.args.should_save:
            rotate_checkpoints(str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """``Trainer.train``, where ``resume_from_checkpoint=True`` means the newest complete checkpoint in
        ``output_dir`` (none yet: from the beginning), and SIGTERM saves, stops and raises ``TrainingStopped``."""
        run_dir = Path(self.args.output_dir)
        if resume_from_checkpoint and resume_from_checkpoint is not True:
            path = Path(resume_from_checkpoint)
            reason = torn_reason(path) if path.is_dir() else "it is not a folder"
            if reason is not None:
                raise TrainingError(f"cannot resume from {path}: {reason}. Pass resume_from_checkpoint=True (--resume) "
                                    "to resume from the newest complete checkpoint.")
        if self.args.should_save:
            for note in set_aside_partial_writes(run_dir):
                logger.warning(note)
        self.accelerator.wait_for_everyone()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(run_dir)
            if resume_from_checkpoint is None and self.args.should_save:
                logger.warning(f"no complete checkpoint in {run_dir} yet: training starts from the beginning")
        resume = str(resume_from_checkpoint) if resume_from_checkpoint else None
        with self.preemption.installed():
            try:
                result = super().train(resume_from_checkpoint=resume, trial=trial, **kwargs)
            except TrainingStopped as stop:  # a second SIGTERM
                stop.checkpoint = newest_complete_checkpoint(run_dir)
                stop.args = (f"{stop}; {resume_hint(run_dir)}.",)
                raise
        if self.preemption.stopped_at is not None:
            step = self.preemption.stopped_at
            checkpoint = newest_complete_checkpoint(run_dir)
            raise TrainingStopped(f"stopped by SIGTERM at step {step} of {self.state.max_steps}; checkpoint saved to "
                                  f"{checkpoint}. Run the same command with --resume (resume_from_checkpoint=True) to "
                                  "continue exactly from there.", step=step, checkpoint=checkpoint)
        return result


# ----------------------------------------------------------------------------------------------------------------------
# OUTPUT of a run
# ----------------------------------------------------------------------------------------------------------------------
def prepare_output(output, *, overwrite: bool = False, resume: bool = False) -> bool:
    """Check OUTPUT before a run that ends by writing its model there, after undoing what a run killed while moving
    its model into place left. Refused (``TrainingError``) unless ``overwrite``: an OUTPUT that holds anything but
    ``checkpoints/`` (a model, other files), and without ``resume`` one whose ``checkpoints/`` holds an earlier run's
    checkpoints. Returns whether those are there to be removed (``overwrite`` without ``resume``: the run starts
    again; ``start_again`` removes them once every other check has passed)."""
    output = Path(output)
    _recover_interrupted_write(output)
    if output.exists() and not output.is_dir():
        raise TrainingError(f"OUTPUT {output} is a file; choose a folder.")
    if not output.is_dir():
        return False
    others = sorted(p.name for p in output.iterdir() if p.name != CHECKPOINTS)
    if others and not overwrite:
        model = [name for name in MODEL_FILES if name in others]
        what = (f"a model ({model[0]})" if model else
                f"files that are not this run's checkpoints ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})")
        raise TrainingError(f"OUTPUT {output} already holds {what}; pass --overwrite (overwrite=True) to replace it "
                            "once the new model is complete, or choose another folder.")
    earlier = checkpoints_in(output / CHECKPOINTS)
    if earlier and not resume and not overwrite:
        raise TrainingError(f"{output / CHECKPOINTS} holds the checkpoints of an earlier run (newest: "
                            f"{earlier[-1].name}); pass --resume to continue that run, or --overwrite to start again.")
    return bool(earlier) and not resume


def start_again(output) -> None:
    """Remove an earlier run's checkpoints from OUTPUT (``overwrite`` without ``resume``)."""
    shutil.rmtree(Path(output) / CHECKPOINTS)
    logger.warning(f"--overwrite: removed the earlier run's checkpoints in {Path(output) / CHECKPOINTS}")


def _recover_interrupted_write(output: Path) -> None:
    """``write_output`` moves the run's checkpoints into its staging folder and renames that into place; a kill
    between those renames is undone here: the previous OUTPUT and the checkpoints come back where they were."""
    settle_replacements(output.parent, glob.escape(output.name))
    for staging in staging_folders(output, SAVING):
        kept = staging / CHECKPOINTS
        if kept.is_dir() and not (output / CHECKPOINTS).exists():
            output.mkdir(parents=True, exist_ok=True)
            kept.rename(output / CHECKPOINTS)
            logger.warning(f"recovered the checkpoints of a run killed while it saved its model, from {staging}")
        shutil.rmtree(staging, ignore_errors=True)


def write_output(output, write) -> None:
    """Write a run's final model: ``write(folder)`` fills a staging folder beside OUTPUT; when that is complete (and
    on disk) the run's ``checkpoints/`` moves into it and it is renamed into place as OUTPUT, a previous OUTPUT
    (allowed by ``prepare_output``) being removed only after that (``folders.staged_folder``). A failure (a full disk,
    an interrupt) leaves OUTPUT as it was, with its checkpoints; a ``write`` that fails raises ``TrainingError`` saying
    what a rerun does."""
    output = Path(output)

    def failed(error: Exception) -> TrainingError:
        return TrainingError(f"could not write the trained model ({describe(error)}); OUTPUT {output} holds no new "
                             f"model and nothing it held was changed. Free space (or fix the cause), then "
                             f"{resume_hint(output / CHECKPOINTS)}.")

    with staged_folder(output, SAVING, carry=CHECKPOINTS, write_error=failed) as staging:
        write(staging)
