"""Application specs (apps.toml): graphs of models under one SLO, checked before anything
is planned or served. Real files, the shipped group-2 profiles for the models' latencies."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from poolpipe.domain.apps import AppSpecError, FanOut, fastest_latencies, load_apps, parse_apps
from poolpipe.domain.profiles import load_ppipe_dir

GROUP2 = Path(__file__).resolve().parents[1] / "data" / "ppipe-gpu-group2"
DET, CLS, SEG = "googlenet-v3-pytorch", "repvgg-b3", "colorization-v2"

SPEC = f"""
[[apps]]
name = "traffic"
slo_ms = 400
weight = 2

[[apps.edges]]
from = "{DET}"
to = "{CLS}"
fanout = 3
transform = "shadow"

[[apps]]
name = "scene"
slo_ms = 500

[[apps.edges]]
from = "{DET}"
to = "{SEG}"
[[apps.edges]]
from = "{DET}"
to = "{CLS}"
fanout = {{ values = [1, 3], weights = [0.5, 0.5] }}
[[apps.edges]]
from = "{CLS}"
to = "tail"
fanout = {{ poisson = 0.5 }}
transform = "json:loads"
[[apps.edges]]
from = "{SEG}"
to = "tail"
transform = "identity"

[[apps]]
name = "alone"
slo_ms = 100
models = ["{SEG}"]
"""


@pytest.fixture(scope="module")
def fastest() -> dict[str, float]:
    return fastest_latencies(load_ppipe_dir(GROUP2))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "apps.toml"
    path.write_text(text)
    return path


def test_a_spec_gives_each_applications_graph(tmp_path):
    apps = {a.name: a for a in load_apps(_write(tmp_path, SPEC))}
    traffic, scene, alone = apps["traffic"], apps["scene"], apps["alone"]
    assert traffic.models == (DET, CLS) and traffic.entry == DET and traffic.exits == (CLS,)
    assert traffic.slo_us == 400_000 and traffic.weight == 2.0
    assert traffic.edges[0].transform == "shadow" and traffic.edges[0].fanout.fixed == 3
    assert traffic.multiplicity() == {DET: 1.0, CLS: 3.0}
    # fan-in: tail waits for both its parents; 2 requests of repvgg a frame on average,
    # each making 0.5 of tail's: one of tail's per frame, as the colorization path makes
    assert scene.models[0] == DET and scene.models[-1] == "tail" and scene.exits == ("tail",)
    assert set(scene.paths()) == {(DET, SEG, "tail"), (DET, CLS, "tail")}
    assert scene.multiplicity() == {DET: 1.0, SEG: 1.0, CLS: 2.0, "tail": 1.0}
    assert {e.src for e in scene.parents("tail")} == {CLS, SEG}
    assert scene.edges[2].transform == "json:loads" and scene.edges[1].fanout.mean == 2.0
    assert alone.models == (SEG,) and alone.paths() == [(SEG,)] and alone.weight == 1.0


def test_an_slo_shorter_than_the_fastest_path_is_refused_naming_it(tmp_path, fastest):
    need_ms = (fastest[DET] + fastest[CLS]) / 1e3
    text = SPEC.split('[[apps]]\nname = "scene"')[0].replace(
        "slo_ms = 400", f"slo_ms = {need_ms * 0.9:.3f}"
    )
    with pytest.raises(
        AppSpecError,
        match=rf"traffic: slo_ms = .* is shorter than its path "
        rf"{DET} -> {CLS} at its fastest \({need_ms:.1f} ms",
    ):
        load_apps(_write(tmp_path, text), fastest_us=fastest)
    ok = text.replace(f"slo_ms = {need_ms * 0.9:.3f}", f"slo_ms = {need_ms * 1.1:.3f}")
    assert load_apps(_write(tmp_path, ok), fastest_us=fastest)[0].name == "traffic"


def _one(edges: str, models: str = "") -> str:
    return f'[[apps]]\nname = "a"\nslo_ms = 300\n{models}\n{edges}'


def _edge(src: str, dst: str, more: str = "") -> str:
    return f'[[apps.edges]]\nfrom = "{src}"\nto = "{dst}"\n{more}\n'


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (_one(_edge("x", "y") + _edge("y", "z") + _edge("z", "y")), "cycle through y, z"),
        (_one(_edge("x", "x")), "edge x -> x is a cycle"),
        (_one(_edge("x", "y", "fanout = 0")), r"fanout = 0: a fixed fan-out is a whole number"),
        (_one(_edge("x", "y", "fanout = -2")), r"fanout = -2: a fixed fan-out"),
        (_one(_edge("x", "y", "fanout = 2.5")), r"for a mean give a distribution"),
        (_one(_edge("x", "y", "fanout = { poisson = 0 }")), "Poisson mean must be a number > 0"),
        (
            _one(_edge("x", "y", "fanout = { values = [0], weights = [1] }")),
            "its mean is 0",
        ),
        (
            _one(_edge("x", "y", 'transform = "no_such_package.mod:fn"')),
            r"transform no_such_package.mod:fn cannot be imported \(ModuleNotFoundError",
        ),
        (_one(_edge("x", "y", 'transform = "json:no_such"')), "json:no_such cannot be imported"),
        (_one(_edge("x", "y", 'transform = "crop it"')), "use identity, shadow or package"),
        (_one(_edge("x", "z") + _edge("y", "z")), "2 models no edge leads to"),
        (
            _one(
                _edge("x", "y", "fanout = 2") + _edge("x", "z") + _edge("y", "w") + _edge("z", "w")
            ),
            r"w waits for y, z, but they make different numbers .* \(2 via y, 1 via z\)",
        ),
        (_one(_edge("x", "y", "fan_out = 2")), r"unknown key\(s\) fan_out"),
        (_one(""), "no models"),
        ('[[apps]]\nname = "a b"\nslo_ms = 3\nmodels = ["x"]', "name = 'a b': use letters"),
        ('[[apps]]\nname = "a"\nslo_ms = 0\nmodels = ["x"]', "slo_ms = 0.0 must be"),
        ('[[apps]]\nname = "a"\nmodels = ["x"]', "application a has no 'slo_ms'"),
        ("apps = 3", r"no \[\[apps\]\]"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_file_and_field(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(AppSpecError, match=match) as err:
        load_apps(path)
    assert str(err.value).startswith(str(path))


def test_models_and_names_are_checked_against_those_onboarded(tmp_path):
    known = [DET, CLS, SEG, "tail"]
    with pytest.raises(AppSpecError, match="unknown model\\(s\\) yolo; onboard them first"):
        parse_apps({"apps": [{"name": "a", "slo_ms": 9, "models": ["yolo"]}]}, "f", known)
    clash = {"apps": [{"name": SEG, "slo_ms": 9, "models": [SEG]}]}
    with pytest.raises(AppSpecError, match="a model has that name"):
        parse_apps(clash, "f", known)
    assert len(load_apps(_write(tmp_path, SPEC), known_models=known)) == 3
    with pytest.raises(AppSpecError, match="missing"):
        load_apps(tmp_path / "none.toml")
    with pytest.raises(AppSpecError, match="not valid TOML"):
        load_apps(_write(tmp_path, "[[apps]\n"))


def test_fan_out_laws_draw_what_they_say():
    rng = random.Random(7)
    poisson = FanOut(poisson=2.5)
    draws = [poisson.sample(rng) for _ in range(20_000)]
    assert abs(sum(draws) / len(draws) - 2.5) < 0.05 and min(draws) == 0
    choice = FanOut((1, 3), (0.25, 0.75))
    assert choice.mean == 2.5 and choice.fixed is None and choice.describe() == "{1: 0.25, 3: 0.75}"
    assert {choice.sample(rng) for _ in range(200)} == {1, 3}
    assert FanOut((4,)).fixed == 4 and FanOut((4,)).sample(rng) == 4


def test_apps_check_shows_the_graph_or_names_what_is_wrong(tmp_path, capsys):
    from poolpipe_cli import main

    good = _write(tmp_path, SPEC.replace('transform = "json:loads"', ""))
    assert main(["apps", "check", str(good), "--profiles", str(GROUP2)]) == 2  # no "tail"
    assert "unknown model(s) tail; onboard them first" in capsys.readouterr().err.replace("\n", " ")
    first = SPEC.split('[[apps]]\nname = "scene"')[0]
    assert main(["apps", "check", str(_write(tmp_path, first)), "--profiles", str(GROUP2)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "traffic: SLO 400 ms" in out and "1 application(s) checked" in out


def _group2_cars(tmp_path: Path) -> tuple[Path, Path]:
    """A warehouse of the shipped group-2 profiles and a spec: DET, then CLS on 2 crops."""
    from poolpipe.store.warehouse import Warehouse

    wh = tmp_path / "wh.duckdb"
    with Warehouse.open(wh) as w:
        w.store_profiles(load_ppipe_dir(GROUP2))
    spec = _write(
        tmp_path,
        f'[[apps]]\nname = "cars"\nslo_ms = 80\n[[apps.edges]]\nfrom = "{DET}"\nto = "{CLS}"\n'
        'fanout = 2\ntransform = "shadow"\n',
    )
    return wh, spec


def test_apps_plan_compares_the_joint_split_with_fixed_ones(tmp_path, capsys):
    """`poolpipe apps plan` on the shipped group-2 profiles and hc2-small: the joint split
    serves at least what the equal and proportional splits serve."""
    from poolpipe_cli import main

    wh, spec = _group2_cars(tmp_path)
    args = ["--warehouse", str(wh), "apps", "plan", str(spec), "--cluster", "hc2-small"]
    assert main([*args, "--clusters-file", str(GROUP2 / "clusters.toml")]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split("│")[1].strip(): line.split("│")[2:]
        for line in out.splitlines()
        if line.count("│") > 4
        and line.split("│")[1].strip() in ("joint", "equal", "proportional", "nexus")
    }
    objective = {k: float(v[0]) for k, v in rows.items()}
    assert objective["joint"] >= max(objective["equal"], objective["proportional"]) - 0.05
    assert objective["joint"] > 0 and "the joint split" in out
    # what each split's plan delivers with >= 99% on time, simulated: below its fluid figure
    delivered = {k: float(v[1]) for k, v in rows.items()}
    assert all(0 < delivered[k] <= objective[k] for k in rows), (delivered, objective)
    # the split kept (its budgets printed) is the one that delivers most
    kept = max(delivered, key=lambda k: (delivered[k], k == "joint"))
    assert f"the {kept} split" in out and f"{kept} / this (delivered)" in out


def test_apps_plan_writes_a_plan_that_apps_simulate_serves(tmp_path, capsys):
    """`apps plan --out` then `apps simulate`: the nexus row, the plan document, and each
    application's requests answered once by the simulated cluster; the cost objective
    beside the cheapest whole-model plan."""
    from poolpipe.domain.plan import Plan
    from poolpipe_cli import main

    wh, spec = _group2_cars(tmp_path)
    base = ["--warehouse", str(wh), "apps"]
    where = ["--cluster", "hc2-small", "--clusters-file", str(GROUP2 / "clusters.toml")]
    out = tmp_path / "apps-plan.json"
    assert main([*base, "plan", str(spec), *where, "--out", str(out), "--delivery", "off"]) == 0
    text = capsys.readouterr().out
    assert "nexus" in text and f"written to {out}" in " ".join(text.split())
    plan = Plan.load(out)
    assert [m.name for m in plan.models] == [f"cars.{DET}", f"cars.{CLS}"]
    budgets = plan.meta["apps"]["cars"]["budgets_us"]
    assert sum(budgets.values()) == pytest.approx(80_000)
    assert "deliverable" not in plan.meta["apps"]["cars"]  # --delivery off: not simulated
    assert main([*base, "simulate", str(spec), "--plan", str(out), "--duration", "3"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.count("│") > 6 and "cars" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    arrived, answered = int(cells[2]), sum(int(c) for c in cells[3:7])
    assert arrived > 0 and answered == arrived
    assert main([*base, "simulate", str(spec), "--plan", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    rates = "--rates=cars=50"
    assert (
        main(
            [
                *base,
                "plan",
                str(spec),
                *where,
                "--objective",
                "cost",
                rates,
                "--prices",
                "L4=0.56,T4=0.35",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "whole-model" in text and "cheapest GPUs" in text
    assert main([*base, "plan", str(spec), *where, "--objective", "cost", rates]) == 2
    assert "no price for GPU type" in capsys.readouterr().err


def test_the_application_mix_seen_is_planned_again():
    """Nightly re-planning of an application plan: the mix read from the entry parts'
    arrivals, each part weighted by its application's share and its requests per request,
    the applications planned again for it (real MILPs); the new plan serves that mix at
    least as well as the serving one, and a router would take it (same graphs and SLOs)."""
    from poolpipe.domain.cluster import load_clusters
    from poolpipe.planner.apps import (
        AppPlanRequest,
        app_plan_document,
        observed_app_shares,
        part_weights,
        plan_apps,
        replan_apps,
    )
    from poolpipe.planner.replan import objective_under
    from triton_backend.deploy.deployment import _cannot_replace

    profiles = {p.name: p for p in load_ppipe_dir(GROUP2)}
    cluster = load_clusters(GROUP2 / "clusters.toml")["hc2-small"]
    spec = {
        "apps": [
            {"name": "cars", "slo_ms": 80, "edges": [{"from": DET, "to": CLS, "fanout": 2}]},
            {"name": "color", "slo_ms": 120, "models": [SEG]},
        ]
    }
    apps = parse_apps(spec, "test", profiles)
    req = AppPlanRequest(tuple(apps), profiles, cluster, time_limit_s=300)
    current = app_plan_document(req, plan_apps(req))[0]
    names = [m.name for m in current.models]
    arrivals = {f"cars.{DET}": 900.0, f"cars.{CLS}": 1800.0, f"color.{SEG}": 100.0}
    shares = observed_app_shares(current.meta, arrivals)
    assert shares == {"cars": pytest.approx(0.9), "color": pytest.approx(0.1)}
    weights = part_weights(current.meta, shares, names)
    assert dict(zip(names, weights, strict=True)) == {
        f"cars.{DET}": pytest.approx(0.9),
        f"cars.{CLS}": pytest.approx(1.8),
        f"color.{SEG}": pytest.approx(0.1),
    }
    assert observed_app_shares(current.meta, {}) is None
    new = replan_apps(current, profiles, cluster, shares, time_limit_s=300)
    before = objective_under(current, names, weights)
    after = objective_under(new, names, weights)
    assert after > 1.1 * before, (before, after)  # planned for 1:1, seen 9:1
    assert new.meta["apps"]["cars"]["weight"] == pytest.approx(0.9)
    assert _cannot_replace(current, new) == ""
