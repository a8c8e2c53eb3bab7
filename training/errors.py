"""What training reports to its user: one-line errors that name the problem and the fix."""

import errno


class TrainingError(ValueError):
    """Training cannot proceed (bad data, an existing OUTPUT, a full disk, ...); the message names the problem and the
    fix. A ValueError, as the argument checks of ``train_model`` have always raised."""


class TrainingStopped(RuntimeError):
    """Training stopped early on SIGTERM (a preemption); ``checkpoint`` is the newest complete checkpoint (None when
    there is none), from which the same command with --resume (``resume_from_checkpoint=True``) continues exactly."""

    def __init__(self, message: str, *, step: int, checkpoint=None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


def describe(error: BaseException) -> str:
    """An exception in one line: the OS's words for an OSError (e.g. "No space left on device"), else its type and
    the first line of its message."""
    if isinstance(error, OSError) and error.errno is not None:
        return f"{error.strerror or errno.errorcode.get(error.errno, error.errno)} (errno {error.errno})"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
