"""The example scripts and the overhead benchmark run as a user would run them, in fresh interpreters.

Each example is a separate program, so each gets its own ``sys.executable`` subprocess; they are started
together (as many at a time as there are CPUs) by one module-scoped fixture and each test waits for its own,
so the module costs about the CPU time of the scripts shared over the CPUs rather than their sum. Most of each
script's time is importing torch and Lightning.

By default a representative subset runs (the scaler path, the batch check, the no-scaler path); set
``AMPWATCH_ALL_EXAMPLES=1`` to run every example. Every scenario behind the examples is also trained in-process
by the end-to-end tests.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from lightning_ampwatch import Finding
from _limits import HANG_S

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BENCHMARK = ROOT / "benchmarks" / "overhead.py"

# example script -> the finding it must make
ALL_EXAMPLES: dict[str, Finding] = {
    "gradient_overflow": Finding.GRADIENT_OVERFLOW,
    "growth_overflow": Finding.GROWTH_OVERFLOW,
    "lr_schedule": Finding.LR_SCHEDULE,
    "normal_scaling": Finding.NORMAL_SCALING,
    "data_nonfinite": Finding.DATA_NONFINITE,
    "input_range": Finding.INPUT_RANGE,
    "forward_overflow": Finding.FORWARD_OVERFLOW,
    "fp32_unstable": Finding.FP32_UNSTABLE,
    "not_reproduced": Finding.NOT_REPRODUCED,
    "recipe_loss_outside_autocast": Finding.LOSS_OUTSIDE_AUTOCAST,
    "recipe_clip_before_unscale": Finding.CLIP_BEFORE_UNSCALE,
    "recipe_step_outside_scaler": Finding.STEP_OUTSIDE_SCALER,
    "recipe_manual_prescale": Finding.MANUAL_PRESCALE,
    "recipe_fp16_parameters": Finding.FP16_PARAMETERS,
    "recipe_eps_underflow": Finding.EPS_UNDERFLOW,
    "fabric_loop": Finding.FORWARD_OVERFLOW,  # a LitGPT-shaped Fabric loop under FabricWatch
}
SUBSET = ("gradient_overflow", "data_nonfinite", "fp32_unstable", "fabric_loop")
SELECTED = tuple(ALL_EXAMPLES) if os.environ.get("AMPWATCH_ALL_EXAMPLES") == "1" else SUBSET
BENCHMARK_ARGS = ("--quick", "--steps", "8", "--warmup", "2", "--rounds", "1")


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONWARNINGS="ignore", COLUMNS="120")
    return subprocess.run([sys.executable, *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=HANG_S)


class _Launcher:
    """Starts scripts in a thread pool and hands back their results.

    Run alone, the first request starts every selected script at once (the CPUs are shared out by the pool);
    under pytest-xdist (``PYTEST_XDIST_WORKER`` set) each test starts only its own script, since the workers
    already run tests side by side and would otherwise each run every script.
    """

    def __init__(self, pool: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.pool, self.tmp_path_factory = pool, tmp_path_factory
        self.futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
        self.prefetch = "PYTEST_XDIST_WORKER" not in os.environ

    def _start(self, name: str) -> None:
        if name not in self.futures:
            script = [str(BENCHMARK), *BENCHMARK_ARGS] if name == "benchmark" else [str(EXAMPLES / f"{name}.py")]
            self.futures[name] = self.pool.submit(_run, script, self.tmp_path_factory.mktemp(name))

    def result(self, name: str) -> subprocess.CompletedProcess[str]:
        if self.prefetch:
            for other in ("benchmark", *SELECTED):
                self._start(other)
        self._start(name)
        return self.futures[name].result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Launcher]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        yield _Launcher(pool, tmp_path_factory)


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"


def test_every_finding_has_an_example() -> None:
    scripts = {p.stem for p in EXAMPLES.glob("*.py")}
    assert set(ALL_EXAMPLES) <= scripts
    assert set(ALL_EXAMPLES.values()) == set(Finding)
    readme = (EXAMPLES / "README.md").read_text()
    for name in ALL_EXAMPLES:
        assert f"{name}.py" in readme, f"examples/README.md does not list {name}.py"


@pytest.mark.parametrize("name", SELECTED)
def test_example_diagnoses_its_finding(name: str, runs: _Launcher) -> None:
    result = runs.result(name)
    expected = ALL_EXAMPLES[name].value
    assert result.returncode == 0, _explain(result)
    assert f"Diagnosed {expected} at " in result.stdout, _explain(result)
    assert "FAILED" not in result.stdout


def _benchmark_configurations() -> list[str]:
    spec = importlib.util.spec_from_file_location("ampwatch_overhead_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return list(module.CONFIGURATIONS)


def test_benchmark_quick_prints_a_ratio_per_configuration(runs: _Launcher) -> None:
    result = runs.result("benchmark")
    assert result.returncode == 0, _explain(result)
    names = _benchmark_configurations()
    assert {"bare", "AmpWatch()", "detect_anomaly=True", "SpikeDetection()"} <= set(names)
    number, span = r"\s*\S\s+([\d.]+)", r"\s*\S\s+([\d.]+)\.\.([\d.]+)"
    for name in names:
        # a table row: the name, ms/step, the median ratio, its min..max, the CPU-time ratio, best over best
        row = re.search(re.escape(name) + number + number + span + number + number, result.stdout)
        assert row is not None, f"no ratio row for {name!r}\n{_explain(result)}"
        ms_per_step, wall_ratio, cpu_ratio, best = (float(row.group(i)) for i in (1, 2, 5, 6))
        assert ms_per_step > 0 and wall_ratio > 0 and cpu_ratio > 0 and best > 0
        if name == "bare":
            assert wall_ratio == cpu_ratio == best == 1.0
    assert re.search(r"AmpWatch\(\): median ratio [\d.]+ \(wall clock\), [\d.]+ \(CPU time\)", result.stdout), \
        _explain(result)
