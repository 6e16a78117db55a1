"""What a flow run on a worker must be told, and the errors that name the missing setting.

A deployment's run happens on a worker, on a host the deploying machine knows nothing of: the
code location, the warehouse and the router address are the worker's settings
(environment variables where the worker starts, or the work pool's job variables `env`), or
the run's parameters. Nothing is taken from the machine that ran `prefect deploy`, and a
worker never creates an empty warehouse next to the code.

Run in-process (the `poolpipe` CLI, tests on Prefect's ephemeral API) the local defaults apply.
"""

from __future__ import annotations

import os
from pathlib import Path

from poolpipe.errors import PoolpipeError

HOME_VAR = "POOLPIPE_HOME"
WAREHOUSE_VAR = "POOLPIPE_WAREHOUSE"
ROUTER_VAR = "POOLPIPE_ROUTER"


class SettingError(PoolpipeError):
    """A setting a flow run needs is missing or wrong."""


def in_deployment() -> bool:
    """Whether this flow run belongs to a deployment (a worker runs it)."""
    from prefect.runtime import deployment

    return deployment.id is not None


def code_location(directory: str | None = None) -> dict[str, str]:
    """Pull step (prefect.yaml): enter poolpipe's code on this worker's host: `directory`, or
    $POOLPIPE_HOME of the worker. Read on the worker when the run starts, never when
    deploying."""
    where = directory or os.environ.get(HOME_VAR, "")
    if not where:
        raise SettingError(
            f"{HOME_VAR} is not set on this worker: start the worker with {HOME_VAR} set to "
            "the folder of poolpipe's code on this host (the checkout holding flows/ and "
            f"prefect.yaml), e.g. '{HOME_VAR}=/opt/poolpipe prefect worker start --pool cpu', "
            "or set it in the work pool's job variables (env)"
        )
    path = Path(where).expanduser()
    if not (path / "flows").is_dir():
        raise SettingError(
            f"{HOME_VAR}={where} on this worker is not poolpipe's code (no flows/ folder "
            "there); point it at the checkout on this host"
        )
    os.chdir(path)
    return {"directory": str(path)}


def warehouse(given: str | None) -> str | None:
    """The warehouse a run uses: the parameter, else $POOLPIPE_WAREHOUSE. On a worker one of
    them must name an existing warehouse file; locally the default file is used (and made)."""
    where = given or os.environ.get(WAREHOUSE_VAR) or None
    if not in_deployment():
        return where
    if where is None:
        raise SettingError(
            f"no warehouse for this run: pass the parameter 'warehouse' or set {WAREHOUSE_VAR} "
            "where the worker starts (or in the work pool's job variables, env) to the "
            "warehouse file of this cluster; a worker does not create an empty one"
        )
    if not Path(where).is_file():
        raise SettingError(
            f"warehouse {where} (from {'the parameter' if given else WAREHOUSE_VAR}) does not "
            "exist on this worker's host; a worker does not create an empty warehouse: "
            "point it at the cluster's warehouse file (create one with "
            "'poolpipe warehouse info --warehouse FILE' on the control host)"
        )
    return where


def router(given: str | None) -> str:
    """The router's control address (host:gRPC port): the parameter, else $POOLPIPE_ROUTER."""
    where = (given or os.environ.get(ROUTER_VAR) or "").strip()
    if not where or "{{" in where:
        raise SettingError(
            f"no router address for this run: pass the parameter 'router' (host:grpc-port) or "
            f"set {ROUTER_VAR} where the worker starts (or in the work pool's job variables)"
        )
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise SettingError(f"router address {where!r} is not host:port (e.g. 10.0.0.5:8001)")
    return where
