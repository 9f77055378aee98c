"""Sharded engines on the CPU, for tests: two processes, gloo. Each workaround below is what it takes to run a
strategy that Lightning (or the engine) only offers on GPUs, on this CPU, and why; none changes what the
strategy computes.

- DeepSpeed (``CpuDeepSpeedStrategy``): Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA in
  ``setup_environment`` (1), checks that device indices equal local ranks in ``setup_distributed`` (CPU devices
  have no index) (2), and hands ``deepspeed.initialize`` ``device_rank=root_device.index``, ``None`` on the CPU,
  which DeepSpeed compares with 0 (3); the process group is gloo, and the processes are forked (Lightning would
  re-run the test script as a subprocess, which under pytest means re-running pytest). DeepSpeed then runs on its
  own CPU accelerator, in bf16; in fp16 after ``deepspeed_fp16_on_cpu`` (a capability check, see there). The first
  run builds DeepSpeed's shared memory op (about two minutes here; cached under ``~/.cache/torch_extensions``
  afterwards).
- FSDP2 (``cpu_fsdp2``): Lightning's ``ModelParallelStrategy`` runs on the CPU as it is (gloo, a CPU device
  mesh); the real-fp16 plugin with a plain ``torch.amp.GradScaler("cpu")`` works on its DTensor gradients and
  agrees ``found_inf`` across ranks. Two overrides: the processes are forked (as above), and the forked
  launcher does not send the final weights home, since the main process cannot unpickle DTensors
  (``Callable map_location not supported with _rebuild_wrapper_subclass``); the tests read what each rank
  wrote instead.
- FSDP1 (``cpu_fsdp1``): Lightning's ``FSDPStrategy`` hands ``FullyShardedDataParallel`` ``device_id=
  root_device.index``, ``None`` on the CPU, which FSDP reads as "the current CUDA device"; the override passes
  ``torch.device("cpu")``. Its precision plugin (``FSDPPrecision("16-mixed")``) makes a ``ShardedGradScaler`` for
  CUDA, disabled without it, and refuses a scaler as an argument: ``fsdp1_fp16`` sets a CPU ``ShardedGradScaler``
  on it afterwards. Lightning's FSDP "16-mixed" gathers the parameters in float16 (its ``param_dtype``). Its
  ``forward_context`` is ``torch.autocast("cuda")`` whatever the device: on the CPU no op would run under autocast
  (a real GPU run has its loss ops in float32), so ``fsdp1_fp16``'s subclass enters ``torch.autocast("cpu",
  float16)`` instead. Checkpoints are saved sharded (``state_dict_type="sharded"``): saving Lightning's default
  "full" checkpoint kills the process with a segmentation fault on the CPU (in FSDP's full-state-dict hook, with
  Lightning's offload to the CPU it already is on; seen with no AmpWatch in the fit).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

_CXX = os.environ.get("CXX", "c++")  # what torch's extension builder compiles DeepSpeed's CPU op with
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and shutil.which(_CXX) is not None
NO_DEEPSPEED = ("deepspeed is not installed (it is in the test extra: pip install -e '.[test]')"
                if importlib.util.find_spec("deepspeed") is None else
                f"no C++ compiler ({_CXX}) to build DeepSpeed's CPU shared-memory op on its first run")


def cpu_deepspeed(**kwargs: Any) -> Any:
    """A ``DeepSpeedStrategy`` that runs on CPU processes (see the module's notes for each override)."""
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    class CpuDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:  # (1) skip the CUDA-only check
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # (2) no device-index check: CPU devices carry none
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed  # (3) device_rank=-1: DeepSpeed takes the rank from the environment

            engine, opt, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=-1), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, opt

        def _get_process_group_backend(self) -> str:
            return "gloo"

        def _configure_launcher(self) -> None:  # forked, not a re-run of the script
            self._launcher = _MultiProcessingLauncher(self, start_method="fork")

    return CpuDeepSpeedStrategy(**kwargs)


def _forked_launcher(strategy: Any) -> Any:
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    class ForkedLauncher(_MultiProcessingLauncher):
        def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
            trainer.state = worker_output.trainer_state  # not the weights: DTensors do not unpickle here

    return ForkedLauncher(strategy, start_method="fork")


def cpu_fsdp2(**kwargs: Any) -> Any:
    """Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``) on forked CPU processes,
    data-parallel over 2 ranks."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    class CpuFsdp2Strategy(ModelParallelStrategy):
        def _configure_launcher(self) -> None:
            self._launcher = _forked_launcher(self)

    return CpuFsdp2Strategy(**{"data_parallel_size": 2, "tensor_parallel_size": 1, **kwargs})


def cpu_fsdp1(**kwargs: Any) -> Any:
    """Lightning's ``FSDPStrategy`` (FSDP1, the whole module wrapped at the root) on forked CPU processes."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    class CpuFsdp1Strategy(FSDPStrategy):
        def _configure_launcher(self) -> None:
            self._launcher = _forked_launcher(self)

        def _setup_model(self, model: Any) -> Any:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                            mixed_precision=self.mixed_precision_config,
                                            sharding_strategy=self.sharding_strategy,
                                            device_id=torch.device("cpu"), **self.kwargs)

    return CpuFsdp1Strategy(**kwargs)


def _cpu_fsdp_precision(precision: str) -> Any:
    """Lightning's FSDP precision plugin for ``precision`` ("16-mixed", "bf16-mixed"), autocasting on the CPU."""
    import torch
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

    class CpuFsdpPrecision(FSDPPrecision):
        def forward_context(self) -> Any:
            # Lightning's FSDP precision is GPU-only: its mixed precision enters torch.autocast("cuda"), under which
            # nothing on the CPU runs in autocast (the loss ops would run in the gathered half-precision parameters'
            # dtype, not autocast's float32). The same autocast, on the device the processes compute on.
            return torch.autocast("cpu", dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16)

    return CpuFsdpPrecision(precision)  # type: ignore[arg-type]


def fsdp1_fp16(**scaler_kwargs: Any) -> Any:
    """Lightning's FSDP precision plugin for "16-mixed", with CPU autocast and a working ``ShardedGradScaler`` on the
    CPU (see the module's notes)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    plugin = _cpu_fsdp_precision("16-mixed")
    plugin.scaler = ShardedGradScaler(device="cpu", **scaler_kwargs)
    return plugin


def fsdp1_bf16() -> Any:
    """Lightning's FSDP precision plugin for "bf16-mixed" (no scaler), with CPU autocast."""
    return _cpu_fsdp_precision("bf16-mixed")


class SnapshotBytes(pl.Callback):
    """Keeps the bytes of the newest snapshot the watch's ring held after each batch (each rank its own); the tests'
    callbacks write them out with what else they need at the fit's end."""

    def __init__(self, watch: Any, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir
        self.snapshot_bytes: set[int] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        control = self.watch.watcher.trajectory
        if control is not None and control.ring.snapshots:
            self.snapshot_bytes.add(control.ring.snapshots[-1].nbytes)


class RowsByRank(pl.LightningDataModule):
    """Rank r trains on rows r, r+2, r+4, ... in order: a bad row reaches one rank only, at a known step."""

    def __init__(self, data: TensorDataset, batch_size: int = 16) -> None:
        super().__init__()
        self.data = data
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, sampler=DistributedSampler(self.data, shuffle=False))


def deepspeed_fp16_on_cpu() -> None:
    """Let DeepSpeed train in fp16 on this CPU (call it in the training process, before ``Trainer.fit``).

    DeepSpeed refuses fp16 in ``DeepSpeedEngine._do_sanity_check`` ("Type fp16 is not supported on your device.")
    because its CPU accelerator's ``is_fp16_supported()`` asks oneDNN whether the CPU has native float16 kernels
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16, which this CPU lacks). That is a
    speed question, not a correctness one: torch computes float16 on any CPU (upcasting inside its kernels), so
    with the check answered "yes" DeepSpeed's real fp16 path runs: the module cast to float16, its ZeRO optimizer's
    ``DynamicLossScaler`` scaling the loss in ``engine.backward``, the overflow check (all-reduced over the ranks)
    and the skipped steps, exactly as on a GPU. The override is on this process's accelerator class only."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True  # type: ignore[method-assign]
