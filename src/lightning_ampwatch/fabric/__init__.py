"""The Fabric adapter: :class:`FabricWatch` watches a hand-written Fabric loop with the same core, diagnoses, remedies,
event log and console output as :class:`~lightning_ampwatch.AmpWatch`.

Fabric has no hooks of its own to feed a watch, so the adapter takes what the loop does anyway:

- ``fabric.backward(loss)``: the precision plugin's ``backward`` is wrapped on the plugin instance (the one patch;
  put back by :meth:`FabricWatch.close`), so the watch sees the loss exactly as Fabric hands it to autograd,
  scaled by the GradScaler, once per micro-batch, at the user's line;
- ``optimizer.step()``: Fabric's optimizer wrapper steps the raw optimizer through the precision plugin's scaler,
  and the watch's step hook on the raw optimizer learns, without a read (a fused optimizer
  excepted, whose flag is read once it lands), whether the scaler took the step;
- ``watch.step(batch, loss)``: the optimizer-step boundary, once per optimizer step.

The package, in the order its imports run (each module imports only those above it):

- ``loop.py``: what the loop did between two ``watch.step`` calls (:class:`~.loop.LoopStep`: ``fabric.backward``
  calls, micro-batches, the scaler's updates, ``hold_lr_on_skip``) and the rates it set itself
  (:class:`~.loop.LoopLearningRates`);
- ``patches.py``: what is installed on the run and put back (:class:`~.patches.LoopPatches`);
- ``host.py``: :class:`~.host.FabricHost`, the core's :class:`~lightning_ampwatch.host.Host` for a Fabric run, and
  how a replay calls ``loss_fn`` the way Fabric runs the model;
- ``watch.py``: :class:`FabricWatch`, the public front.
"""

from lightning_ampwatch.fabric.watch import DEFAULT_LOG_EVERY_N_STEPS, FabricWatch

__all__ = ["DEFAULT_LOG_EVERY_N_STEPS", "FabricWatch"]
