"""The watch's own checkpointed state (diagnoses, the machine, the remedies applied, the policy), as a part of
:class:`~lightning_ampwatch.core.RunWatcher`: written by ``state_dict``, kept by ``load_state_dict`` until
``start`` builds the rooms, and put back there part by part (a part that cannot be read is warned about and left
out). No Lightning import."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from lightning_ampwatch.machine import AmpStateMachine
from lightning_ampwatch.remedies import AppliedRemedy, reapply_all
from lightning_ampwatch.taxonomy import Diagnosis

#: The checkpoint state's layout; a state of another version is set aside with a warning, never half-read.
STATE_VERSION = 2


class WatchState:
    """The checkpoint methods of :class:`~lightning_ampwatch.core.RunWatcher` (which holds the attributes they
    read: ``diagnoses``, ``machine``, ``applied``, ``treatment``, ``config``, ``remedy_context``)."""

    diagnoses: list[Diagnosis]
    machine: AmpStateMachine | None
    applied: list[AppliedRemedy]
    treatment: Any
    config: Any
    _loaded_state: dict[str, Any] | None

    def remedy_context(self) -> Any:
        raise NotImplementedError

    def _say(self, message: str) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "diagnoses": [d.to_dict() for d in self.diagnoses],
            "machine": None if self.machine is None else self.machine.state_dict(),
            "applied": [r.to_dict() for r in self.applied],
            "policy": self.treatment.policy.state_dict(),
            "watch": self.treatment.watch_state(),  # a remedy still watched: judged after a resume too
            "recovered": self.treatment.recovered_state(),  # recoveries a relapse after a resume takes back
        }

    def load_state_dict(self, state_dict: Any) -> None:
        """Kept until ``start`` builds the rooms; restored there, part by part."""
        self._loaded_state = state_dict if isinstance(state_dict, dict) else {"invalid": state_dict}

    def _restore(self, state: dict[str, Any]) -> None:
        """Put back what a checkpoint holds, part by part: a part that cannot be read is warned about once, by name,
        and left out; the watch goes on with what could be read."""
        if "invalid" in state and len(state) == 1:
            self._warn_state(f"it is a {type(state['invalid']).__name__}, not a dict", None)
            return
        version = state.get("version", 1)
        if version not in (1, STATE_VERSION):
            self._warn_state(f"it has version {version!r}; this AmpWatch reads versions 1 and {STATE_VERSION}", None)
            return
        parts: list[tuple[str, Callable[[], None]]] = [
            ("diagnoses", lambda: setattr(self, "diagnoses",
                                          [Diagnosis.from_dict(d) for d in state.get("diagnoses", ())])),
            ("applied", lambda: setattr(self, "applied",
                                        [AppliedRemedy.from_dict(a) for a in state.get("applied", ())])),
            ("policy", lambda: self.treatment.policy.load_state_dict(state.get("policy", {}))),
            ("machine", lambda: self.machine.load_state_dict(state["machine"])  # type: ignore[union-attr]
             if state.get("machine") else None),
            ("watch", lambda: self.treatment.load_watch(state.get("watch"), self.diagnoses)),
            ("recovered", lambda: self.treatment.load_recovered(state.get("recovered"), self.diagnoses)),
        ]
        for part, load in parts:
            try:
                load()
            except Exception as err:  # noqa: BLE001 - a bad part must not cost the watch
                self._warn_state(f"its {part!r} entry cannot be read ({type(err).__name__}: {err})", part)
        if self.applied:
            # a checkpoint carries neither forward hooks nor a swapped precision plugin: put them back first
            try:
                for line in reapply_all(self.remedy_context(), self.applied):
                    self._say(line)  # (the reporters are not built yet: the host's own line)
            except Exception as err:  # noqa: BLE001
                self._warn_state(f"a remedy it records cannot be applied again ({type(err).__name__}: {err})",
                                 "applied")

    def _warn_state(self, why: str, part: str | None) -> None:
        if part == "machine" and self.machine is not None:
            self.machine = AmpStateMachine(self.machine.mode, self.config.thresholds, self.machine.scaler_config,
                                           early_startup=self.machine.early_startup)
        warnings.warn(f"AmpWatch could not use the checkpoint's {self.config.state_key!r} state: {why}. "
                      + ("It keeps watching without it." if part is None else
                         f"It keeps watching without the {part!r} part."), RuntimeWarning, stacklevel=4)
