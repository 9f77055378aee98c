"""Diagnose by intervention: at an alarm, the episode's window is replayed from the snapshot before its onset once
per candidate fix, and what cured decides the finding and the remedy (the taxonomy's own method: FP32 as the
control, then "lower the LR and re-test").

:class:`Interventions` runs the replays (``trajectory.replay_trajectory``: in place, the live state put back
exactly) within a total replay-step cap; :class:`InterventionReport` is what they measured, typed; and
:func:`decide` applies the taxonomy's order to it. Replays run on alarms only: a healthy step never gets here.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

from lightning_ampwatch.taxonomy import Finding, format_pow2
from lightning_ampwatch.machine.vocabulary import FP16_MAX
from lightning_ampwatch.verdicts import TrajectoryResult


class Intervention(str, Enum):
    """A candidate fix tried on a replay of the window, in the order they are tried."""

    NOTHING = "nothing"  # the run's own precision, nothing changed: does the fault reproduce?
    FP32 = "fp32"  # autocast off, no scaler: the control
    LOWER_LR = "lower_lr"  # the run's own precision, every learning rate divided by 10
    ISLAND = "fp32_island"  # the located module and its siblings in float32
    LOWER_SCALE = "lower_scale"  # the run's own precision from a lower loss scale
    BF16 = "bf16"  # bfloat16 autocast, no scaler


#: Least invasive first: which cure a remedy copies when several cured (a scale changes no arithmetic; an island
#: changes a few modules'; bf16 every module's; a lower learning rate changes the optimisation itself).
INVASIVENESS = (Intervention.LOWER_SCALE, Intervention.ISLAND, Intervention.BF16, Intervention.LOWER_LR)

#: The lower-LR intervention's factor (as the FP32_UNSTABLE remedy's first rung); after a known rise larger than
#: 10x, the factor that undoes the rise.
LR_FACTOR = 0.1
#: At the lower LR the watched modules' headroom under float16's maximum "still shrinks" when their largest output
#: grows by more than this many bits (log2) from the first third of the window to the last.
SHRINK_BITS = 0.25


@dataclass(frozen=True)
class Tried:
    """One replay of the window with one intervention: what it changed (``label``) and what it measured."""

    kind: Intervention
    label: str
    result: TrajectoryResult
    window_steps: int  # the steps the whole window has: a replay that stopped at a fault ran fewer
    modules: tuple[str, ...] = ()  # the island's modules
    scale: float | None = None  # the lower-scale replay's starting scale
    # the fault's onset: the replay's skips before it are the run's own history (the scaler finding its level at the
    # start), which the state machine did not count as the fault's first sign: they are no fault here either
    counted_from: int | None = None

    def _counted(self) -> list[bool]:
        r, start = self.result, self.counted_from
        return list(r.skipped) if start is None else [k and s >= start for s, k in zip(r.steps, r.skipped)]

    @property
    def skips(self) -> int:
        return sum(self._counted())

    @property
    def skips_before(self) -> int:
        """The skips before the onset, left out of :attr:`skips`."""
        return sum(self.result.skipped) - self.skips

    @property
    def nonfinite(self) -> int:
        return sum(1 for v in self.result.losses if v is not None and not math.isfinite(v))

    @property
    def cured(self) -> bool:
        """Ran the whole window with no non-finite loss, finite weights and no skip (one, the scaler probing, for a
        fix). Whether FP32 itself diverges is the trajectory verdict's to say (against the healthy level)."""
        r = self.result
        # a fix may let the scaler probe once (a skip as it tries a higher scale); nothing changed, and a lower scale
        # measured for safety, may not skip at all
        allowed = 0 if self.kind in (Intervention.NOTHING, Intervention.LOWER_SCALE) else 1
        return len(r.steps) == self.window_steps and r.first_nonfinite is None and self.skips <= allowed

    @property
    def losses(self) -> list[float]:
        return [v for v in self.result.losses if v is not None and math.isfinite(v)]

    def headroom_bits(self) -> list[float]:
        """Per step, log2(float16 max / the watched modules' largest output): how many doublings are left."""
        return [math.log2(FP16_MAX / v) if v > 0 else math.inf for v in self.result.absmax]

    def shrinking(self) -> tuple[float, float] | None:
        """(headroom at the start, at the end) when it still shrinks over the window by more than
        :data:`SHRINK_BITS`; None when it stopped shrinking (or nothing was watched)."""
        bits = [b for b in self.headroom_bits() if math.isfinite(b)]
        if len(bits) < 3:
            return None
        third = max(1, len(bits) // 3)
        first, last = statistics.median(bits[:third]), statistics.median(bits[-third:])
        return (first, last) if first - last > SHRINK_BITS else None

    def keeps_growing(self, onset: int) -> tuple[float, float] | None:
        """For the FP32 replay: (the watched modules' headroom under float16's maximum at the onset, at the window's
        end, in bits) when, while this replay trains clean, it keeps shrinking after the onset by more than
        :data:`SHRINK_BITS` (or the values pass float16's maximum): values that keep growing with training. None
        otherwise."""
        if not self.result.absmax or not self.cured:
            return None
        pairs = [(s, b) for s, b in zip(self.result.steps, self.headroom_bits()) if s >= onset and math.isfinite(b)]
        if len(pairs) < 2:
            return None
        at, end = pairs[0][1], pairs[-1][1]
        return (at, end) if at - end > SHRINK_BITS or end < 0 else None

    def line(self) -> str:
        """One line for the panel: "fp32 island on a, b: 0 skips, loss 1.9 -> 1.4"."""
        losses = self.losses
        trend = f"loss {losses[0]:.3g} -> {losses[-1]:.3g}" if losses else "no finite loss"
        parts = [f"{self.skips} skip{'s' if self.skips != 1 else ''}"]
        if self.skips_before:
            parts[0] += f" (and {self.skips_before} before the onset at step {self.counted_from}, not counted)"
        if self.nonfinite:
            parts.append(f"{self.nonfinite} non-finite")
        if len(self.result.steps) < self.window_steps:
            at = self.first_fault()
            parts.append(f"stopped at the fault at step {at}" if at is not None else "stopped early")
        return f"{self.label}: {', '.join(parts)}, {trend}"

    def first_fault(self) -> int | None:
        r = self.result
        bad = r.first_nonfinite
        skipped = next((s for s, k in zip(r.steps, self._counted()) if k), None)
        found = [s for s in (bad, skipped) if s is not None]
        return min(found) if found else None

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"intervention": self.kind.value, "label": self.label, "skips": self.skips,
                               "nonfinite": self.nonfinite, "steps_run": len(self.result.steps),
                               "cured": self.cured,
                               "losses": [v if v is None or math.isfinite(v) else str(v) for v in self.result.losses]}
        if self.skips_before:
            out["skips_before_onset"] = self.skips_before
        if self.modules:
            out["modules"] = list(self.modules)
        if self.scale is not None:
            out["scale"] = self.scale
        if self.result.absmax:
            out["headroom_log2"] = [round(b, 2) if math.isfinite(b) else None for b in self.headroom_bits()]
        return out


@dataclass(frozen=True)
class InterventionReport:
    """What the interventions measured over one window: each replay, those not tried (and why), the safe scale."""

    from_step: int  # the snapshot's step: the window starts after it
    onset: int
    lr_factor: float  # what the lower-LR replay multiplied every learning rate by
    window: tuple[int, int]  # the steps replayed (the last ones past the alarm repeat the window's batches)
    repeated_from: int | None  # the first step whose batches repeat earlier ones (None: none repeated)
    tried: tuple[Tried, ...]
    not_tried: tuple[tuple[str, str], ...] = ()  # (label, why)
    safe_scale: float | None = None  # the largest scale that ran the whole window without a skip
    safe_scale_tried: tuple[tuple[float, bool], ...] = ()  # (scale, ran clean) in the order tried

    @property
    def safe_scale_bounded(self) -> bool:
        """Twice the safe scale was replayed and skipped (or is above the onset's half): it is the largest that holds,
        not only the largest the cap let the search try."""
        return self.safe_scale is not None and any(s == 2 * self.safe_scale and not ok
                                                   for s, ok in self.safe_scale_tried)
    island_modules: tuple[str, ...] = ()
    replayed_steps: int = 0
    cap: int = 0

    def get(self, kind: Intervention) -> Tried | None:
        """The first replay of ``kind`` (for LOWER_SCALE: the one at the safe scale, else the first)."""
        found = [t for t in self.tried if t.kind is kind]
        if kind is Intervention.LOWER_SCALE and self.safe_scale is not None:
            found = [t for t in found if t.scale == self.safe_scale] or found
        return found[0] if found else None

    def cured(self, kind: Intervention) -> bool:
        t = self.get(kind)
        return t is not None and t.cured

    def cures(self) -> list[Intervention]:
        """The interventions that cured for good, least invasive first (a lower LR that only delays the fault, its
        headroom still shrinking, is no cure)."""
        out = []
        for kind in INVASIVENESS:
            t = self.get(kind)
            if t is None or not t.cured:
                continue
            if kind is Intervention.LOWER_LR and self.lr_only_delays():
                continue
            out.append(kind)
        return out

    def lr_only_delays(self) -> bool:
        """The lower LR ran clean, but only delays the fault: its own headroom still shrinks, or FP32 training
        healthily at the full LR shows the located module's values growing on after the onset."""
        lower, fp32 = self.get(Intervention.LOWER_LR), self.get(Intervention.FP32)
        if lower is None:
            return False
        return lower.shrinking() is not None or (fp32 is not None and bool(self.island_modules)
                                                 and fp32.keeps_growing(self.onset) is not None)

    def lines(self) -> list[str]:
        """The panel's lines: one per replay (the lower-scale search as one line), then those not tried."""
        fp32 = self.get(Intervention.FP32)
        fp32_end = f" (FP32 {fp32.losses[-1]:.3g})" if fp32 is not None and fp32.cured and fp32.losses else ""
        out: list[str] = []
        for t in self.tried:
            if t.kind is Intervention.LOWER_SCALE:
                continue
            line = t.line()
            if t.kind in (Intervention.ISLAND, Intervention.BF16) and t.cured:
                line += fp32_end
            if t.kind is Intervention.LOWER_LR and t.cured and self.lr_only_delays():
                line += " (only delays it: see the finding)"
            out.append(line)
        if self.safe_scale_tried:
            tried = ", ".join(f"{format_pow2(s)} {'clean' if ok else 'skipped'}" for s, ok in self.safe_scale_tried)
            safe = f"safe scale {format_pow2(self.safe_scale)}" if self.safe_scale is not None else "no scale held"
            out.append(f"lower loss scale: {tried}: {safe}")
        out.extend(f"{label}: not tried ({why})" for label, why in self.not_tried)
        return out

    def headline(self) -> str:
        a, b = self.window
        return f"tried from step {a} (to {b}): " + "; ".join(self.lines())

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from_snapshot_step": self.from_step, "window": list(self.window),
                               "replayed_steps": self.replayed_steps, "replay_step_cap": self.cap,
                               "tried": [t.evidence() for t in self.tried], "lines": self.lines(),
                               "cured_by": [k.value for k in self.cures()]}
        if self.repeated_from is not None:
            out["repeats_batches_from_step"] = self.repeated_from
        if self.not_tried:
            out["not_tried"] = {label: why for label, why in self.not_tried}
        if self.safe_scale_tried:
            out["scales_tried"] = [[s, ok] for s, ok in self.safe_scale_tried]
        return out


def siblings(module: Any, name: str) -> tuple[str, ...]:
    """``name`` and every module of the same class: for a class of the user's own, anywhere in the model; for one of
    torch's (a Linear), only those at the same place in repeated blocks (``blocks.*.attn.q``). In model order."""
    named = dict(module.named_modules())
    target = named.get(name)
    if target is None:
        return (name,)
    cls = type(target)
    pattern = _pattern(name)
    builtin = cls.__module__.startswith("torch.")
    found = [n for n, m in named.items() if type(m) is cls and n and (not builtin or _pattern(n) == pattern)]
    # a module inside another of the list runs inside its island already
    found = [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    return tuple(found) or (name,)


def _pattern(name: str) -> tuple[str, ...]:
    return tuple("*" if part.isdigit() else part for part in name.split("."))


def module_label(module: Any, names: Sequence[str]) -> str:
    """"2 ExpSelfAttention modules (blocks.0.attn, blocks.1.attn)", or the one name."""
    if len(names) == 1:
        return names[0]
    cls = type(module.get_submodule(names[0])).__name__
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(names)} {cls} modules ({shown})"


Replay = Callable[..., TrajectoryResult]


class Interventions:
    """Replays one window once per candidate intervention, within ``cap`` replayed steps in all.

    ``replay(**options)`` is ``replay_trajectory`` bound to the state, snapshot and window (``precision``,
    ``lr_factor``, ``scale``, ``island``, ``watch``, ``stop_on_fault``). ``before_each`` is called before each replay
    with no argument and returns True to stop (the ranks meeting between replays, where they must).
    """

    def __init__(self, replay: Replay, *, window: Sequence[int], cap: int, bf16: bool,
                 before_each: Callable[[], bool] = lambda: False,
                 agree: Callable[[bool], bool] = lambda ran_clean: ran_clean) -> None:
        self.onset = window[0] if window else 0
        self.lr_factor = LR_FACTOR
        self.replay = replay
        self.window = list(window)
        self.cap = cap
        self.bf16 = bf16
        self.before_each = before_each
        # every rank's answer to "did it run clean?" made one (all of them): which replay comes next must be the same
        # on every rank, since the replays' restores and meetings are collectives (each rank replays its own batches)
        self.agree = agree
        self.stopped = False  # a replay failed (here or, where the ranks meet, on another rank): no more replays
        self.used = 0

    def _room(self) -> bool:
        return self.used + len(self.window) <= self.cap

    def _run(self, **options: Any) -> TrajectoryResult | None:
        if self.stopped or self.before_each():  # (once stopped, on every rank alike: no more meetings either)
            self.stopped = True
            return None
        result = self.replay(**options)
        if result is not None:
            self.used += len(result.steps)
        return result

    def run(self, *, module: Any, located: str | None, forward: bool, onset_scale: float | None,
            scale_hint: float | None, scaled: bool, from_step: int, onset: int,
            repeated_from: int | None, lr_factor: float = LR_FACTOR,
            lr_cap: float | None = None, lr_rose: bool = False,
            unlocated: str = "the fault was not located in a module", lower_lr_moot: str | None = None,
            fp32_fails: Callable[[Tried, Tried], bool] | None = None) -> InterventionReport:
        """``located``: the module the fault was located in (forward faults), or None; ``forward``: the loss itself
        went non-finite (no loss scale reaches a forward overflow); ``onset_scale``: the scale the run faulted at;
        ``scale_hint``: the single-batch estimate of a safe scale, where the search starts; ``scaled``: the run has
        a scaler; ``lr_rose``: the LR rose before the onset, so the lower LR is always replayed: where the cap has no
        room left for the whole window, over as much of it as fits, through the onset and a step past it;
        ``fp32_fails(nothing, fp32)``: the FP32 replay, finite, still failed (it climbed far above the level: the
        trajectory control's verdict), so no precision fix is replayed. ``lower_lr_moot``: why the lower LR is not
        replayed (the window starts past the onset), or None."""
        n = len(self.window)
        self.onset = onset
        self.lr_factor = lr_factor
        tried: list[Tried] = []
        not_tried: list[tuple[str, str]] = []
        island = siblings(module, located) if located else ()
        watch = island

        def attempt(kind: Intervention, label: str, stop: bool, **options: Any) -> Tried | None:
            steps = n
            if not self._room():
                room = self.cap - self.used
                through = self.window.index(onset) + 2 if onset in self.window else None  # the onset and one past
                if kind is Intervention.LOWER_LR and lr_rose and through is not None and through <= room < n:
                    steps = room  # shortened, never left out: the LR rose before the onset
                    options["limit"] = room
                    label = (f"{label} (steps {self.window[0]}-{self.window[room - 1]}: the window shortened to the "
                             f"replay-step cap of {self.cap})")
                else:
                    not_tried.append((label, f"the replay-step cap of {self.cap} per alarm is reached "
                                             "(Thresholds.replay_steps)"))
                    return None
            allowed = 0 if kind in (Intervention.NOTHING, Intervention.LOWER_SCALE) else 1
            result = self._run(stop_on_fault=stop, skips_allowed=allowed, count_from=onset, **options)
            if result is None:
                return None
            t = Tried(kind, label, result, steps, modules=tuple(options.get("island", ())), scale=options.get("scale"),
                      counted_from=onset)
            tried.append(t)
            return t

        nothing = attempt(Intervention.NOTHING, "nothing changed", True, precision="amp", watch=watch)
        fp32 = attempt(Intervention.FP32, "FP32", False, precision="fp32", watch=watch)
        # it did not reproduce: nothing to measure a fix against (asked on every rank alike, whatever it ran)
        if self.agree(nothing is not None and nothing.cured) and not self.stopped:
            return self._report(from_step, repeated_from, tried, not_tried, island)
        # FP32 fails too: not an AMP fault, so no precision fix (island, scale, bf16) can cure it and only the lower
        # LR is worth its replay steps (the lr_schedule demo spent its cap on a scale search; agreed, every rank alike)
        amp_fault = self.agree(fp32 is not None and fp32.cured and not (
            fp32_fails is not None and nothing is not None and fp32_fails(nothing, fp32)))
        if not amp_fault:
            moot = ["fp32 island", *(["lower loss scale"] if scaled else []), *(["bf16"] if self.bf16 else [])]
            not_tried.append((", ".join(moot), "FP32 training fails over the same steps, so no precision setting "
                                               "can cure it"))
        # the island first, whether or not the LR rose: it is the least invasive cure, and it stops at its first
        # fault, so it costs little where it fails; tried after the lower LR, a long window left it to the cap
        # (an LM overflowing in its attention during a 30-step warmup: the run died with the island untried)
        order = [Intervention.ISLAND, Intervention.LOWER_LR]
        safe: float | None = None
        scales: list[tuple[float, bool]] = []
        for kind in order:
            if kind is Intervention.ISLAND:
                if not amp_fault:
                    pass  # (said once, above)
                elif island:
                    attempt(kind, f"fp32 island on {module_label(module, island)}", True, precision="amp",
                            island=island)
                else:
                    not_tried.append(("fp32 island", unlocated))
            elif lower_lr_moot is not None:
                not_tried.append((f"LR/{1 / lr_factor:.3g}", lower_lr_moot))
            else:
                if lr_cap is not None:  # a rise of more than 10x: the same steps without it
                    attempt(kind, f"LR capped at {lr_cap:.3g} (before the rise)", False, precision="amp",
                            lr_cap=lr_cap, watch=watch)
                else:
                    attempt(kind, f"LR/{1 / lr_factor:.3g}", False, precision="amp", lr_factor=lr_factor,
                            watch=watch)
        if not scaled:
            pass
        elif not amp_fault:
            pass
        elif forward:
            not_tried.append(("lower loss scale", "the fault is in the forward pass, which a loss scale does not "
                                                  "reach"))
        elif onset_scale is not None:
            safe, scales = self._search_scale(tried, not_tried, onset_scale, scale_hint)
        if not self.bf16:
            not_tried.append(("bf16", "bfloat16 is not supported on this device"))
        elif not amp_fault:
            pass
        else:
            attempt(Intervention.BF16, "bf16", True, precision="bf16")
        return self._report(from_step, repeated_from, tried, not_tried, island, safe, scales)

    def _search_scale(self, tried: list[Tried], not_tried: list[tuple[str, str]], onset: float,
                      hint: float | None) -> tuple[float | None, list[tuple[float, bool]]]:
        """The largest power-of-two scale below ``onset`` that runs the whole window without a skip: from the
        single-batch estimate (or 2**-4 x the onset's), down by 4x until one runs clean, then up by 2x while one
        does. Each replay stops at its first skip."""
        n = len(self.window)
        top = onset / 2
        start = min(hint, top) if hint is not None and hint > 0 else onset / 16
        c = 2.0 ** math.floor(math.log2(start))
        results: dict[float, bool] = {}
        order: list[tuple[float, bool]] = []

        def clean(scale: float) -> bool | None:
            if scale in results:
                return results[scale]
            if not self._room():
                return None
            result = self._run(precision="amp", scale=scale, stop_on_fault=True)
            if result is None:
                return None
            t = Tried(Intervention.LOWER_SCALE, f"loss scale {format_pow2(scale)}", result, n, scale=scale)
            tried.append(t)
            ran_clean = self.agree(t.cured)
            results[scale] = ran_clean
            order.append((scale, ran_clean))
            return ran_clean

        floor = 2.0 ** -24
        ok = clean(c)
        while ok is False and c / 4 >= floor:
            c /= 4
            ok = clean(c)
        if ok is None:
            not_tried.append(("lower loss scale", f"the replay-step cap of {self.cap} per alarm is reached "
                                                  "(Thresholds.replay_steps)") if not order else
                             ("lower loss scale, further", "the replay-step cap is reached"))
            return (max((s for s, k in order if k), default=None)), order
        if not ok:
            return None, order
        safe = c
        # between a clean scale and a failed one above it, there may be room: go up by 2x while clean
        while safe * 2 <= top and results.get(safe * 2) is not False:
            up = clean(safe * 2)
            if not up:
                break
            safe *= 2
        return safe, order

    def _report(self, from_step: int, repeated_from: int | None, tried: list[Tried],
                not_tried: list[tuple[str, str]], island: tuple[str, ...], safe: float | None = None,
                scales: Sequence[tuple[float, bool]] = ()) -> InterventionReport:
        return InterventionReport(from_step=from_step, onset=self.onset, lr_factor=self.lr_factor, window=(self.window[0], self.window[-1]),
                                  repeated_from=repeated_from, tried=tuple(tried), not_tried=tuple(not_tried),
                                  safe_scale=safe, safe_scale_tried=tuple(scales), island_modules=island,
                                  replayed_steps=self.used, cap=self.cap)


# --------------------------------------------------------------------------------------------
# the finding from what cured, in the taxonomy's order
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The finding the interventions support, why in a sentence, and the co-factors shown beside it."""

    finding: Finding
    reason: str
    cofactors: tuple[str, ...] = field(default_factory=tuple)
    location: str | None = None


def decide(report: InterventionReport, *, finding: Finding, located: str | None, lr_rise: str | None,
           batch_nonfinite: bool, forward: bool, onset: int, fp32_cured: bool = True) -> Decision | None:
    """The taxonomy's order applied to what cured. ``finding``: the machine's (timing-based) name; ``lr_rise``: the
    LR rise before the onset in words, or None; ``forward``: the loss went non-finite. None: the replays do not
    decide (the fault did not reproduce is NOT_REPRODUCED; too little was measured to say more: None)."""
    nothing = report.get(Intervention.NOTHING)
    fp32 = report.get(Intervention.FP32)
    lower = report.get(Intervention.LOWER_LR)
    a, b = report.window
    factor = report.lr_factor
    if nothing is None:
        return None
    if nothing.cured:
        return Decision(Finding.NOT_REPRODUCED, (
            f"replayed from the snapshot after step {report.from_step} at the run's own precision, steps {a}-{b} ran "
            "with no skip and no non-finite loss: the fault did not reproduce"))
    if fp32 is None:
        return None
    cofactors = (f"the learning rate rose before the onset ({lr_rise})",) if lr_rise else ()
    if not (fp32.cured and fp32_cured):
        # not an AMP fault (FP32 went non-finite, or climbed far above its level: judged by the trajectory verdict)
        if batch_nonfinite:
            return Decision(Finding.DATA_NONFINITE, "FP32 training over the window goes non-finite too, and the "
                                                    "batch itself holds NaN/inf: not an AMP fault")
        if lower is not None and lower.cured and lr_rise:
            return Decision(Finding.LR_SCHEDULE, (
                f"FP32 training over steps {a}-{b} fails too, and the same steps at the learning rate x{factor:.3g} "
                f"train clean ({lower.line()}): the learning rate's rise ({lr_rise}) is the cause, not AMP"))
        return Decision(Finding.FP32_UNSTABLE, f"FP32 training over steps {a}-{b} fails too ({fp32.line()}): not "
                                               "an AMP fault")
    # FP32 cures: an AMP fault
    where = located
    if lr_rise and lower is not None:
        shrinking = lower.shrinking()
        grows = fp32.keeps_growing(onset) if where else None
        if lower.cured and shrinking is None and grows is None:
            return Decision(Finding.LR_SCHEDULE, (
                f"FP32 cures it, and so does the learning rate x{factor:.3g} for good ({lower.line()}; "
                f"{_headroom_words(lower)}): the learning rate's rise ({lr_rise}) sets it off"))
        if forward and where and not lower.cured:
            # measured: a lower LR does not prevent it, which says nothing of the values growing with training
            back = f"at the learning rate x{factor:.3g} the fault comes back at step {lower.first_fault()}"
            if finding is Finding.INPUT_RANGE:
                return Decision(Finding.INPUT_RANGE, (
                    f"FP32 training over steps {a}-{b} cures it; {back}: the batch's values past float16's range, "
                    "not the learning rate's rise"), cofactors, where)
            return Decision(Finding.FORWARD_OVERFLOW, (
                f"FP32 training over steps {a}-{b} cures it; {back}: a float16 overflow in {where} that a lower "
                "learning rate does not prevent, with the learning rate's rise only a co-factor"), cofactors, where)
        if forward and where:
            if shrinking:
                how = (f"at the learning rate x{factor:.3g} it only arrives later: the headroom of {where} under "
                       f"float16's maximum still shrinks ({shrinking[0]:.1f} -> {shrinking[1]:.1f} bits over steps "
                       f"{a}-{b})")
            else:
                assert grows is not None
                how = (f"in FP32, training healthily at the full learning rate, the headroom of the values inside "
                       f"{where} under float16's maximum keeps shrinking after the onset ({grows[0]:.1f} -> "
                       f"{grows[1]:.1f} bits), so the learning rate x{factor:.3g} (clean over the window, having "
                       "trained less) only makes the overflow arrive later")
            return Decision(Finding.FORWARD_OVERFLOW, (
                f"FP32 training over steps {a}-{b} cures it; {how}: a float16 overflow in {where} whose values keep "
                "growing with training, with the learning rate's rise only a co-factor"), cofactors, where)
    if report.safe_scale is not None and not forward and finding in (Finding.LR_SCHEDULE, Finding.GRADIENT_OVERFLOW):
        return Decision(Finding.GRADIENT_OVERFLOW, (
            f"FP32 cures it, and so does a loss scale of {format_pow2(report.safe_scale)}, the largest that ran steps "
            f"{a}-{b} without a skip: the scaled gradients overflow float16"), cofactors)
    if forward and where and finding in (Finding.LR_SCHEDULE, Finding.GRADIENT_OVERFLOW):
        return Decision(Finding.FORWARD_OVERFLOW, (
            f"FP32 training over steps {a}-{b} cures it and the loss itself went non-finite in {where}: a float16 "
            "overflow in the forward pass"), cofactors, where)
    return None


def _headroom_words(t: Tried) -> str:
    bits = [x for x in t.headroom_bits() if math.isfinite(x)]
    if not bits:
        return "nothing watched"
    return f"the headroom under float16's maximum stops shrinking ({bits[0]:.1f} -> {bits[-1]:.1f} bits)"
