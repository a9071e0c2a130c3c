"""The runner's own error types. Core code raises these; only the CLI turns them into messages.

Each class carries the process exit code the CLI uses for it (README: "Exit codes").
"""
from __future__ import annotations


class RunnerError(Exception):
    """Base of every error the runner reports to a user as one `Error: ...` line."""

    exit_code = 1


class SpecError(RunnerError):
    """A job file, config or schema is invalid: names the file and the field."""

    exit_code = 2


class TemplateError(SpecError):
    """The chat template (the model's or prompts.chat_template) failed to compile or render."""


class InputError(RunnerError):
    """The input Parquet is missing, unreadable, or its rows break the job's contract."""

    exit_code = 3


class ModelError(RunnerError):
    """The model folder is missing or cannot be prepared."""

    exit_code = 4


class EngineError(RunnerError):
    """The generation engine failed to start or died."""

    exit_code = 5


class StoreError(RunnerError):
    """The SQLite store cannot be opened or written."""

    exit_code = 6


class NotFound(RunnerError):
    """What a read-only command was asked to show is not there: the job has not run yet (no
    database, or no runs in it), or no run has that id. Not a damaged database (6)."""

    exit_code = 7


class OutputFileError(StoreError):
    """A file the runner writes from the store (an export, a report) cannot be written: the same
    exit code as the database, a place the results cannot go."""


class OutputClosed(RunnerError):
    """The reader of standard output stopped reading (`runner export ... | head`): what a filter
    does then, not a failure worth an `Error:` line."""

    exit_code = 141  # 128 + SIGPIPE: what a shell reports for a filter its reader stopped


class LockedError(RunnerError):
    """Another run of the same job holds the lock."""

    exit_code = 75  # EX_TEMPFAIL: cron wrappers treat it as "try later"


class ChangedWhileRead(RunnerError):
    """A reading command that could not take SQLite's locks (another user's database, a read-only
    folder) found the file changed under it: a run wrote meanwhile. Not damage: try again."""

    exit_code = 75  # EX_TEMPFAIL, as for a running job: "try later"


class TooManyFailed(RunnerError):
    """The run completed, but more of the input's rows are not ok than output.max_failed_fraction allows."""

    exit_code = 65  # EX_DATAERR: cron sees a failure although every row was stored
