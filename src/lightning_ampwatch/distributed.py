"""Cross-rank agreement, used only on anomalous steps. (How results come home from ``ddp_spawn`` workers is
Lightning's business: :func:`lightning_ampwatch.compat.carry_spawn_results`.)

Under a GradScaler every rank skips the same steps (gradients are all-reduced before the inf check, and sharded
scalers all-reduce ``found_inf``), so an anomalous step is a step every rank is in at the same time: a collective
there is safe and costs nothing on healthy steps. Without a scaler, anomalies need not coincide, and each rank
judges alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from lightning_ampwatch import sharding
from lightning_ampwatch.machine import BatchStats
from lightning_ampwatch.protocol import ReplayAborted, gather, meet, rank, world_size
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis, Finding

#: Diagnoses a rank holds for rank zero between two exchanges (the oldest go first past it).
RELAY_MAX = 32


__all__ = ["ReplayAborted", "gather", "meet", "rank", "world_size"]  # (the protocol's, as this module gave them)


def merge_step(records: list[dict[str, Any]]) -> tuple[float | None, bool | None, BatchStats | None, list[int]]:
    """One view of an anomalous step from every rank's record: (loss, loss_finite, batch, ranks at fault).

    The loss is non-finite if any rank's was; the batch holds non-finite values if any rank's did (named with
    the rank); the ranks at fault are those whose loss or data was bad, or every watching rank when none was.
    """
    bad_ranks = [r for r, rec in enumerate(records)
                 if rec["loss_finite"] is False or (rec["batch"] is not None and rec["batch"].nonfinite)]
    finite_flags = [rec["loss_finite"] for rec in records if rec["loss_finite"] is not None]
    loss_finite = None if not finite_flags else all(finite_flags)
    losses = [rec["loss"] for rec in records if rec["loss"] is not None]
    loss = None
    if losses:
        bad = [x for x in losses if not (x == x and abs(x) != float("inf"))]
        loss = bad[0] if bad else sum(losses) / len(losses)
    batches = [(r, rec["batch"]) for r, rec in enumerate(records) if rec["batch"] is not None]
    batch = None
    if batches:
        nonfinite = [(r, b) for r, b in batches if b.nonfinite]
        biggest_rank, biggest = max(batches, key=lambda rb: rb[1].absmax)
        prefix = len(records) > 1
        batch = BatchStats(
            nonfinite=bool(nonfinite),
            nonfinite_where="; ".join((f"rank {r}: " if prefix else "") + str(b.nonfinite_where) for r, b in nonfinite)
            or None,
            absmax=biggest.absmax,
            absmax_where=((f"rank {biggest_rank}: " if prefix else "") + str(biggest.absmax_where))
            if biggest.absmax_where else None,
        )
    watching = [r for r, rec in enumerate(records) if not rec.get("off")]  # a switched-off rank holds no view
    return loss, loss_finite, batch, bad_ranks or watching


class Relay:
    """Diagnoses a rank other than zero reached alone, carried to rank zero, which alone prints and logs.

    Without a GradScaler the ranks meet anomalies at different steps (a NaN in one rank's data), so each judges
    alone; under one, a finite divergence is still each rank's own (judged from its own losses). Either would reach
    no console and no event log from rank 1. No collective is added to any step for it: the log step already sums
    a few counts across ranks in one reduction (one vector every rank reads alike), among them the diagnoses held
    here; only when that count has moved do the ranks exchange what they hold, in one ``all_gather_object``. At the
    end of the fit (every rank is there) they exchange once more."""

    def __init__(self) -> None:
        self.held: list[Diagnosis] = []
        #: this rank's alarms judged alone, not yet published: compared with every rank's at the next exchange
        #: (:func:`reconcile`), then published alike on every rank (:attr:`reconciled`)
        self.deferred: list[Diagnosis] = []
        self.reconciled: list[Diagnosis] = []  # what the last exchange agreed on, until taken (take_reconciled)
        self.count = 0  # diagnoses held on this rank so far (the log step's cross-rank sum adds them up)
        self.ends = 0.0  # requests to end the run the last exchange carried, summed over the ranks
        self._agreed_total = 0.0

    def hold(self, diagnosis: Diagnosis) -> None:
        if rank() != 0:
            self.held = [*self.held[-(RELAY_MAX - 1):], diagnosis]
            self.count += 1

    def defer(self, diagnosis: Diagnosis) -> None:
        """An alarm this rank judged alone, on any rank: published by every rank after the next exchange, once
        every rank's are compared (the one that began the fault, not the rank it reached through the gradients)."""
        self.deferred = [*self.deferred[-(RELAY_MAX - 1):], diagnosis]
        self.count += 1

    def take_reconciled(self) -> list[Diagnosis]:
        out, self.reconciled = self.reconciled, []
        return out

    def at_log_step(self, agreed_held_total: float) -> list[Diagnosis]:
        """Call on every rank with the cross-rank count of held diagnoses just read; rank zero gets the others'
        diagnoses when it moved."""
        if agreed_held_total <= self._agreed_total:
            return []
        self._agreed_total = agreed_held_total
        return self.exchange()

    def exchange(self, ends: float = 0.0) -> list[Diagnosis]:
        """Every rank must call it together. Rank zero gets each other rank's held diagnoses (the rank named in
        their evidence); the others get nothing. ``ends``: this rank's requests to end the run not yet carried by
        a log step's sum (the last exchange's); every rank reads their sum in :attr:`ends`."""
        held, self.held = self.held, []
        deferred, self.deferred = self.deferred, []
        records = gather(([d.to_dict() for d in held], [d.to_dict() for d in deferred], ends))
        self.ends = sum(e for _, _, e in records)
        # every rank's deferred alarms, compared alike on every rank: each publishes the same findings
        self.reconciled += reconcile([[Diagnosis.from_dict(d) for d in alone] for _, alone, _ in records])
        if rank() != 0:
            return []
        out: list[Diagnosis] = []
        for r, (dicts, _, _) in enumerate(records):
            if r == 0:
                continue
            for d in dicts:
                out.append(named_with_rank(Diagnosis.from_dict(d), r))
        return out


#: How many optimizer steps after a rank's non-finite step another rank can meet it through the gradient reduction
#: alone: that step's reduction makes every rank's weights non-finite, and every rank's next loss with them.
REACH = 1


def reconcile(by_rank: Sequence[Sequence[Diagnosis]]) -> list[Diagnosis]:
    """One set of findings from the alarms each rank judged alone (``by_rank[r]``: rank r's), the same on every rank
    (each computes it from the same gathered records). Without a GradScaler a NaN in one rank's batch reaches the
    other ranks only through the gradient reduction, one step later: there the weights are non-finite and the loss
    with them, and that rank alone would call it a forward overflow. Such an alarm (another rank's, from 1 to
    :data:`REACH` steps after one that began on a rank, and not the rank's own bad data) is the same fault: it is
    absorbed into the originating rank's finding, which names it (``reached_ranks``). The same finding at the same
    step on several ranks is one finding, naming every rank (``fault_ranks``). A finite divergence (a rank's own
    losses) absorbs nothing and is absorbed by nothing. Each is named with its rank, as
    rank zero publishes another rank's diagnosis (:func:`named_with_rank`), on every rank alike."""
    alarms = sorted(((d.step, r, d) for r, ds in enumerate(by_rank) for d in ds if not d.withdrawn),
                    key=lambda x: (x[0], x[1]))
    kept: list[tuple[int, int, Diagnosis, list[int], list[str]]] = []  # (step, rank, diagnosis, ranks, reached)
    for step, r, d in alarms:
        same = next((k for k in kept if k[0] == step and k[2].finding is d.finding and r not in k[3]), None)
        if same is not None:
            same[3].append(r)
            continue
        origin = next((k for k in kept if r not in k[3] and k[0] < step <= k[0] + REACH
                       and d.finding is not Finding.DATA_NONFINITE
                       and not _finite_divergence(d) and not _finite_divergence(k[2])), None)
        if origin is not None:
            origin[4].append(f"rank {r} at step {step} (alone it said {d.finding.value})")
            continue
        kept.append((step, r, d, [r], []))
    out: list[Diagnosis] = []
    for _, r, d, ranks, reached in kept:
        ev = dict(d.evidence)
        ev["fault_ranks"] = sorted(ranks)
        if reached:
            ev["reached_ranks"] = ("through the gradient reduction: " + "; ".join(reached)
                                   + "; one fault, published once, as the rank it began on found it")
        out.append(named_with_rank(replace(d, evidence=ev), r))
    return out


def _finite_divergence(diagnosis: Diagnosis) -> bool:
    """A rank's own finite divergence (its losses climbed, finite): no gradient reduction carries it anywhere."""
    return diagnosis.measured.finite_divergence


#: The evidence that says where in a batch a fault sits: named with the rank when several ranks' batches are seen
#: together (:func:`merge_step`), and in a diagnosis another rank reached alone (:func:`named_with_rank`).
_BATCH_WHERE = ("nonfinite_where", "input_where")


def named_with_rank(diagnosis: Diagnosis, r: int) -> Diagnosis:
    """A diagnosis rank ``r`` reached alone, as rank zero publishes it: ``reported_from_rank``, and where the batch's
    fault sits named with the rank in the evidence and the advice, as :func:`merge_step` names it when the ranks
    see a step together (``rank 1: batch[0] rows [1]``)."""
    ev, advice = dict(diagnosis.evidence), diagnosis.advice
    for key in _BATCH_WHERE:
        where = ev.get(key)
        if isinstance(where, str) and where and not where.startswith("rank "):
            ev[key] = f"rank {r}: {where}"
            advice = advice.replace(f"({where})", f"({ev[key]})")
    ev["reported_from_rank"] = r
    return replace(diagnosis, evidence=ev, advice=advice)


#: The log step's cross-rank sum, in this order: non-finite losses, diagnoses held for rank zero (Relay.count),
#: ranks whose watch switched itself off, requests to end the run (``on_unrecoverable``) from an alarm a rank
#: judged alone. One reduction carries them all.
SIGNALS = 4


class CrossRank:
    """What one rank's watch says to the others outside an anomaly's own agreement (several ranks only): the relay
    to rank zero, the agreement itself (``ledger.agree``: whether the ranks still meet anomalies together), and
    the bystander a switched-off rank becomes.

    Every decision here is made from values every rank reads alike at the same point (the log step's cross-rank
    sum, a skipped step's gather, a watched remedy's judgement), so every rank makes it at the same step. The watch stops agreeing, on every
    rank at once, when a rank's watch switched itself off: that rank takes no further part in replays, remedies or
    judgements, so from then on each rank judges alone (as without a scaler) and no remedy is applied.
    """

    def __init__(self, world_size: int, on_unrecoverable: str = "warn") -> None:
        self.world_size = world_size
        self.on_unrecoverable = on_unrecoverable
        self.relay = Relay()
        self.bystander: Bystander | None = None
        self.off = 0.0  # ranks whose watch switched itself off, as agreed (0: every rank watches)
        self._held_sent = self._off_sent = 0.0  # what this rank has added to the cross-rank sums so far
        self._ended_noted = False
        # on_unrecoverable ("stop", "raise") after an alarm a rank judged alone: asked for on that rank, carried by the
        # log step's sum, and carried out on every rank at the log step where the sum moved (``end_due``)
        self.end_asked: Diagnosis | None = None  # this rank's first alarm that asked for it
        self._ends = self._ends_sent = self._ends_agreed = 0.0
        self.end_due = False

    def ask_to_end(self, diagnosis: Diagnosis) -> None:
        """An unrecoverable alarm this rank judged alone, with ``on_unrecoverable`` "stop" or "raise": the other
        ranks did not meet it, so this rank must not stop (nor raise) alone, or they would wait for it in their
        next collective. The request goes with the next log step's sum; every rank ends the run there."""
        if self.end_asked is None:
            self.end_asked = diagnosis
        self._ends += 1.0

    def defers(self, diagnosis: Diagnosis, agreed: bool) -> bool:
        """Whether this alarm waits for the next exchange before any rank publishes it (:meth:`Relay.defer`): one
        judged alone (the ranks do not meet anomalies together), or a rank's own finite divergence (judged from its
        own losses, also under a scaler), so that every rank publishes the same findings; never one rank zero is
        told of (``reported_from_rank``)."""
        return (self.world_size > 1 and (not agreed or _finite_divergence(diagnosis)) and diagnosis.is_alarm
                and not diagnosis.withdrawn and diagnosis.measured.reported_from_rank is None)

    def hold(self, diagnosis: Diagnosis, agreed: bool) -> None:
        """A published diagnosis that rank zero may not have reached itself is held for it: every one where the ranks
        judge alone (``agreed`` False), and a rank's own finite divergence where they agree."""
        if self.world_size > 1 and not diagnosis.withdrawn and (
                not agreed or _finite_divergence(diagnosis)):
            self.relay.hold(diagnosis)

    def signals(self) -> tuple[float, float, float]:
        """This rank's share of the log step's cross-rank sum past the non-finite count: (diagnoses held so far,
        1 once this rank's watch switched itself off, requests to end the run). Increments: the sum accumulates
        them."""
        held, off, ends = float(self.relay.count), 1.0 if self.bystander is not None else 0.0, self._ends
        increments = (held - self._held_sent, off - self._off_sent, ends - self._ends_sent)
        self._held_sent, self._off_sent, self._ends_sent = held, off, ends
        return increments

    def at_log_step(self, values: Sequence[float], ledger: Any) -> list[Diagnosis]:
        """Every rank, with the log step's cross-rank sums just read (:data:`SIGNALS` values): a switched-off rank
        ends the agreement here on every rank, and what the ranks hold for rank zero is exchanged when it moved.
        Rank zero gets the others' diagnoses."""
        if len(values) < SIGNALS:
            return []
        _, held, off, ends = values[:SIGNALS]
        if off > 0:
            self.stop_agreeing(ledger, off)
        if ends > self._ends_agreed:  # a rank asked to end the run: every rank reads the same sum, and ends here
            self._ends_agreed = ends
            self.end_due = True
        return self.relay.at_log_step(held)

    def end_if_due(self, host: Any, relayed: Sequence[Diagnosis] = (), when: str = "at this log step") -> str | None:
        """At a log step, after :meth:`at_log_step`, on every rank: when a rank asked to end the run, the run ends
        here on every rank at once: ``host.stop()`` ("stop"; returns the line rank zero says), or
        :class:`AmpWatchError` ("raise"), with this rank's own alarm, or on rank zero the one another rank relayed
        (``relayed``: what rank zero got at this log step). ``when``: where the run ends, as said."""
        if not self.end_due:
            return None
        self.end_due = False
        # the finding every rank published for it (reconciled), else this rank's own alarm, else one relayed
        own = next((d for d in relayed if d.is_alarm and d.remedy is None and d.measured.fault_ranks is not None
                    and d.measured.reported_from_rank is not None), None) or self.end_asked
        if own is None:
            own = next((d for d in relayed if d.is_alarm and d.remedy is None), None)
        on = rank() if own is None or own.measured.reported_from_rank is None else own.measured.reported_from_rank
        what = (f"{own.finding.value} at step {own.step} was judged on rank {on} alone" if own is not None else
                "another rank judged an unrecoverable alarm alone (rank zero reports it)")
        if self.on_unrecoverable == "raise":
            message = f"every rank stops {when} (on_unrecoverable='raise'): {what}"
            if own is not None:
                message = f"{own.headline()}\nFix: {own.advice}\n({message})"
            raise AmpWatchError(message, own)
        if host is not None:
            host.stop()
        return f"stopping the run on every rank {when} (on_unrecoverable='stop'): {what}."

    def end_at_fit_end(self, relayed: Sequence[Diagnosis]) -> None:
        """At the end of the fit, after the last exchange (:meth:`at_end`; ``relayed``: what rank zero got there): a
        rank that asked to end the run after the last log step has "raise" carried out here, on every rank at once
        ("stop": the run is over anyway)."""
        if self.end_due:
            if self.on_unrecoverable == "raise":
                self.end_if_due(None, relayed, when="at the end of the fit")
            self.end_due = False

    def step_aside(self, ledger: Any, reporters: Any, host: Any, log_every: int, *, stepped: bool,
                   remedy_left: int | None) -> None:
        """This rank's watch switched itself off: under several ranks it becomes a :class:`Bystander`, since the
        other ranks still meet it where they talk across ranks and it keeps its place there. ``stepped``: a step was
        taken but not closed (it is closed at its batch's end); ``remedy_left``: the steps until the remedy the
        ranks watch is judged (None: none is watched), after which the bystander meets the judgement."""
        if self.world_size > 1 and ledger is not None and reporters is not None and host is not None:
            judge_at = None if remedy_left is None or remedy_left < 1 else ledger.step_index + remedy_left
            self.bystander = Bystander(self, ledger, reporters, host, ledger.step_index, log_every, stepped=stepped,
                                       judge_at=judge_at)

    def stop_agreeing(self, ledger: Any, off: float) -> None:
        self.off = max(self.off, off)
        if ledger is not None:
            ledger.agree = False

    def note_agreement_ended(self, ledger: Any, control: Any, say: Callable[[str], None]) -> None:
        """Once, on a watching rank, after the agreement ended: the snapshots stop where a replay from them needs
        every rank (split across DDP ranks, or sharded), since none can be agreed on any more, and one line says
        so."""
        if self._ended_noted:
            return
        self._ended_noted = True
        self.stop_agreeing(ledger, self.off)
        if control is not None and control.ring.enabled and (
                control.state.split or sharding.replay_needs_all_ranks(control.state.root)):
            control.ring.turn_off(f"the snapshot ring is off: {self.why_alone}, and a replay from its snapshots "
                                  "needs every rank")
        say(f"{self.why_alone}: from step {ledger.step_index - 1} each rank judges anomalies alone; replays that "
            "need every rank and remedies are off for the rest of the run.")

    @property
    def why_alone(self) -> str:
        """Why the ranks no longer meet anomalies together (for the evidence and the one line said)."""
        n = int(self.off) or 1
        return f"AmpWatch switched itself off on {n} other rank{'s' if n > 1 else ''}"

    def gather(self, ledger: Any) -> Callable[[Any], list[Any]]:
        """:func:`gather` for a judgement every rank makes together: a switched-off rank joins it with :data:`OFF`,
        which ends the agreement (``ledger.agree``), and the values come back as this rank's alone."""

        def agreed_gather(value: Any) -> list[Any]:
            held = gather(value)
            if any(isinstance(h, str) and h == OFF for h in held):
                self.stop_agreeing(ledger, max(self.off, 1.0))
                return [value]
            return held

        return agreed_gather

    def at_end(self) -> list[Diagnosis]:
        """The relay's last exchange, at the end of the fit: every rank takes part, whatever happened to its watch
        (a bystander's part adds what it still held). Rank zero gets the others' diagnoses."""
        if self.bystander is not None:
            self.bystander.finish()
            return []
        if self.world_size == 1:
            return []
        # a request to end the run that no log step carried (asked after the last one) goes with this exchange
        ends, self._ends_sent = self._ends - self._ends_sent, self._ends
        relayed = self.relay.exchange(ends)
        if self.relay.ends > 0:
            self.end_due = True
        return relayed


#: What a switched-off rank brings to a gather it joins only to keep its place (see :meth:`CrossRank.gather`).
OFF = "ampwatch: this rank's watch is off"


class Bystander:
    """A rank whose watch switched itself off while the other ranks go on watching. They still meet it where the
    watch talks across ranks on every rank's schedule: the log step's cross-rank sum (and, when what is held for
    rank zero moved, the relay's exchange), a skipped step's gather under a GradScaler (every rank skips it; the
    first one it meets ends the agreement on every rank), and the relay's last exchange at the end. Were it to stay
    away, they would wait for it for ever (NCCL) or abort on a collective mismatch (gloo). It counts optimizer steps
    the way the ledger does, tells a skipped step from the optimizer's step hook the ledger left attached (a fused
    optimizer's flag is read: one read per step on this rank only), takes part with nothing to add, and reads
    nothing else. Once the agreement has ended, the other ranks enter no collective it would not enter."""

    def __init__(self, cross: CrossRank, ledger: Any, reporters: Any, host: Any, steps: int, log_every: int,
                 stepped: bool = False, judge_at: int | None = None) -> None:
        self.cross, self.ledger, self.reporters, self.host = cross, ledger, reporters, host
        self.steps = steps  # optimizer steps closed so far, as the other ranks' ledgers count them
        self.stepped = stepped  # a step began before the watch switched off: closed at this batch's end
        self.log_every = log_every
        # the step count after which the others judge the remedy they watch (its first collective is a gather)
        self.judge_at = judge_at

    def optimizer_step(self) -> None:
        if self.stepped:  # manual optimization: a second step in the same batch
            self._close()
        self.stepped = True

    def batch_end(self) -> None:
        if self.stepped:
            self._close()

    def _close(self) -> None:
        """One optimizer step over: the collectives the watching ranks make at its end, in their order (a skip's
        gather as the step is taken in, the log step's sum, the watched remedy's judgement at the step boundary)."""
        self.stepped = False
        self.steps += 1
        try:
            self._meet_a_skip()
        except Exception:  # noqa: BLE001 - switched off: it has nothing more to say, and never stops the run
            pass
        if self.log_every and self.steps % self.log_every == 0:
            self._at_log_step()
        if self.judge_at is not None and self.steps >= self.judge_at:
            self.judge_at = None
            self._meet_the_judgement()

    def _meet_the_judgement(self) -> None:
        """The remedy the ranks watched when this rank's watch switched off is judged now: while the ranks still
        agree, the judgement starts with a gather (``Treatment.fp32_reference``), where this rank says it is off;
        that ends the agreement on every rank, and the rest of the judgement is each rank's own."""
        if not (self.ledger.agree and self.cross.world_size > 1):
            return
        try:
            gather(OFF)
        except Exception:  # noqa: BLE001
            pass
        self.ledger.agree = False

    def _meet_a_skip(self) -> None:
        """Under a scaler, while the ranks still agree, every rank gathers a view of each skipped step: this rank's
        view says that its watch is off, which ends the agreement on every rank at once."""
        ledger = self.ledger
        taken = ledger.taken
        was_taken, found_inf = taken.taken, taken.found_inf
        taken.taken, taken.found_inf = False, None
        if not (ledger.scaler_active and ledger.agree and self.cross.world_size > 1):
            return
        skipped = bool(found_inf.item()) if found_inf is not None else not was_taken
        if skipped:
            gather({"loss": None, "loss_finite": None, "batch": None, "off": True})
            ledger.agree = False

    def _at_log_step(self) -> None:
        reporters, host = self.reporters, self.host
        try:
            metrics = reporters.metric_tensors(host, steps=0, skipped=0, nonfinite=0, signals=self.cross.signals())
            if metrics:  # the others' cross-rank sum: what it held goes to rank zero; it publishes nothing
                self.cross.at_log_step(metrics[0].float().cpu().tolist(), self.ledger)
        except Exception:  # noqa: BLE001
            pass
        # another rank asked to end the run (on_unrecoverable): this rank ends with the others, or they would wait
        # for it (AmpWatchError, "raise", goes up to the training loop)
        self.cross.end_if_due(host)

    def finish(self) -> None:
        try:
            self.cross.relay.exchange()
        except Exception:  # noqa: BLE001
            pass


class Lockstep:
    """A replay that talks to every rank (the forward of a sharded model: FSDP's all-gathers), run so that a rank
    whose part raises before that talk does not leave the others waiting in it.

    Inside ``with Lockstep(module) as lock:``, before each micro-batch's first module forward (a forward pre-hook on
    every module, ahead of FSDP's own), the ranks meet in one small all-reduce (:func:`~.protocol.meet`); call
    :meth:`next` before each micro-batch, and every rank meets once more on leaving the block. A rank that raised
    brings its error to the next meeting instead (the one on leaving), and every other rank raises
    :class:`ReplayAborted` at that point, before entering any collective of its own forward. Every rank leaves the
    block at the same micro-batch, with an exception. What it cannot cover: a rank
    that raises after the meeting, inside the sharded forward or backward (between FSDP's own collectives), leaves
    the others waiting in FSDP's next collective; nothing outside FSDP can make those safe. Anomalous steps only: it
    costs one all-reduce per
    micro-batch of a replay, and nothing on a healthy step."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._handles: list[Any] = []
        self._met = True  # this rank met the others for the current micro-batch
        self._fresh = True  # no micro-batch begun with next() yet (the block's start begins the first)
        self.told = False  # the block ended with an error that this rank brought to a meeting (every rank knows it)

    def __enter__(self) -> "Lockstep":
        if world_size() > 1:
            self._handles = [m.register_forward_pre_hook(self._before_forward, prepend=True)
                             for m in self.module.modules()]
        self._met, self._fresh = False, True
        return self

    def next(self) -> None:
        """A new micro-batch: its first module forward meets the others again (a micro-batch that ran no forward
        of any module still meets them once)."""
        if not self._met and not self._fresh:
            self._meet(None)
        self._met, self._fresh = False, False

    def _before_forward(self, module: Any, args: Any) -> None:
        if not self._met:
            self._meet(None)

    def _meet(self, error: str | None) -> None:
        self._met = True
        meet(error)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if isinstance(exc, ReplayAborted):  # stopped at a meeting: every rank knows, and leaves there
            return False
        # Every rank meets once more on leaving, bringing its error if it raised: one that raised before a
        # micro-batch's meeting, or after it (in a backward, or in its own work after the passes), while the others
        # go on to the next micro-batch's meeting or leave too, meets them there; nobody waits alone.
        self._met = True
        self._meet(None if exc is None else f"{type(exc).__name__}: {exc}")
        self.told = exc is not None
        return False
