"""The documentation's commands are the code's: every `poolpipe` command in the README, in
docs/ and in the systemd units of deploy/ parses with the command's own parser (a flag
renamed in the code fails here, not in an operator's rollout), every `./run` command is
one the script knows, and every relative link points at a file that exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from poolpipe_cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# with the design notes the code cites (their commands are the design's, not checked here)
ALL_PAGES = [*PAGES, *sorted((REPO / "docs" / "design").glob("*.md"))]
UNITS = sorted((REPO / "deploy" / "systemd").glob("*.service"))
# what a unit's variables stand for (their env files hold the real values)
UNIT_VALUES = {
    "${DEVICE}": "T4",
    "${GPUS}": "4",
    "${LISTEN}": "10.0.0.21",
    "${GRPC_PORT}": "8001",
    "${HTTP_PORT}": "8000",
    "${METRICS_PORT}": "8002",
    "${WATCH_PORT}": "8003",
    "${PLAN}": "42",
    "%i": "0",
    "%H": "host",
}


def _code_lines(page: Path) -> list[str]:
    """The command lines of a page's fenced shell blocks (continuations joined, comments
    dropped)."""
    out: list[str] = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _poolpipe_args(line: str) -> list[str] | None:
    """The arguments of a `poolpipe` command line (after any VAR=value and ./run), or None
    for another command."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if words[:2] == ["./run", "poolpipe"]:
        return words[2:]
    if words and words[0].endswith("poolpipe") and words[0] != "/opt/poolpipe":
        return words[1:]
    return None


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in _code_lines(page):
            args = _poolpipe_args(line)
            if args is not None:
                found.append((f"{page.name}: {line}", args))
    for unit in UNITS:
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart=") and "poolpipe " in line:
                for k, v in UNIT_VALUES.items():
                    line = line.replace(k, v)
                args = _poolpipe_args(line.removeprefix("ExecStart="))
                assert args is not None, line
                found.append((f"{unit.name}: {line}", args))
    return found


COMMANDS = _commands()


def test_the_pages_and_units_have_commands_to_check():
    where = {what.split(":", 1)[0] for what, _ in COMMANDS}
    assert {"README.md", "deployment.md", "poolpipe-node@.service"} <= where, where
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize(("what", "args"), COMMANDS, ids=[w[:60] for w, _ in COMMANDS])
def test_every_poolpipe_command_parses(what, args, capsys):
    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{what}\n{capsys.readouterr().err}")


def test_every_run_command_is_one_the_script_knows():
    known = set(re.findall(r"^    ([a-z-]+)\)", (REPO / "run").read_text(), re.M))
    used = {
        line.split()[1]
        for page in PAGES
        for line in _code_lines(page)
        if line.startswith("./run ") and len(line.split()) > 1
    }
    assert used and used <= known, used - known


def test_relative_links_point_at_files_that_exist():
    for page in ALL_PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_reply_margin_defaults_are_stated_once_from_the_code():
    """`serve --reply-margin-ms` is the floor the router measures on top of (the same as a
    deployment's), `plan --reply-margin-ms` the margin a router measures idle; the pages say
    the code's numbers (serve's used to be plan's 3 ms while the pages said 1 ms)."""
    import inspect

    from poolpipe.runtime import (
        DEFAULT_MARGIN_CEILING_US,
        DEFAULT_MARGIN_FLOOR_US,
        DEFAULT_REPLY_MARGIN_US,
    )
    from triton_backend.deploy.deployment import Deployment

    serve = build_parser().parse_args(["serve", "plan.json"])
    plan = build_parser().parse_args(["plan", "--models", "m", "--cluster", "c"])
    up = inspect.signature(Deployment.up).parameters["reply_margin_us"].default
    assert serve.reply_margin_ms * 1e3 == DEFAULT_MARGIN_FLOOR_US == up
    assert plan.reply_margin_ms * 1e3 == DEFAULT_REPLY_MARGIN_US
    text = " ".join((REPO / "docs" / "serving.md").read_text().split())
    assert f"`--reply-margin-ms`, {DEFAULT_MARGIN_FLOOR_US / 1e3:g} ms by default" in text
    assert f"`--reply-margin-max-ms` ({DEFAULT_MARGIN_CEILING_US / 1e3:g} ms)" in text
    assert f"{DEFAULT_REPLY_MARGIN_US / 1e3:g} ms by default, what the router measures" in text


# How the work was organised is not the project's to say: pages name commits, dates and
# commands (a step of the work, a throwaway script, a branch, a change "not landed").
PROCESS_WORDS = re.compile(
    r"\bstops?\s+\d+|\bstop\d+\b|\b(?:an?|the)\s+/tmp\s+(?:script|wrapper|patch|experiment)"
    r"|\b(?:this|that|the|previous|next|a)\s+session\b|\blanded\b|\bwip/",
    re.I,
)


def _process_words(text: str) -> list[str]:
    return [m.group(0) for m in PROCESS_WORDS.finditer(text)]


def test_the_process_words_check_finds_a_planted_one():
    planted = "Measured at stop 53 (2026-11-25) by a /tmp script, not landed; later this session."
    assert _process_words(planted) == ["stop 53", "a /tmp script", "landed", "this session"]
    assert _process_words("as before stop\n  57 the tables") == ["stop\n  57"]
    assert _process_words("On a02dfe1 (2026-11-25): its sessions are shut, /tmp/x kept.") == []


def test_the_pages_name_commits_not_how_the_work_was_organised():
    assert len(ALL_PAGES) > len(PAGES) > 8
    found = {page.name: _process_words(page.read_text()) for page in ALL_PAGES}
    assert not {k: v for k, v in found.items() if v}, found


def _anchors(page: Path) -> set[str]:
    """The anchors a page's headings get (lower case, punctuation dropped, spaces as
    hyphens, as the usual Markdown renderers make them)."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_to_a_section_name_one_that_exists():
    for page in ALL_PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            linked = page.parent / target if target else page
            assert anchor in _anchors(linked), f"{page.name}: {target}#{anchor}"


def test_the_results_page_stays_short():
    """docs/benchmarks.md gives each benchmark's current figures; their history goes to
    docs/benchmarks-history.md."""
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 600
