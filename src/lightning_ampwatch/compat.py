"""Every private attribute of torch and Lightning the project touches, in one module.

A torch or Lightning release that renames one of these breaks this module and nothing else; ``tests/test_compat.py``
fails when another module touches a private attribute of either. Each accessor says what it reads and why the
public API does not do: most exist to learn something without a host-device synchronisation (the scaler's state as
device tensors, not ``GradScaler.state_dict()``'s ``.item()``), or to leave a live run exactly as it was found.

Lightning is imported lazily, inside the functions only the Lightning adapter calls: the framework-free core may
import this module.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from lightning_ampwatch import protocol  # (it imports nothing of the package's)

# --------------------------------------------------------------------------------------------
# torch.amp.GradScaler
# --------------------------------------------------------------------------------------------


def scale_tensor(scaler: Any) -> Tensor | None:
    """The scaler's scale as its device tensor (``get_scale()`` would read it); None before its first use."""
    return getattr(scaler, "_scale", None)


def growth_tracker_tensor(scaler: Any) -> Tensor | None:
    """The scaler's count of clean steps towards the next growth, as its device tensor."""
    return getattr(scaler, "_growth_tracker", None)


def reset_growth_tracker(scaler: Any) -> None:
    """Start counting clean steps towards the next growth afresh (no public setter exists)."""
    tracker = growth_tracker_tensor(scaler)
    if tracker is not None:
        tracker.zero_()


def initial_scale(scaler: Any) -> tuple[float, int]:
    """(scale, growth tracker) of a scaler not used yet (or just resumed): plain numbers, no device read."""
    return float(scaler._init_scale), int(getattr(scaler, "_init_growth_tracker", 0))


def per_optimizer_states(scaler: Any) -> Any:
    """GradScaler's per-optimizer bookkeeping (``{id(optimizer): {"stage": OptState, ...}}``, a defaultdict: read
    it with ``.get``), or None for a scaler that has none."""
    return getattr(scaler, "_per_optimizer_states", None)


#: :func:`per_optimizer_states` for a scaler known to have it, as one C call (no Python frame): the recipe guard
#: reads it at every optimizer step.
read_per_optimizer_states = operator.attrgetter("_per_optimizer_states")


def unscales_in_kernel(optimizer: Any) -> bool:
    """Whether the optimizer takes the scaler's ``found_inf``/``grad_scale`` and unscales in its own (fused)
    kernel."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# --------------------------------------------------------------------------------------------
# torch.optim and its schedulers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def without_step_hooks(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Optimizer steps taken inside stay unseen by the step hooks watching the live run (AmpWatch's own among
    them): the hooks are set aside and put back exactly. Optimizers without torch's hook dicts (DeepSpeed's) are
    left as they are."""
    saved = [(opt, opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks) for opt in optimizers
             if hasattr(opt, "_optimizer_step_pre_hooks") and hasattr(opt, "_optimizer_step_post_hooks")]
    for opt, _, _ in saved:
        opt._optimizer_step_pre_hooks = OrderedDict()
        opt._optimizer_step_post_hooks = OrderedDict()
    try:
        yield
    finally:
        for opt, pre, post in saved:
            opt._optimizer_step_pre_hooks = pre
            opt._optimizer_step_post_hooks = post


def scale_last_lr(scheduler: Any, factor: float) -> None:
    """Scale what ``get_last_lr()`` reports along with the optimizer's learning rates (no public setter)."""
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [lr * factor for lr in scheduler._last_lr]


def held_last_lr(scheduler: Any) -> None:
    """What ``get_last_lr()`` reports, made the optimizer's learning rates again after they were held under a
    ceiling (as torch sets it at the end of a step; no public setter)."""
    opt = getattr(scheduler, "optimizer", None)
    if hasattr(scheduler, "_last_lr") and opt is not None:
        scheduler._last_lr = [group["lr"] for group in opt.param_groups]


# --------------------------------------------------------------------------------------------
# torch.autograd graph nodes (read a few nodes below the loss)
# --------------------------------------------------------------------------------------------


def node_output_dtype(node: Any) -> torch.dtype | None:
    """The dtype of what a backward node's forward op produced; None where the graph does not say."""
    meta = getattr(node, "_input_metadata", None)  # private but stable since torch 2.1; absent: no verdict
    try:
        return meta[0].dtype if meta else None
    except (AttributeError, IndexError, TypeError):
        return None


def saved_operand(node: Any, which: str) -> Any:
    """The operand a ``Mul``/``Div`` backward node saved: ``"self"`` or ``"other"``; None if it saved none."""
    return getattr(node, f"_saved_{which}", None)


# --------------------------------------------------------------------------------------------
# torch.nn
# --------------------------------------------------------------------------------------------

#: Module types that draw random numbers in training (every dropout variant shares the private base class).
STOCHASTIC_MODULES: tuple[type, ...] = (nn.modules.dropout._DropoutNd, nn.RReLU)


def tensor_version(t: Tensor) -> int:
    """The tensor's version counter: every in-place change bumps it (no public reader exists)."""
    return int(t._version)


# --------------------------------------------------------------------------------------------
# torch.distributed.fsdp
# --------------------------------------------------------------------------------------------


#: torch.compile's wrapper (``OptimizedModule``) holds the user's module as this child: a name the user never wrote
COMPILED_CHILD = "_orig_mod"


def user_name(name: str) -> str:
    """A module's or parameter's qualified name as the user's model spells it: the steps torch.compile's wrapper
    adds (``attention._orig_mod.q`` is ``attention.q``) left out."""
    if COMPILED_CHILD not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_CHILD)


def has_submodule(module: nn.Module, name: str) -> bool:
    """``name`` names a submodule of ``module`` (``""``: the module itself), through a ``torch.compile``'d one too:
    the user's path, without ``_orig_mod`` (the compiled wrapper hands attribute access on to what it compiled)."""
    try:
        module.get_submodule(name)
    except (AttributeError, TypeError):
        return False
    return True


def copy_all(dst: list[Tensor], src: list[Tensor], non_blocking: bool = False) -> None:
    """``dst[i].copy_(src[i])`` for every pair, in one call (``torch._foreach_copy_``: the loop in C++; on an
    accelerator, grouped launches). Falls back to the Python loop where a build lacks it."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:  # pragma: no cover - torch < 2.1
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=non_blocking)
        return
    foreach(dst, src, non_blocking=non_blocking)


#: A module's own parameters, buffers and child modules: its ``_parameters``, ``_buffers`` and ``_modules`` dicts
#: (None entries included), each read with one C call. The snapshot's fingerprint walks them every snapshot.
module_parameters = operator.attrgetter("_parameters")
module_buffers = operator.attrgetter("_buffers")
module_children = operator.attrgetter("_modules")


def fsdp1_flattened(p: Tensor) -> bool:
    """Whether ``p`` is one of FSDP1's flattened parameters (its forward gathers it from every rank)."""
    return bool(getattr(p, "_fsdp_flattened", False))


def fsdp1_unsharded(root: nn.Module) -> bool:
    """Whether one of FSDP1's sharded flat parameters under ``root`` holds the gathered whole rather than this rank's
    shard (``FlatParamHandle.flat_param`` against its ``_local_shard``; FSDP1 keeps no public reader of either)."""
    for m in root.modules():
        handle = getattr(m, "_handle", None)  # each FullyShardedDataParallel's FlatParamHandle (None: no parameter)
        flat = getattr(handle, "flat_param", None)
        shard = getattr(flat, "_local_shard", None)
        if shard is not None and getattr(handle, "uses_sharded_strategy", False) \
                and flat.data_ptr() != shard.data_ptr():
            return True
    return False


def fsdp2_param_dtype(module: nn.Module) -> torch.dtype | None:
    """The ``param_dtype`` of the ``MixedPrecisionPolicy`` ``fully_shard`` gave ``module`` (FSDP2), or None."""
    get_state = getattr(module, "_get_fsdp_state", None)  # fully_shard's module class has it
    if not callable(get_state):
        return None
    try:
        return getattr(getattr(get_state(), "_mp_policy", None), "param_dtype", None)
    except Exception:  # noqa: BLE001 - a module fully_shard has not set up: no policy to read
        return None


# --------------------------------------------------------------------------------------------
# DeepSpeed (its engine's attributes: public names, but no documented API; written only by the scaler remedies)
# --------------------------------------------------------------------------------------------


def deepspeed_fp16(engine: Any) -> bool:
    """Whether the DeepSpeed engine trains in fp16 (with a loss scaler of its own)."""
    enabled = getattr(engine, "fp16_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def deepspeed_loss_scaler(engine: Any) -> Any:
    """The engine's loss scaler (``DynamicLossScaler`` or a static ``LossScaler``), kept by its ZeRO or fp16
    optimizer; None where it keeps none."""
    return getattr(getattr(engine, "optimizer", None), "loss_scaler", None)


def deepspeed_loss_scale(engine: Any) -> float:
    """The engine's current loss scale, a host-side float (its optimizer's ``cur_scale``, which also answers for a
    custom loss scaler)."""
    optimizer = getattr(engine, "optimizer", None)
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(deepspeed_loss_scaler(engine), "cur_scale", 1.0)
    return float(scale)


def deepspeed_overflow(engine: Any) -> bool:
    """Whether the engine's latest optimizer step overflowed (its optimizer's host-side flag)."""
    return bool(getattr(getattr(engine, "optimizer", None), "overflow", False))


def deepspeed_skipped_steps(engine: Any) -> int:
    """How many optimizer steps the engine has skipped on an overflow (its own counter)."""
    return int(getattr(engine, "skipped_steps", 0))


def deepspeed_at_boundary(engine: Any) -> bool:
    """Whether the engine's next ``step()`` is a gradient-accumulation boundary (an optimizer step, taken or
    skipped); asked before it runs. Where the caller owns accumulation (``managed_gradient_accumulation`` off),
    every ``step()`` is one."""
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        return True
    at_boundary = getattr(engine, "is_gradient_accumulation_boundary", None)
    return bool(at_boundary()) if callable(at_boundary) else True


def deepspeed_set_loss_scale(engine: Any, scale: float) -> None:
    """Set the engine's loss scale, and restart the count of clean steps towards its next growth (DynamicLossScaler
    grows when ``cur_iter - last_overflow_iter - 1`` reaches a multiple of ``scale_window``)."""
    scaler = deepspeed_loss_scaler(engine)
    scaler.cur_scale = float(scale)
    if hasattr(scaler, "last_overflow_iter") and hasattr(scaler, "cur_iter"):
        scaler.last_overflow_iter = scaler.cur_iter - 1


def deepspeed_set_scale_window(engine: Any, window: int) -> None:
    """Set how many clean steps DeepSpeed's dynamic loss scaler waits before it grows the scale."""
    deepspeed_loss_scaler(engine).scale_window = int(window)


def deepspeed_set_scale_factor(engine: Any, factor: float) -> None:
    """Set DeepSpeed's scale factor: it grows the scale by it, and divides the scale by it on an overflow."""
    deepspeed_loss_scaler(engine).scale_factor = float(factor)


def deepspeed_fp32_partitions(optimizer: Any) -> list[Tensor] | None:
    """A ZeRO-1/2 optimizer's float32 master weights on this rank: one flat partition per parameter group."""
    partitions = getattr(optimizer, "single_partition_of_fp32_groups", None)
    return list(partitions) if partitions is not None else None


def deepspeed_inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a ZeRO optimizer steps its float32 partitions with."""
    return optimizer.optimizer


def deepspeed_cpu_offload(optimizer: Any) -> bool:
    """Whether a ZeRO optimizer offloads its optimizer state to the host."""
    return bool(getattr(optimizer, "cpu_offload", False))


# --------------------------------------------------------------------------------------------
# Lightning (imported lazily: only the Lightning adapter calls these)
# --------------------------------------------------------------------------------------------


def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning logs at (``trainer.global_step`` counts each optimizer of a step; this does not)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def skips_uncallable_hooks() -> bool:
    """Whether Lightning passes over a callback hook that is not callable: its ``_call_callback_hooks`` checks
    ``callable(fn)`` before it opens the profiler's context and calls the hook (Lightning 2.x). AmpWatch then makes the
    per-step hooks it has no use for ``None`` on its instance during a fit, and that dispatch is not paid each step."""
    try:
        from lightning.pytorch.trainer import call
    except Exception:  # noqa: BLE001 - another Lightning: keep every hook
        return False
    fn = getattr(call, "_call_callback_hooks", None)
    code = getattr(fn, "__code__", None)
    return code is not None and "callable" in code.co_names


def optimizer_steps_done(trainer: Any) -> int:
    """The optimizer steps Lightning's automatic optimization has run in this fit, skipped ones included (it counts
    each ``optimizer_step`` call; a GradScaler's skip happens inside it): ``global_step`` without its property
    chain, read on the lean route at every batch end the express lane does not take."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed


def logger_connector(trainer: Any) -> Any:
    return trainer._logger_connector


class StepMetrics:
    """Puts AmpWatch's metrics in the same logger call as the step's own ``self.log`` values, so that a
    ``CSVLogger`` writes them on one row. The callback runs before Lightning logs the step, so the metrics wait
    on the logger connector (one wrapper on that instance) and ride along with Lightning's call at that step;
    a step Lightning does not log gets them in a call of their own, at the same step."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.pending: tuple[int, dict[str, float]] | None = None
        self._original = connector.log_metrics
        connector.log_metrics = self._log_metrics

    def hold(self, step: int, metrics: dict[str, float]) -> None:
        self.release()
        self.pending = (step, metrics)

    def _log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.pending is not None and step is None and "step" not in metrics \
                and self.pending[0] == batches_that_stepped(self.connector.trainer):
            metrics = {**metrics, **self.pending[1]}
            self.pending = None
        else:
            self.release()
        self._original(metrics, step=step)

    def release(self) -> None:
        """Log what is waiting on its own (its step was not logged by Lightning, or the fit is over)."""
        if self.pending is not None:
            step, metrics = self.pending
            self.pending = None
            self._original(metrics, step=step)

    def detach(self) -> None:
        self.release()
        if self.connector.__dict__.get("log_metrics") == self._log_metrics:
            del self.connector.log_metrics  # the class's own method again


class FitCheckpoints:
    """The checkpoint files one fit may roll back to, and the search for the newest of them from before a step.

    A file is this fit's when a ``ModelCheckpoint`` wrote it during the fit: it was not in the checkpoint folders (or
    among the callbacks' known paths) when the fit began, or it was rewritten since (its inode, size or modification
    time changed: a comparison of the file with itself, never with a clock). The file the fit resumed from
    (``ckpt_path``) is also its own: a resumed fit continues that state. The older files of the run it resumed are
    not: nothing in a file says which run wrote it, and a folder an unrelated run wrote to holds files just like
    them. Made at fit start (after ``setup``, where ``ModelCheckpoint`` settles its folder); it never raises: what it
    cannot read counts as not this fit's."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.passed_over: dict[str, int] = {}  # why -> how many files the latest search passed over for it
        try:
            self.before_fit: dict[str, tuple[int, int, int] | None] | None = {
                path: _signature(path) for path in _checkpoint_paths(trainer)}
        except Exception:  # noqa: BLE001 - unreadable folders: no file can be told apart, none is taken
            self.before_fit = None
        try:
            resumed = trainer.ckpt_path
            self.resumed_from = os.path.realpath(resumed) if isinstance(resumed, (str, os.PathLike)) \
                and os.path.exists(resumed) else None
        except Exception:  # noqa: BLE001
            self.resumed_from = None

    def written_by_this_fit(self, path: str) -> bool:
        if path == self.resumed_from:
            return True
        if self.before_fit is None:
            return False
        return path not in self.before_fit or self.before_fit[path] != _signature(path)

    def roll_back(self, before: int, keep_live: Callable[[], Callable[[], None]] | None = None,
                  ready: Callable[[int], None] | None = None) -> tuple[str | None, int | None]:
        """Load the newest checkpoint of this fit (a file, or a sharded checkpoint's directory) written before step
        ``before`` ran that holds the whole training state, through Lightning's own checkpoint connector: weights,
        precision plugin (the scaler), optimizers and schedulers; not the loops, so ``global_step`` stays monotonic.
        Returns (path, the step it was written at), or (None, None); :meth:`passed_over_sentence` then says which
        files were passed over and why.

        A file is read once, to the CPU, and checked before anything live is touched: one that holds only the
        weights (``save_weights_only=True``), or whose weights' names and shapes, optimizers or schedulers are not
        this run's, is passed over. A sharded strategy (FSDP, ModelParallelStrategy) loads a checkpoint into the
        live model inside ``load_checkpoint``, before it can be checked: ``keep_live()`` is called before each load
        and returns what puts the live state back, called when the checkpoint is passed over or fails to restore.
        A restore that still fails raises :class:`RollbackFailed`, saying whether the live state was put back.
        ``ready(step)``: called once a file has passed every check, right before it is restored (several ranks: their
        meeting, :func:`lightning_ampwatch.protocol.together`, which raises unless every rank is about to restore
        the same step; the live state is then put back, and nothing restored)."""
        self.passed_over = {}
        paths = [p for p in _checkpoint_paths(self.trainer) if os.path.exists(p)]
        own = [p for p in paths if self.written_by_this_fit(p)]
        if len(own) < len(paths):
            self._pass("foreign", len(paths) - len(own))
        trainer = self.trainer
        connector = trainer._checkpoint_connector
        for path in sorted(own, key=os.path.getmtime, reverse=True):
            if ready is not None and keep_live is not None:
                # a sharded load is a collective: every rank meets before each (protocol.meet_or_abort), and a rank
                # that could not keep its live state says so there; then every rank leaves, before the load
                try:
                    put_back = keep_live()
                except Exception as err:  # noqa: BLE001 - brought to the meeting: every rank raises alike
                    protocol.meet_or_abort(f"{type(err).__name__}: {err}")
                    raise
                try:
                    protocol.meet_or_abort(None)
                except protocol.ReplayAborted:
                    put_back()
                    raise
            else:
                put_back = keep_live() if keep_live is not None else None
            try:
                checkpoint = trainer.strategy.load_checkpoint(path)
            except Exception:  # noqa: BLE001 - a file that cannot be read is passed over, like any unfit one
                if put_back is not None:
                    put_back()
                self._pass("unreadable")
                continue
            step = checkpoint.get("global_step")
            unfit = None if not isinstance(step, int) or step > before else \
                _unfit(trainer, checkpoint, weights_loaded=keep_live is not None)
            if not isinstance(step, int) or step > before or unfit is not None:
                # (too new: written after `step` steps, so before step `step` ran)
                if put_back is not None:
                    put_back()
                if unfit is not None:
                    self._pass(unfit)
                continue
            if ready is not None:
                try:
                    ready(step)
                except Exception:
                    if put_back is not None:
                        put_back()
                    raise
            connector._loaded_checkpoint = checkpoint
            restored: list[str] = []
            try:
                for part, restore in (("the weights", connector.restore_model),
                                      ("the precision plugin (the scaler)", connector.restore_precision_plugin_state),
                                      ("the optimizers and schedulers", connector.restore_optimizers_and_schedulers)):
                    restore()
                    restored.append(part)
            except Exception as err:
                if put_back is not None:
                    put_back()
                raise RollbackFailed(path, err, restored, put_back=put_back is not None) from err
            finally:
                connector._loaded_checkpoint = {}
            return path, step
        return None, None

    def _pass(self, why: str, count: int = 1) -> None:
        self.passed_over[why] = self.passed_over.get(why, 0) + count

    def passed_over_sentence(self) -> str | None:
        """The files the latest search passed over, by why (None: none was), e.g. ``1 file that holds only the
        weights (save_weights_only=True)``."""
        if not self.passed_over:
            return None
        return " and ".join(f"{n} file{'' if n == 1 else 's'} that {_PASSED[why][n != 1]}"
                            for why, n in self.passed_over.items())


#: Why a checkpoint file was passed over (the singular and the plural).
_PASSED = {
    "foreign": ("was already there when this fit began", "were already there when this fit began"),
    "weights": ("holds only the weights, written with save_weights_only=True",
                "hold only the weights, written with save_weights_only=True"),
    "mismatch": ("does not match this run's model, optimizers or schedulers",
                 "do not match this run's model, optimizers or schedulers"),
    "no_scaler": ("holds no loss-scaler state", "hold no loss-scaler state"),
    "unreadable": ("could not be read", "could not be read"),
}


class RollbackFailed(RuntimeError):
    """Restoring a checkpoint that passed every check still failed (a user hook, a device error)."""

    def __init__(self, path: str, err: Exception, restored: list[str], put_back: bool) -> None:
        if put_back:
            state = "the live state was put back as it was"
        elif restored:
            state = f"{' and '.join(restored)} had been restored from it, the rest is the live run's"
        else:
            state = "nothing had been restored from it yet"
        super().__init__(f"restoring the checkpoint file {path} failed ({type(err).__name__}: {err}); {state}")
        self.path = path
        self.put_back = put_back


def _checkpoint_paths(trainer: Any) -> set[str]:
    """Every checkpoint path the trainer's ``ModelCheckpoint`` callbacks know of or whose folders hold (real
    paths)."""
    candidates: set[str] = set()
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        candidates.update(p for p in (getattr(cb, "last_model_path", ""), *getattr(cb, "best_k_models", {})) if p)
        dirpath = getattr(cb, "dirpath", None)
        if dirpath and os.path.isdir(dirpath):
            candidates.update(os.path.join(dirpath, f) for f in os.listdir(dirpath) if f.endswith(".ckpt"))
    return {os.path.realpath(p) for p in candidates}


def _signature(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is written again: its inode, size and modification time (None: no such file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _unfit(trainer: Any, checkpoint: dict[str, Any], weights_loaded: bool) -> str | None:
    """Why a checkpoint cannot restore this run's whole training state (a key of :data:`_PASSED`), or None when it
    can. ``weights_loaded``: a
    sharded strategy loaded its weights (and optimizer states) already, into the live model."""
    strategy = trainer.strategy
    restores_optimizers = bool(strategy.lightning_restore_optimizer)
    if "lr_schedulers" not in checkpoint or (restores_optimizers and "optimizer_states" not in checkpoint):
        return "weights"
    mismatch = "mismatch"
    if restores_optimizers:
        states = checkpoint["optimizer_states"]
        if not isinstance(states, (list, tuple)) or len(states) != len(trainer.optimizers):
            return mismatch
        for optimizer, state in zip(trainer.optimizers, states):
            groups = state.get("param_groups") if isinstance(state, dict) else None
            if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups) or any(
                    len(saved.get("params", ())) != len(live["params"])
                    for saved, live in zip(groups, optimizer.param_groups)):
                return mismatch
    if len(checkpoint["lr_schedulers"]) != len(trainer.lr_scheduler_configs):
        return mismatch
    plugin = trainer.precision_plugin
    if getattr(plugin, "scaler", None) is not None and type(plugin).__qualname__ not in checkpoint \
            and "native_amp_scaling_state" not in checkpoint:
        return "no_scaler"
    if not weights_loaded:
        module = trainer.lightning_module
        saved, live = checkpoint.get("state_dict"), module.state_dict()
        if not isinstance(saved, dict):
            return mismatch
        if module.strict_loading and set(saved) != set(live):
            return mismatch
        if any(k in live and getattr(v, "shape", None) is not None and tuple(v.shape) != tuple(live[k].shape)
               for k, v in saved.items()):
            return mismatch
    return None


def set_trainer_precision(trainer: Any, precision: str, device_type: str) -> None:
    """Swap a Lightning Trainer's precision plugin for ``MixedPrecision(precision)`` mid-fit (the bf16 fallback)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    trainer.strategy.precision_plugin = MixedPrecision(precision, device_type)  # type: ignore[arg-type]


def carry_spawn_results(kind: type, send: Callable[[Any], Any], receive: Callable[[Any, Any], None]) -> None:
    """Under ``ddp_spawn`` the fit runs in worker processes and the callbacks in the main process never see a hook.
    Lightning sends results home through its launcher's ``get_extra_results`` and ``update_main_process_results``;
    the results of every callback of ``kind`` (``send(callback)``, keyed by its state key) ride along there and
    are handed to its main-process twin (``receive(callback, results)``). Installed once per kind."""
    try:
        from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    except ImportError:  # pragma: no cover - another Lightning: the worker's event log still has everything
        return
    installed = _MultiProcessingLauncher.__dict__.get("_carried_kinds", set())
    if kind in installed:
        return
    key = f"carried:{kind.__module__}.{kind.__qualname__}"
    get_extra, update_main = _MultiProcessingLauncher.get_extra_results, _MultiProcessingLauncher.update_main_process_results

    @functools.wraps(get_extra)
    def get_extra_results(self: Any, trainer: Any) -> dict[str, Any]:
        extra = get_extra(self, trainer)
        extra[key] = {cb.state_key: send(cb) for cb in trainer.callbacks if isinstance(cb, kind)}
        return extra

    @functools.wraps(update_main)
    def update_main_process_results(self: Any, trainer: Any, extra: dict[str, Any]) -> None:
        update_main(self, trainer, extra)
        results = extra.get(key, {})
        for cb in trainer.callbacks:
            if isinstance(cb, kind) and cb.state_key in results:
                receive(cb, results[cb.state_key])

    _MultiProcessingLauncher.get_extra_results = get_extra_results  # type: ignore[method-assign]
    _MultiProcessingLauncher.update_main_process_results = update_main_process_results  # type: ignore[method-assign]
    _MultiProcessingLauncher._carried_kinds = installed | {kind}  # type: ignore[attr-defined]


@contextlib.contextmanager
def uncompiled(root: nn.Module) -> Iterator[None]:
    """Every ``torch.compile``'d submodule of ``root`` replaced by the module it compiled, for an alarm's replays and
    put back on exit: hooks, FP32 islands and probes work on the user's own modules (a compiled graph refuses a
    hook that records, and would donate its backward's buffers), and their names are the user's module paths,
    never ``_orig_mod``. The parameters are the same tensors: a replay changes nothing it does not put back."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for parent in list(root.modules()):
            for name, child in list(parent._modules.items()):
                inner = getattr(child, COMPILED_CHILD, None)
                if isinstance(inner, nn.Module) and child is not None and type(child).__name__ == "OptimizedModule":
                    parent._modules[name] = inner
                    swapped.append((parent, name, child))
        yield
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child
