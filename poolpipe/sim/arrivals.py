"""Arrival processes for the simulator: Poisson, bursty Gamma, an Azure Functions 2021 trace,
or a plain file of arrival times. All return merged, sorted (time µs, model index) arrays.

    poisson            exponential inter-arrivals at each model's rate
    gamma:CV           Gamma inter-arrivals with coefficient of variation CV (CV=1 is Poisson)
    FILE.csv           Azure Functions 2021 trace (app,func,end_timestamp,duration), scaled
    FILE               one arrival per line: `time_us` or `time_us model_name`
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poolpipe.errors import PoolpipeError, UnknownNameError

US_PER_S = 1e6
AZURE_COLUMNS = ("app", "func", "end_timestamp", "duration")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str  # poisson | gamma | azure | list
    cv: float = 1.0
    path: Path | None = None

    @classmethod
    def parse(cls, text: str) -> ArrivalSpec:
        t = text.strip()
        if t == "poisson":
            return cls("poisson")
        if t.startswith("gamma:"):
            try:
                cv = float(t.split(":", 1)[1])
            except ValueError:
                cv = math.nan
            if not (cv > 0 and math.isfinite(cv)):
                raise PoolpipeError(f"--arrivals {text!r}: gamma needs a positive CV, e.g. gamma:4")
            return cls("gamma", cv=cv)
        path = Path(t)
        if not path.is_file():
            raise PoolpipeError(
                f"--arrivals {text!r} is neither poisson, gamma:CV nor an existing file"
            )
        with path.open() as f:
            first = f.readline().strip().lower()
        header = [c.strip() for c in first.split(",")]
        if all(c in header for c in AZURE_COLUMNS):
            return cls("azure", path=path)
        return cls("list", path=path)

    def describe(self) -> str:
        if self.kind == "gamma":
            return f"gamma:{self.cv:g}"
        if self.path is not None:
            return f"{self.kind}:{self.path.name}"
        return self.kind

    @property
    def absolute(self) -> bool:
        """A plain list of times is replayed as is (rates and load factor do not apply)."""
        return self.kind == "list"


def generate(
    spec: ArrivalSpec,
    rates_per_s: Sequence[float],
    duration_s: float,
    seed: int,
    model_names: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (µs, ascending) and the model index of each."""
    if duration_s <= 0:
        raise PoolpipeError(f"duration must be positive, got {duration_s} s")
    rng = np.random.default_rng(seed)
    if spec.kind == "list":
        assert spec.path is not None
        return _read_list(spec.path, model_names)
    per_model: list[np.ndarray]
    if spec.kind == "azure":
        assert spec.path is not None
        per_model = _azure(spec.path, rates_per_s, duration_s, len(model_names))
    else:
        per_model = [
            _renewal(rng, rate, duration_s, spec.cv if spec.kind == "gamma" else 1.0)
            for rate in rates_per_s
        ]
    return _merge(per_model)


def _renewal(rng: np.random.Generator, rate: float, duration_s: float, cv: float) -> np.ndarray:
    if rate <= 0:
        return np.empty(0)
    horizon = duration_s * US_PER_S
    mean_gap = US_PER_S / rate
    out: list[np.ndarray] = []
    t = 0.0
    chunk = max(int(rate * duration_s * 1.1) + 16, 64)
    while t < horizon:
        if cv == 1.0:
            gaps = rng.exponential(mean_gap, chunk)
        else:
            shape = 1.0 / (cv * cv)
            gaps = rng.gamma(shape, mean_gap / shape, chunk)
        times = t + np.cumsum(gaps)
        out.append(times)
        t = float(times[-1])
    allt = np.concatenate(out)
    return allt[allt < horizon]


def _merge(per_model: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    times = np.concatenate(per_model) if per_model else np.empty(0)
    models = (
        np.concatenate([np.full(len(t), i, dtype=np.int64) for i, t in enumerate(per_model)])
        if per_model
        else np.empty(0, dtype=np.int64)
    )
    order = np.argsort(times, kind="stable")
    return times[order], models[order]


def _read_list(path: Path, model_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    index = {n: i for i, n in enumerate(model_names)}
    times: list[float] = []
    models: list[int] = []
    turn = 0
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            try:
                t = float(parts[0].rstrip(","))
            except ValueError:
                raise PoolpipeError(
                    f"{path}:{lineno}: {parts[0]!r} is not an arrival time in µs"
                ) from None
            if not (t >= 0 and math.isfinite(t)):
                raise PoolpipeError(f"{path}:{lineno}: arrival time must be >= 0, got {t}")
            if len(parts) > 1:
                if parts[1] not in index:
                    raise UnknownNameError(
                        f"{path}:{lineno}: model {parts[1]!r} is not in the plan "
                        f"({', '.join(model_names)})"
                    )
                m = index[parts[1]]
            else:
                m = turn % len(model_names)  # unlabelled lines go to the models in turn
                turn += 1
            times.append(t)
            models.append(m)
    if not times:
        raise PoolpipeError(f"{path}: no arrival times in the file")
    t_arr = np.asarray(times)
    m_arr = np.asarray(models, dtype=np.int64)
    order = np.argsort(t_arr, kind="stable")
    return t_arr[order], m_arr[order]


def _azure(
    path: Path, rates_per_s: Sequence[float], duration_s: float, num_models: int
) -> list[np.ndarray]:
    """Invocation starts (end - duration) per function; functions go to models round-robin,
    and each model's merged stream is time-scaled to its target rate."""
    starts: dict[tuple[str, str], list[float]] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        for lineno, row in enumerate(reader, 2):
            try:
                end = float(row["end_timestamp"])
                dur = float(row["duration"])
            except (KeyError, TypeError, ValueError):
                raise PoolpipeError(
                    f"{path}:{lineno}: expected numeric end_timestamp and duration "
                    f"(Azure Functions 2021 format: {','.join(AZURE_COLUMNS)})"
                ) from None
            starts.setdefault((row["app"], row["func"]), []).append(end - dur)
    if not starts:
        raise PoolpipeError(f"{path}: the trace has no invocations")
    per_model_raw: list[list[float]] = [[] for _ in range(num_models)]
    # Busiest functions first, dealt out in turn, so models get comparable traffic.
    funcs = sorted(starts.values(), key=len, reverse=True)
    for i, s in enumerate(funcs):
        per_model_raw[i % num_models].extend(s)
    out = []
    for raw, rate in zip(per_model_raw, rates_per_s, strict=True):
        if not raw or rate <= 0:
            out.append(np.empty(0))
            continue
        t = np.sort(np.asarray(raw))
        t = (t - t[0]) * US_PER_S  # seconds -> µs, from the first invocation
        span = max(float(t[-1]), 1.0)
        observed = len(t) / (span / US_PER_S)
        t = t * (observed / rate)  # stretch or squeeze to the target rate
        horizon = duration_s * US_PER_S
        if t[-1] < horizon:  # too short: repeat the trace
            reps = math.ceil(horizon / (t[-1] + US_PER_S / rate))
            period = t[-1] + US_PER_S / rate
            t = np.concatenate([t + k * period for k in range(reps)])
        out.append(t[t < horizon])
    return out
