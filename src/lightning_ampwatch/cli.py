"""``ampwatch``: run a demo that hits a real AMP fault, or summarise a run's diagnoses."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from typing import Sequence

from rich.console import Console


def _quiet_lightning() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def _demo(args: argparse.Namespace, console: Console) -> int:
    from lightning_ampwatch.scenarios import SCENARIOS

    if args.list:
        for name, scenario in SCENARIOS.items():
            console.print(f"[bold]{name:<18}[/bold] -> {scenario.expected:<18} {scenario.description}")
        return 0
    if args.scenario not in SCENARIOS:
        console.print(f"[red]Unknown scenario {args.scenario!r}.[/red] Choose one of: {', '.join(SCENARIOS)}")
        return 2
    _quiet_lightning()
    from lightning_ampwatch.callback import AmpWatch
    from lightning_ampwatch.scenarios import run_scenario

    scenario = SCENARIOS[args.scenario]
    root = args.root_dir or tempfile.mkdtemp(prefix=f"ampwatch-{args.scenario}-")
    console.rule(f"ampwatch demo: {scenario.name}")
    console.print(scenario.description)
    console.print(f"Precision: {scenario.precision} on the CPU, {scenario.max_steps} steps, logs in {root}\n")
    watch = AmpWatch(remediate=args.remediate)
    run_scenario(args.scenario, root, watch)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    console.print()
    if not watch.diagnoses:
        console.print("AmpWatch saw nothing to report.")
    found = [d.finding.value for d in watch.diagnoses]
    verdict = "as expected" if scenario.expected in found else f"expected {scenario.expected}"
    console.print(f"Diagnoses: {', '.join(found) or 'none'} ({verdict}); {len(alarms)} alarm(s).")
    if watch.event_log is not None:
        console.print(f"Event log: {watch.event_log.path}")
    return 0 if scenario.expected in found else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampwatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on the CPU with true float16 AMP until it breaks")
    demo.add_argument("scenario", nargs="?", default="gradient_overflow", help="which fault (see --list)")
    demo.add_argument("--list", action="store_true", help="list the scenarios and exit")
    demo.add_argument("--remediate", action="store_true", help="let AmpWatch apply its fixes mid-run")
    demo.add_argument("--root-dir", default=None, help="where logs go (default: a new temporary directory)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False)
    if args.command == "demo":
        return _demo(args, console)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
