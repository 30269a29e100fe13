"""Progress bars on stderr (rich), shown only when stderr is a terminal: a log file, a pipe or a test's
captured output stays free of them."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


def stderr_is_terminal() -> bool:
    from rich.console import Console
    return Console(stderr=True).is_terminal


@contextmanager
def progress_bar(description: str, total: int, fields: dict | None = None, show_fields: str | None = None,
                 enabled: bool | None = None) -> Iterator[Callable[..., None]]:
    """A bar ``description  ━━━━  done/total  elapsed<remaining  [show_fields]``; yields ``advance(n=1,
    **fields)``. ``show_fields`` is a rich format string over the task's fields (e.g. ``"{task.fields[rate]}"``).
    ``enabled`` defaults to whether stderr is a terminal; disabled, ``advance`` does nothing visible."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    console = Console(stderr=True)
    enabled = console.is_terminal if enabled is None else enabled
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("<"), TimeRemainingColumn()]
    if show_fields:
        columns.append(TextColumn(show_fields))
    progress = Progress(*columns, console=console, disable=not enabled)
    task = progress.add_task(description, total=total, **(fields or {}))

    def advance(n: int = 1, **updates) -> None:
        progress.update(task, advance=n, **updates)

    with progress:
        yield advance
