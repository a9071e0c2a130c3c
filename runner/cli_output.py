"""How the command line shows things: one formatter per thing, shared by every command."""
from __future__ import annotations

import errno
import os
import sys

import click

from runner.console import console
from runner.errors import OutputClosed, OutputFileError, RunnerError
from runner.summary import stats_lines


_closed: set[int] = set()  # standard descriptors the process began without (`>&-`): see reopen_closed


def reopen_closed() -> None:
    """Descriptors 0-2 closed at the start (`runner run >&-`) are opened on /dev/null, so that the
    engine's output can be pointed elsewhere and back as ever. A command whose output is what was
    asked for then says standard output is closed (check_stdout); one that acts says nothing."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            _closed.add(fd)
    if 1 in _closed:
        sys.stdout = open(1, "w", closefd=False)
    if 2 in _closed:
        sys.stderr = open(2, "w", closefd=False)


def stdout_open() -> bool:
    """Whether standard output was open when the process began."""
    return 1 not in _closed


def check_stdout(hint: str = "") -> None:
    """Raise the runner's error where standard output was closed when the process began: called by
    the commands whose output is what was asked for (stats, status, plan, a report or an export to
    stdout); a command that acts (run, prune, calibrate) does its work and says nothing."""
    if 1 in _closed:
        raise OutputFileError("standard output is closed: nothing can be written to it" + (f" ({hint})" if hint else ""))


def confirm(message: str) -> None:
    """A line saying where something was written: left out where standard output was closed (the
    file is the outcome), not an error as the output itself would be."""
    if stdout_open():
        say(message)


def say(message: str = "", nl: bool = True) -> None:
    """A line of the runner's own output (reaches the terminal while the engine's goes to its log).
    Standard output that cannot be written (a full disk, /dev/full) is the runner's error, and one
    whose reader stopped reading (`| head`) is OutputClosed: no traceback. Where standard output
    was closed at the start, the line goes to /dev/null (reopen_closed): see check_stdout."""
    try:
        click.echo(message, file=console().out, nl=nl)
    except OSError as exc:
        raise stdout_error(exc) from None


def stdout_error(exc: OSError) -> RunnerError:
    """The runner's error for a write to standard output that failed."""
    if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
        return OutputClosed("standard output was closed by its reader")
    return OutputFileError(f"standard output: cannot write: {exc.strerror or exc}")


def warn(message: str) -> None:
    """A line to standard error (notes, errors). One that cannot be written (a full disk, a closed
    pipe) is dropped: a note must not stop the run it is about, and an error exits anyway."""
    try:
        click.echo(message, file=console().err)
    except (OSError, ValueError):
        pass


def table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def stats_table(s: dict, statuses: dict[str, int], extra: list[tuple[str, object]] = ()) -> str:
    """A run's stats row: the one rendering `runner run` and `runner stats` share."""
    return table([*stats_lines(s, statuses), *extra])


def run_summary(summary) -> str:
    s = summary.stats
    rows = (f"{s['rows_total']:,} run ({summary.rows_redone:,} of them again), " if summary.rows_redone
            else f"{s['rows_total']:,} run, ")
    return f"Results: {summary.database} (run {summary.run_id})\n" + stats_table(s, summary.counts, [
        ("rows", rows + f"{summary.rows_skipped:,} already done, {summary.rows_input:,} "
                 + (f"taken from the input (limit {summary.input_limit:,})" if summary.input_limit else "in input")
                 + (f", {summary.rows_rejected:,} left out (see rejected_rows)" if summary.rows_rejected else "")
                 + (f", {summary.rows_documents_cut:,} with their document cut to fit (results.document_tokens_cut)"
                    if summary.rows_documents_cut else "")),
    ])
