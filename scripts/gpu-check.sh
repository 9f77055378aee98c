#!/usr/bin/env bash
# The GPU check in one go (docs/gpu.md): the CUDA tests (tests/test_cuda.py, marker "cuda") and their CPU
# counterparts, then benchmarks/gpu_bench.py, then one summary table. About 5 minutes on one H100; on a machine
# without CUDA every CUDA check reads "skipped: no CUDA" and the script still ends cleanly (exit 0).
#
#   bash scripts/gpu-check.sh            # outputs (junit XML, JSON, logs) under $OUT if set, else a temporary folder
#   PYTHON=/path/to/python bash scripts/gpu-check.sh
#
# The Python: $PYTHON if set; else, of .venv/bin/python and python3, the first whose torch sees a CUDA device, or
# failing that the first that imports torch and lightning. It needs nothing beyond the project's test extras (the
# CUDA tests use pytest, torch, lightning, torchmetrics and rich), and runs the sources of this tree (src/).
# Exit status: 0 when nothing failed (skips included), 1 when a check failed, 2 when no Python could run it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$(mktemp -d -t ampwatch-gpu-check.XXXXXX)}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)

probe='import torch, lightning; print(int(torch.cuda.is_available()))'
pick() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local first="" c
  for c in "$ROOT/.venv/bin/python" python3; do
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    local cuda
    cuda=$("$c" -c "$probe" 2>/dev/null) || continue
    [ -z "$first" ] && first=$c
    if [ "$cuda" = 1 ]; then echo "$c"; return; fi
  done
  echo "$first"
}
PY=$(pick)
if [ -z "$PY" ] || ! "$PY" -c "$probe" >/dev/null 2>&1; then
  echo "gpu-check: no Python here imports torch and lightning: set PYTHON=..., or make .venv as .ci/run does (with a CUDA build of torch for the CUDA checks)" >&2
  exit 2
fi
"$PY" - <<'EOF' | tee "$OUT_DIR/environment.txt"
import platform, sys, torch, lightning
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (no CUDA: the CUDA checks are skipped)"
print(f"python {sys.executable} {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"lightning {lightning.__version__}")
print(f"GPU: {gpu}")
EOF

status=0
echo "== the CUDA tests and their CPU counterparts"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs -o addopts="" \
  --junitxml="$OUT_DIR/junit-gpu-check.xml" \
  tests/test_cuda.py tests/test_snapshot_copy.py tests/test_compiled_names.py tests/test_rollback_by_hand.py \
  2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && status=1 && echo "gpu-check: the tests ended with exit status $rc"

echo "== the benchmark"
timeout 170 "$PY" benchmarks/gpu_bench.py --json "$OUT_DIR/gpu_bench.json" 2>&1 \
  | grep -v -e "LOCAL_RANK" -e "litlogger" -e "available: " -e "stopped: \`max_steps" | tee "$OUT_DIR/gpu_bench.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && status=1 && echo "gpu-check: the benchmark ended with exit status $rc"

echo "== summary"
"$PY" - "$OUT_DIR" "$(( $(date +%s) - START ))" <<'EOF' | tee "$OUT_DIR/summary.txt"
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, seconds = Path(sys.argv[1]), int(sys.argv[2])
rows = []
junit = out / "junit-gpu-check.xml"
if junit.exists():
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        result = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                why = (found.get("message") or "").splitlines()[0] if found.get("message") else ""
                if tag == "skipped":
                    why = why.split(": ", 1)[1] if why.startswith("Skipped: ") else why
                    result = "skipped: no CUDA" if why.startswith("no CUDA") else f"skipped: {why}"
                else:
                    result = f"FAILED: {why[:100]}"
                break
        rows.append((name, result))
else:
    rows.append(("tests", "FAILED: no junit XML (the test run did not finish)"))
width = max(len(n) for n, _ in rows)
print(f"{'check'.ljust(width)}  result")
for name, result in rows:
    print(f"{name.ljust(width)}  {result}")
counts = {k: sum(r.startswith(k) for _, r in rows) for k in ("passed", "skipped", "FAILED")}
print(f"{counts['passed']} passed, {counts['FAILED']} failed, {counts['skipped']} skipped")
print()
bench = out / "gpu_bench.json"
data = json.loads(bench.read_text()) if bench.exists() else {"skipped": "the benchmark wrote no figures"}
if "skipped" in data:
    for what in ("watched/bare, realistic step", "snapshot stall", "host syncs per step"):
        print(f"{what:32s} skipped: {data['skipped']}")
else:
    print(f"measured on {data['device']}, torch {data['torch']}, {data['date']}")
    r = data.get("realistic")
    if r:
        ci = r["ratio_ci95"]
        ci_text = f"95% CI {ci[0]:.3f}..{ci[1]:.3f}" if ci else "no 95% CI"
        print(f"{'watched/bare, realistic step':32s} {r['ratio_median']:.3f} ({ci_text}; {r['rounds']} rounds; bare "
              f"{r['bare_ms_median']:.1f} ms, watched {r['watched_ms_median']:.1f} ms a step, "
              f"{r['parameters'] / 1e6:.0f}M parameters)")
    s = data.get("stall")
    if s:
        on = s["modes"].get("on", {})
        before = s["modes"].get("on, compute-stream copy")
        extra = f"; the copy on the compute stream: {before['stall_ms']:+.2f} ms" if before else ""
        print(f"{'snapshot stall':32s} {on.get('stall_ms', float('nan')):+.2f} ms on the step after a snapshot "
              f"({s['snapshot_mb']:.0f} MB, the copy alone {s['copy_ms']:.1f} ms{extra})")
    y = data.get("syncs")
    if y and "skipped" not in y:
        print(f"{'host syncs per step':32s} bare {y['bare_per_step']:.2f}, watched {y['watched_per_step']:.2f}; "
              f"added {y['added_per_ordinary_step']:.2f} on an ordinary step (max {y['added_max_ordinary']}), "
              f"{y['added_per_log_step']:.2f} on a log step (max {y['added_max_log']})")
    elif y:
        print(f"{'host syncs per step':32s} skipped: {y['skipped']}")
print(f"\n{seconds} s in all; outputs in {out}")
EOF
exit $status
