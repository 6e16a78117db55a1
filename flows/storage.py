"""The exchange between the warehouse's host and workers on other hosts: files and small JSON
documents under an fsspec location the operator configures (the `storage` parameter or
$POOLPIPE_STORAGE: a local or mounted folder, `s3://bucket/prefix`, `gs://...`, any fsspec
URL both sides reach). Default: `exchange/` beside the warehouse file, which serves workers on
the warehouse's own host only."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flows.settings import SettingError

STORAGE_VAR = "POOLPIPE_STORAGE"


def location(given: str | None, warehouse_path: Path | None = None) -> str:
    where = given or os.environ.get(STORAGE_VAR) or ""
    if where:
        return where
    if warehouse_path is None:
        raise SettingError(
            f"no exchange storage for this run: pass the parameter 'storage' or set "
            f"{STORAGE_VAR} (an fsspec URL or a folder both hosts reach)"
        )
    return str(warehouse_path.parent / "exchange")


def _fs(url: str):
    from fsspec.core import url_to_fs

    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise SettingError(f"exchange storage {url!r} cannot be used: {exc}") from None


def put_files(url: str, prefix: str, files: Sequence[Path]) -> list[str]:
    """Copy `files` under `prefix/`; their keys, in order."""
    fs, root = _fs(url)
    keys = []
    for f in files:
        key = f"{prefix}/{f.name}"
        fs.makedirs(f"{root}/{prefix}", exist_ok=True)
        fs.put_file(str(f), f"{root}/{key}")
        keys.append(key)
    return keys


def get_files(url: str, keys: Sequence[str], dest: Path) -> list[Path]:
    """Fetch `keys` into `dest` (file names kept); the local paths, in order."""
    fs, root = _fs(url)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for key in keys:
        local = dest / Path(key).name
        try:
            fs.get_file(f"{root}/{key}", str(local))
        except FileNotFoundError:
            raise SettingError(
                f"{key} is not in the exchange storage {url}: does this worker reach the same "
                f"storage as the warehouse's host? ({STORAGE_VAR} or the 'storage' parameter)"
            ) from None
        out.append(local)
    return out


def put_json(url: str, key: str, doc: Any) -> None:
    fs, root = _fs(url)
    fs.makedirs(f"{root}/{Path(key).parent}", exist_ok=True)
    with fs.open(f"{root}/{key}", "w") as f:
        json.dump(doc, f)


def get_json(url: str, key: str) -> Any:
    fs, root = _fs(url)
    with fs.open(f"{root}/{key}", "r") as f:
        return json.load(f)


def remove(url: str, prefix: str) -> None:
    fs, root = _fs(url)
    if fs.exists(f"{root}/{prefix}"):
        fs.rm(f"{root}/{prefix}", recursive=True)
