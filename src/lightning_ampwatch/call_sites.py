"""Where the user's code is: the first frame up the stack that is not torch, Lightning or AmpWatch, and the line a
function hands its result back at. The recipe guards (:mod:`lightning_ampwatch.guards`) name each mistake there.
Called only when a guard has found something, or once per call site of backward: never on a healthy step.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import linecache
import os
import sys
import textwrap
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Iterable, Sequence

_SKIPPED_PACKAGES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_ampwatch")


def _package_dirs(names: Sequence[str]) -> tuple[str, ...]:
    dirs: list[str] = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            dirs.append(os.path.join(os.path.realpath(location), ""))
            dirs.append(os.path.join(os.path.abspath(location), ""))
    return tuple(dict.fromkeys(dirs))


_SKIPPED_DIRS = _package_dirs(_SKIPPED_PACKAGES)
# The demo scenarios live in this package but play the part of user code: their lines are what to name.
_USER_CODE_IN_PACKAGE = frozenset(os.path.join(d, "scenarios.py") for d in _package_dirs(["lightning_ampwatch"]))
_skip_cache: dict[CodeType, bool] = {}


def _is_framework(code: CodeType) -> bool:
    skip = _skip_cache.get(code)
    if skip is None:
        filename = code.co_filename
        skip = filename.startswith(_SKIPPED_DIRS) and filename not in _USER_CODE_IN_PACKAGE
        if len(_skip_cache) < 4096:
            _skip_cache[code] = skip
    return skip


def _display_path(filename: str) -> str:
    """Relative to the working directory when inside it (what a user clicks on), absolute otherwise."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith(os.pardir) else rel


@dataclass(frozen=True)
class CallSite:
    """A line in the user's code."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{_display_path(self.filename)}:{self.lineno}"

    @property
    def code(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def evidence(self) -> dict[str, object]:
        return {"call_site": f"{self} in {self.function}", "code": self.code}


def user_call_site(frame: FrameType | None = None) -> tuple[CallSite | None, frozenset[str]]:
    """The first frame above ``frame`` outside torch/Lightning/AmpWatch, and the framework functions passed on
    the way (to tell ``LightningModule.clip_gradients`` from a direct ``torch.nn.utils`` call)."""
    f = frame if frame is not None else sys._getframe(1)
    passed: set[str] = set()
    while f is not None:
        code = f.f_code
        if not _is_framework(code):
            return CallSite(code.co_filename, f.f_lineno, code.co_name), frozenset(passed)
        passed.add(code.co_name)
        f = f.f_back
    return None, frozenset(passed)


def returned_at(func: Any) -> CallSite | None:
    """Where ``func`` hands its result back: its one ``return <value>`` statement, else its ``def`` line.

    In automatic optimization no user frame is on the stack at backward time; the loss left the user's code at
    ``training_step``'s return, so that is the line to name. ``None`` when ``func`` is not user code.
    """
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None or _is_framework(code):
        return None
    lineno = code.co_firstlineno
    try:
        lines, first = inspect.getsourcelines(func)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return CallSite(code.co_filename, lineno, code.co_name)
    returns = [node.lineno + first - 1 for node in _own_statements(tree.body[0]) if isinstance(node, ast.Return)
               and node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None)]
    if len(returns) == 1:
        lineno = returns[0]
    return CallSite(code.co_filename, lineno, code.co_name)


def _own_statements(function: ast.AST) -> Iterable[ast.AST]:
    """The nodes of a function body, not descending into functions, lambdas or classes defined inside it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))

