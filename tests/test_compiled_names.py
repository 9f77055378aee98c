"""A torch.compile'd submodule is named as the user's model names it: torch.compile's wrapper holds the module as
``_orig_mod``, a step the user never wrote, left out of locations and of the island's module. Dynamo with the eager
backend (no Inductor: seconds on the CPU) gives the same wrapper and module tree as a real compile; the CUDA test
with Inductor is in tests/test_cuda.py."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.compat import user_name
from lightning_ampwatch.scenarios import SCENARIOS, build_trainer


def _compiled_fit(root: Path, watch: AmpWatch) -> pl.LightningModule:
    scenario = SCENARIOS["forward_overflow"]
    pl.seed_everything(0, verbose=False)
    model = scenario.model()
    model.attention = torch.compile(model.attention, backend="eager")
    build_trainer(scenario, [watch], str(root), max_steps=16).fit(model, scenario.dataloader())
    return model


def test_user_name_leaves_out_the_compiled_wrappers_step() -> None:
    assert user_name("attention._orig_mod.q.weight") == "attention.q.weight"
    assert user_name("_orig_mod.encoder.0") == "encoder.0"
    assert user_name("encoder.0.weight") == "encoder.0.weight"


def test_a_forward_overflow_in_a_compiled_submodule_is_located_by_its_users_name(tmp_path: Path) -> None:
    torch.compiler.reset()  # a fresh compile cache per test
    watch = AmpWatch(verbose=False, remediate=True)
    model = _compiled_fit(tmp_path, watch)
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert (d.finding, d.location) == (Finding.FORWARD_OVERFLOW, "attention")
    assert "_orig_mod" not in d.advice and "_orig_mod" not in str(d.evidence)
    assert d.remedy == "fp32_island" and d.evidence["remedy_details"] == {"module": "attention"}
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
