"""ampwatch: run a demo that hits a real AMP fault, or summarise a run's diagnoses."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from lightning_ampwatch.reporters import EVENT_LOG_NAME, ensure_writable


def _quiet_lightning() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def _demo(args: argparse.Namespace, console: Console) -> int:
    from lightning_ampwatch.scenarios import SCENARIOS

    if args.list:
        _list_scenarios(SCENARIOS, console)
        return 0
    if args.scenario not in SCENARIOS:
        console.print(f"[red]Unknown scenario {escape(repr(args.scenario))}.[/red] "
                      f"Choose one of: {', '.join(SCENARIOS)}")
        return 2
    _quiet_lightning()
    from lightning_ampwatch.callback import AmpWatch
    from lightning_ampwatch.scenarios import run_scenario

    scenario = SCENARIOS[args.scenario]
    root = Path(args.root_dir or tempfile.mkdtemp(prefix=f"ampwatch-{args.scenario}-"))
    logs = root / "ampwatch"  # build_trainer runs without a logger: the log directory is the root itself
    try:
        ensure_writable(logs)
    except OSError as err:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"ampwatch demo: cannot write the logs to {logs}: {err}", markup=False)
        return 2
    steps = scenario.max_steps * 2 if args.remediate else scenario.max_steps  # room to show the recovery
    console.rule(f"ampwatch demo: {scenario.name}")
    console.print(scenario.description)
    console.print(f"Precision: {scenario.precision} on the CPU, {steps} optimizer steps, logs in {root}\n",
                  markup=False, soft_wrap=True)  # never break a path across lines
    watch = AmpWatch(remediate="all" if args.remediate else False)  # reduce_lr included
    run_scenario(args.scenario, str(root), watch, max_steps=steps)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    console.print()
    if not watch.diagnoses:
        console.print("AmpWatch saw nothing to report.")
    found = [d.finding.value for d in watch.diagnoses]
    verdict = "as expected" if scenario.expected in found else f"expected {scenario.expected}"
    console.print(f"Diagnoses: {', '.join(found) or 'none'} ({verdict}); {len(alarms)} alarm(s).")
    if args.remediate:
        _say_recovery(watch, console)
    event_log = logs / EVENT_LOG_NAME
    if event_log.is_file():
        console.print(f"Event log: {event_log}", markup=False, soft_wrap=True)
    return 0 if scenario.expected in found else 1


def _list_scenarios(scenarios: dict[str, Any], console: Console) -> None:
    """One scenario a row: its name, the finding it makes, and its description wrapped in its own column."""
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True, style="bold")
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for name, scenario in scenarios.items():
        table.add_row(Text(name), Text(scenario.expected), Text(scenario.description))
    console.print(table)


def _say_recovery(watch: object, console: Console) -> None:
    """After a ``--remediate`` demo: each alarm's remedy, where the run went back to, and whether it was verified;
    or why it got none."""
    from lightning_ampwatch.reporters import rollback_line, unremedied_reason
    from lightning_ampwatch.summary import remedy_outcome

    diagnoses = list(getattr(watch, "diagnoses", []))
    for d in sorted((d for d in diagnoses if d.is_alarm), key=lambda d: d.step):
        if d.remedy is None:
            why = unremedied_reason(d, diagnoses, getattr(watch, "remedies", None)) or "see the advice above"
            console.print(f"{d.finding.value} at step {d.step}: no remedy; {why}.",
                          markup=False, soft_wrap=True)
            continue
        said = remedy_outcome(d)
        console.print(f"Remedy for {d.finding.value} at step {d.step}: {said}.", markup=False, soft_wrap=True)
        for earlier in d.evidence.get("remedies_tried", []):
            console.print(f"  before it: {earlier.get('remedy')}, {earlier.get('outcome')}: {earlier.get('reason')}",
                          markup=False, soft_wrap=True)
        for key in ("rollback", "recovery"):
            value = d.evidence.get(key)
            text = value.get("reason") if isinstance(value, dict) else value
            if key == "rollback" and isinstance(text, str):
                text = rollback_line(text, d)  # how many batches it skipped, and what sets how many
            if text and text not in said:  # a recovery not verified: its reason is already in the line above
                console.print(f"  {key}: {text}", markup=False, soft_wrap=True)


def _report(args: argparse.Namespace, console: Console) -> int:
    """Print the episode table of a run; with ``--plot`` / ``--html`` draw its timeline too."""
    from lightning_ampwatch.report import (
        load_run,
        locate_run,
        print_report,
        record_gap,
        render_html,
        render_plot,
        run_title,
    )

    errors = Console(stderr=True, highlight=False, soft_wrap=True)  # never break a path across lines
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            files = locate_run(args.path)
            diagnoses, timeline = load_run(files)
    except (OSError, ValueError) as err:
        errors.print(f"ampwatch report: {err}", markup=False)
        return 2
    for warning in caught:  # a cut-short last line: said plainly, once, before the report
        errors.print(f"ampwatch report: warning: {warning.message}", markup=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=120)  # piped or captured: a table wider than the 80 default
    print_report(files, diagnoses, timeline, console, full=args.full)
    if (args.plot or args.html) and (timeline is None or not timeline.steps):
        errors.print(f"ampwatch report: {files.directory} has no {'steps in its ' if timeline else ''}timeline.jsonl "
                     "to draw (the callback writes it beside diagnoses.jsonl)", markup=False)
        return 2
    title = f"AmpWatch timeline: {run_title(files)}"
    for out, render in ((args.plot, lambda o: render_plot(timeline, diagnoses.shown, o, title=title)),
                        (args.html, lambda o: render_html(o, files, diagnoses, timeline))):
        if not out:
            continue
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            render(out)
        except ImportError as err:  # matplotlib is the [plot] extra, not a dependency of the callback
            errors.print(f"ampwatch report: drawing needs matplotlib ({err}); install it with "
                         "pip install 'lightning-ampwatch[plot]' (or pip install matplotlib)", markup=False)
            return 2
        except (OSError, ValueError) as err:
            errors.print(f"ampwatch report: cannot write {out}: {err}", markup=False)
            return 2
        console.print(f"Wrote {out}", markup=False)
    # the report is written, but the event log does not account for the run: a script must not read it as healthy
    return 1 if record_gap(files, diagnoses, timeline) is not None else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampwatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on the CPU with true float16 AMP until it breaks")
    demo.add_argument("scenario", nargs="?", default="gradient_overflow", help="which fault (see --list)")
    demo.add_argument("--list", action="store_true", help="list the scenarios and exit")
    demo.add_argument("--remediate", action="store_true",
                      help="let AmpWatch apply its fixes mid-run (every remedy, reduce_lr included)")
    demo.add_argument("--root-dir", default=None, help="where logs go (default: a new temporary directory)")
    report = sub.add_parser("report", help="summarise a run's diagnoses; draw its timeline with --plot/--html")
    report.add_argument("path", help="a run or log directory, an ampwatch/ directory, or a diagnoses.jsonl")
    report.add_argument("--plot", metavar="FILE.png", help="draw the timeline to this image (.png, .svg, .pdf)")
    report.add_argument("--full", action="store_true",
                        help="after the table, each diagnosis's panel with every evidence row")
    report.add_argument("--html", metavar="FILE.html", help="write a self-contained page: summary, plot, table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False)
    if args.command == "demo":
        return _demo(args, console)
    if args.command == "report":
        return _report(args, console)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
