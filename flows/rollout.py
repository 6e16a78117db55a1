"""Roll a plan out to a running router: pipeline-flush migration done by the router (load
new partition models while the old serve, pause, flush, switch, resume, unload); this flow
stores the plan, asks the router over its control model and reports the result."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows.common import artifact_key, io_error_only, markdown_table
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.store.plan_inputs import check_plan
from poolpipe.store.warehouse import Warehouse


@task(name="store-plan", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def resolve_plan(warehouse: str | None, plan: str) -> int:
    """A plan id in the warehouse, or a plan JSON file (stored, to get an id)."""
    if plan.isdigit():
        with Warehouse.open(warehouse) as wh:
            check_plan(wh, wh.load_plan(int(plan)), f"plan {plan}", int(plan))
        return int(plan)
    path = Path(plan)
    if not path.is_file():
        raise PoolpipeError(f"plan {plan!r} is neither a plan id nor a plan file")
    loaded = Plan.load(path)
    with Warehouse.open(warehouse) as wh:  # stored only once it passes
        return wh.stored_plan_id(check_plan(wh, loaded, str(path)), label=f"rollout:{path.name}")


@task(name="router-accepts", cache_policy=NO_CACHE)
def router_accepts(router: str, token_file: str | None = None) -> None:
    """The router answers and takes this token, before anything is stored."""
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from

    answer = send_control(router, {"op": "health"}, timeout_s=30, token=token_from(token_file))
    if not answer.get("ok"):
        raise PoolpipeError(f"router {router}: {answer.get('error', answer)}")


@task(name="switch", cache_policy=NO_CACHE)
def switch(router: str, plan_id: int, token_file: str | None = None, force: bool = False) -> dict:
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from

    command = {"op": "rollout", "plan_id": plan_id, "force": force}
    return send_control(router, command, token=token_from(token_file))


@flow(name="rollout", log_prints=True)
def rollout_plan(
    plan: str,
    router: str | None = None,
    warehouse: str | None = None,
    token_file: str | None = None,
    force: bool = False,
) -> dict:
    """Roll PLAN (id or JSON file) out to the router at ROUTER (its gRPC host:port; default
    $POOLPIPE_ROUTER), with the router's token from TOKEN_FILE (default
    $POOLPIPE_TOKEN_FILE of the worker; the token itself is never a parameter). The router
    refuses a plan whose SLO, less its measured reply margin, is shorter than the plan's
    fastest pipeline; FORCE rolls it out anyway (logged)."""
    router, warehouse = worker.router(router), worker.warehouse(warehouse)
    router_accepts(router, token_file)  # a refused token stores nothing
    plan_id = resolve_plan(warehouse, plan)
    result = switch(router, plan_id, token_file, force)
    rows = [[k, v] for k, v in result.items() if k != "ok"]
    create_markdown_artifact(
        key=artifact_key("rollout", str(plan_id)),
        description=f"rollout of plan {plan_id}: {result.get('status')}",
        markdown=f"# rollout of plan {plan_id}\n\n" + markdown_table(["", ""], rows),
    )
    if not result.get("ok"):
        raise PoolpipeError(
            f"rollout of plan {plan_id} {result.get('status') or 'did not happen'}: "
            f"{result.get('reason') or result.get('error') or json.dumps(result)}"
        )
    return result
