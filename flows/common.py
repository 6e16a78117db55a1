"""What the flows share: the progress hook, the I/O-only retry rule, markdown tables."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import duckdb

from poolpipe.errors import WarehouseBusyError

DEFAULT_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8)  # profiled batch sizes

_reporter: Callable[[str, int, int], None] | None = None


@contextmanager
def reporting(fn: Callable[[str, int, int], None]) -> Iterator[None]:
    """Send the progress of flows run in this process to `fn(step, done, total)` (the CLI's
    progress bar). Tasks run in this process, so a module-level hook reaches them."""
    global _reporter
    old, _reporter = _reporter, fn
    try:
        yield
    finally:
        _reporter = old


def report(step: str, done: int, total: int) -> None:
    if _reporter is not None:
        _reporter(step, done, total)


def io_error_only(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: only failures of I/O (files, the warehouse file) are retried; bad
    input fails at once, because trying again cannot fix it."""
    try:
        state.result()
    except (OSError, duckdb.IOException, WarehouseBusyError):
        return True
    except BaseException:
        return False
    return False


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
