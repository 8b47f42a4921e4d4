"""How a training run ends other than by finishing: the exceptions the scripts turn into exit codes.

No paddle here: ``cli.common`` maps these to exit codes before anything heavy is imported.
"""

import signal


class TrainingInterrupted(Exception):
    """SIGTERM/SIGINT: a checkpoint of the current step was saved and training stopped.

    ``exit_code`` is the shell's convention for a process ended by a signal (128 + its number:
    143 for SIGTERM, 130 for SIGINT), so a job scheduler or a ``run && merge`` chain sees that
    the run did not finish.
    """

    def __init__(self, signum: int, checkpoint, command: str):
        self.signum = signum
        self.checkpoint = checkpoint
        self.command = command
        self.exit_code = 128 + int(signum)
        name = signal.Signals(signum).name
        if checkpoint:
            text = f"training stopped by {name}: checkpoint {checkpoint} is complete. Resume with:\n  {command}"
        else:
            text = f"training stopped by {name} before any step finished; nothing to resume, run it again"
        super().__init__(text)


class SaveError(Exception):
    """A checkpoint or the final weights could not be written (disk full, permission, ...).

    The message says what failed, that the previous files are intact (writes are staged
    and renamed into place), and how to resume.
    """
