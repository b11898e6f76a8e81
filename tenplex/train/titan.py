"""torchtitan's own ``Trainer``, elastic in process under :class:`~tenplex.elastic.ElasticRuntime` (#31 item 2).

``ElasticTrainer`` is torchtitan 0.3.0's ``Trainer`` whose model, parallelize function, optimizer
container, LR scheduler, loss, dataloader and ``train_step`` are torchtitan's own, built for
whatever mesh the runtime hands it: when a worker dies the survivors agree, build torchtitan's
model again for the mesh the rule gives their number (FSDP2 x TP -> FSDP2 over 3), receive the
state they held live (model, optimizer, LR scheduler, data position, train counters) and run
the next step, in the same processes; a worker started with ``elastic.join=True`` is admitted at
a step boundary and the job grows back. A torchtitan job switches by its config and its trainer
class::

    from tenplex.train.titan import ElasticOptions, ElasticTrainer
    config = ElasticTrainer.Config(**titan_fields, elastic=ElasticOptions(ckpt="/ckpt", global_batch=8))
    ElasticTrainer(config, model_config=model_config, dataset=dataset).train()

``elastic.in_process=False`` runs the same job as stock torchtitan does (its ``Trainer.train`` loop: one
mesh from ``config.parallelism``, its ``CheckpointManager`` saving DCP checkpoints at
``config.checkpoint.interval`` and loading the newest after torchrun restarts the workers): the
baseline ``scripts/titan_elastic.py`` measures beside the in-process recovery.

The data: ``dataset`` is a map-style dataset of token rows (``seq_len + 1`` tokens each, e.g. a
Hugging Face ``datasets.Dataset`` with a ``tokens`` column); global batch ``k`` holds rows
``k * global_batch ...`` (cycled), split into equal contiguous parts over the data-parallel ranks
and served by torchtitan's ``ParallelAwareDataloader``: every step sees the same rows whatever
the mesh, which is what makes the losses of a run that changed its mesh equal an uninterrupted
run's. The global batch must divide by every data-parallel degree the rule uses.

CPU (gloo): importing this module sets torchtitan's device type to ``cpu`` when there is no CUDA
and stubs the Triton kernels of the MoE EP path (never used here) when Triton is absent; the
model's attention must be torchtitan's SDPA, its QKV unfused (torch's ``get_state_dict`` cannot
name ``FusedQKVLinear``'s parameters); FSDP2 reductions are plain sums (gloo has no PREMUL_SUM):
docs/titan.md. This module and ``native/titan_checkpoint.py`` are the only ones importing torchtitan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.tools.utils as titan_utils


class _CpuModule(types.ModuleType):
    """``torch.cpu`` as torchtitan's device module, except ``current_device()``: an index (0), as
    ``torch.distributed.barrier(device_ids=[...])`` in its ``set_pg_timeouts`` takes (gloo ignores it;
    ``torch.cpu.current_device()`` is the string "cpu": "incompatible function arguments")."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


def _cpu_setup() -> None:
    """torchtitan on a machine without CUDA: its device type ``cpu`` (it picks ``cuda`` when no
    accelerator is found), and the MoE EP Triton kernels it imports at module top (GPU only, never
    called by a dense model) replaced when Triton is absent."""
    if not torch.cuda.is_available():
        titan_utils.device_type, titan_utils.device_module = "cpu", _CpuModule("torch.cpu")
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules and importlib.util.find_spec("triton") is None:
        mod = types.ModuleType(name)

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torchtitan's MoE minimal-async EP kernels need triton")

        def attribute(key: str) -> Any:
            if key.startswith("__"):
                raise AttributeError(key)
            return missing

        mod.__getattr__ = attribute  # type: ignore[method-assign]
        sys.modules[name] = mod


_cpu_setup()

import torchtitan.distributed.parallel_dims as titan_parallel_dims  # noqa: E402 - after the device type
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as titan_dist  # noqa: E402
from torchtitan.models.llama3 import parallelize_llama  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from ..elastic.runtime import ElasticRuntime  # noqa: E402
from ..errors import ConfigError  # noqa: E402

__all__ = ["ElasticOptions", "ElasticTrainer", "TokenRows", "titan_mesh_rule"]

log = logging.getLogger(__name__)


def titan_mesh_rule(tp: int, global_batch: int) -> Callable[[int], dict[str, int]]:
    """world size -> mesh dims: FSDP2 x TP ``tp`` when ``tp`` divides the world and the data-parallel
    degree divides ``global_batch``, else FSDP2 over every worker (ConfigError when neither fits:
    the runtime then waits for a size that does)."""

    def rule(world: int) -> dict[str, int]:
        if tp > 1 and world % tp == 0 and global_batch % (world // tp) == 0:
            return {"dp_shard": world // tp, "tp": tp}
        if global_batch % world == 0:
            return {"dp_shard": world}
        raise ConfigError(f"no mesh for {world} workers: global batch {global_batch} % {world} != 0 and "
                          f"tp {tp} does not leave a data-parallel degree dividing it")

    return rule


@dataclass(frozen=True)
class ElasticOptions:
    """``ElasticTrainer.Config.elastic``: ``ckpt``, the tenplex checkpoint URL (resume, the runtime's
    checkpoints every ``ckpt_every`` steps, pieces no survivor holds); ``global_batch``: rows per step
    over all data-parallel ranks (fixed: the local batch is ``global_batch / dp``); ``mesh_rule``:
    world size -> mesh dims (default :func:`titan_mesh_rule` with ``config.parallelism``'s TP degree);
    ``in_process``: False runs stock torchtitan (``Trainer.train``'s loop on ``config.parallelism``'s mesh,
    its CheckpointManager, torchrun's restarts); ``join``: this process joins a running job;
    ``dead_after``: heartbeat silence (s) that means death; ``on_event``: the runtime's records."""

    ckpt: str = ""
    global_batch: int = 0
    mesh_rule: Callable[[int], dict[str, int]] | None = None
    ckpt_every: int = 0
    in_process: bool = True
    join: bool = False
    dead_after: float = 2.0
    on_event: Callable[[dict[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        if type(self.global_batch) is not int or self.global_batch < 1:
            raise ConfigError(f"elastic.global_batch must be an integer >= 1, got {self.global_batch!r}")
        if self.in_process and not self.ckpt:
            raise ConfigError("elastic.ckpt: the in-process path needs a checkpoint URL")


class TokenRows(torch.utils.data.IterableDataset):
    """This data-parallel rank's rows of every global batch from ``position`` on: global batch ``k``
    is rows ``k * global_batch + dp_rank * local_batch + i`` (``i < local_batch``, cycled over the
    dataset), each as torchtitan's ``({"input", "positions"}, labels)``. ``Stateful`` (rows served),
    so a DCP checkpoint of torchtitan's dataloader resumes it."""

    def __init__(self, rows: Any, dp_rank: int, dp_size: int, global_batch: int) -> None:
        if global_batch % dp_size:
            raise ConfigError(f"global batch {global_batch} % data-parallel degree {dp_size} != 0")
        self.rows, self.dp_rank, self.global_batch = rows, dp_rank, global_batch
        self.local = global_batch // dp_size
        self.served = 0  # rows this rank served: whole local batches at a step boundary

    def seek(self, step: int) -> None:
        """Serve from global batch ``step`` on."""
        self.served = step * self.local

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            step, i = divmod(self.served, self.local)
            row = self.rows[(step * self.global_batch + self.dp_rank * self.local + i) % len(self.rows)]
            tokens = torch.as_tensor(row["tokens"] if isinstance(row, Mapping) else row, dtype=torch.long)
            self.served += 1
            yield {"input": tokens[:-1], "positions": torch.arange(tokens.numel() - 1)}, tokens[1:]

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, sd: Mapping[str, int]) -> None:
        self.served = int(sd["served"])


class _Losses:
    """torchtitan's ``MetricsProcessor`` surface ``train_step`` uses, keeping each step's global
    average loss (its ``should_log`` always true: every step's loss is reduced and kept)."""

    def __init__(self) -> None:
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.last: dict[str, float] = {}

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: Mapping[str, Any] | None = None) -> None:
        self.last = {"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm)}
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _world_from(mesh: Any) -> Iterator[None]:
    """torchtitan's ``ParallelDims.build_mesh`` starts from ``init_device_mesh(world)``: here from the
    runtime's mesh flattened, so every mesh torchtitan makes has the runtime's mesh as its root and
    the runtime's release of it at a failure drops torchtitan's groups too."""
    world = mesh._flatten("world") if mesh.ndim > 1 else mesh
    original = titan_parallel_dims.init_device_mesh
    titan_parallel_dims.init_device_mesh = lambda *args, **kwargs: world
    try:
        yield
    finally:
        titan_parallel_dims.init_device_mesh = original


class ElasticTrainer(Trainer):
    """torchtitan's ``Trainer`` run by :class:`~tenplex.elastic.ElasticRuntime` (module docstring).
    After ``train()``: ``losses``, ``{step: global average loss}`` of the steps this process ran (a
    redone step's last value), ``runtime``, the runtime (its ``times``: the last recovery's table)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's trainer config plus ``elastic`` (:class:`ElasticOptions`)."""

        elastic: ElasticOptions = field(default_factory=lambda: ElasticOptions(ckpt="", global_batch=1,
                                                                             in_process=False))

    def __init__(self, config: Config, *, model_config: Any, dataset: Any,
                 parallelize: Callable[..., Any] = parallelize_llama) -> None:
        # not Trainer.__init__: it builds one mesh and one model for the launch's world at once; here
        # the runtime builds them for each group of workers (the parts below are Trainer's attributes)
        self.config, self.model_config, self.dataset, self.parallelize = config, model_config, dataset, parallelize
        self.elastic = config.elastic
        self.device = torch.device("cpu") if titan_utils.device_type == "cpu" else titan_utils.get_local_device()
        self.loss_fn = config.loss.build(compile_config=config.compile)
        self.step, self.ntokens_seen = 0, 0
        self.gradient_accumulation_steps, self.num_pipeline_parallel_microbatches = 1, 1
        self.metrics_processor = _Losses()
        self.gc_handler = titan_utils.GarbageCollection(gc_freq=1000)
        self.losses: dict[int, float] = {}
        self.runtime: ElasticRuntime | None = None
        self._data_at: int | None = None  # the step the data iterator serves next (None: none made)

    # -- one mesh --------------------------------------------------------------------------------
    def build(self, mesh: Any) -> tuple[Any, Any]:
        """torchtitan's model, parallelized for ``mesh`` (the runtime's), its optimizers, LR scheduler,
        dataloader and (disabled) checkpointer: ``build(mesh)`` for the runtime."""
        dims = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        self._setup(dims, mesh)
        return self.model_parts[0], tuple(self.optimizers.optimizers)

    def _setup(self, dims: Mapping[str, int], mesh: Any = None) -> None:
        """The trainer's parts for the mesh ``dims`` (built from ``mesh`` when given, else torchtitan's own)."""
        cfg = self.config
        par = dataclasses.replace(cfg.parallelism, data_parallel_shard_degree=dims.get("dp_shard", 1),
                                  data_parallel_replicate_degree=dims.get("dp_replicate", 1),
                                  tensor_parallel_degree=dims.get("tp", 1), pipeline_parallel_degree=1)
        world = mesh.size() if mesh is not None else dist.get_world_size()
        pd = ParallelDims.from_config(par, world)
        with _world_from(mesh) if mesh is not None else contextlib.nullcontext():
            pd.build_mesh()
        titan_dist.set_spmd_backend(par.spmd_backend)
        dp_size, dp_rank = (pd.get_mesh("batch").size(), pd.get_mesh("batch").get_local_rank()) if pd.dp_enabled \
            else (1, 0)
        gb = self.elastic.global_batch
        training = dataclasses.replace(cfg.training, local_batch_size=gb // dp_size)
        self.parallel_dims, self.train_config = pd, dataclasses.replace(cfg, parallelism=par, training=training)
        torch.manual_seed(cfg.debug.seed or 0)
        with torch.device("meta"):
            model = self.model_config.build()
        model = self.parallelize(model, parallel_dims=pd, training=training, parallelism=par,
                                 compile_config=cfg.compile, ac_config=None, dump_folder=cfg.dump_folder)
        if dist.get_backend() == "gloo":  # torchtitan's FSDP divide factor 1.0 is PREMUL_SUM, which gloo lacks
            for mod in model.modules():
                if isinstance(mod, FSDPModule):
                    mod.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model_parts = [model]
        self.optimizers = cfg.optimizer.build(model_parts=self.model_parts)
        self.lr_schedulers = cfg.lr_scheduler.build(optimizers=self.optimizers, training_steps=training.steps)
        self.rows = TokenRows(self.dataset, dp_rank, dp_size, gb)
        self.dataloader = ParallelAwareDataloader(self.rows, dp_rank=dp_rank, dp_world_size=dp_size,
                                                  batch_size=training.local_batch_size)
        checkpoint = cfg.checkpoint if not self.elastic.in_process else dataclasses.replace(cfg.checkpoint,
                                                                                            enable=False)
        self.checkpointer = checkpoint.build(dataloader=self.dataloader, model_parts=self.model_parts,
                                             optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                             states={"train_state": self}, sd_adapter=None,
                                             base_folder=cfg.dump_folder)
        self.train_context = titan_dist.get_spmd_context(parallel_dims=pd, spmd_typechecking=False)
        self.fwd_bwd_fn = self._forward_backward_body
        self._data_at = None

    def extra_state(self) -> dict[str, Any]:
        """What the runtime keeps beside model and optimizer: torchtitan's LR schedulers and the
        trainer's ``step`` / ``ntokens_seen`` (``Trainer.state_dict``); the data position is the step."""
        return {"lr_scheduler": self.lr_schedulers, "train_state": self}

    def release(self) -> None:
        """Drop this mesh's parts (before a recovery frees the broken groups: ``RuntimeConfig.release``)."""
        for name in ("model_parts", "optimizers", "lr_schedulers", "dataloader", "rows", "checkpointer",
                     "parallel_dims", "train_context", "_iterator"):
            self.__dict__.pop(name, None)
        self._data_at = None  # the mesh's groups and DTensor's sharding caches: the runtime's release_mesh

    # -- the loop -----------------------------------------------------------------------------------
    def train_step(self, data_iterator: Iterator[Any]) -> None:
        """torchtitan's ``train_step``; its global average loss kept in ``losses[step]``."""
        super().train_step(data_iterator)
        self.losses[self.step] = self.metrics_processor.last["loss"]
        if not self.elastic.in_process:  # stock torchtitan: no step is redone
            self.committed(self.step)

    def committed(self, step: int) -> None:
        """Called after step ``step`` (1-based) is committed: a hook for the job's logging."""
        log.info("step %d: loss %.6f", step, self.losses[step])

    def _batches(self, step: int) -> Iterator[Any]:
        """torchtitan's dataloader from global batch ``step`` (a new iterator after a rebuild or a redo)."""
        if self._data_at != step:
            self.rows.seek(step)
            self._iterator = self.batch_generator(self.dataloader)
        self._data_at = step + 1
        return self._iterator

    def _train_stock(self) -> None:
        """torchtitan's ``Trainer.train`` loop: load the newest checkpoint, then train and save at the
        interval. Not ``Trainer.train`` itself: after the first step it calls ``set_pg_timeouts``,
        whose ``torch.distributed.set_timeout`` torch 2.13 lacks (AttributeError)."""
        self.checkpointer.load(step=self.config.checkpoint.load_step)
        data_iterator = self.batch_generator(self.dataloader)
        while self.should_continue_training():
            self.step += 1
            self.gc_handler.run(self.step)
            self.train_step(data_iterator)
            self.checkpointer.save(self.step, last_step=(self.step == self.config.training.steps))

    def train(self) -> None:
        """Train ``config.training.steps`` steps: in process elastic under the runtime, or (``in_process``
        False) torchtitan's own ``Trainer.train`` loop on ``config.parallelism``'s mesh."""
        el = self.elastic
        if not el.in_process:
            par = self.config.parallelism
            if not dist.is_initialized():
                dist.init_process_group("gloo" if self.device.type == "cpu" else None)
            self._setup({"dp_shard": par.data_parallel_shard_degree, "tp": par.tensor_parallel_degree,
                         "dp_replicate": par.data_parallel_replicate_degree})
            self.config = self.train_config
            return self._train_stock()
        rule = el.mesh_rule or titan_mesh_rule(self.config.parallelism.tensor_parallel_degree, el.global_batch)
        rt = ElasticRuntime(self.build, rule, ckpt=el.ckpt, ckpt_every=el.ckpt_every, join=el.join,
                            dead_after=el.dead_after, on_event=el.on_event, extra_state=self.extra_state,
                            release=self.release,
                            device=self.device.type)
        self.runtime = rt
        for step in rt.steps(self.config.training.steps):
            before = rt.step
            with step:
                self.step = before + 1  # torchtitan counts the step being trained from 1
                self.train_step(self._batches(before))
            if rt.step > before:
                self.committed(rt.step)
        return None
