"""Regenerate ``docs/timeline.png``, the README's screenshot, from a real run: nothing in it is drawn by hand.

It runs ``ampwatch demo SCENARIO`` (a small true-float16 training on the CPU that hits a real fault) into a
temporary directory, then draws that run's logs with ``ampwatch report DIR --plot docs/timeline.png``, exactly
as a user would. Run from anywhere: ``python scripts/make_screenshot.py [--scenario lr_schedule]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from lightning_ampwatch.cli import main as ampwatch
    from lightning_ampwatch.scenarios import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="lr_schedule", choices=sorted(SCENARIOS),
                        help="which demo run to draw (default: lr_schedule, an LR jump that overflows float16)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "timeline.png", help="where the PNG goes")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ampwatch-screenshot-") as tmp:
        run_dir = Path(tmp) / args.scenario  # the plot's title names the run directory
        code = ampwatch(["demo", args.scenario, "--root-dir", str(run_dir)])
        if code != 0:
            print(f"make_screenshot: the {args.scenario} demo did not reach its expected finding (exit {code})",
                  file=sys.stderr)
            return code
        code = ampwatch(["report", str(run_dir), "--plot", str(args.out)])
    if code == 0:
        print(f"make_screenshot: wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
