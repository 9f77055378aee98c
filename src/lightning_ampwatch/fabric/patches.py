"""What the Fabric adapter installs on the run, and puts back (:class:`LoopPatches`).

Fabric has no hooks of its own to feed a watch, so the adapter takes what the loop does anyway:

- ``fabric.backward(loss)``: the precision plugin's ``backward`` is wrapped on the plugin instance, so the watch sees
  the loss exactly as Fabric hands it to autograd, scaled by the GradScaler, once per micro-batch, at the user's line;
- ``optimizer.step()``: Fabric's optimizer wrapper steps the raw optimizer through the precision plugin's scaler,
  whose ``update`` (wrapped on the scaler instance) tells that the loop's optimizer step ran, taken or skipped;
- a model that draws random numbers gets a forward pre-hook, where the RNG state a replay needs is kept.

Each patch is an attribute on the instance, removed by :meth:`LoopPatches.uninstall` (a wrapper someone put on top
of ours since stays). What the patches see goes to :class:`~lightning_ampwatch.fabric.loop.LoopStep`.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_ampwatch.core import RunWatcher
from lightning_ampwatch.fabric.loop import LoopStep, scaler_of
from lightning_ampwatch.probes import uses_rng


class LoopPatches:
    """The backward watch on the precision plugin (on the instance), a look after the scaler's update (the loop's
    optimizer step ran; ``hold_lr_on_skip``) and, for models that draw random numbers, a forward pre-hook that keeps
    the RNG state a replay needs."""

    def __init__(self, fabric: Fabric, module: nn.Module, loop: LoopStep, watcher: RunWatcher) -> None:
        self._fabric = fabric
        self._module = module
        self._loop = loop
        self._watcher = watcher
        self._patched: list[tuple[Any, str, Any]] = []  # (object, attribute, the wrapper put there)
        self._rng_hook: Any = None

    def install(self) -> None:
        precision = self._fabric.strategy.precision
        self._watch_backward(precision)
        scaler = scaler_of(precision)
        if scaler is not None:  # the optimizer step Fabric runs ends in the scaler's update, skipped or not
            self._patch(scaler, "update", _AfterScalerUpdate(scaler, self._loop, self._watcher))
        if uses_rng(self._module):  # only a model that draws random numbers needs the RNG state of each batch
            self._rng_hook = self._module.register_forward_pre_hook(self._loop.before_forward)

    def uninstall(self) -> None:
        """Put back everything :meth:`install` changed; a wrapper someone put on top of ours since stays."""
        for obj, name, wrapper in reversed(self._patched):
            if obj.__dict__.get(name) is wrapper:
                del obj.__dict__[name]
        self._patched.clear()
        if self._rng_hook is not None:
            self._rng_hook.remove()
            self._rng_hook = None

    def follow(self, plugin: Any) -> None:
        """The run's precision plugin now (a bf16 fallback swaps it): its backward is watched too, once installed."""
        if self._patched and not any(obj is plugin for obj, _, _ in self._patched):
            self._watch_backward(plugin)

    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        obj.__dict__[name] = wrapper
        self._patched.append((obj, name, wrapper))

    def _watch_backward(self, plugin: Any) -> None:
        self._patch(plugin, "backward", _WatchedBackward(plugin, self._loop, self._watcher))


class _WatchedBackward:
    """Stands in for the precision plugin's ``backward`` (on the instance): the loss goes to the watch as Fabric
    hands it to autograd, scaled by the plugin's GradScaler when there is one. The scaler's ``scale`` is looked at
    only for the length of the call."""

    def __init__(self, plugin: Any, loop: LoopStep, watcher: RunWatcher) -> None:
        self.original = type(plugin).backward.__get__(plugin)
        self.__wrapped__ = self.original  # Fabric asks whether the plugin overrides backward: it still does
        self.plugin = plugin
        self.loop = loop
        self.watcher = watcher

    def __call__(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        loop = self.loop
        loop.backward_seen = True
        loop.backward_calls += 1
        watcher = self.watcher
        if not loop.lrs_noted:
            try:
                loop.note_lrs()
            except Exception as err:  # noqa: BLE001 - the adapter's own failure never reaches the loop
                watcher.internal_failure("fabric.backward", err)
        scaler = scaler_of(self.plugin)
        if scaler is None:
            watcher.route.before_backward(tensor)
            return self.original(tensor, *args, **kwargs)
        seen = _ScaledLoss(scaler, watcher)
        scaler.__dict__["scale"] = seen
        try:
            return self.original(tensor, *args, **kwargs)
        finally:
            scaler.__dict__.pop("scale", None)
            if not seen.seen:  # a plugin that scales some other way: its loss is not the one the ledger can read
                watcher.say_once(f"{type(self.plugin).__name__} did not scale the loss through its GradScaler's "
                                 "scale(); FabricWatch cannot read the loss of this run's steps.")


class _ScaledLoss:
    """Stands in for the scaler's ``scale`` for the length of one ``backward``: the first scaled loss goes to the
    watch, as Lightning's ``on_before_backward`` hands it over (scaled)."""

    __slots__ = ("scaler", "watcher", "seen")

    def __init__(self, scaler: Any, watcher: RunWatcher) -> None:
        self.scaler, self.watcher, self.seen = scaler, watcher, False

    def __call__(self, outputs: Any) -> Any:
        out = type(self.scaler).scale(self.scaler, outputs)
        if not self.seen and isinstance(out, Tensor):
            self.seen = True
            self.watcher.route.before_backward(out)
        return out


class _AfterScalerUpdate:
    """Stands in for the GradScaler's ``update`` (on the instance; the scaler's ``state_dict`` lists its fields, so a
    checkpoint never holds this): after the real update, the loop learns that its optimizer step ran, and
    ``hold_lr_on_skip`` whether it was skipped, before the loop steps its schedulers."""

    def __init__(self, scaler: Any, loop: LoopStep, watcher: RunWatcher) -> None:
        self.original = type(scaler).update.__get__(scaler)
        self.loop = loop
        self.watcher = watcher

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        try:
            self.loop.after_scaler_update()
        except Exception as err:  # noqa: BLE001 - the adapter's own failure never reaches the loop
            self.watcher.internal_failure("the scaler's update", err)
        return out
