"""The timeline drawn: the figure of ``ampwatch report --plot`` and of the ``--html`` page. Loss scale (log2) with
the skipped steps, loss, learning rates, and a marker at every diagnosis and remedy, on a bare matplotlib ``Figure``
(matplotlib is imported only when a figure is drawn).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import IO, Any, Sequence

from lightning_ampwatch.summary import counts_line, timeline_stats
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.timeline import TimelineData


def _pow2_label(value: float, _pos: Any = None) -> str:
    if value <= 0 or not math.isfinite(value):
        return ""
    exponent = math.log2(value)
    return f"$2^{{{int(round(exponent))}}}$" if abs(exponent - round(exponent)) < 1e-6 else ""


def render_plot(timeline: TimelineData, diagnoses: Sequence[Diagnosis], out: str | os.PathLike[str] | IO[bytes],
                title: str = "AmpWatch timeline", fmt: str | None = None) -> None:
    """Draw the timeline to ``out`` (see :func:`timeline_figure`)."""
    fig = timeline_figure(timeline, diagnoses, title)
    if fmt is None:
        suffix = Path(out).suffix.lstrip(".").lower() if isinstance(out, (str, os.PathLike)) else ""
        fmt = suffix or "png"
    # no version stamp in a PNG: the same run gives the same bytes (docs/timeline.png stays diff-free)
    fig.savefig(out, format=fmt, metadata={"Software": None} if fmt == "png" else None)


def timeline_figure(timeline: TimelineData, diagnoses: Sequence[Diagnosis], title: str = "AmpWatch timeline") -> Any:
    """The timeline as a matplotlib ``Figure``: loss scale (log2) with skipped steps, loss, learning rates, and a
    marker at every diagnosis and remedy. Headless: a bare ``Figure`` on the Agg canvas, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    from matplotlib.transforms import blended_transform_factory

    if not timeline.steps:
        raise ValueError(f"{timeline.path}: the timeline holds no steps to draw")
    steps = timeline.steps
    has_scale = any(s is not None for s in timeline.scales)
    n_groups = max((len(lrs) for lrs in timeline.lrs), default=0)
    panels = (["scale"] if has_scale else []) + ["loss"] + (["lr"] if n_groups else [])
    heights = {"scale": 3.0, "loss": 2.0, "lr": 1.6}
    fig = Figure(figsize=(11, 1.1 + sum(heights[p] for p in panels)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [heights[p] for p in panels]})[:, 0]
    ax_of = dict(zip(panels, axes))
    bad_steps = [s for s, skip in zip(steps, timeline.skipped) if skip]

    if has_scale:
        ax = ax_of["scale"]
        pts = [(s, v) for s, v in zip(steps, timeline.scales) if v is not None and v > 0]
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:blue", lw=1.6, label="loss scale")
        skipped = [(s, v) for s, v, k in zip(steps, timeline.scales, timeline.skipped) if k and v]
        if skipped:
            ax.scatter([p[0] for p in skipped], [p[1] for p in skipped], marker="v", s=26, color="tab:red",
                       zorder=3, label=f"skipped step ({len(bad_steps)})")
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_locator(LogLocator(base=2, numticks=9))
        ax.yaxis.set_major_formatter(FuncFormatter(_pow2_label))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, p: ""))
        ax.set_ylabel("loss scale")
        ax.legend(**_OUTSIDE)

    ax = ax_of["loss"]
    finite = [(s, v) for s, v in zip(steps, timeline.losses) if v is not None and math.isfinite(v)]
    nonfinite = [s for s, f in zip(steps, timeline.loss_finite) if f is False]
    if finite:
        # a marker at each step whose loss was read; a line only between steps read one after the other (a NaN
        # breaks it): nothing is drawn across the steps in between, which nobody measured
        xs: list[float] = []
        ys: list[float] = []
        for s, v in finite:
            if xs and s != xs[-1] + 1:
                xs.append(math.nan)
                ys.append(math.nan)
            xs.append(s)
            ys.append(v)
        ax.plot(xs, ys, marker="o", ms=3.5, ls="-", lw=0.8, alpha=0.85, color="tab:green", label="loss (read)")
        values = [p[1] for p in finite]
        if min(values) > 0 and max(values) / min(values) > 100:
            ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no loss read (a healthy step under a GradScaler is not read)", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, color="0.4")
    if nonfinite:
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(nonfinite, [0.94] * len(nonfinite), transform=top, marker="x", s=30, color="tab:red",
                   zorder=3, label=f"non-finite loss ({len(nonfinite)}, drawn at the top)", clip_on=False)
    ax.set_ylabel(f"loss\n({loss_sampling(timeline)})")
    if finite or nonfinite:
        ax.legend(**_OUTSIDE)

    if n_groups:
        ax = ax_of["lr"]
        shown = min(n_groups, 6)
        for g in range(shown):
            ys = [lrs[g] if len(lrs) > g else math.nan for lrs in timeline.lrs]
            ax.step(steps, ys, where="post", lw=1.3, label=f"group {g}" if n_groups > 1 else "learning rate")
        flat = [v for lrs in timeline.lrs for v in lrs[:shown]]
        if flat and min(flat) > 0:
            ax.set_yscale("log")  # schedules are multiplicative; a log axis also keeps a flat LR readable
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("learning rate")
        if n_groups > 1:
            extra = f" (first {shown} of {n_groups})" if n_groups > shown else ""
            ax.legend(**_OUTSIDE, title=f"param groups{extra}", title_fontsize=8)

    markers: list[tuple[int, str, str, str]] = []  # step, label, colour, line style
    for d in diagnoses:
        where = f" in {d.location}" if d.location else ""
        markers.append((d.step, f"{d.finding.value}{where}", "tab:red" if d.is_alarm else "tab:purple", "--"))
    remedies = {(e["step"], str(e.get("name"))) for e in timeline.of_kind("remedy")}
    if not remedies:  # a timeline from before remedies were recorded: fall back on the diagnoses
        remedies = {(d.step, d.remedy) for d in diagnoses if d.remedy}
    for step, name in sorted(remedies):
        markers.append((step, f"remedy: {name}", "tab:green", "-."))
    first, last = steps[0], steps[-1]
    span = max(1, last - first)
    for ax in axes:
        ax.set_xlim(first - 0.01 * span - 0.5, last + 0.01 * span + 0.5)
        ax.grid(True, which="major", alpha=0.25)
        for step, _, colour, style in markers:
            ax.axvline(step, color=colour, ls=style, lw=1.1, alpha=0.85, zorder=1)
    if markers:
        kinds = {("tab:red", "--"): "alarm", ("tab:purple", "--"): "normal scaling", ("tab:green", "-."): "remedy"}
        used = {(c, s) for _, _, c, s in markers}
        handles = [Line2D([], [], color=c, ls=s, label=name) for (c, s), name in kinds.items() if (c, s) in used]
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    axes[-1].set_xlabel("optimizer step")
    stats = timeline_stats(timeline)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    if stats is not None:
        axes[0].set_title(counts_line(stats), fontsize=9, color="0.3")
    if markers:
        _place_labels(fig, axes[0], markers)
    return fig


#: Every legend beside its panel, right of the axes: none covers a curve (the layout makes room for it)
_OUTSIDE: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, "fontsize": 8,
                            "framealpha": 0.9}


def loss_sampling(timeline: TimelineData) -> str:
    """How often the loss was read, for the loss axis: "read every step", "read every 5 steps", or "read at 9 of
    240 steps" where the reads are irregular (log steps and anomalies)."""
    read = [s for s, v in zip(timeline.steps, timeline.losses) if v is not None]
    if not read:
        return "never read"
    span = timeline.steps[-1] - timeline.steps[0] + 1
    gaps = {b - a for a, b in zip(read, read[1:])}
    if len(read) == span:
        return "read every step"
    if len(gaps) == 1:
        (gap,) = gaps
        return f"read every {gap} steps" if gap > 1 else f"read at {len(read)} of {span} steps"
    return f"read at {len(read)} of {span} steps"


def _place_labels(fig: Any, ax: Any, markers: Sequence[tuple[int, str, str, str]]) -> None:
    """Each marker's label, written upwards beside its line at the top of the top panel, measured once the layout
    is done so that none is cut off: a label longer than the panel is tall goes over several lines (the location
    under the finding, then split at its dots); one that would run past the panel's right edge goes left of its
    line; labels at nearby steps stand side by side, never on top of each other."""
    from matplotlib.transforms import blended_transform_factory, offset_copy

    fig.draw_without_rendering()  # the layout: where the axes are, in pixels
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    at = blended_transform_factory(ax.transData, ax.transAxes)
    px = fig.dpi / 72  # pixels per point
    placed: list[tuple[Any, float, float, float]] = []  # text, its line's x, its left edge, its width (pixels)
    for step, label, colour, _ in sorted(markers, key=lambda m: m[0]):
        text = ax.text(step, 0.97, label, transform=at, rotation=90, va="top", ha="left", fontsize=8, color=colour,
                       clip_on=False, bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.75})
        text.set_in_layout(False)  # placed after the layout: it must not move the axes it was measured against
        for folded in _foldings(label):
            text.set_text(folded)
            extent = text.get_window_extent(renderer)
            if extent.height <= 0.94 * box.height:
                break
        else:  # a panel too short for any folding: a smaller font (never a label cut short)
            text.set_fontsize(max(3.0, 8 * 0.94 * box.height / extent.height))
            extent = text.get_window_extent(renderer)
        line_x = ax.transData.transform((step, 0))[0]
        placed.append((text, line_x, line_x + 2 * px, extent.width + 4 * px))  # and the bbox's padding
    # Left to right, each right of its line and of the label before it; then, from the right edge back, the ones
    # that would run past it pushed left, each left of the one after it: side by side, none cut off
    cursor = -math.inf
    lefts: list[float] = []
    for _, _, left, width in placed:
        lefts.append(max(left, cursor))
        cursor = lefts[-1] + width + px
    limit = box.x1
    for i in range(len(placed) - 1, -1, -1):
        width = placed[i][3]
        lefts[i] = max(min(lefts[i], limit - width), box.x0)
        limit = lefts[i] - px
    for (text, line_x, _, _), left in zip(placed, lefts):
        text.set_transform(offset_copy(at, fig=fig, x=(left - line_x) / px, y=0, units="points"))


def _foldings(label: str) -> list[str]:
    """A label as one line, then over more and more lines: the location under the finding, then split at its
    dots (``FORWARD_OVERFLOW in blocks.0.attn``), each line as long as the longest word allows."""
    head, sep, where = label.partition(" in ")
    out = [label]
    if not sep:
        return out
    parts = where.split(".")
    for n in range(1, len(parts) + 1):
        size = math.ceil(len(parts) / n)
        lines = [".".join(parts[i:i + size]) for i in range(0, len(parts), size)]
        lines = [line + "." for line in lines[:-1]] + lines[-1:]  # each split keeps its dot at the line's end
        folded = "\n".join([head, "in " + lines[0], *lines[1:]])
        if folded != out[-1]:
            out.append(folded)
    return out
