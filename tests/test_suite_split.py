"""`./run test` runs the files of tests/compute-only.txt at nice 19 beside the rest: they
must compute only. Each listed file exists once, and none holds what a live test does
(starts a server or a served process, reads a clock, sleeps, uses the session's Prefect
API or imports a live test's helpers); the check is shown to catch a planted one."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LIST = TESTS / "compute-only.txt"
LIVE = re.compile(
    r"mark\.integration|prefect_api|ServingProcess\(|Deployment\.up\(|TritonNode\(|netns|"
    r"time\.(sleep|monotonic|monotonic_ns|perf_counter|time)\(|Popen\(|start_http_server|"
    r"tritonserver"
)


def listed() -> list[str]:
    lines = (line.split("#")[0].strip() for line in LIST.read_text().splitlines())
    return [line for line in lines if line]


def live_lines(source: str, compute_only: set[str]) -> list[str]:
    """The lines of a test file that a compute-only file must not have."""
    out = [line for line in source.splitlines() if LIVE.search(line)]
    for mod in re.findall(r"^from tests\.(test_\w+) import", source, re.M):
        if f"tests/{mod}.py" not in compute_only:
            out.append(f"imports tests/{mod}.py, which is not compute-only")
    return out


def test_every_listed_file_exists_once_and_computes_only():
    files = listed()
    assert len(files) == len(set(files)) and files
    names = set(files)
    for f in files:
        path = TESTS.parent / f
        assert path.is_file() and path.name.startswith("test_"), f
        if path != Path(__file__).resolve():  # (this file spells the patterns out)
            assert live_lines(path.read_text(), names) == [], f


def test_the_check_catches_a_planted_live_test():
    names = set(listed())
    assert live_lines("import time\n\ndef test_x():\n    time.sleep(0.1)\n", names)
    assert live_lines("def test_x(prefect_api):\n    pass\n", names)
    assert live_lines("from tests.test_serving import hand_plan\n", names)
    assert live_lines("from tests.test_planner_properties import instances\n", names) == []
