"""Rows of a serving benchmark run for the warehouse's `bench_serving` table."""

from __future__ import annotations

import socket
from datetime import UTC, datetime


class BenchRows(list):
    """One benchmark run's rows: `record(bench, config, metric, value)` adds one, stamped
    with the run's start, label and host."""

    def __init__(self, label: str | None) -> None:
        super().__init__()
        self.run_at = datetime.now(UTC).replace(tzinfo=None)
        self.label = label
        self.host = socket.gethostname()

    def record(self, bench: str, config: str, metric: str, value: float) -> None:
        self.append(
            {
                "run_at": self.run_at,
                "run_label": self.label,
                "bench": bench,
                "config": config,
                "metric": metric,
                "value": float(value),
                "host": self.host,
            }
        )
