"""The data plane stays in layers a reader can hold (docs/design/dataplane.md): the batching
policy's file (`poolpipe/scheduler/adaptive.py`) at most 700 lines, no function in
`poolpipe/scheduler/` over 120 lines, no class there with more than 25 attributes. Each
limit is shown to catch a planted violation."""

from __future__ import annotations

import ast
from pathlib import Path

SCHEDULER = Path(__file__).resolve().parents[1] / "poolpipe" / "scheduler"
MAX_POLICY_LINES = 700
MAX_FUNCTION_LINES = 120
MAX_ATTRIBUTES = 25


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function or method longer than MAX_FUNCTION_LINES."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append((node.name, lines))
    return out


def attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's instances hold: its slots, its annotated names, and every
    `self.x` its methods assign."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets
        ):
            names |= {e.value for e in ast.walk(stmt.value) if isinstance(e, ast.Constant)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for e in ast.walk(t):
                if (
                    isinstance(e, ast.Attribute)
                    and isinstance(e.value, ast.Name)
                    and e.value.id == "self"
                ):
                    names.add(e.attr)
    return names


def crowded_classes(source: str) -> list[tuple[str, int]]:
    """(name, attributes) of every class with more than MAX_ATTRIBUTES attributes."""
    return [
        (node.name, len(attributes(node)))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and len(attributes(node)) > MAX_ATTRIBUTES
    ]


def test_the_batching_policy_file_stays_short():
    lines = len((SCHEDULER / "adaptive.py").read_text().splitlines())
    assert lines <= MAX_POLICY_LINES, f"adaptive.py has {lines} lines"


def test_no_scheduler_function_is_too_long_and_no_class_too_crowded():
    too_long, crowded = {}, {}
    for path in sorted(SCHEDULER.glob("*.py")):
        source = path.read_text()
        if found := long_functions(source):
            too_long[path.name] = found
        if found := crowded_classes(source):
            crowded[path.name] = found
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"
    assert not crowded, f"classes with over {MAX_ATTRIBUTES} attributes: {crowded}"


def test_the_limits_catch_a_planted_violation():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def planted():\n{body}") == [("planted", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def fits():\n{body[: body.rindex('    x')]}") == []
    fields = "".join(f"        self.a{i} = {i}\n" for i in range(MAX_ATTRIBUTES))
    crowded = f"class Planted:\n    b: int\n    def __init__(self):\n{fields}"
    assert crowded_classes(crowded) == [("Planted", MAX_ATTRIBUTES + 1)]
    slotted = "class Fits:\n    __slots__ = ('a', 'b')\n    def f(self):\n        self.a = 1\n"
    assert crowded_classes(slotted) == []
