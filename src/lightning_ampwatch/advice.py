"""The fix for each finding, in words, from what was measured: one function per finding, each reading the evidence
the machine and the replays gathered (:func:`lightning_ampwatch.taxonomy.advise` picks the finding's own). Kept apart
from the machine, so that the wording lives in one place and the machine only decides.

Pure Python, as the taxonomy: the typed measurements (:mod:`lightning_ampwatch.measured`) and the standard library.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from lightning_ampwatch.measured import GradientPattern, LrEvent, LrRise, Measured

#: float16's largest finite value.
FP16_LIMIT = 65504.0
#: Within this many powers of 2 of float16's largest value, a module's output counts as near the limit.
NEAR_FP16_LIMIT_LOG2 = 1.0


def fp16_nearest(ev: Mapping[str, Any]) -> tuple[str, float] | None:
    """The module whose float16 output came nearest float16's limit in the replay (``fp16_headroom_log2``: its
    headroom in powers of 2), or None when the replay measured none."""
    headroom = ev.get("fp16_headroom_log2")
    if not isinstance(headroom, Mapping):
        return None
    rooms = [(str(k), float(v)) for k, v in headroom.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return min(rooms, key=lambda kv: kv[1]) if rooms else None


def format_pow2(value: object) -> str:
    """A scale as the user would type it: ``2**10`` for a power of two, else a short float."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    if v > 0 and math.isfinite(v) and math.log2(v).is_integer():
        return f"2**{int(math.log2(v))}"
    return f"{v:g}"


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def advised_init_scale(ev: Mapping[str, Any]) -> float | None:
    """The measured safe scale, only when it is below the scale the run started at or failed at: advice (and a
    remedy) must never recommend the value already in use. None when no lower scale is known."""
    m = Measured.read_back(ev)
    safe = _number(m.safe_scale)
    in_use = [v for v in (_number(m.init_scale), _number(m.onset_scale)) if v is not None]
    if safe is None or safe <= 0 or (in_use and safe >= max(in_use)):
        return None
    return safe


def gradient_overflow(ev: Mapping[str, Any]) -> str:
    # made from the typed record of the measurements (as lr_schedule): the pattern, the scales
    m = Measured.read_back(ev)
    if m.pattern is GradientPattern.UNSCALED_OVERFLOW:
        return (
            "Even a loss scale below 1 does not stop the overflow, so the gradients themselves are too large for "
            "float16 and no scaler setting can help. Fix the operation that makes them: a log-softmax or "
            "log(sum(exp(x))) written by hand instead of torch.log_softmax / torch.logsumexp, a sum where a mean "
            "was meant; or keep that operation in float32 inside autocast (an fp32 island); or train in bf16-mixed "
            "where the hardware supports it."
        )
    safe = advised_init_scale(ev)
    init = _number(m.init_scale)
    if safe is not None and ev.get("loss_scaler") == "deepspeed":
        power_text = str(math.floor(math.log2(safe)))  # DeepSpeed takes the scale as a power of two
        instead = f" instead of {format_pow2(init)}" if init is not None else ""
        return (
            f"Start DeepSpeed's loss scaler where it proved safe, {format_pow2(safe)}{instead}: "
            f'"initial_scale_power": {power_text} in the "fp16" section of the DeepSpeed config (in Lightning, '
            f"DeepSpeedStrategy(initial_scale_power={power_text})). If skips continue, clip gradients "
            '("gradient_clipping" in the config; Lightning\'s gradient_clip_val).'
        )
    if safe is not None:
        instead = f" instead of {format_pow2(init)}" if init is not None else ""
        return (
            f"Start the scaler where it proved safe: torch.amp.GradScaler(init_scale={format_pow2(safe)}){instead}; "
            f"in Lightning pass it as MixedPrecision('16-mixed', device, "
            f"scaler=GradScaler(init_scale={format_pow2(safe)})). "
            "If skips continue, clip gradients (Lightning's gradient_clip_val unscales first)."
        )
    held = _number(m.safe_scale)
    if held is not None and held > 0:
        return (
            f"Steps went through at a scale of {format_pow2(held)} before these skips began, so a lower starting "
            "scale would not have prevented them: the gradients grew during training. Check what changed (the "
            "learning rate, the batches) and clip gradients after unscaling (Lightning's gradient_clip_val does)."
        )
    onset = _number(m.onset_scale) or init
    lower = f"below the {format_pow2(onset)} the skips began at" if onset is not None else \
        "for example torch.amp.GradScaler(init_scale=2**10)"
    return (
        f"Lower the starting scale, {lower}, and clip gradients after unscaling (Lightning's gradient_clip_val "
        "does this for you). Most of these steps were thrown away."
    )


def growth_overflow(ev: Mapping[str, Any]) -> str:
    interval = ev.get("growth_interval")
    factor = ev.get("growth_factor")
    bigger = f"{int(interval) * 10}" if isinstance(interval, (int, float)) and interval else "2000 or more"
    safe = advised_init_scale(ev)
    if safe is not None:
        start = f"; or start at the scale that held, init_scale={format_pow2(safe)}."
    elif _number(ev.get("safe_scale")) is not None:
        start = f"; the scale it started at ({format_pow2(ev['safe_scale'])}) holds, so slower growth is the fix."
    else:
        start = "; or start at a lower init_scale."
    if ev.get("loss_scaler") == "deepspeed":
        return (
            f'The scale keeps doubling into overflow. Let DeepSpeed\'s loss scaler grow less often: '
            f'"loss_scale_window": {bigger} in the "fp16" section of the DeepSpeed config (in Lightning, '
            f"DeepSpeedStrategy(loss_scale_window={bigger})), or let it survive an overflow before halving "
            f'("hysteresis")' + start.replace("init_scale=", "a starting scale of ")
        )
    return (
        f"The scale keeps doubling into overflow. Let it grow less often or by less: "
        f"GradScaler(growth_interval={bigger}"
        + (f", growth_factor={max(1.0001, float(factor) ** 0.5):.3g})" if isinstance(factor, (int, float)) else ")")
        + start
    )


def _divergence(ev: Mapping[str, Any]) -> str:
    """The climb of the loss as the machine worded it (measured, with its steps), to lead an advice with."""
    climb = ev.get("divergence")
    return f"The loss climbed ({climb}). " if climb else ""


def lr_schedule(ev: Mapping[str, Any]) -> str:
    # made from the typed record of the rise (the pattern for a sentence made from a record, not from keys)
    rise = Measured.read_back(ev).lr or LrRise()
    before, after, kind = rise.before, rise.after, rise.event
    what = "warmup reached its peak" if kind is LrEvent.WARMUP_END else "the learning rate rose"
    if kind is LrEvent.PARAM_GROUP_ADDED:
        at = f" ({after:.3g}, the others at most {before:.3g})" if before is not None and after is not None else ""
        return _divergence(ev) + (
            f"The failure began right after a param group was added at a far higher learning rate{at} (a "
            "backbone unfrozen, say BackboneFinetuning's backbone_initial_lr). Give the new group a learning rate "
            "near the others' (or warm it up), then re-test before touching the loss scaler.")
    fix = "Lower the peak learning rate or lengthen the warmup"
    if kind is LrEvent.LR_INCREASE:  # a rise in one step: a warm restart, a step schedule, a change by hand
        what = "the learning rate jumped in one step"
        fix = ("Lower the learning rate it jumps to, or ramp up to it over several steps (a scheduler's warm restart "
               "jumps back to its peak)")
    return _divergence(ev) + (
        f"The failure began right after {what} ({before:.3g} -> {after:.3g}). {fix}, then re-test before touching "
        "the loss scaler."
        if before is not None and after is not None
        else f"The failure began right after {what}. {fix}."
    )


def _checked_tensor(where: Any) -> str:
    """The tensor the advice's check names, as the user's code names it: the first one the batch held NaN/inf in
    (``batch['pixel_values'] rows [2]`` gives ``batch['pixel_values']``; a micro-batch of an accumulation is the
    user's ``batch`` too), or ``batch`` where nothing more precise was measured."""
    if not isinstance(where, str) or not where:
        return "batch"
    path = where.split("; ")[0].split(" rows ")[0]
    if path.startswith("micro_batch[") and "]" in path:
        path = "batch" + path[path.index("]") + 1:]
    return path if path.startswith("batch") else "batch"


def data_nonfinite(ev: Mapping[str, Any]) -> str:
    where = ev.get("nonfinite_where")
    return (
        f"Clean the data before it reaches the model{' (' + str(where) + ')' if where else ''}: "
        f"check torch.isfinite({_checked_tensor(where)}).all() in the dataset or a collate function, and drop or "
        "repair the offending rows. Changing the precision will not help."
    ) + (" The weights already hold NaN/inf from this batch: unless the run goes back to a state from before it, "
         "the rest of the run is lost (remediate=True rolls back and skips the batch; by hand, resume from a "
         "checkpoint from before it without that batch)." if ev.get("weights_lost") else "")


def fp32_unstable(ev: Mapping[str, Any], control_diverging: bool = False, against_first_loss: bool = False) -> str:
    level, control = ev.get("loss_level"), ev.get("fp32_control_loss")
    precision = ev.get("precision")
    full = precision == "fp32"  # the run itself is at full precision: there is no reduced precision to blame
    if ev.get("pattern") == "finite_divergence":
        why = (f"The loss climbed ({ev['divergence']}): training diverges at the precision it runs in, and no "
               "loss-scale or precision setting changes that. ")
    elif ev.get("divergence") and full:
        why = (f"The loss climbed ({ev['divergence']}): training diverges, in a run at full precision, so no "
               "loss-scale or precision setting is involved. ")
    elif ev.get("divergence"):
        why = f"The loss climbed ({ev['divergence']}): training was diverging before reduced precision failed. "
    elif control_diverging and isinstance(level, (int, float)) and isinstance(control, (int, float)):
        against = "the run's first loss" if against_first_loss else "a healthy level"
        reduced = "bfloat16" if precision == "bf16" else "float16"
        why = (f"Replayed in float32 the loss is finite but {control:.3g}, against {against} of {level:.3g}: "
               f"training is diverging and {reduced} merely went non-finite first. ")
    elif full:
        why = ("The loss went non-finite in a run at full precision, so no loss-scale or precision setting is "
               "involved. ")
    else:
        why = "The loss is non-finite at full precision as well, so reduced precision is not the cause. "
    return why + (
        "Lower the learning rate, add gradient clipping, and look for log/exp/division of values that can "
        "reach zero or grow without bound in the loss."
    )


def _fp32_island(ev: Mapping[str, Any]) -> str:
    if ev.get("precision") == "half":  # 16-true: no autocast to step out of; the tensors themselves are float16
        return ("Keep the fragile operation in float32: cast its inputs with .float() (and a module that computes "
                "it with module.float())")
    return ("Keep the fragile operation in float32 inside autocast: wrap it in torch.autocast(device_type, "
            "enabled=False) and cast its inputs with .float()")


def forward_overflow(ev: Mapping[str, Any]) -> str:
    island = _fp32_island(ev)
    if ev.get("precision") == "bf16":
        return (
            "bfloat16 has float32's range, so this is rarely an overflow; more often a value rounded in bfloat16 "
            "(8 significant bits) to one the next operation cannot take: 1 - sigmoid(x) or a small difference "
            f"rounded to 0, then a log or a division. {island}, or write it in a form that does not round that "
            "way (torch.nn.functional.logsigmoid, torch.log1p, a clamp before the log)."
        )
    inside = inside_headroom(ev)
    if inside is not None:  # the interventions watched every tensor computed inside the located module(s)
        where, bits = inside
        return (
            f"{island} (the replays watched the values computed inside {where}: in FP32 they reach "
            f"{2.0 ** -bits:.3g}x float16's maximum, 65504; exp, pow and large sums are the usual ones). Where the "
            "hardware supports it, precision='bf16-mixed' lifts float16's range limit (bfloat16 has float32's range), "
            "though it rounds more coarsely than float16."
        )
    nearest = fp16_nearest(ev)
    if nearest is not None and nearest[1] <= NEAR_FP16_LIMIT_LOG2:
        return (
            f"{island} (softmax, exp, pow, large sums are the usual ones). Where the hardware supports it, "
            "precision='bf16-mixed' lifts float16's range limit (bfloat16 has float32's range), though it rounds "
            "more coarsely than float16."
        )
    seen = ""
    if nearest is not None:
        seen = (f" No float16 module output came near float16's limit in the replay (the largest, about "
                f"{FP16_LIMIT / 2.0 ** nearest[1]:.3g}, in {nearest[0]}): an overflow, if this was one, happened "
                "inside an operation, where the probes do not look; else it was a rounding.")
    return (
        f"{island}. The usual ones: exp, pow and large sums, which overflow float16; a log or a division of a value "
        f"that rounded to 0 (1 - sigmoid(x), a small difference).{seen} precision='bf16-mixed', where the hardware "
        "supports it, lifts float16's range limit but not the rounding: bfloat16 keeps fewer significant bits than "
        "float16, so it helps with an overflow only."
    )


def inside_headroom(ev: Mapping[str, Any]) -> tuple[str, float] | None:
    """(the island's modules, the lowest headroom in bits under float16's maximum of the values computed inside them
    in the FP32 replay) when that went below zero: values float16 cannot hold; None otherwise."""
    info = ev.get("interventions")
    if not isinstance(info, Mapping):
        return None
    for tried in info.get("tried", ()):
        if isinstance(tried, Mapping) and tried.get("intervention") == "fp32":
            bits = [b for b in tried.get("headroom_log2") or () if isinstance(b, (int, float))]
            island = next((t.get("modules") for t in info.get("tried", ())
                           if isinstance(t, Mapping) and t.get("modules")), None)
            if bits and min(bits) < 0 and island:
                return ", ".join(island), min(bits)
    return None


def input_range(ev: Mapping[str, Any]) -> str:
    amax = ev.get("input_absmax")
    where = ev.get("input_where")
    return (
        f"The batch holds values up to {amax:.3g}{' in ' + str(where) if where else ''}; float16 tops out at 65504. "
        "Normalise inputs and targets (standardise features, rescale regression targets) or keep the first layer "
        "and the loss in float32."
        if isinstance(amax, (int, float))
        else "Normalise inputs and targets; float16 tops out at 65504."
    )


def normal_scaling(ev: Mapping[str, Any]) -> str:
    if ev.get("withdrawn") is True:
        return (
            f"The earlier 'normal scaling' call was premature: a {ev.get('withdrawn_by')} episode (raised at step "
            f"{ev.get('withdrawn_at')}) began soon after the skip it was about, which may have been its first sign. "
            "Follow that diagnosis's advice instead."
        )
    return (
        "Nothing to fix: GradScaler skips a step now and then to find the largest safe scale. "
        "Keep an eye on ampwatch/skipped_steps; act only if skips become frequent."
    )


def _at(ev: Mapping[str, Any]) -> str:
    code = ev.get("code")
    return f" (`{code}`)" if code else ""


def loss_outside_autocast(ev: Mapping[str, Any]) -> str:
    op = ev.get("loss_op")
    return (
        f"The loss op {op + ' ' if op else ''}ran in float16 because autocast was off where the loss was computed"
        f"{_at(ev)}. Compute the loss inside the autocast region (in Lightning, training_step already is one: "
        "drop the autocast(enabled=False) block), or cast the model outputs and targets with .float() before the "
        "loss so it runs in float32."
    )


def clip_before_unscale(ev: Mapping[str, Any]) -> str:
    real = ev.get("limit_in_real_units")
    effect = (f"Your clipping limit acts as {real:.3g} on the real gradients. " if isinstance(real, (int, float))
              else "")
    if ev.get("optimization") == "manual" or ev.get("via") == "LightningModule.clip_gradients":
        return effect + (
            "In manual optimization opt.step() unscales only after this line runs, and calling scaler.unscale_ "
            "yourself makes that step fail. Move the clipping into the on_before_optimizer_step(self, optimizer) "
            "hook, which Lightning calls after unscaling: self.clip_gradients(optimizer, gradient_clip_val=...)."
        )
    return effect + (
        "Clip where the gradients are already unscaled: pass gradient_clip_val to the Trainer, or clip inside "
        "on_before_optimizer_step or configure_gradient_clipping (both run after Lightning unscales). Outside "
        "Lightning, call scaler.unscale_(optimizer) before clipping."
    )


def step_outside_scaler(ev: Mapping[str, Any]) -> str:
    if ev.get("optimization") == "manual":
        return (
            f"Step the LightningOptimizer from self.optimizers(), not the raw optimizer{_at(ev)}: opt.step() goes "
            "through the GradScaler, which unscales, skips steps with inf/NaN gradients and updates the scale."
        )
    return (
        f"Let the GradScaler step the optimizer{_at(ev)}: in an optimizer_step override call optimizer.step("
        "closure=optimizer_closure) on the LightningOptimizer you are given; outside Lightning use "
        "scaler.step(optimizer) followed by scaler.update()."
    )


def manual_prescale(ev: Mapping[str, Any]) -> str:
    if ev.get("second_scaler_scale"):
        what = "The loss went through scaler.scale twice"
        fix = "Hand the plain loss to backward (self.manual_backward(loss)); Lightning scales it once itself."
    else:
        factor = ev.get("factor")
        what = f"The loss was multiplied by {format_pow2(factor)} before the scaler's own scale" if factor else \
            "The loss was multiplied by hand before the scaler's own scale"
        fix = "Drop that factor and let the GradScaler pick the scale; if you want a larger start, pass " \
              "GradScaler(init_scale=...) to the precision plugin."
    return (
        f"{what}{_at(ev)}, so the gradients carry both and overflow early. {fix} Dividing the loss by the number "
        "of accumulation steps is fine."
    )


def fp16_parameters(ev: Mapping[str, Any]) -> str:
    return (
        "16-mixed keeps the parameters in float32 and lets autocast run selected ops in float16; with float16 "
        "parameters the scaler cannot unscale their gradients (it refuses float16 gradients) and the updates lose "
        "precision. Remove the .half() / .to(torch.float16) on the model and let the precision plugin cast, or "
        "train with precision='16-true' if you really want float16 weights."
    )


def eps_underflow(ev: Mapping[str, Any]) -> str:
    eps, held = ev.get("eps"), ev.get("eps_in_float16")
    known = isinstance(eps, (int, float)) and isinstance(held, (int, float))
    what = f"eps={eps:g} becomes {held:g} in float16" if known else "eps is below float16's smallest normal number"
    return (
        f"{what}, so it no longer keeps the update m / (sqrt(v) + eps) finite once v underflows. Pass eps=1e-4 "
        f"(or larger) to {ev.get('optimizer') or 'the optimizer'}, or train with 16-mixed / bf16 so that the "
        "optimizer state stays in float32."
    )


def not_reproduced(ev: Mapping[str, Any]) -> str:
    window = ev.get("trajectory_window")
    where = f" (steps {window[0]}-{window[1]})" if isinstance(window, list) and len(window) == 2 else ""
    return (
        f"Replayed from a snapshot{where} with the same batches and random state, in float32 and at the run's own "
        "precision, the steps stay finite: the fault is not a deterministic overflow, so no precision setting is "
        "the fix. Suspect something outside the replayed computation: a transient hardware fault, a "
        "nondeterministic kernel or data race, or state your training_step changes on its own (counters, caches). "
        "If it comes back, rerun from the same checkpoint and seed to catch it."
    )
