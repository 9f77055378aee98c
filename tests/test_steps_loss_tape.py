"""The loss tape taken as floats on the CPU (``StepLedger.backward``: ``loss.item()``, no synchronisation there) reads
exactly as the tape of unread tensors it replaces: every dtype a loss comes in, scaled or not, one backward per step
or several, NaN and inf. The whole-fit comparison is in ``test_deferred_steps.py``; this is the arithmetic, bit for
bit, over many values."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ampwatch import steps
from lightning_ampwatch.machine import PrecisionMode
from lightning_ampwatch.signals import LossTape, PrecisionInfo
from lightning_ampwatch.steps import LossRing, StepLedger

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_VALUES = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.floats(min_value=1e-3, max_value=1e3),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3.4028235e38, 1e39, 65504.0, 7e4]),
)
_SCALES = st.sampled_from([1.0, 2.0**16, 2.0**-3, 1024.0, 3.0, 0.1])


def _bits(values: list[float] | float) -> list[bytes] | bytes:
    """Floats as their bytes: -0.0 is told from 0.0. A NaN is any NaN (its payload shows nowhere: not in a
    diagnosis, the timeline's ``"nan"`` or a metric)."""
    if isinstance(values, list):
        return [_bits(v) for v in values]  # type: ignore[misc]
    return b"nan" if math.isnan(values) else struct.pack("<d", values)


def _both(entries: list[tuple[float, torch.dtype, float]]) -> tuple[LossTape, LossTape]:
    """The same losses as a tape of tensors (as on an accelerator) and as a tape of floats (as on the CPU)."""
    tensors = [(torch.tensor(v, dtype=dtype), scale) for v, dtype, scale in entries]
    return LossTape(tensors), LossTape([(t.item(), scale) for t, scale in tensors])


def _read(host: bool, held: list[tuple[int, Any]],
          extra: list[torch.Tensor]) -> tuple[list[float], list[tuple[int, float]]]:
    """A ledger's read (the host path, or the packed one of an accelerator) of ``held``, the loss ring's entries
    (``(step, tape)``, or ``(step, loss)`` as the express lane holds it), with ``extra`` values: the values returned
    and the per-step losses settled."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps.losses, "HOST_TAPE_DEVICES", frozenset({"cpu"}) if host else frozenset())
        ledger = StepLedger(PrecisionInfo(PrecisionMode.FP16), "cpu")
    assert ledger._host_tape is host
    ring = LossRing()
    ring.entries.extend(held)
    ledger.losses = ring
    values = ledger.read_losses(extra)
    assert ring.entries == []
    return values, ledger.take_unnoted()


def _assert_same_reads(one: tuple[list[float], list[tuple[int, float]]],
                       other: tuple[list[float], list[tuple[int, float]]], steps_read: int) -> None:
    (values_a, losses_a), (values_b, losses_b) = one, other
    assert _bits(values_a) == _bits(values_b)
    assert [s for s, _ in losses_a] == [s for s, _ in losses_b] == list(range(1000, 1000 + steps_read))
    assert _bits([v for _, v in losses_a]) == _bits([v for _, v in losses_b])


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(entries=st.lists(st.tuples(_VALUES, st.sampled_from(DTYPES), _SCALES), min_size=1, max_size=4))
def test_a_float_tape_reads_and_totals_as_its_tensors(entries: list[tuple[float, torch.dtype, float]]) -> None:
    tensors, floats = _both(entries)
    assert _bits(floats.read()) == _bits(tensors.read())
    total_t, total_f = tensors.total(), floats.total()
    # what a DeferredRead of the total gives (the no-scaler path): the value, whatever the dtype the total is in
    assert _bits(float(total_f)) == _bits(float(total_t))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(steps_=st.lists(st.lists(st.tuples(_VALUES, st.sampled_from(DTYPES), _SCALES), min_size=1, max_size=3),
                       min_size=1, max_size=60),
       one_dtype=st.booleans(), scale=_SCALES, tracker=st.integers(0, 2**25 + 3))
def test_a_log_steps_read_of_floats_is_the_packed_read_of_tensors(
        steps_: list[list[tuple[float, torch.dtype, float]]], one_dtype: bool,
        scale: float, tracker: int) -> None:
    """The packed read (the scaler's scale and tracker, the losses, one ``cat``) against the host read of the same
    values taken as floats: the same values returned, the same per-step losses settled."""
    if one_dtype:  # the usual case: one loss dtype, one backward per step (stacked as they are)
        steps_ = [[(tape[0][0], torch.float32, tape[0][2])] for tape in steps_]
    extra = [torch.tensor([scale], dtype=torch.float32), torch.tensor([tracker], dtype=torch.int32),
             torch.tensor([3.0, 0.1, 7e40], dtype=torch.float64)]

    def held(host: bool) -> list[tuple[int, LossTape]]:
        return [(1000 + i, _both(entries)[1 if host else 0]) for i, entries in enumerate(steps_)]

    _assert_same_reads(_read(True, held(True), extra), _read(False, held(False), extra), len(steps_))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(steps_=st.lists(st.lists(st.tuples(_VALUES, st.sampled_from(DTYPES), _SCALES), min_size=1, max_size=3),
                       min_size=1, max_size=60),
       plain=st.lists(st.booleans(), min_size=60, max_size=60), host=st.booleans(), with_extra=st.booleans())
def test_a_lane_steps_loss_held_alone_reads_as_its_one_loss_tape(
        steps_: list[list[tuple[float, torch.dtype, float]]], plain: list[bool], host: bool,
        with_extra: bool) -> None:
    """The express lane holds a step's one unscaled loss alone, not in a tape: among tapes of one or several losses,
    scaled or not, it reads (returned values, per-step losses settled) bit for bit as the one-loss tape it stands
    for, on the host path and the packed one, with or without other values in the read."""
    lane = [keep and len(tape) == 1 for keep, tape in zip(plain, steps_)]
    steps_ = [[(tape[0][0], tape[0][1], 1.0)] if alone else tape for alone, tape in zip(lane, steps_)]
    extra = [torch.tensor([2.0**16], dtype=torch.float32), torch.tensor([7], dtype=torch.int32)] if with_extra else []

    def held(as_lane: bool) -> list[tuple[int, Any]]:
        tapes = [_both(entries)[1 if host else 0] for entries in steps_]
        return [(1000 + i, tape[0][0] if alone and as_lane else tape)
                for i, (alone, tape) in enumerate(zip(lane, tapes))]

    _assert_same_reads(_read(host, held(True), extra), _read(host, held(False), extra), len(steps_))


def test_the_cpu_takes_each_loss_as_a_float_and_an_accelerator_keeps_the_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = torch.tensor(0.75, requires_grad=True) * 1.0
    on_cpu = StepLedger(PrecisionInfo(PrecisionMode.FP16, scaler), "cpu")
    on_cpu.mirror_scaler()
    on_cpu.backward(scaler.scale(loss))  # Lightning hands over the scaled loss under a GradScaler
    assert on_cpu._tape == [(0.75 * 2.0**10, 2.0**10)] and on_cpu._tape.read() == 0.75
    monkeypatch.setattr(steps.losses, "HOST_TAPE_DEVICES", frozenset())
    kept = StepLedger(PrecisionInfo(PrecisionMode.FP16, scaler), "cpu")
    kept.mirror_scaler()
    kept.backward(scaler.scale(loss))
    (value, scale), = kept._tape
    assert isinstance(value, torch.Tensor) and not value.requires_grad and scale == 2.0**10
    assert kept._tape.read() == 0.75


def test_a_loss_of_several_values_is_kept_as_a_tensor_from_then_on() -> None:
    """A manual backward of a vector (with its gradient) has no single value to take: the tape keeps tensors, as
    before, instead of failing the watch."""
    ledger = StepLedger(PrecisionInfo(PrecisionMode.FP32), "cpu")
    ledger.backward(torch.tensor(1.5))
    ledger.backward(torch.tensor([1.0, 2.0]))
    ledger.backward(torch.tensor(0.5))
    assert not ledger._host_tape
    assert [type(v) for v, _ in ledger._tape] == [float, torch.Tensor, torch.Tensor]


def test_a_host_read_of_the_lane_s_float32_losses_hands_the_ring_s_own_pairs_on() -> None:
    """On the CPU the express lane holds each step's loss as ``(step, loss)``; where float32 leaves every loss as it
    was (a float32 loss, the usual case), the read hands those very pairs on to the machine: no new object a step.
    A loss float32 rounds is handed on rounded, in a pair of its own, as the packed read gives it."""
    ledger = StepLedger(PrecisionInfo(PrecisionMode.FP16), "cpu")
    held = [(1000 + i, torch.tensor(v, dtype=torch.float32).item()) for i, v in enumerate([0.5, 1.1, 3.0e-3])]
    ledger.losses.entries.extend(held)
    ledger.read_losses()
    read = ledger.take_unnoted()
    assert read == held and all(a is b for a, b in zip(read, held))
    rounded = [(2000, 0.1), (2001, 0.5)]  # 0.1 is no float32 value
    ledger.losses.entries.extend(rounded)
    ledger.read_losses()
    read = ledger.take_unnoted()
    assert read == [(2000, torch.tensor(0.1, dtype=torch.float32).item()), (2001, 0.5)] and read[1] is not rounded[1]
