"""Requests that enter a model mid-way (Graft's hybrid clients): entry streams and segments.

A hybrid client (a camera, a phone, an edge box) runs blocks [0, p) of a model itself and
sends the feature map leaving block p - 1; the server runs blocks [p, N). An *entry
stream* is such clients' traffic: the model, the entry block p (0: the raw input), the
time left of the SLO when a request reaches the server (`budget_ms`) and its rate. Streams
are written in a TOML file:

    [[streams]]
    name = "phones"       # the stream's name (default: <model>.e<entry>)
    model = "resnet50"
    entry = 4             # the first block the server runs (0: the raw input)
    budget_ms = 90        # what is left of the SLO when the request reaches the server
    rate = 30             # req/s
    slo_ms = 150          # optional: the end-to-end SLO (default: the model's), what a
                          # client sending the raw input would give the server

A *segment* of a model is its blocks [start, end) as a model of its own (`segment`): its
latency tables and boundaries those blocks', its input the feature map entering block
`start`. Planning a segment is planning those blocks; serving it is serving the model's
block files from `start` on. Segments are named `<model>.<start>-<end>`.

`choose_entry` is Neurosurgeon's rule for a client: the entry block of the least estimated
end-to-end latency (the client's blocks, the upload, the server's blocks), within the SLO.
This module is pure: no files are read but the one named, nothing is timed."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from poolpipe.domain.profiles import LatencyTable, ModelProfile
from poolpipe.domain.tomlfile import read_toml
from poolpipe.errors import PoolpipeError


class EntrySpecError(PoolpipeError):
    """An entry-stream spec that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class EntryStream:
    """Requests of `model` entering at block `entry`, `budget_us` of their SLO left when
    they reach the server, at `rate` req/s; `slo_us`: their end-to-end SLO."""

    name: str
    model: str
    entry: int
    budget_us: float
    rate: float
    slo_us: float


def segment_name(model: str, start: int, end: int) -> str:
    """The name of blocks [start, end) of `model` as a model of their own."""
    return f"{model}.{start}-{end}"


@dataclass(frozen=True)
class Segment:
    """A plan's model that is blocks [start, end) of `model` (the warehouse's)."""

    model: str
    start: int
    end: int


def segment_record(profile: ModelProfile) -> dict | None:
    """What a plan records of a segment's profile (meta `segments`); None for a model."""
    base = profile.meta.get("segment_of")
    if not base:
        return None
    start, end = (int(x) for x in str(profile.meta["blocks"]).split("-"))
    return {"model": str(base), "start": start, "end": end}


def plan_segments(meta: Mapping) -> dict[str, Segment]:
    """The segments a plan's meta records: each plan model that is blocks of another."""
    out = {}
    for name, rec in (meta.get("segments") or {}).items():
        try:
            out[str(name)] = Segment(str(rec["model"]), int(rec["start"]), int(rec["end"]))
        except (KeyError, TypeError, ValueError):
            raise PoolpipeError(
                f"plan: segment {name!r} is recorded as {rec!r}; want model, start and end"
            ) from None
    return out


def segment(profile: ModelProfile, start: int, end: int) -> ModelProfile:
    """Blocks [start, end) of `profile` as a model of its own (segment_name): the tables'
    rows of those blocks, the boundaries between them, its input the feature map leaving
    block start - 1 (the model's input for start 0). Its GPU memory is the whole model's
    (an upper bound: the weights are not split by block)."""
    if not 0 <= start < end <= profile.num_blocks:
        raise PoolpipeError(
            f"model {profile.name}: blocks [{start}, {end}) are not a segment of its "
            f"{profile.num_blocks} blocks"
        )
    if start == 0 and end == profile.num_blocks:
        return profile
    tables = {
        key: LatencyTable(t.gpu, t.share, t.latency_us[start:end], t.source)
        for key, t in profile.tables.items()
    }
    return replace(
        profile,
        name=segment_name(profile.name, start, end),
        num_blocks=end - start,
        tables=tables,
        boundary_bytes=tuple(profile.boundary_bytes[start : end - 1]),
        reference_latency_us=None,
        slo_us=None,
        meta={**profile.meta, "segment_of": profile.name, "blocks": f"{start}-{end}"},
        input_bytes=profile.input_bytes if start == 0 else profile.boundary_bytes[start - 1],
    )


def parse_streams(
    data: Mapping, profiles: Mapping[str, ModelProfile], source: str = "streams"
) -> tuple[EntryStream, ...]:
    """The [[streams]] of a spec, checked against the models' profiles: a known model, an
    entry block it has, a budget and rate > 0, names unique."""
    rows = data.get("streams")
    if not isinstance(rows, list) or not rows:
        raise EntrySpecError(f"{source}: no [[streams]] table: name at least one stream")
    out: list[EntryStream] = []
    for i, row in enumerate(rows):
        what = f"{source}: stream {i + 1}"
        if not isinstance(row, Mapping):
            raise EntrySpecError(f"{what}: a table of model, entry, budget_ms and rate")
        unknown = sorted(set(row) - {"name", "model", "entry", "budget_ms", "rate", "slo_ms"})
        if unknown:
            raise EntrySpecError(
                f"{what}: unknown field(s) {', '.join(unknown)}; "
                "known: name, model, entry, budget_ms, rate, slo_ms"
            )
        model = row.get("model")
        if not isinstance(model, str) or model not in profiles:
            raise EntrySpecError(
                f"{what}: model {model!r} is not profiled; known: {', '.join(sorted(profiles))}"
            )
        profile = profiles[model]
        entry = row.get("entry", 0)
        if (
            not isinstance(entry, int)
            or isinstance(entry, bool)
            or not 0 <= entry < profile.num_blocks
        ):
            raise EntrySpecError(
                f"{what}: entry {entry!r}: a block of {model}, 0 (the raw input) to "
                f"{profile.num_blocks - 1}"
            )
        numbers = {}
        for key in ("budget_ms", "rate", "slo_ms"):
            value = row.get(key)
            if value is None and key == "slo_ms":
                continue
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not (value > 0 and math.isfinite(value))
            ):
                raise EntrySpecError(f"{what}: {key} must be a number > 0, got {value!r}")
            numbers[key] = float(value)
        slo_ms = numbers.get("slo_ms")
        if slo_ms is None:
            if profile.slo_us is None:
                raise EntrySpecError(f"{what}: {model} has no SLO of its own: give slo_ms")
            slo_ms = profile.slo_us / 1e3
        if numbers["budget_ms"] > slo_ms * (1 + 1e-9):
            raise EntrySpecError(
                f"{what}: budget_ms {numbers['budget_ms']:g} is more than its SLO of {slo_ms:g} ms"
            )
        name = row.get("name", f"{model}.e{entry}")
        if not isinstance(name, str) or not name:
            raise EntrySpecError(f"{what}: name must be a string")
        out.append(
            EntryStream(
                name, model, entry, numbers["budget_ms"] * 1e3, numbers["rate"], slo_ms * 1e3
            )
        )
    names = [s.name for s in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EntrySpecError(
            f"{source}: stream name(s) {', '.join(twice)} given twice: name each stream"
        )
    clash = sorted(set(names) & set(profiles))
    if clash:
        raise EntrySpecError(f"{source}: stream(s) {', '.join(clash)} named like a model: rename")
    return tuple(out)


def load_streams(path: str | Path, profiles: Mapping[str, ModelProfile]) -> tuple[EntryStream, ...]:
    """The entry streams of a TOML file (parse_streams)."""
    return parse_streams(
        read_toml(Path(path), "entry streams", EntrySpecError), profiles, str(path)
    )


Floats = Sequence[float] | np.ndarray  # per block


def choose_entry(
    client_us: Floats,
    upload_bytes: Floats,
    uplink_bytes_per_s: float,
    server_us: Floats,
    slo_us: float,
    margin: float = 0.0,
    entries: Sequence[int] | None = None,
) -> tuple[int, float]:
    """Neurosurgeon's rule: the entry block p whose estimate (the client's blocks [0, p),
    the upload of what enters block p, the server's blocks [p, N)) is least, and the budget
    left the server (the SLO less the client's part and the upload). `client_us[i]` and
    `server_us[i]`: block i's latency on the client and on the server; `upload_bytes[p]`:
    what a request sends entering at p (p = 0: the raw input); `margin`: the server's part
    counted as what a plan at that SLO margin needs (its blocks / (1 - margin)), so that
    the budget left can be planned; `entries`: the blocks to choose among (those a plan
    serves; default every block). Ties keep the earlier block.
    An error where no entry leaves the server its blocks' time within the SLO."""
    n = len(server_us)
    if len(client_us) != n or len(upload_bytes) != n:
        raise PoolpipeError("client, upload and server figures need one per block")
    if not uplink_bytes_per_s > 0:
        raise PoolpipeError(f"uplink: a rate > 0 bytes/s, got {uplink_bytes_per_s}")
    before = np.concatenate([[0.0], np.cumsum(client_us)])[:n]  # client time up to block p
    if not 0 <= margin < 1:
        raise PoolpipeError(f"margin: in [0, 1), got {margin}")
    server = np.asarray(server_us, dtype=float) / (1 - margin)
    after = np.cumsum(server[::-1])[::-1]  # server from p on
    upload = np.asarray(upload_bytes, dtype=float) / uplink_bytes_per_s * 1e6
    total = before + upload + after
    if entries is not None:
        if not entries or any(not 0 <= e < n for e in entries):
            raise PoolpipeError(f"entries: blocks 0 to {n - 1}, got {list(entries)}")
        total[np.setdiff1d(np.arange(n), np.asarray(entries, dtype=int))] = np.inf
    ok = np.nonzero(total <= slo_us)[0]
    if not len(ok):
        raise PoolpipeError(
            f"no entry block fits the SLO of {slo_us / 1e3:g} ms: the least estimate is "
            f"{total.min() / 1e3:.3g} ms (entry {int(total.argmin())})"
            if np.isfinite(total.min())
            else "no entry block to choose"
        )
    p = int(ok[np.argmin(total[ok])])
    return p, float(slo_us - before[p] - upload[p])
