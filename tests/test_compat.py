"""One module for torch's and Lightning's internals (compat.py), and a core that imports no Lightning.

The source checks are static (the modules' syntax trees), so a new access fails here at once, not when a torch or
Lightning release renames the attribute; the accessors themselves are checked on real objects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_ampwatch
from lightning_ampwatch import compat

PACKAGE = Path(lightning_ampwatch.__file__).parent
FRAMEWORKS = {"torch", "lightning", "lightning_fabric", "pytorch_lightning"}
#: Private names of the standard library that are fine to use (not torch's or Lightning's).
STDLIB_PRIVATE = {("sys", "_getframe")}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("lightning_ampwatch", *path.relative_to(PACKAGE).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), filename=str(path))
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    """Every private attribute a module reads or writes, by attribute syntax or by name in get/set/has/delattr,
    and every private name or module it imports from torch or Lightning."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) not in STDLIB_PRIVATE:
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _is_private(node.args[1].value):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FRAMEWORKS:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _is_private(a.name)]
            if any(_is_private(part) for part in (node.module or "").split(".")):
                found.append((node.lineno, str(node.module)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in FRAMEWORKS
                      and any(_is_private(part) for part in a.name.split("."))]
    return found


def _own_private_names(trees: dict[str, ast.Module]) -> set[str]:
    """Private names the package defines itself: functions, classes, module globals, attributes it assigns on
    ``self``/``cls``, parameters."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def foreign_private_accesses(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line name`` for every private access outside compat.py that is not the package's own name, or that
    is a name compat.py reads on a torch or Lightning object."""
    compat_names = {name for _, name in _private_accesses(trees["lightning_ampwatch.compat"])}
    own = _own_private_names({k: v for k, v in trees.items() if k != "lightning_ampwatch.compat"}) - compat_names
    return [f"{module}:{line} {name}" for module, tree in trees.items() if module != "lightning_ampwatch.compat"
            for line, name in _private_accesses(tree) if name not in own]


def test_only_compat_touches_private_attributes_of_torch_or_lightning() -> None:
    assert foreign_private_accesses(_modules()) == []


@pytest.mark.parametrize("line", [
    "value = scaler._scale",
    "tracker = getattr(scaler, '_growth_tracker', None)",
    "trainer._checkpoint_connector.restore_model()",
    "from torch.nn.modules.dropout import _DropoutNd",
    "import torch._dynamo",
    "opt._optimizer_step_pre_hooks = {}",
])
def test_the_compat_check_catches_an_access_outside_compat(line: str) -> None:
    """The check bites: each of these lines, added to a module other than compat.py, fails it."""
    trees = _modules()
    trees["lightning_ampwatch.core"].body.extend(ast.parse(line).body)
    assert len(foreign_private_accesses(trees)) == 1


# ------------------------------------------------------------------------------ the core imports no Lightning


def _package_imports(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_ampwatch"):
            submodules = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
            # ``from lightning_ampwatch import compat`` needs compat, not what the package's __init__ re-exports
            out |= submodules if submodules else {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lightning_ampwatch")}
    return {m for m in out if m in known and m != module}


def _framework_imports(tree: ast.Module, top_level_only: bool = False) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in nodes if isinstance(n, ast.ImportFrom)}
    return {n for n in names if n.split(".")[0] in FRAMEWORKS - {"torch"}}


def core_closure(trees: dict[str, ast.Module]) -> set[str]:
    """The package modules ``core`` needs, directly or not (compat.py included: it is checked apart)."""
    known, seen = set(trees), set()
    todo = ["lightning_ampwatch.core"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += sorted(_package_imports(module, trees[module], known))
    return seen


def test_the_core_imports_no_lightning_anywhere_in_what_it_needs() -> None:
    trees = _modules()
    closure = core_closure(trees)
    assert {"lightning_ampwatch.steps", "lightning_ampwatch.remedies.treatment", "lightning_ampwatch.reporters",
            "lightning_ampwatch.reporters.sinks", "lightning_ampwatch.reporters.panel",
            "lightning_ampwatch.machine", "lightning_ampwatch.machine.state", "lightning_ampwatch.machine.reference",
            "lightning_ampwatch.machine.lr_history"} <= closure  # the walk does follow the imports
    assert "lightning_ampwatch.callback" not in closure and "lightning_ampwatch.scenarios" not in closure
    offenders = {m: _framework_imports(trees[m]) for m in closure if m != "lightning_ampwatch.compat"}
    assert {m: names for m, names in offenders.items() if names} == {}
    # compat.py reaches Lightning only inside the functions the Lightning adapter calls
    assert _framework_imports(trees["lightning_ampwatch.compat"], top_level_only=True) == set()


def test_the_records_are_pure_python() -> None:
    tree = _modules()["lightning_ampwatch.records"]
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    allowed = {"lightning_ampwatch.taxonomy", "lightning_ampwatch.verdicts", "lightning_ampwatch.measured"}  # all pure
    assert {n for n in imported if n.split(".")[0] in FRAMEWORKS or
            (n.startswith("lightning_ampwatch") and n not in allowed)} == set()


# ------------------------------------------------------------------------------ the accessors, on real objects


def _stepped_scaler() -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    return scaler, opt


def test_scaler_accessors_read_what_the_scaler_holds() -> None:
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    assert compat.scale_tensor(fresh) is None and compat.initial_scale(fresh) == (256.0, 0)
    scaler, opt = _stepped_scaler()
    assert compat.per_optimizer_states(scaler)[id(opt)]["stage"].name == "UNSCALED"
    scaler.step(opt)
    scaler.update()
    assert float(compat.scale_tensor(scaler)) == scaler.get_scale() == 256.0
    assert int(compat.growth_tracker_tensor(scaler)) == 1
    compat.reset_growth_tracker(scaler)
    assert int(compat.growth_tracker_tensor(scaler)) == 0
    assert not compat.unscales_in_kernel(opt)


def test_without_step_hooks_hides_the_hooks_and_puts_them_back() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    model(torch.ones(1, 2)).sum().backward()
    with compat.without_step_hooks([opt]):
        opt.step()
    assert calls == []
    opt.step()
    assert calls == ["pre", "post"]


def test_scale_last_lr_follows_the_optimizer() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    compat.scale_last_lr(sched, 0.5)
    assert sched.get_last_lr() == [0.2]


def test_dropout_counts_as_stochastic() -> None:
    assert all(issubclass(t, compat.STOCHASTIC_MODULES) for t in (nn.Dropout, nn.Dropout2d, nn.AlphaDropout))
    assert not issubclass(nn.Linear, compat.STOCHASTIC_MODULES)
