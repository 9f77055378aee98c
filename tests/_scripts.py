"""Load a script from benchmarks/ as a module, for the tests that read its functions."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextmanager
def loaded_script(path: Path, name: str) -> Iterator[ModuleType]:
    """The script at `path` as the module `name`, registered while in use (its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
