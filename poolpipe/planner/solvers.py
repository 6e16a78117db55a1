"""A minimal MILP container and its back ends: HiGHS (default, open source) and Gurobi.

The formulation code fills a `Milp` (variables, rows, maximisation); a back end solves it and
returns a `MilpResult`. Nothing here knows about pipelines.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from poolpipe.errors import SolverError

SOLVERS = ("highs", "gurobi")
DEFAULT_MIP_GAP = 1e-4
DEFAULT_TIME_LIMIT_S = 60.0


@dataclass
class Milp:
    """maximize c·x  s.t.  row_lower <= A x <= row_upper,  lower <= x <= upper."""

    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)

    @property
    def num_vars(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    @property
    def num_integer(self) -> int:
        return sum(self.integer)

    def add_var(
        self, lower: float = 0.0, upper: float = math.inf, cost: float = 0.0, integer: bool = False
    ) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def add_row(
        self,
        terms: dict[int, float],
        lower: float = -math.inf,
        upper: float = math.inf,
    ) -> int:
        for var, coef in terms.items():
            if coef != 0.0:
                self.row_index.append(var)
                self.row_value.append(coef)
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        return len(self.row_lower) - 1


@dataclass
class MilpResult:
    solver: str
    status: str  # optimal | time_limit | target | cutoff | infeasible | error: <text>
    values: np.ndarray | None
    objective: float
    bound: float
    gap: float
    seconds: float
    nodes: int = 0

    @property
    def has_solution(self) -> bool:
        return self.values is not None


def solve(
    milp: Milp,
    solver: str = "highs",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    mip_gap: float = DEFAULT_MIP_GAP,
    threads: int | None = None,
    start: dict[int, float] | None = None,
    target: float | None = None,
    cutoff: float | None = None,
) -> MilpResult:
    """Solve; `start` is a (partial) feasible assignment the solver may complete and use.

    `target`: stop (status "target") as soon as a solution scores at least this much, for
    callers that know a bound the solver does not. `cutoff`: only solutions scoring above
    it are wanted (the caller has one that scores it): status "cutoff", no solution and
    the cutoff as bound, once the solver proves there is none (a MILP only).
    """
    if cutoff is not None and not milp.num_integer:
        cutoff = None
    if solver == "highs":
        return _solve_highs(milp, time_limit_s, mip_gap, threads, start, target, cutoff)
    if solver == "gurobi":
        return _solve_gurobi(milp, time_limit_s, mip_gap, threads, start, target, cutoff)
    raise SolverError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


def relative_gap(objective: float, bound: float) -> float:
    if not math.isfinite(bound) or not math.isfinite(objective):
        return math.inf
    return abs(bound - objective) / max(abs(objective), 1e-9)


_STOP = threading.local()  # .event: what stops this thread's solves (stopped_by)


@contextlib.contextmanager
def stopped_by(event: threading.Event) -> Iterator[None]:
    """HiGHS solves this thread runs inside the block stop, raising KeyboardInterrupt,
    within milliseconds of `event` being set (by another thread: a search running its
    MILPs in threads stops them all when one fails or the user presses Ctrl-C, instead of
    leaving them to run to their time limits while the process exits)."""
    before = getattr(_STOP, "event", None)
    _STOP.event = event
    try:
        yield
    finally:
        _STOP.event = before


_HIGHS_MADE = threading.Lock()
_highs_made = False


def _new_highs(highspy, logged: bool):
    """A Highs object; the first one of the process is made with the process's stdout
    pointed at /dev/null (HiGHS prints its banner there from C++ as it is made, before any
    option can be set), unless the solver's log is asked for."""
    global _highs_made
    with _HIGHS_MADE:
        if _highs_made or logged:
            _highs_made = True
            return highspy.Highs()
        _highs_made = True
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 1)
                return highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _solve_highs(
    milp: Milp,
    time_limit_s: float,
    mip_gap: float,
    threads: int | None,
    start: dict[int, float] | None,
    target: float | None,
    cutoff: float | None = None,
) -> MilpResult:
    import highspy

    logged = os.environ.get("POOLPIPE_SOLVER_LOG", "") not in ("", "0")
    h = _new_highs(highspy, logged)
    # POOLPIPE_SOLVER_LOG=1 shows HiGHS's own progress log (for diagnosing slow solves).
    h.setOptionValue("output_flag", logged)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads:
        h.setOptionValue("threads", int(threads))
    if target is not None and milp.num_integer:
        h.setOptionValue("objective_target", float(target))
    if cutoff is not None:  # HiGHS minimises inside: the bound is on the negated objective
        h.setOptionValue("objective_bound", -float(cutoff))
    inf = highspy.kHighsInf

    def clip(values: list[float]) -> np.ndarray:
        return np.clip(np.asarray(values, dtype=float), -inf, inf)

    lp = highspy.HighsLp()
    lp.num_col_ = milp.num_vars
    lp.num_row_ = milp.num_rows
    lp.col_cost_ = np.asarray(milp.cost, dtype=float)
    lp.col_lower_ = clip(milp.lower)
    lp.col_upper_ = clip(milp.upper)
    lp.row_lower_ = clip(milp.row_lower)
    lp.row_upper_ = clip(milp.row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = milp.num_vars
    lp.a_matrix_.num_row_ = milp.num_rows
    lp.a_matrix_.start_ = np.asarray(milp.row_start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(milp.row_index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(milp.row_value, dtype=float)
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
        for i in milp.integer
    ]
    lp.sense_ = highspy.ObjSense.kMaximize
    t0 = time.perf_counter()
    h.passModel(lp)
    if start:
        idx = np.fromiter(start.keys(), dtype=np.int32)
        h.setSolution(len(idx), idx, np.fromiter(start.values(), dtype=float))
    stop: threading.Event | None = getattr(_STOP, "event", None)
    if stop is not None:
        if stop.is_set():
            raise KeyboardInterrupt

        def interrupt(e) -> None:  # HiGHS asks between nodes and simplex iterations
            if stop.is_set():
                e.interrupt()

        h.enableCallbacks()
        h.cbMipInterrupt += interrupt
        h.cbSimplexInterrupt += interrupt
    h.run()
    seconds = time.perf_counter() - t0
    model_status = h.getModelStatus()
    if stop is not None and model_status == highspy.HighsModelStatus.kInterrupt:
        raise KeyboardInterrupt  # (a solve that ended as the event came keeps its result)
    text = h.modelStatusToString(model_status).lower()
    info = h.getInfo()
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = np.asarray(h.getSolution().col_value, dtype=float) if has_sol else None
    if values is not None and not np.isfinite(values).all():
        bad = int((~np.isfinite(values)).sum())
        raise SolverError(
            f"highspy {importlib.metadata.version('highspy')} returned a plan with {bad} "
            "values that are not numbers (1.16.0 does so on some small MILPs); install the "
            "version poolpipe asks for: pip install 'highspy<1.16'"
        )
    objective = float(info.objective_function_value) if has_sol else -math.inf
    bound = float(info.mip_dual_bound) if milp.num_integer else objective
    if model_status == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif model_status == highspy.HighsModelStatus.kTimeLimit:
        status = "time_limit"
    elif model_status == highspy.HighsModelStatus.kObjectiveTarget and has_sol:
        status = "target"
    elif model_status == highspy.HighsModelStatus.kInfeasible:
        status = "infeasible"
    else:
        status = f"error: {text}"
    if cutoff is not None and status in ("optimal", "infeasible") and objective <= cutoff:
        # The search ended with every node at most the cutoff: no solution above it (HiGHS
        # then says "infeasible", or "optimal" with a solution below it, bound and all).
        status, values, objective, bound, has_sol = "cutoff", None, -math.inf, cutoff, False
    gap = relative_gap(objective, bound) if has_sol else math.inf
    if status == "optimal":
        gap = min(gap, float(info.mip_gap)) if milp.num_integer else 0.0
    return MilpResult(
        solver="highs",
        status=status,
        values=values,
        objective=objective,
        bound=bound,
        gap=gap,
        seconds=seconds,
        nodes=int(info.mip_node_count) if milp.num_integer else 0,
    )


def gurobi_available() -> tuple[bool, str]:
    """(usable, reason): gurobipy imports and its license can build a model."""
    try:
        import gurobipy as gp
    except ImportError:
        return False, "gurobipy is not installed (pip install 'poolpipe[gurobi]')"
    try:
        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        env.dispose()
    except gp.GurobiError as e:
        return False, f"no working Gurobi license ({e})"
    return True, "ok"


def _solve_gurobi(
    milp: Milp,
    time_limit_s: float,
    mip_gap: float,
    threads: int | None,
    start: dict[int, float] | None,
    target: float | None,
    cutoff: float | None = None,
) -> MilpResult:
    ok, reason = gurobi_available()
    if not ok:
        raise SolverError(f"--solver gurobi is not usable: {reason}; use --solver highs")
    import gurobipy as gp

    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 0)
    env.start()
    m = gp.Model(env=env)
    m.Params.TimeLimit = float(time_limit_s)
    m.Params.MIPGap = float(mip_gap)
    if threads:
        m.Params.Threads = int(threads)
    if target is not None:
        m.Params.BestObjStop = float(target)
    if cutoff is not None:
        m.Params.Cutoff = float(cutoff)
    xs = [
        m.addVar(
            lb=lo if math.isfinite(lo) else -gp.GRB.INFINITY,
            ub=up if math.isfinite(up) else gp.GRB.INFINITY,
            obj=c,
            vtype=gp.GRB.INTEGER if integer else gp.GRB.CONTINUOUS,
        )
        for c, lo, up, integer in zip(milp.cost, milp.lower, milp.upper, milp.integer, strict=True)
    ]
    for r in range(milp.num_rows):
        s, e = milp.row_start[r], milp.row_start[r + 1]
        expr = gp.LinExpr(milp.row_value[s:e], [xs[i] for i in milp.row_index[s:e]])
        lo, up = milp.row_lower[r], milp.row_upper[r]
        if math.isfinite(lo):
            m.addLConstr(expr, gp.GRB.GREATER_EQUAL, lo)
        if math.isfinite(up):
            m.addLConstr(expr, gp.GRB.LESS_EQUAL, up)
    m.ModelSense = gp.GRB.MAXIMIZE
    for var, value in (start or {}).items():
        xs[var].Start = value
    t0 = time.perf_counter()
    try:
        m.optimize()
    except gp.GurobiError as e:
        raise SolverError(f"Gurobi failed: {e}; use --solver highs") from None
    seconds = time.perf_counter() - t0
    has_sol = m.SolCount > 0
    status = {
        gp.GRB.OPTIMAL: "optimal",
        gp.GRB.TIME_LIMIT: "time_limit",
        gp.GRB.USER_OBJ_LIMIT: "target",
        gp.GRB.CUTOFF: "cutoff",
        gp.GRB.INFEASIBLE: "infeasible",
    }.get(m.Status, f"error: gurobi status {m.Status}")
    values = np.array([x.X for x in xs]) if has_sol else None
    objective = float(m.ObjVal) if has_sol else -math.inf
    bound = float(m.ObjBound) if has_sol and milp.num_integer else objective
    if status == "cutoff":
        bound = float(cutoff)  # type: ignore[arg-type]  # set with the Cutoff parameter
    gap = relative_gap(objective, bound) if has_sol else math.inf
    return MilpResult("gurobi", status, values, objective, bound, gap, seconds, int(m.NodeCount))
