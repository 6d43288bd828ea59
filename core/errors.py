"""Errors meant for people, with the exit code the CLI returns for them.

Exit codes (the contract in README.md):
  2  the pipeline file or its input data is invalid
  3  a stage does not fit the GPUs it asked for
  1  a stage failed
  128 + N  a run stopped by signal N (130: Ctrl-C, 143: SIGTERM), after saving what it could
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_DOES_NOT_FIT = 3


class PipelineError(Exception):
    """An error the CLI prints as a short message, without a traceback."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(PipelineError):
    """The pipeline file, a model or a data file is wrong: nothing was submitted."""

    exit_code = EXIT_INVALID


class InvalidStageInput(InvalidInput):
    """Bad input a running stage found (its data, its model): exit 2 like any bad input, but a
    stage ran."""


class DoesNotFit(PipelineError):
    """A stage needs more memory than the hardware it asked for."""

    exit_code = EXIT_DOES_NOT_FIT


class StageFailed(PipelineError):
    """A stage ran and failed; the message says where its log is."""

    exit_code = EXIT_FAILED


class Diverged(PipelineError):
    """A stage's weights (or its evaluation loss) stopped being numbers, nan or inf: it stops
    before saving or exporting them (stages/engine.py `Numbers`)."""

    exit_code = EXIT_FAILED


class Interrupted(PipelineError):
    """A run stopped by a signal (Ctrl-C, `kill`): the message says what was saved and how to resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
