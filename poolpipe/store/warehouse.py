"""DuckDB warehouse: connect, migrate, and read/write profiles, clusters, plans and results.

The SQL lives in `warehouse/migrations/vNNNN_*.sql`, applied in order and recorded in
`schema_version`. A file of another schema version is refused with the command that fixes
it. Every write that spans several rows runs in one transaction: all or nothing.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np

from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import (
    DEFAULT_CALL_OVERHEAD_US,
    DEFAULT_SLO_SCALE,
    LatencyTable,
    ModelProfile,
    ServedReference,
)
from poolpipe.errors import ProfileError, UnknownNameError, WarehouseBusyError, WarehouseError

if TYPE_CHECKING:  # the ONNX side is imported only where it is used
    from poolpipe.offline.engines import EngineInfo
    from poolpipe.offline.profiler import Measurement
    from poolpipe.offline.split import SplitResult

ENV_VAR = "POOLPIPE_WAREHOUSE"
REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "warehouse" / "migrations"
_MIGRATION_RE = re.compile(r"v(\d{4})_([a-z0-9_]+)\.sql$")


def default_path() -> Path:
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else REPO_ROOT / "warehouse" / "poolpipe.duckdb"


def migrations() -> list[tuple[int, str, Path]]:
    found = []
    for path in sorted(MIGRATIONS_DIR.glob("v*.sql")):
        m = _MIGRATION_RE.search(path.name)
        if m:
            found.append((int(m.group(1)), m.group(2), path))
    if not found:
        raise WarehouseError(f"no migrations found in {MIGRATIONS_DIR}")
    return found


LATEST_VERSION = migrations()[-1][0]


def _now() -> datetime:
    return datetime.now().replace(microsecond=0)


_MODEL_TABLES = (
    "block_latency",
    "model_latency",
    "block_boundaries",
    "blocks",
    "model_files",
    "models",
)


def _delete_models(con: duckdb.DuckDBPyConnection, names: list[str]) -> None:
    for table in _MODEL_TABLES:
        key = "name" if table == "models" else "model"
        con.execute(f"DELETE FROM {table} WHERE {key} IN (SELECT unnest($1))", [names])


def _insert_measurements(
    con: duckdb.DuckDBPyConnection,
    model: str,
    info: EngineInfo,
    measurements: Sequence[Measurement],
    share: int,
    settings: dict[str, Any] | None,
    now: datetime,
) -> None:
    from poolpipe.offline.profiler import WHOLE

    prov = json.dumps({**info.provenance(), **(settings or {}), "date": now.isoformat()})
    source = f"{info.engine}-profile"
    con.execute(
        "INSERT OR IGNORE INTO gpu_types VALUES (?, ?)",
        [info.device, f"{info.device_detail} ({info.engine})"],
    )
    for table, rows in (
        ("block_latency", [m for m in measurements if m.block != WHOLE]),
        ("model_latency", [m for m in measurements if m.block == WHOLE]),
    ):
        cols: dict[str, list] = {"model": [model] * len(rows)}
        if table == "block_latency":
            cols["block_index"] = [m.block for m in rows]
        cols |= {
            "gpu_type": [info.device] * len(rows),
            "share": [share] * len(rows),
            "batch": [m.batch for m in rows],
            "latency_us": [m.median_us for m in rows],
            "p99_us": [m.p99_us for m in rows],
            "source": [source] * len(rows),
            "provenance": [prov] * len(rows),
            "measured_at": [now] * len(rows),
        }
        _insert_columns(con, table, cols)


def _latency_columns(profiles: Sequence[ModelProfile], prov: str, now: datetime) -> dict[str, list]:
    """The block_latency rows of every table of `profiles`, as columns."""
    lat: dict[str, list] = {
        k: []
        for k in (
            "model",
            "block_index",
            "gpu_type",
            "share",
            "batch",
            "latency_us",
            "source",
            "provenance",
            "measured_at",
        )
    }
    for p in profiles:
        for (gpu, share), t in sorted(p.tables.items()):
            blocks, batches = np.meshgrid(
                np.arange(p.num_blocks), np.arange(1, t.max_batch + 1), indexing="ij"
            )
            n = blocks.size
            lat["model"] += [p.name] * n
            lat["block_index"] += blocks.ravel().tolist()
            lat["gpu_type"] += [gpu] * n
            lat["share"] += [share] * n
            lat["batch"] += batches.ravel().tolist()
            lat["latency_us"] += t.latency_us.ravel().tolist()
            lat["source"] += [t.source] * n
            lat["provenance"] += [prov] * n
            lat["measured_at"] += [now] * n
    return lat


def _boundary_columns(profiles: Sequence[ModelProfile]) -> dict[str, list]:
    """The block_boundaries rows of `profiles`, as columns."""
    bnd: dict[str, list] = {"model": [], "block_index": [], "bytes": []}
    for p in profiles:
        for i, b in enumerate(p.boundary_bytes):
            bnd["model"].append(p.name)
            bnd["block_index"].append(i)
            bnd["bytes"].append(b)
    return bnd


def _insert_columns(con: duckdb.DuckDBPyConnection, table: str, columns: dict[str, list]) -> None:
    """Bulk insert column lists (much faster than executemany)."""
    names = list(columns)
    if not columns[names[0]]:
        return
    select = ", ".join(f"unnest(${i + 1}) AS {n}" for i, n in enumerate(names))
    con.execute(
        f"INSERT INTO {table} ({', '.join(names)}) SELECT * FROM (SELECT {select})",
        [columns[n] for n in names],
    )


# How long opening the warehouse waits for another process's lock (s), unless told.
LOCK_WAIT_S = 10.0
WAIT_ENV_VAR = "POOLPIPE_WAREHOUSE_WAIT_S"


def lock_wait_s() -> float:
    text = os.environ.get(WAIT_ENV_VAR)
    if text is None:
        return LOCK_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise WarehouseError(f"${WAIT_ENV_VAR} must be seconds >= 0, got {text!r}")
    return value


def _is_lock_conflict(e: BaseException) -> bool:
    return isinstance(e, duckdb.IOException) and "lock" in str(e).lower()


def _connect(path: Path, wait_s: float) -> duckdb.DuckDBPyConnection:
    """A connection to `path`, waiting out another process's lock up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            return duckdb.connect(str(path))
        except duckdb.Error as e:
            if not _is_lock_conflict(e):
                raise WarehouseError(f"cannot open warehouse {path}: {e}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                holder = re.search(r"held in (.*?\(PID \d+\))", str(e))
                raise WarehouseBusyError(
                    f"warehouse {path} is in use by another process"
                    + (f" ({holder.group(1)})" if holder else "")
                    + f"; waited {wait_s:g} s. Try again when it is done, or wait longer "
                    f"(${WAIT_ENV_VAR})"
                ) from None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 1.0)


def spool_dir(path: Path) -> Path:
    """Where rows wait while the warehouse at `path` is busy (beside it, same disk)."""
    return path.with_name(path.name + ".spool")


def store_rows_durably(
    path: Path | str | None, table: str, rows: list[dict[str, Any]], wait_s: float | None = None
) -> bool:
    """store_tables_durably for one table."""
    return store_tables_durably(path, {table: rows}, wait_s)


def store_tables_durably(
    path: Path | str | None, tables: dict[str, list[dict[str, Any]]], wait_s: float | None = None
) -> bool:
    """Write rows to their tables, opening the warehouse once; if another process keeps it
    busy past `wait_s`, spool each table's rows to a file beside it (written atomically)
    that the next open writes in. True when written now, False when spooled: either way
    nothing is lost."""
    tables = {t: rows for t, rows in tables.items() if rows}
    if not tables:
        return True
    p = Path(path) if path is not None else default_path()
    try:
        with Warehouse.open(p, wait_s=wait_s) as wh:
            for table, rows in tables.items():
                wh.store_rows(table, rows)
        return True
    except WarehouseBusyError:
        pass
    folder = spool_dir(p)
    folder.mkdir(parents=True, exist_ok=True)
    for table, rows in tables.items():
        name = f"{time.time_ns():020d}-{os.getpid()}-{table}"
        tmp = folder / f"{name}.tmp"
        with tmp.open("w") as f:
            f.write(json.dumps({"table": table}) + "\n")
            for row in rows:
                f.write(json.dumps(row, default=_encode) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(folder / f"{name}.jsonl")
    return False


def _encode(v: Any) -> Any:
    if isinstance(v, datetime):
        return {"__datetime__": v.isoformat()}
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"cannot spool a {type(v).__name__}")


def _decode(v: Any) -> Any:
    if isinstance(v, dict) and "__datetime__" in v:
        return datetime.fromisoformat(v["__datetime__"])
    return v


def _read_spool(f: Path) -> tuple[str, list[dict[str, Any]]]:
    lines = f.read_text().splitlines()
    table = json.loads(lines[0])["table"]
    rows = [{k: _decode(v) for k, v in json.loads(line).items()} for line in lines[1:] if line]
    return table, rows


class Warehouse:
    """An open warehouse file. Use `Warehouse.open(path)`; close with `.close()` or `with`."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: Path):
        self.con = con
        self.path = path
        self.spool_problems: list[str] = []  # spooled files that could not be written

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(
        cls, path: Path | str | None = None, migrate: bool = False, wait_s: float | None = None
    ) -> Warehouse:
        """Open (creating a new file at the latest schema); refuse other schema versions.

        DuckDB lets one process at a time write a file: while another holds it, wait up to
        `wait_s` (default $POOLPIPE_WAREHOUSE_WAIT_S, else LOCK_WAIT_S) with backoff, then
        raise WarehouseBusyError naming the holder. Rows spooled by writers that found it
        busy (store_rows_durably) are written first thing once it opens."""
        path = Path(path) if path is not None else default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        con = _connect(path, lock_wait_s() if wait_s is None else wait_s)
        wh = cls(con, path)
        version = wh.schema_version()
        if version is None and not wh._has_tables():
            wh.migrate()
        elif version != LATEST_VERSION:
            if migrate and version is not None and version < LATEST_VERSION:
                wh.migrate()
            else:
                con.close()
                raise WarehouseError(wh._version_message(version))
        wh.replay_spool()
        return wh

    def replay_spool(self) -> int:
        """Write the rows spooled while the warehouse was busy (oldest first), each file in
        one transaction and removed after it; returns the rows written."""
        folder = spool_dir(self.path)
        if not folder.is_dir():
            return 0
        written = 0
        for f in sorted(folder.glob("*.jsonl")):
            try:
                table, rows = _read_spool(f)
                self.store_rows(table, rows)
            except Exception as e:
                # it is kept aside for a person to look at; the warehouse stays usable
                bad = f.with_suffix(".unreadable")
                f.rename(bad)
                self.spool_problems.append(f"{bad}: {type(e).__name__}: {e}")
                continue
            f.unlink()
            written += len(rows)
        return written

    def _version_message(self, version: int | None) -> str:
        if version is None:
            return (
                f"{self.path} is not a poolpipe warehouse (it has tables but no schema_version); "
                f"pass another --warehouse or move the file away"
            )
        if version > LATEST_VERSION:
            return (
                f"{self.path} has schema version {version}, newer than this poolpipe "
                f"({LATEST_VERSION}); upgrade poolpipe or use another --warehouse"
            )
        return (
            f"{self.path} has schema version {version}, this poolpipe needs {LATEST_VERSION}; "
            f"run: poolpipe --warehouse {self.path} warehouse migrate"
        )

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Warehouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _has_tables(self) -> bool:
        n = self.con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'main'"
        ).fetchone()
        return bool(n and n[0])

    def schema_version(self) -> int | None:
        exists = self.con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_version'"
        ).fetchone()
        if not exists or not exists[0]:
            return None
        row = self.con.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def migrate(self) -> list[int]:
        """Apply every migration newer than the file's version; returns those applied."""
        current = self.schema_version()
        applied = []
        with self.transaction():
            if current is None:
                self.con.execute(
                    "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, "
                    "name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)"
                )
                current = 0
            for version, name, path in migrations():
                if version <= current:
                    continue
                self.con.execute(path.read_text())
                self.con.execute(
                    "INSERT INTO schema_version VALUES (?, ?, ?)", [version, name, _now()]
                )
                applied.append(version)
        return applied

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self.con.execute("BEGIN TRANSACTION")
        try:
            yield self.con
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        self.con.execute("COMMIT")

    # ------------------------------------------------------------------ profiles

    def store_profiles(
        self, profiles: Sequence[ModelProfile], provenance: dict[str, Any] | None = None
    ) -> None:
        """Replace everything stored for these models (idempotent), in one transaction."""
        now = _now()
        prov = json.dumps(provenance or {"host": socket.gethostname()})
        names = [p.name for p in profiles]
        gpus = sorted({g for p in profiles for g in p.gpus})
        lat = _latency_columns(profiles, prov, now)
        bnd = _boundary_columns(profiles)
        with self.transaction() as con:
            _delete_models(con, names)
            for g in gpus:
                con.execute("INSERT OR IGNORE INTO gpu_types (name) VALUES (?)", [g])
            for p in profiles:
                con.execute(
                    "INSERT INTO models (name, num_blocks, reference_latency_us, slo_us, source,"
                    " updated_at, input_bytes, weight_bytes, activation_bytes)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        p.name,
                        p.num_blocks,
                        p.reference_latency_us,
                        p.slo_us,
                        p.meta.get("source", "unknown"),
                        now,
                        p.input_bytes,
                        p.weight_bytes,
                        p.activation_bytes,
                    ],
                )
                _insert_columns(
                    con,
                    "blocks",
                    {
                        "model": [p.name] * p.num_blocks,
                        "block_index": list(range(p.num_blocks)),
                    },
                )
            _insert_columns(con, "block_latency", lat)
            _insert_columns(con, "block_boundaries", bnd)

    # ------------------------------------------------------------------ onboarding

    def store_onboarding(
        self,
        split: SplitResult,
        info: EngineInfo,
        measurements: Sequence[Measurement],
        *,
        verify_errors: tuple[float, float],
        slo_us: float | None = None,
        settings: dict[str, Any] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Replace everything stored for `split.model` by a fresh onboarding: the model (its
        reference latency is the whole model's batch-1 median here; SLO given or
        DEFAULT_SLO_SCALE x the model as served: that, a stage call and the reply margin at
        their defaults, ServedReference), blocks, boundaries, latencies, files. One transaction;
        `before_commit` runs inside it (publishing the block files), so that a failure
        anywhere leaves the warehouse as it was."""
        from poolpipe.offline.profiler import WHOLE

        ref = next((m.median_us for m in measurements if m.block == WHOLE and m.batch == 1), None)
        part = split.partitioning
        now = _now()
        with self.transaction() as con:
            _delete_models(con, [split.model])
            con.execute(
                "INSERT INTO models (name, num_blocks, reference_latency_us, slo_us, source,"
                " updated_at, weight_bytes, activation_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    split.model,
                    len(split.blocks),
                    ref,
                    slo_us if slo_us is not None else _default_slo_us(ref),
                    f"onboard:{split.source}",
                    now,
                    split.weight_bytes,
                    split.activation_bytes,
                ],
            )
            _insert_columns(
                con,
                "blocks",
                {
                    "model": [split.model] * len(split.blocks),
                    "block_index": [b.index for b in split.blocks],
                    "name": [b.first_layer for b in split.blocks],
                    "onnx_path": [str(b.path) for b in split.blocks],
                    "layer_start": [b.layer_start for b in split.blocks],
                    "layer_end": [b.layer_end for b in split.blocks],
                    "inputs": [list(b.inputs) for b in split.blocks],
                    "outputs": [list(b.outputs) for b in split.blocks],
                },
            )
            _insert_columns(
                con,
                "block_boundaries",
                {
                    "model": [split.model] * (len(split.blocks) - 1),
                    "block_index": [b.index for b in split.blocks[:-1]],
                    "bytes": [b.out_bytes for b in split.blocks[:-1]],
                },
            )
            con.execute(
                "INSERT INTO model_files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    split.model,
                    str(split.source),
                    split.sha256,
                    str(split.folder),
                    split.layers,
                    part.method,
                    part.policy.max_tensors,
                    part.balance,
                    verify_errors[0],
                    verify_errors[1],
                    now,
                ],
            )
            _insert_measurements(con, split.model, info, measurements, 1, settings, now)
            if before_commit is not None:
                before_commit()

    def store_measurements(
        self,
        model: str,
        info: EngineInfo,
        measurements: Sequence[Measurement],
        *,
        share: int = 1,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """Replace the latencies of `model` on `info.device` at `share` (one transaction)."""
        self.onboarded_blocks(model)  # the model must be onboarded
        with self.transaction() as con:
            for table in ("block_latency", "model_latency"):
                con.execute(
                    f"DELETE FROM {table} WHERE model = ? AND gpu_type = ? AND share = ?",
                    [model, info.device, share],
                )
            _insert_measurements(con, model, info, measurements, share, settings, _now())

    def store_device_tables(self, profile: ModelProfile, provenance: dict[str, Any]) -> None:
        """Give an onboarded model (a shadow: poolpipe.offline.shadow) the device tables,
        boundary sizes, reference latency and SLO of an imported profile of the same blocks,
        replacing its tables for those devices (one transaction)."""
        blocks = self.onboarded_blocks(profile.name)
        if len(blocks) != profile.num_blocks:
            raise ProfileError(
                f"model {profile.name}: onboarded with {len(blocks)} blocks, but its profile "
                f"has {profile.num_blocks}; onboard its shadow (same blocks) first"
            )
        now = _now()
        lat = _latency_columns([profile], json.dumps(provenance), now)
        with self.transaction() as con:
            for gpu, share in profile.tables:
                con.execute("INSERT OR IGNORE INTO gpu_types (name) VALUES (?)", [gpu])
                con.execute(
                    "DELETE FROM block_latency WHERE model = ? AND gpu_type = ? AND share = ?",
                    [profile.name, gpu, share],
                )
            _insert_columns(con, "block_latency", lat)
            con.execute("DELETE FROM block_boundaries WHERE model = ?", [profile.name])
            _insert_columns(con, "block_boundaries", _boundary_columns([profile]))
            con.execute(
                "UPDATE models SET reference_latency_us = ?, slo_us = ?, source = ?,"
                " input_bytes = coalesce(?, input_bytes),"
                " weight_bytes = coalesce(?, weight_bytes),"
                " activation_bytes = coalesce(?, activation_bytes) WHERE name = ?",
                [
                    profile.reference_latency_us,
                    profile.slo_us,
                    f"shadow of {profile.meta.get('source', 'profile')}",
                    profile.input_bytes,
                    profile.weight_bytes,
                    profile.activation_bytes,
                    profile.name,
                ],
            )

    def onboarded_blocks(self, model: str) -> list[Path]:
        """The block files of an onboarded model, in order."""
        rows = self.con.execute(
            "SELECT onnx_path FROM blocks WHERE model = ? ORDER BY block_index", [model]
        ).fetchall()
        if not rows or any(r[0] is None for r in rows):
            if model not in self.model_names():
                self.load_profile(model)  # raises with the known names
            raise UnknownNameError(
                f"model {model!r} in {self.path} has no block files (imported profiles only); "
                f"onboard it with: poolpipe onboard MODEL.onnx --name {model}"
            )
        return [Path(r[0]) for r in rows]

    def block_layers(self, model: str) -> list[tuple[int, int]]:
        """Layer range [start, end) of every block of an onboarded model, in order."""
        self.onboarded_blocks(model)
        return [
            (int(a), int(b))
            for a, b in self.con.execute(
                "SELECT layer_start, layer_end FROM blocks WHERE model = ? ORDER BY block_index",
                [model],
            ).fetchall()
        ]

    def whole_model_file(self, model: str) -> Path | None:
        from poolpipe.offline.split import WHOLE_FILE

        row = self.con.execute(
            "SELECT blocks_dir FROM model_files WHERE model = ?", [model]
        ).fetchone()
        return Path(row[0]) / WHOLE_FILE if row else None

    def model_names(self) -> list[str]:
        return [r[0] for r in self.con.execute("SELECT name FROM models ORDER BY name").fetchall()]

    def measured_reply_margin_us(
        self, models: Sequence[str] = (), any_model: bool = True
    ) -> float | None:
        """What the router serving from this warehouse last measured of the reply's way out
        (its reply margin beyond its floor, µs), or None where none has written it. Given
        `models`: the largest of what routers last measured while serving each of them (a
        reply's way out grows with its outputs), what any router last measured where none
        served them (unless not `any_model`)."""
        return self._last_measured("reply_measured_ms", models, any_model=any_model)

    def measured_call_overhead_us(self, models: Sequence[str]) -> float | None:
        """What a stage call on the nodes took beyond its blocks' profiled run, as routers
        last measured while serving each of `models` (µs, the largest), or None where none
        served them (it depends on the models' devices and tensors: another's says nothing)."""
        return self._last_measured("call_overhead_ms", models, any_model=False)

    def _last_measured(self, column: str, models: Sequence[str], any_model: bool) -> float | None:
        measured = f"{column} IS NOT NULL"
        if models:
            row = self.con.execute(
                f"SELECT max(ms) FROM (SELECT arg_max({column}, minute) AS ms "
                f"FROM serving_stats WHERE {measured} AND model IN "
                f"({', '.join('?' * len(models))}) GROUP BY model)",
                list(models),
            ).fetchone()
            if row and row[0] is not None:
                return float(row[0]) * 1e3
        if not any_model:
            return None
        row = self.con.execute(
            f"SELECT {column} FROM serving_stats WHERE {measured} ORDER BY minute DESC LIMIT 1"
        ).fetchone()
        return float(row[0]) * 1e3 if row else None

    def model_origin(self, model: str) -> tuple[str, datetime] | None:
        """Where `model`'s entry came from (onboard:<file>, an import, ...) and when."""
        row = self.con.execute(
            "SELECT source, updated_at FROM models WHERE name = ?", [model]
        ).fetchone()
        return (str(row[0]), row[1]) if row else None

    def plans_using(self, model: str) -> list[int]:
        """Ids of the stored plans that serve `model`, oldest first."""
        rows = self.con.execute(
            "SELECT plan_id FROM plan_models WHERE model = ? ORDER BY plan_id", [model]
        ).fetchall()
        return [int(r[0]) for r in rows]

    def outdated_models(self, plan_id: int) -> list[tuple[str, datetime]]:
        """The models of plan `plan_id` onboarded again after it was made (their blocks may
        differ from those it was planned on), with when."""
        rows = self.con.execute(
            "SELECT m.name, m.updated_at FROM plan_models pm JOIN plans p USING (plan_id) "
            "JOIN models m ON m.name = pm.model WHERE pm.plan_id = ? "
            "AND m.updated_at > p.created_at AND m.source LIKE 'onboard:%' ORDER BY m.name",
            [plan_id],
        ).fetchall()
        return [(str(r[0]), r[1]) for r in rows]

    def load_profile(self, name: str) -> ModelProfile:
        row = self.con.execute(
            "SELECT num_blocks, reference_latency_us, slo_us, source, input_bytes, weight_bytes,"
            " activation_bytes FROM models WHERE name = ?",
            [name],
        ).fetchone()
        if row is None:
            known = self.model_names()
            hint = (
                f"known: {', '.join(known)}"
                if known
                else "the warehouse has no models yet; run: poolpipe profiles import-ppipe "
                "../shared/profiles/ppipe-gpu"
            )
            raise UnknownNameError(f"model {name!r} is not in warehouse {self.path}; {hint}")
        num_blocks, ref, slo, source, input_bytes, weight_bytes, activation_bytes = row
        rows = self.con.execute(
            "SELECT gpu_type, share, block_index, batch, latency_us, source FROM block_latency "
            "WHERE model = ? ORDER BY gpu_type, share, block_index, batch",
            [name],
        ).fetchall()
        grouped: dict[tuple[str, int], list[tuple[int, int, float, str]]] = {}
        for gpu, share, bi, b, lat_us, src in rows:
            grouped.setdefault((gpu, share), []).append((bi, b, lat_us, src))
        tables = {}
        for (gpu, share), cells in grouped.items():
            max_b = max(c[1] for c in cells)
            arr = np.full((num_blocks, max_b), np.nan)
            for bi, b, lat_us, _ in cells:
                arr[bi, b - 1] = lat_us
            # Keep only batch sizes measured for every block.
            complete = ~np.isnan(arr).any(axis=0)
            n_ok = int(np.argmin(complete)) if not complete.all() else max_b
            if n_ok == 0:
                continue
            tables[(gpu, share)] = LatencyTable(gpu, share, arr[:, :n_ok], source=cells[0][3])
        boundary = [
            r[0]
            for r in self.con.execute(
                "SELECT bytes FROM block_boundaries WHERE model = ? ORDER BY block_index", [name]
            ).fetchall()
        ]
        return ModelProfile(
            name=name,
            num_blocks=num_blocks,
            tables=tables,
            boundary_bytes=tuple(boundary),
            reference_latency_us=ref,
            slo_us=slo,
            meta={"source": source},
            input_bytes=input_bytes,
            weight_bytes=weight_bytes,
            activation_bytes=activation_bytes,
        )

    def profile_summary(self) -> list[tuple]:
        return self.con.execute(
            """SELECT m.name, m.num_blocks, m.reference_latency_us, m.slo_us,
                      string_agg(DISTINCT l.gpu_type, ',' ORDER BY l.gpu_type),
                      count(DISTINCT (l.gpu_type, l.share)), count(l.latency_us), m.source
               FROM models m LEFT JOIN block_latency l ON l.model = m.name
               GROUP BY ALL ORDER BY m.name"""
        ).fetchall()

    # ------------------------------------------------------------------ clusters

    def store_clusters(self, clusters: Sequence[Cluster], source: str) -> None:
        with self.transaction() as con:
            for c in clusters:
                con.execute("DELETE FROM cluster_pools WHERE cluster = ?", [c.name])
                con.execute("DELETE FROM clusters WHERE name = ?", [c.name])
                con.execute(
                    "INSERT INTO clusters (name, bandwidth_gbps, source, mixed_model_interference) "
                    "VALUES (?, ?, ?, ?)",
                    [c.name, c.bandwidth_gbps, source, c.mixed_model_interference],
                )
                for p in c.pools:
                    con.execute(
                        "INSERT INTO cluster_pools (cluster, gpu_type, count, gpus_per_server, "
                        "shares, price_per_hour, memory_gb) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        [
                            c.name,
                            p.gpu,
                            p.count,
                            p.gpus_per_server,
                            list(p.shares),
                            p.price_per_hour,
                            p.memory_gb,
                        ],
                    )

    def load_cluster(self, name: str) -> Cluster:
        row = self.con.execute(
            "SELECT bandwidth_gbps, mixed_model_interference FROM clusters WHERE name = ?", [name]
        ).fetchone()
        if row is None:
            known = [
                r[0] for r in self.con.execute("SELECT name FROM clusters ORDER BY 1").fetchall()
            ]
            raise UnknownNameError(
                f"cluster {name!r} is not in warehouse {self.path} (known: {known or 'none'}); "
                "pass --clusters-file FILE.toml or import one"
            )
        pools = tuple(
            GpuPool(gpu, count, gps, tuple(shares), price, memory)
            for gpu, count, gps, shares, price, memory in self.con.execute(
                "SELECT gpu_type, count, gpus_per_server, shares, price_per_hour, memory_gb "
                "FROM cluster_pools "
                "WHERE cluster = ? ORDER BY rowid",
                [name],
            ).fetchall()
        )
        return Cluster(
            name=name, bandwidth_gbps=row[0], pools=pools, mixed_model_interference=row[1]
        )

    # ------------------------------------------------------------------ plans

    def plan_id_of(self, plan: Plan) -> int | None:
        """The id of a stored plan identical to `plan` (the same JSON), if any: a plan file
        served or rolled out again is the plan stored the first time, not a new one."""
        row = self.con.execute(
            "SELECT min(plan_id) FROM plans WHERE plan_json = ?", [plan.to_json()]
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def stored_plan_id(self, plan: Plan, label: str | None = None) -> int:
        """`plan`'s id: the one it was stored under before (plan_id_of), else a new one."""
        known = self.plan_id_of(plan)
        return known if known is not None else self.store_plan(plan, label)

    def store_plan(self, plan: Plan, label: str | None = None) -> int:
        """Store a plan as rows (models, pipelines, partitions) plus its JSON; returns its id."""
        s = plan.solver
        with self.transaction() as con:
            run = con.execute(
                """INSERT INTO solver_runs (started_at, solver, status, gap, seconds, milp_seconds,
                   num_vars, num_integer, num_rows, candidates, feasible_configs)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING run_id""",
                [
                    _now(),
                    s.name,
                    s.status,
                    s.gap if np.isfinite(s.gap) else None,
                    s.seconds,
                    s.milp_seconds,
                    s.num_vars,
                    s.num_integer,
                    s.num_rows,
                    s.candidates,
                    s.feasible_configs,
                ],
            ).fetchone()
            assert run is not None  # RETURNING always yields the row
            pid = con.execute(
                """INSERT INTO plans (created_at, strategy, packing, cluster, margin,
                   max_partitions,
                   objective, solver_run_id, label, plan_json, deliverable)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING plan_id""",
                [
                    _now(),
                    plan.strategy,
                    plan.packing,
                    plan.cluster.name,
                    plan.margin,
                    plan.max_partitions,
                    plan.objective,
                    run[0],
                    label,
                    plan.to_json(),
                    plan.deliverable,
                ],
            ).fetchone()
            assert pid is not None
            plan_id = int(pid[0])
            for pos, m in enumerate(plan.models):
                con.execute(
                    "INSERT INTO plan_models VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        plan_id,
                        m.name,
                        pos,
                        m.weight,
                        m.slo_us,
                        m.est_throughput,
                        m.throughput,
                        m.deliverable,
                    ],
                )
                for pi, p in enumerate(m.pipelines):
                    con.execute(
                        "INSERT INTO plan_pipelines VALUES (?, ?, ?, ?, ?, ?)",
                        [plan_id, m.name, pi, p.batch, p.latency_us, p.throughput],
                    )
                    for d, q in enumerate(p.partitions):
                        con.execute(
                            "INSERT INTO plan_partitions VALUES "
                            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            [
                                plan_id,
                                m.name,
                                pi,
                                d,
                                q.start,
                                q.end,
                                q.gpu,
                                q.share,
                                q.vgpus,
                                q.gpus,
                                q.latency_us,
                                q.transfer_us,
                                q.vgpu_throughput,
                            ],
                        )
        return plan_id

    def load_plan(self, plan_id: int) -> Plan:
        row = self.con.execute(
            "SELECT plan_json FROM plans WHERE plan_id = ?", [plan_id]
        ).fetchone()
        if row is None:
            raise UnknownNameError(f"no plan with id {plan_id} in {self.path}")
        return Plan.from_dict(json.loads(row[0]))

    # ------------------------------------------------------------------ benchmarks

    def store_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self.transaction() as con:
            _insert_columns(con, table, {k: [r[k] for r in rows] for k in rows[0]})


def _default_slo_us(ref: float | None) -> float | None:
    """An onboarded model's SLO where none is given: DEFAULT_SLO_SCALE x the model as served
    (its run, a stage call and the reply margin at their defaults)."""
    from poolpipe.runtime.intake import DEFAULT_REPLY_MARGIN_US

    if not ref:
        return None
    served = ServedReference(ref, DEFAULT_CALL_OVERHEAD_US, DEFAULT_REPLY_MARGIN_US)
    return served.slo_us(DEFAULT_SLO_SCALE)
