"""What happens on the first alarm of an episode: localise (which module, which parameter) and run the FP32
control, on the rank(s) where the fault arose, then agree on one answer across ranks.

Bounded by construction: it runs once per new alarm, and the machine raises an alarm once per episode.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from lightning_ampwatch import distributed
from lightning_ampwatch.machine import BatchStats, PrecisionMode
from lightning_ampwatch.verdicts import judge_control
from lightning_ampwatch.probes import MicroBatch, Replayer, ReplayResult
from lightning_ampwatch.taxonomy import Diagnosis, Finding, advise

#: Findings located by the first non-finite forward output, and by the first non-finite gradient.
_FORWARD = {Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.DATA_NONFINITE, Finding.FP32_UNSTABLE}
_BACKWARD = {Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW}
_INVESTIGATED = _FORWARD | _BACKWARD | {Finding.LR_SCHEDULE}
#: Alarms a live probe of the next step can locate when the faulty step cannot be replayed.
LIVE_PROBED = _BACKWARD | {Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.LR_SCHEDULE}


class InvestigationError(RuntimeError):
    """A replay failed on some rank; raised on every rank alike so that all of them stop replaying together."""


class Investigator:
    """Replays a faulty step's batches with probes (under autocast) and without autocast (the control)."""

    def __init__(self, module: Any, forward_context: Any, device: torch.device, mode: PrecisionMode,
                 localize: bool, control: bool, automatic: bool) -> None:
        self.replayer = Replayer(module, forward_context, device)
        self.module = module
        self.mode = mode
        self.localize = localize
        self.control = control and mode is not PrecisionMode.FP32  # in FP32 the run is its own control
        self.automatic = automatic

    def collect(self, batches: Sequence[MicroBatch], *, scale: float | None, fault_ranks: Sequence[int],
                weights_stepped: bool, loss_level: float | None) -> dict[str, Any] | None:
        """Replay on the rank(s) at fault and agree on one record; every rank must call this together.

        ``loss_level`` is this rank's usual loss; the record carries the investigating rank's, so that every rank
        judges the control against the same number.
        """
        if not (self.localize or self.control):
            return None
        batches = [mb if isinstance(mb, MicroBatch) else MicroBatch(*mb) for mb in batches]
        local: dict[str, Any] | None = None
        if distributed.rank() in fault_ranks:
            try:
                local = self._local(batches, scale, weights_stepped)
                local["loss_level"] = loss_level
            except Exception as err:  # noqa: BLE001 - every rank must still reach the gather below
                local = {"error": f"{type(err).__name__}: {err}"}
        results = distributed.gather(local)
        failed = [(r, res["error"]) for r, res in enumerate(results) if res is not None and "error" in res]
        if failed:
            raise InvestigationError(f"the replay failed on rank {failed[0][0]}: {failed[0][1]}")
        for r, res in enumerate(results):
            if res is not None:
                if distributed.world_size() > 1:
                    res["evidence"].update(fault_ranks=list(fault_ranks), investigated_on_rank=r)
                return res
        return None

    def apply(self, diagnosis: Diagnosis, record: dict[str, Any] | None, *,
              batch: BatchStats | None) -> tuple[Diagnosis, Finding | None]:
        """The diagnosis with location and control evidence; and the new finding if the control renamed it."""
        if record is None or diagnosis.finding not in _INVESTIGATED:
            return diagnosis, None
        loss_level = record.get("loss_level")
        ev = dict(diagnosis.evidence)
        ev.update(record["evidence"])
        finding, reason = judge_control(
            diagnosis.finding, control_loss=record.get("control_loss"),
            control_grads_finite=record.get("control_grads_finite"),
            batch_nonfinite=bool(batch and batch.nonfinite), loss_level=loss_level,
        )
        ev["control_verdict"] = reason
        if loss_level is not None:
            ev["loss_level"] = loss_level
        if batch is not None and batch.nonfinite:
            ev.setdefault("nonfinite_where", batch.nonfinite_where)
        if finding is Finding.DATA_NONFINITE:
            location = diagnosis.location  # the data, not a module: where is in evidence["nonfinite_where"]
        else:
            location = record["param"] if finding in _BACKWARD else record["module"]
            location = location or record["module"] or record["param"] or diagnosis.location
        renamed = finding if finding is not diagnosis.finding else None
        refined = Diagnosis(finding=finding, step=diagnosis.step, location=location, evidence=ev,
                            advice=advise(finding, ev), remedy=diagnosis.remedy)
        return refined, renamed

    def _local(self, batches: Sequence[MicroBatch], scale: float | None, weights_stepped: bool) -> dict[str, Any]:
        """Both probes at once (the finding may not be known yet): forward outputs, and gradients at ``scale``."""
        ev: dict[str, Any] = {"batch_idx": [mb.batch_idx for mb in batches]}
        out: dict[str, Any] = {"evidence": ev, "module": None, "param": None}
        if not self.automatic:
            ev["replay"] = ("not run: manual optimization (replaying training_step would step the optimizer); "
                            "the step's own measurements stand")
            return out
        if weights_stepped and not _weights_finite(self.module):
            ev["replay"] = "not run: the weights already hold non-finite values (no scaler protected them)"
            return out
        if weights_stepped:
            ev["replay_note"] = "the optimizer stepped after this batch: replayed with the updated weights"
        probe_scale = scale if scale is not None else 1.0
        if self.localize:
            use_autocast = self.mode is not PrecisionMode.FP32
            amp = self.replayer.run(batches, use_autocast=use_autocast, grad_scale=probe_scale, probe=True)
            ev.update(_replay_evidence(amp, "replay"))
            out["module"] = amp.first_nonfinite_module
            if amp.nonfinite_outside_modules:
                out["module"] = f"{type(self.module).__name__}.training_step"
            out["param"] = amp.first_nonfinite_param
            if amp.headroom:
                ev["fp16_headroom_log2"] = dict(amp.headroom)
        if self.control:
            ctl = self.replayer.run(batches, use_autocast=False, grad_scale=1.0, probe=False)
            ev.update(_replay_evidence(ctl, "fp32_control"))
            out["control_loss"] = ctl.loss if ctl.loss is not None else None
            out["control_grads_finite"] = ctl.grads_finite
        return out


def _replay_evidence(result: ReplayResult, prefix: str) -> dict[str, Any]:
    ev: dict[str, Any] = {f"{prefix}_loss": result.loss}
    if result.grads_finite is not None:
        ev[f"{prefix}_grads_finite"] = result.grads_finite
    if result.first_nonfinite_module:
        ev[f"{prefix}_first_nonfinite_module"] = result.first_nonfinite_module
    if result.first_nonfinite_param:
        ev[f"{prefix}_first_nonfinite_param"] = result.first_nonfinite_param
    return ev


def _weights_finite(module: torch.nn.Module) -> bool:
    params = [p.detach() for p in module.parameters()]
    if not params:
        return True
    return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def located_live(diagnosis: Diagnosis, first_module: str | None, first_param: str | None,
                 headroom: list[tuple[str, float]]) -> Diagnosis:
    """A diagnosis that waited for a :class:`~lightning_ampwatch.probes.LiveProbe`, with what the probe saw."""
    ev = dict(diagnosis.evidence)
    ev["live_probe"] = ("the next training step watched as it ran (manual optimization: no replay)"
                        if (first_module or first_param) else
                        "the next training step watched as it ran: the fault did not recur there")
    if first_module:
        ev["live_first_nonfinite_module"] = first_module
    if first_param:
        ev["live_first_nonfinite_param"] = first_param
    if headroom:
        ev["fp16_headroom_log2"] = dict(headroom)
    backward = diagnosis.finding in _BACKWARD
    location = (first_param or first_module) if backward else (first_module or first_param)
    return replace(diagnosis, location=location, evidence=ev)

