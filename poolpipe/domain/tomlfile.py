"""Reading the project's TOML files (clusters, inventories, applications): errors that name
the file and the field, one way for all of them."""

from __future__ import annotations

import tomllib
from pathlib import Path

from poolpipe.errors import PoolpipeError


def read_toml(path: Path, what: str, error: type[PoolpipeError]) -> dict:
    """The parsed file; `error` naming it where it is missing or not TOML."""
    if not path.is_file():
        raise error(f"{path}: {what} file is missing")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path}: not valid TOML ({e})") from None


def need(table: dict, key: str, what: str, source: str, kind: type, error: type[PoolpipeError]):
    """table[key] as `kind` (an int is taken for a float, a bool for neither)."""
    if key not in table:
        raise error(f"{source}: {what} has no {key!r}")
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise error(f"{source}: {what}: {key} = {value!r} is not a {kind.__name__}")
    return value


def only_known(
    table: dict, keys: set[str], what: str, source: str, error: type[PoolpipeError]
) -> None:
    """`error` naming the keys of `table` not among `keys` (a typo, most often)."""
    extra = sorted(set(table) - keys)
    if extra:
        raise error(
            f"{source}: {what}: unknown key(s) {', '.join(extra)} "
            f"(known: {', '.join(sorted(keys))})"
        )
