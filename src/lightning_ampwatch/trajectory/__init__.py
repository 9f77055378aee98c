"""The FP32 control as a run, not one batch: a budgeted ring of host snapshots, a trajectory replay, and the control
that judges an alarm with them.

One batch replayed in FP32 with the current weights cannot tell float16 from a diverging optimisation: once a
too-high LR has inflated the weights, FP32 computes that batch fine while FP32 *training* diverges as well. So the
control restores a snapshot from before the onset and re-runs those optimizer steps in FP32; a second replay at
the run's own precision tells whether the fault reproduces at all. Both run in place on the live module and then
put the live state back exactly, so the run continues bit-identically.

The modules, each importing only those above it:

- :mod:`.state`: :class:`~.state.TrainState`, what drives an optimizer step outside Lightning's loop;
- :mod:`.snapshot`: :class:`~.snapshot.Snapshot`, a host copy of everything an optimizer step changes;
- :mod:`.ring`: :class:`~.ring.SnapshotRing`, snapshots every few steps within a memory budget, and the batches since;
- :mod:`.replay`: :func:`~.replay.replay_trajectory` and :func:`~.replay.retrain`, the window's steps again;
- :mod:`.control`: :class:`~.control.TrajectoryControl`, the FP32 trajectory control the core owns.

Import from the module that defines a name (``from lightning_ampwatch.trajectory.ring import SnapshotRing``): this
package re-exports nothing.
"""
