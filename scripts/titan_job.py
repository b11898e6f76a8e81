#!/usr/bin/env python3
"""torchtitan's own Llama 3 on CPU with gloo: train a few steps, save, dump placements.

Groundwork for issue #17 item 4(b).  Builds the ``torchtitan`` package's Llama 3
(tiny config), its mesh (``ParallelDims``), applies its own ``parallelize_llama``
(TP + FSDP2 / HSDP) or its ``pipeline_llm`` (PP), runs ``--steps`` steps of its
own ``Trainer.train_step`` (AdamW through its ``OptimizersContainer``) on seeded
random tokens, then

  (a) ``get_state_dict(model, optimizers)`` -> ``torch.distributed.checkpoint.save``
      into ``OUT/dcp`` (plain DCP), and
  (b) torchtitan's own ``CheckpointManager.save`` into ``OUT/titan/step-N``,

and writes, per rank, JSON descriptions of every state-dict entry (key, type,
global shape, dtype, mesh dim names/sizes, placements incl. ``_StridedShard``
split factors, local shape, offsets from
``compute_local_shape_and_global_offset``, and the exact global index runs held
on each dim) to ``OUT/placements/``.  Rank 0 also writes ``OUT/summary.json``
(timings, loss, directory layouts, the keys stored in each checkpoint's
metadata).

Usage (spawns N gloo processes itself with a free port and a timeout)::

    python scripts/titan_job.py --tp 2 --dp-shard 2 --out /tmp/titan_tp2_fsdp2
    python scripts/titan_job.py --pp 2 --out /tmp/titan_pp2

or under ``torchrun --nproc-per-node N scripts/titan_job.py ...``.
``--load DIR`` (a ``titan/step-N`` folder written by another configuration)
loads it with torchtitan's ``CheckpointManager`` under this run's mesh before
training and reports whether the loaded model/optimizer match the saved
values (compared as full tensors).

Device: ``TORCH_DEVICE`` (default ``cpu``; gloo).  torchtitan itself picks
``cuda`` when no accelerator is found (``torchtitan/tools/utils.py``
``get_device_info``), so on CPU this script sets its ``device_type`` to
``cpu`` before importing the rest of torchtitan.

Imports that torchtitan 0.3.0 makes at module top but that this path never
uses are replaced by stubs when the real package is absent: the Triton kernels
of the MoE minimal-async EP (``triton`` is a GPU compiler) and HF ``datasets``
(text dataloaders; this script feeds random tokens).  Further CPU/gloo adjustments
(SDPA instead of FlexAttention, FSDP2 plain-SUM reductions, a PP ``schedule.step`` shim,
``--spmd-backend partial_dtensor``) and the exact errors without them: docs/titan.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path


# ----------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(args) -> int:
    return args.tp * args.dp_shard * args.dp_replicate * args.pp


def launch(args, argv) -> int:
    n = _world(args)
    port = _free_port()
    procs = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.monotonic()
    for r in range(n):
        env = dict(os.environ)
        env.update(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )
        f = open(logs / f"rank{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, *argv], env=env,
                                       stdout=f, stderr=subprocess.STDOUT), f))
    rc = 0
    try:
        for p, f in procs:
            left = max(1.0, args.timeout - (time.monotonic() - t0))
            try:
                r = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                print(f"timeout after {args.timeout}s", file=sys.stderr)
                rc = 124
                break
            rc = rc or r
    finally:
        for p, f in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            f.close()
    wall = time.monotonic() - t0
    print(f"world={n} rc={rc} wall={wall:.1f}s logs={logs}")
    if rc:
        for r in range(n):
            txt = (logs / f"rank{r}.log").read_text().splitlines()
            print(f"--- rank{r} (last 25 lines)")
            print("\n".join(txt[-25:]))
    summ = out / "summary.json"
    if summ.exists():
        d = json.loads(summ.read_text())
        d["launcher_wall_s"] = round(wall, 2)
        summ.write_text(json.dumps(d, indent=1))
    return rc


# ------------------------------------------------------------------ stubs


def _stub_unused_imports() -> list[str]:
    stubbed = []
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules and importlib.util.find_spec("triton") is None:
        mod = types.ModuleType(name)

        def _missing(*a, **k):
            raise RuntimeError("stub: MoE minimal-async EP kernels need triton")

        def __getattr__(k):
            if k.startswith("__"):
                raise AttributeError(k)
            return _missing

        mod.__getattr__ = __getattr__
        sys.modules[name] = mod
        stubbed.append(name)
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        class _Unavailable:
            def __init__(self, *a, **k):
                raise RuntimeError("stub: HF datasets not installed")

        def _fn(*a, **k):
            raise RuntimeError("stub: HF datasets not installed")

        ds = types.ModuleType("datasets")
        ds.__path__ = []
        ds.Dataset = ds.IterableDataset = _Unavailable
        ds.load_dataset = _fn
        dd = types.ModuleType("datasets.distributed")
        dd.split_dataset_by_node = _fn
        ds.distributed = dd
        sys.modules["datasets"] = ds
        sys.modules["datasets.distributed"] = dd
        stubbed.append("datasets")
    return stubbed


# ---------------------------------------------------------- description


def _runs(idx):
    """Sorted global indices -> [[start, stop), ...]."""
    out = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def describe(sd, *, index_runs=True):
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    res = []
    for key, v in sd.items():
        e = {"key": key, "type": type(v).__name__}
        if isinstance(v, DTensor):
            mesh = v.device_mesh
            gshape = tuple(v.shape)
            e.update(
                type="DTensor", global_shape=list(gshape), dtype=str(v.dtype).replace("torch.", ""),
                mesh_dim_names=list(mesh.mesh_dim_names or ()), mesh_shape=list(mesh.shape),
                mesh_ranks=mesh.mesh.tolist(), mesh_coordinate=mesh.get_coordinate(),
                placements=[repr(p) for p in v.placements],
                local_shape=list(v.to_local().shape),
            )
            try:
                ls, off = compute_local_shape_and_global_offset(gshape, mesh, v.placements)
                e["computed_local_shape"], e["global_offset"] = list(ls), list(off)
            except Exception as ex:  # noqa: BLE001
                e["global_offset_error"] = f"{type(ex).__name__}: {ex}"
            if index_runs:
                runs = []
                for d, n in enumerate(gshape):
                    shp = [1] * len(gshape)
                    shp[d] = n
                    idx = torch.arange(n).view(shp).expand(gshape).contiguous()
                    loc = distribute_tensor(idx, mesh, v.placements, src_data_rank=None).to_local()
                    if loc.numel():
                        sel = [0] * len(gshape)
                        sel[d] = slice(None)
                        runs.append(_runs(loc[tuple(sel)].tolist()))
                    else:
                        runs.append([])
                e["index_runs"] = runs
        elif isinstance(v, torch.Tensor):
            e.update(type="Tensor", global_shape=list(v.shape),
                     dtype=str(v.dtype).replace("torch.", ""), local_shape=list(v.shape))
            if v.numel() == 1:
                e["value"] = v.item()
        else:
            r = repr(v)
            e["value"] = v if isinstance(v, (int, float, str, bool, type(None))) else (
                r if len(r) < 300 else r[:300] + "...")
        res.append(e)
    return res


def flatten(d, prefix=""):
    """Nested state dict -> dotted keys (how DCP names them in its metadata)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, x in enumerate(v):
                out.update(flatten(x, f"{key}.{i}."))
        else:
            out[key] = v
    return out


def dump_lines(entries) -> str:
    """A JSON list, one entry per line (small, diffable)."""
    return "[\n" + ",\n".join(json.dumps(e, default=str) for e in entries) + "\n]\n"


def tree(path: Path):
    return sorted(f"{p.relative_to(path)} ({p.stat().st_size} B)" for p in path.rglob("*") if p.is_file())


def metadata_keys(path: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for k, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[k] = {"tensor": list(m.size), "chunks": [
                {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]}
        else:
            out[k] = {"bytes": True}
    return out


# ------------------------------------------------------------------ worker


def worker(args) -> None:
    dev = os.environ.get("TORCH_DEVICE", "cpu")
    import torch
    import torch.distributed as dist

    import torchtitan.tools.utils as tt_utils
    if dev == "cpu":
        tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    stubbed = _stub_unused_imports()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torchtitan
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model, parallelize_llama
    from torchtitan.models.llama3 import (  # the helpers torchtitan's own flavours use
        _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init)
    from torchtitan.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(dev if dev == "cpu" else f"{dev}:{int(os.environ['LOCAL_RANK'])}")
    if dev != "cpu":
        torch.accelerator.set_device_index(device.index)
    t_start = time.monotonic()
    # as torchtitan's init_distributed: needed by the spmd_types backend (TLS mesh stack)
    torch.autograd.set_multithreading_enabled(False)
    dist.init_process_group("gloo" if dev == "cpu" else None, rank=rank, world_size=world)
    out = Path(args.out)

    manager = CheckpointManager
    if args.checkpointer == "tenplex":  # torchtitan's CheckpointManager writing tenplex checkpoints
        from tenplex.native.titan_checkpoint import TenplexCheckpointManager as manager

    def setup(tp, dp_shard, dp_replicate, pp, exclude=None):
        """torchtitan's config, mesh, model config, loss and a model builder for this mesh."""
        cfg = Trainer.Config(
            dump_folder=str(out),
            loss=CrossEntropyLoss.Config(global_vocab_size=args.vocab),
            training=TrainingConfig(
                local_batch_size=args.batch, seq_len=args.seq_len, steps=args.steps,
                mixed_precision_param="float32", dtype="float32", disable_cuda_graphs=True,
                max_norm=1.0),
            parallelism=ParallelismConfig(
                data_parallel_replicate_degree=dp_replicate,
                data_parallel_shard_degree=dp_shard,
                tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                pipeline_parallel_schedule=args.pp_schedule,
                pipeline_parallel_microbatch_size=max(1, args.batch // 2) if pp > 1 else 1,
                enable_sequence_parallel=not args.no_sp,  # torchtitan default True (also at tp=1)
                spmd_backend=args.spmd_backend),
            optimizer=OptimizersContainer.Config(
                param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=dict(
                    lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))],
                implementation="foreach"),
            lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
            compile=CompileConfig(enable=False),
            checkpoint=manager.Config(
                enable=True, folder="titan", interval=1, last_save_model_only=False,
                keep_latest_k=0, initial_load_path=args.load, initial_load_model_only=False,
                exclude_from_loading=exclude if exclude is not None else [
                    x for x in args.exclude_from_loading.split(",") if x]),
        )
        pd = ParallelDims.from_config(cfg.parallelism, world)
        pd.build_mesh()
        dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
        torch.manual_seed(args.seed)

        dim, heads, kv = args.dim, args.heads, args.kv_heads
        mcfg = Llama3Model.Config(
            dim=dim, vocab_size=args.vocab,
            tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=args.vocab, param_init=_output_linear_init(dim)),
            layers=_build_llama3_layers(
                fuse_qkv=not args.no_fuse_qkv, n_layers=args.layers, dim=dim, n_heads=heads, n_kv_heads=kv,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max(args.seq_len, 64), theta=500000,
                                        scaling="llama"),
                attn_backend="flex"),
        )
        if args.attn == "sdpa":
            # FlexAttention has no backward on CPU in torch 2.13 ("FlexAttention does not support
            # backward on CPU"), varlen_attn is CUDA-only; torchtitan's SDPA inner attention
            # (is_causal=True) equals block-causal flex for one document per row, as here.
            from torchtitan.models.common.attention import ScaledDotProductAttention
            for lc in mcfg.layers:
                lc.attention.inner_attention = ScaledDotProductAttention.Config()
        mcfg.update_from_config(config=cfg)
        loss_fn = cfg.loss.build(compile_config=cfg.compile)

        def build_parts():  # torchtitan's model on this mesh, parallelized and initialised (seeded)
            torch.manual_seed(args.seed)
            with torch.device("meta"):
                model = mcfg.build()
            pp_info = (None, True, True)
            if pd.pp_enabled:
                sched, parts, first, last = pipeline_llm(
                    model, parallel_dims=pd, training=cfg.training, parallelism=cfg.parallelism,
                    compile_config=cfg.compile, ac_config=None, dump_folder=str(out), device=device,
                    model_config=mcfg, parallelize_fn=parallelize_llama, loss_fn=loss_fn)
                pp_info = (sched, first, last)
                if not args.no_pp_shim:
                    _pp_step_shim(sched)
            else:
                parts = [parallelize_llama(
                    model, parallel_dims=pd, training=cfg.training, parallelism=cfg.parallelism,
                    compile_config=cfg.compile, ac_config=None, dump_folder=str(out))]
            if dev == "cpu":
                # torchtitan sets FSDP's gradient divide factor to 1.0 (it scales by the global token
                # count itself), which FSDP2 turns into ReduceOp.PREMUL_SUM(1.0) -- unsupported by gloo
                # ("Cannot use ReduceOp.PREMUL_SUM with Gloo").  Force plain SUM (+ post-divide by 1.0),
                # what torchtitan's own enable_fsdp_symm_mem() does for symmetric-memory comms.
                from torch.distributed.fsdp import FSDPModule
                for m in parts:
                    for mod in m.modules():
                        if isinstance(mod, FSDPModule):
                            mod.set_force_sum_reduction_for_comms(True)
            for m in parts:
                m.to_empty(device=device)
                with torch.no_grad():
                    m.init_weights(buffer_device=None)
                m.train()
            return parts, pp_info

        return cfg, pd, mcfg, loss_fn, build_parts

    cfg, pd, mcfg, loss_fn, build_parts = setup(args.tp, args.dp_shard, args.dp_replicate, args.pp)

    if args.check_load:
        check_load(args.check_load, args.check_ref, cfg, pd, build_parts, rank, out)
        dist.barrier()
        dist.destroy_process_group()
        return
    parts, pp_info = build_parts()
    t_built = time.monotonic()

    # torchtitan's Trainer, assembled without its tokenizer/dataloader/metrics
    tr = Trainer.__new__(Trainer)
    tr.config, tr.parallel_dims, tr.model_config, tr.model_parts = cfg, pd, mcfg, parts
    tr.device, tr.loss_fn = device, loss_fn
    tr.pp_schedule, tr.pp_has_first_stage, tr.pp_has_last_stage = pp_info
    tr.optimizers = cfg.optimizer.build(model_parts=parts)
    tr.lr_schedulers = cfg.lr_scheduler.build(optimizers=tr.optimizers, training_steps=args.steps)
    tr.step, tr.ntokens_seen = 0, 0
    tr.gradient_accumulation_steps = 1
    tr.num_pipeline_parallel_microbatches = (
        args.batch // cfg.parallelism.pipeline_parallel_microbatch_size if pd.pp_enabled else 1)

    class _Metrics:  # train_step only touches these when should_log is False
        ntokens_since_last_log = 0
        data_loading_times: list = []

        def should_log(self, step):
            return False

    tr.metrics_processor = _Metrics()
    tr.train_context = dist_utils.get_spmd_context(parallel_dims=pd, spmd_typechecking=False)
    losses = []

    def fwd_bwd_step(**k):  # local loss sum / global tokens (PP: -1 on non-last stages)
        loss = Trainer.forward_backward_step(tr, **k)
        losses.append(float(loss.detach().sum()))
        return loss

    tr.fwd_bwd_fn = tr._forward_backward_body
    tr.forward_backward_step = fwd_bwd_step
    if pd.dp_enabled:
        bm = pd.get_mesh("batch")
        bdeg, brank = bm.size(), bm.get_local_rank()
    else:
        bdeg, brank = 1, 0

    class _Tokens(torch.utils.data.IterableDataset):  # seeded random tokens, resumable
        def __init__(self):
            self.n = 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(args.seed * 100003 + brank * 1009 + self.n)
                self.n += 1
                tok = torch.randint(0, args.vocab, (args.seq_len + 1,), generator=g)
                yield {"input": tok[:-1], "positions": torch.arange(args.seq_len)}, tok[1:]

        def state_dict(self):
            return {"sample": self.n}

        def load_state_dict(self, sd):
            self.n = sd["sample"]

    from torchtitan.components.dataloader import ParallelAwareDataloader
    data = ParallelAwareDataloader(  # torchtitan's own (torchdata StatefulDataLoader)
        _Tokens(), dp_rank=brank, dp_world_size=bdeg,
        batch_size=cfg.parallelism.pipeline_parallel_microbatch_size if pd.pp_enabled else args.batch)
    tr.dataloader = data
    tr.checkpointer = cfg.checkpoint.build(
        dataloader=data, model_parts=parts, optimizers=tr.optimizers, lr_schedulers=tr.lr_schedulers,
        states={"train_state": tr}, sd_adapter=None, base_folder=str(out))

    summary = {"rank": rank, "world": world, "torch": torch.__version__,
               "torchtitan": getattr(torchtitan, "__version__", "?"), "stubbed_imports": stubbed,
               "args": vars(args), "parallel_dims": {k: getattr(pd, k) for k in (
                   "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "world_size", "spmd_backend")}}
    if pd.pp_enabled:
        summary["pp_stage_has_first_last"] = [pp_info[1], pp_info[2]]
    if args.load:
        tl = time.monotonic()
        # CheckpointManager.load(step) reads OUT/titan/step-N; initial_load_path is used when
        # OUT/titan has no checkpoint yet (our case), with model_only=False -> full state.
        ok = tr.checkpointer.load(step=-1)
        summary["load"] = {"path": args.load, "loaded": bool(ok), "wall_s": round(time.monotonic() - tl, 2),
                           "train_state_after_load": tr.state_dict(),
                           "data_after_load": repr(data.state_dict())[:300]}
        summary["load"]["full_values_after_load"] = _full_values(tr)

    it = iter(data)
    ts = time.monotonic()
    for _ in range(args.steps):
        tr.step += 1
        tr.train_step(it)
    t_trained = time.monotonic()
    summary["losses_this_rank"] = losses
    summary["wall_s"] = {"init_build_parallelize": round(t_built - t_start, 2),
                         "train_steps": round(t_trained - ts, 2)}
    if args.resume_check:
        resume_check(args, setup, rank, out, tr)
        dist.barrier()
        dist.destroy_process_group()
        return

    # (a) plain DCP via get_state_dict
    pdir = out / "placements"
    pdir.mkdir(parents=True, exist_ok=True)
    ta = time.monotonic()
    msd, osd = {}, {}
    try:
        for m in parts:
            a, b = get_state_dict(m, tr.optimizers.optimizers)
            msd.update(a)
            osd.update(b)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp"))
        summary["wall_s"]["dcp_save"] = round(time.monotonic() - ta, 2)
        (pdir / f"get_state_dict.rank{rank}.json").write_text(dump_lines(
            describe(flatten({"model": msd, "optim": osd}))))
        summary["get_state_dict"] = "ok"
    except Exception as ex:  # noqa: BLE001  (recorded: e.g. fused wqkv vs its state-dict hooks)
        import traceback
        tb = traceback.extract_tb(ex.__traceback__)[-1]
        summary["get_state_dict"] = f"{type(ex).__name__}: {ex} (at {tb.filename}:{tb.lineno})"

    # (b) torchtitan's CheckpointManager
    tb = time.monotonic()
    saved = tr.checkpointer.save(curr_step=tr.step, last_step=False)
    tr.checkpointer.maybe_wait_for_saving()
    summary["wall_s"]["titan_checkpoint_save"] = round(time.monotonic() - tb, 2)
    summary["titan_saved"] = bool(saved)
    states = tr.checkpointer._flattened_model_states_sd()
    flat = {}
    for k, v in states.items():
        flat.update(flatten({k: v.state_dict() if hasattr(v, "state_dict") else v}))
    (pdir / f"titan_checkpoint.rank{rank}.json").write_text(dump_lines(describe(flat)))
    summary["wall_s"]["total_worker"] = round(time.monotonic() - t_start, 2)
    summary["full_values_after_train"] = _full_values(tr)
    dist.barrier()
    if rank == 0:
        tdir = out / "titan" / f"step-{tr.step}"
        summary["titan_checkpoint_dir"] = str(tdir.relative_to(out))
        summary["titan_files"] = tree(tdir) if tdir.exists() else None
        summary["dcp_files"] = tree(out / "dcp") if (out / "dcp").exists() else None
        if tdir.exists():
            mk = metadata_keys(tdir)
            (out / "titan_metadata_keys.json").write_text(dump_lines([{"key": k, **v} for k, v in mk.items()]))
            summary["titan_metadata_nkeys"] = len(mk)
        if (out / "dcp").exists():
            (out / "dcp_metadata_keys.json").write_text(dump_lines(
                [{"key": k, **v} for k, v in metadata_keys(out / "dcp").items()]))
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    else:
        (out / f"summary.rank{rank}.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({"rank": rank, "losses": losses, "wall_s": summary["wall_s"]}))
    tr.checkpointer.close()
    dist.barrier()
    if args.then_check:
        then_check(args, setup, rank, out, out / "titan" / f"step-{tr.step}")
    dist.destroy_process_group()


def _exact_values(checkpointer):
    """Every model and optimizer entry of what ``checkpointer`` saves, as full CPU tensors (collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    flat = {}
    for k, v in checkpointer._flattened_model_states_sd().items():
        if k not in ("dataloader", "lr_scheduler", "train_state"):
            flat.update(flatten({k: v.state_dict() if hasattr(v, "state_dict") else v}))
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in sorted(flat.items()) if isinstance(v, torch.Tensor)}


def resume_check(args, setup, rank, out, tr) -> None:
    """``--checkpointer tenplex --resume-check MESH[;MESH]``: after training, save with the job's
    (tenplex) ``CheckpointManager``, then for each MESH build torchtitan's model, optimizer and LR
    scheduler again on the same ranks under that mesh, with ``exclude_from_loading=["dataloader"]``
    (its state is per DP rank), ``load()`` through a new manager of the same class (it finds the
    step itself), and compare: every model and optimizer tensor bit for bit with the saved job's,
    the train state and the LR scheduler's epoch; per rank the bytes read, the bytes needed and the
    bytes of its local shards. Rank 0 writes ``OUT/resume.json``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import tenplex

    ref = _exact_values(tr.checkpointer)
    t0 = time.monotonic()
    assert tr.checkpointer.save(curr_step=tr.step, last_step=False)
    save_s = time.monotonic() - t0
    saved = {"step": tr.step, "ntokens_seen": tr.ntokens_seen, "lr": tr.lr_schedulers.state_dict()}
    tdir = out / "titan" / f"step-{tr.step}"
    results = []
    for spec in args.resume_check.split(";"):
        mesh = {"tp": 1, "dp_shard": 1, "dp_replicate": 1, "pp": 1}
        for part in spec.split(","):
            k, _, v = part.partition("=")
            mesh[k.strip().replace("-", "_")] = int(v)
        cfg2, pd2, _, _, build2 = setup(mesh["tp"], mesh["dp_shard"], mesh["dp_replicate"], mesh["pp"],
                                        exclude=["dataloader"])
        parts2, _ = build2()
        opt2 = cfg2.optimizer.build(model_parts=parts2)
        lr2 = cfg2.lr_scheduler.build(optimizers=opt2, training_steps=args.steps)

        class _TrainState:  # torchtitan's Trainer state_dict / load_state_dict
            step, ntokens_seen = 0, 0

            def state_dict(self):
                return {"step": self.step, "ntokens_seen": self.ntokens_seen}

            def load_state_dict(self, sd):
                self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]

        ts = _TrainState()
        ck = cfg2.checkpoint.build(dataloader=None, model_parts=parts2, optimizers=opt2, lr_schedulers=lr2,
                                   states={"train_state": ts}, sd_adapter=None, base_folder=str(out))
        t0 = time.monotonic()
        loaded = ck.load(step=-1)
        load_s = time.monotonic() - t0
        local = 0
        for k, v in ck._flattened_model_states_sd().items():
            if k not in ("dataloader", "lr_scheduler", "train_state"):
                for x in flatten({k: v.state_dict() if hasattr(v, "state_dict") else v}).values():
                    if isinstance(x, torch.Tensor):
                        x = x.to_local() if isinstance(x, DTensor) else x
                        local += x.numel() * x.element_size()
        got = _exact_values(ck)

        def bits(t):
            t = t.reshape(-1).contiguous()
            return t.view(torch.uint8) if t.numel() else t

        mism = sorted(k for k in ref if k not in got or ref[k].dtype != got[k].dtype
                      or not torch.equal(bits(ref[k]), bits(got[k])))
        res = ck.last_load
        mine = {"rank": rank, "mesh": {k: getattr(pd2, k) for k in ("dp_shard", "tp", "world_size")},
                "loaded": bool(loaded), "keys": len(got), "missing": sorted(set(ref) - set(got)), "mismatches": mism,
                "train_state": ts.state_dict(), "lr": lr2.state_dict(), "step": res.step if res else None,
                "bytes_read": res.bytes_read if res else None, "bytes_needed": res.bytes_needed if res else None,
                "local_tensor_bytes": local,
                "read_over_needed": round(res.bytes_read / max(1, res.bytes_needed), 4) if res else None,
                "load_s": round(load_s, 3)}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results.append(every)
        ck.close()
        del parts2, opt2, lr2, ck
    if rank == 0:
        steps = tenplex.list_steps(str(tdir))
        summary = {"saved": saved, "save_s": round(save_s, 3), "checkpoint": str(tdir),
                   "tenplex_steps": [[i.step, i.complete] for i in steps],
                   "dcp_metadata": (tdir / ".metadata").exists(), "checks": results}
        (out / "resume.json").write_text(json.dumps(summary, indent=1, default=str))


def checkpoint_sizes(tdir, tenplex_dir) -> dict:
    """Bytes of the DCP checkpoint's tensors (its chunks, from .metadata), of its files, and of the
    tenplex checkpoint's data files: the tensor payload (file minus safetensors header and CRC table) and in all."""
    import math
    import struct

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(tdir)).read_metadata()
    tensor_bytes = sum(math.prod(c.sizes) * torch.empty(0, dtype=m.properties.dtype).element_size()
                       for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)
                       for c in m.chunks)
    payload = files = 0
    from tenplex.checkpoint.format import CRC_TABLE

    for f in Path(tenplex_dir).glob("step-*/rank-*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            table = json.loads(fh.read(n)).get(CRC_TABLE)  # format version 4: the block CRCs, not payload
        files += f.stat().st_size
        payload += f.stat().st_size - 8 - n - (table["data_offsets"][1] - table["data_offsets"][0] if table else 0)
    return {"dcp_tensor_bytes": tensor_bytes, "dcp_files_bytes": sum(f.stat().st_size for f in Path(tdir).iterdir()),
            "tenplex_data_payload_bytes": payload, "tenplex_data_files_bytes": files,
            "tenplex_all_files_bytes": sum(f.stat().st_size for f in Path(tenplex_dir).rglob("*") if f.is_file())}


def then_check(args, setup, rank, out, tdir) -> None:
    """``--then-check MESH``: rank 0 runs ``tenplex import`` of the titan checkpoint just saved into
    ``OUT/tenplex``; then every rank checks a load of it under MESH (``check_load``)."""
    import contextlib
    import io

    import torch.distributed as dist

    from tenplex.cli import main as tenplex_cli

    extra = None
    if rank == 0:
        t0 = time.monotonic()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = tenplex_cli(["import", str(tdir), str(out / "tenplex"), "--json"])
        if rc:
            raise SystemExit(f"tenplex import failed with exit code {rc}")
        extra = {"import": {**json.loads(buf.getvalue()), "wall_s": round(time.monotonic() - t0, 3)},
                 "sizes": checkpoint_sizes(tdir, out / "tenplex")}
    got = [extra]
    dist.broadcast_object_list(got, src=0)
    mesh = {"tp": 1, "dp_shard": 1, "dp_replicate": 1, "pp": 1}
    for part in args.then_check.split(","):
        k, _, v = part.partition("=")
        mesh[k.strip().replace("-", "_")] = int(v)
    cfg2, pd2, _, _, build2 = setup(mesh["tp"], mesh["dp_shard"], mesh["dp_replicate"], mesh["pp"])
    check_load(str(out / "tenplex"), str(tdir), cfg2, pd2, build2, rank, out, extra=got[0])
    dist.barrier()


def check_load(url, ref, cfg, pd, build_parts, rank, out, extra=None) -> None:
    """``--check-load URL --check-ref DIR`` (and ``--then-check``): under ``pd``'s mesh, build torchtitan's model and
    optimizer twice, take the state dict its ``CheckpointManager`` saves (``ModelWrapper`` keys at
    the top, ``OptimizersContainer``'s under ``optimizer.``, the checkpoint's other entries as
    placeholders), fill one with ``tenplex.load_state_dict(URL)`` and the other with
    ``torch.distributed.checkpoint.load`` of the titan checkpoint ``DIR``, and compare every entry
    (DTensors as full tensors, bit for bit).  Rank 0 writes ``OUT/check.json``: per rank the bytes
    tenplex read and needed, the load times, and every mismatch."""
    import pickle

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import ModelWrapper

    import tenplex

    md = dcp.FileSystemReader(ref).read_metadata()
    saved_objects = [k for k, m in md.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)]

    def state():
        parts, _ = build_parts()
        optimizers = cfg.optimizer.build(model_parts=parts)
        sd = dict(ModelWrapper(parts).state_dict())
        sd.update({f"optimizer.{k}": v for k, v in optimizers.state_dict().items()})
        for k in saved_objects:
            sd.setdefault(k, None)
        return (parts, optimizers), sd

    keep_a, sd_a = state()
    keep_b, sd_b = state()
    t0 = time.monotonic()
    res = tenplex.load_state_dict(sd_a, url)
    t_tenplex = time.monotonic() - t0
    t0 = time.monotonic()
    dcp.load(sd_b, checkpoint_id=ref)
    t_dcp = time.monotonic() - t0

    def bits(t):
        t = t.detach().reshape(-1).contiguous()
        return t.view(torch.uint8) if t.numel() else t

    mismatches, n_dtensor, n_tensor, n_obj = [], 0, 0, 0
    for k in sorted(sd_b):
        a, b = sd_a.get(k), sd_b[k]
        if isinstance(b, DTensor):
            n_dtensor += 1
            same = isinstance(a, DTensor) and a.placements == b.placements and torch.equal(
                bits(a.full_tensor()), bits(b.full_tensor()))
        elif isinstance(b, torch.Tensor):
            n_tensor += 1
            same = isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
        else:
            n_obj += 1
            same = pickle.dumps(a) == pickle.dumps(b)
        if not same:
            mismatches.append(k)
    mine = {"rank": rank, "dtensors": n_dtensor, "tensors": n_tensor, "objects": n_obj,
            "mismatches": mismatches, "bytes_read": res.bytes_read, "bytes_needed": res.bytes_needed,
            "read_over_needed": round(res.bytes_read / max(1, res.bytes_needed), 5), "step": res.step,
            "tenplex_load_s": round(t_tenplex, 3), "tenplex_load_internal_s": round(res.seconds, 3),
            "dcp_load_s": round(t_dcp, 3)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        summary = {"mesh": {k: getattr(pd, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "world_size")},
                   "tenplex_url": url, "titan_checkpoint": ref, "ranks": every,
                   "ok": all(not r["mismatches"] for r in every), **(extra or {})}
        (out / "check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(mine))
    del keep_a, keep_b


def _full_values(tr):
    """[sum, abs-sum] of every floating model/optimizer tensor in what torchtitan's
    CheckpointManager saves, gathered to full tensors (to compare a load across meshes)."""
    import torch
    from torch.distributed.tensor import DTensor

    res = {}
    states = tr.checkpointer._flattened_model_states_sd()
    flat = {}
    for k, v in states.items():
        if k in ("dataloader", "lr_scheduler", "train_state"):
            continue
        flat.update(flatten({k: v.state_dict() if hasattr(v, "state_dict") else v}))
    for k, v in sorted(flat.items()):
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
            res[k] = [round(float(v.double().sum()), 5), round(float(v.double().abs().sum()), 5)]
    return res


def _pp_step_shim(sched) -> bool:
    """torchtitan 0.3.0 calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=,
    loss_kwargs=, return_outputs=)`` (pre-split microbatches: a newer torch API); torch 2.13's
    ``step(*args, target=, **kwargs)`` would treat ``arg_mbs`` as a model kwarg and fail with
    "Expecting 2 arg_mbs but got 1".  torch 2.13 has the same per-microbatch entry point as
    ``_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs)``;
    route the new-style call there (after ``clear_runtime_states``, as ``step`` does)."""
    import inspect

    if "arg_mbs" in inspect.signature(sched.step).parameters:
        return False
    orig = sched.step

    def step(*a, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
             loss_kwargs=None, **kw):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return orig(*a, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kw)
        for st in getattr(sched, "_stages", None) or [sched._stage]:
            st.clear_runtime_states()
        return sched._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                        loss_kwargs)

    sched.step = step
    return True


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp-shard", type=int, default=1)
    ap.add_argument("--dp-replicate", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--pp-schedule", default="1F1B")
    ap.add_argument("--no-pp-shim", action="store_true",
                    help="call torch 2.13's schedule.step as torchtitan does (fails)")
    ap.add_argument("--spmd-backend", default="partial_dtensor",
                    choices=["spmd_types", "partial_dtensor", "full_dtensor"],
                    help="torchtitan's default spmd_types needs a nightly torch (FSDP2 with "
                         "dp_mesh_dims); partial_dtensor and full_dtensor run on torch 2.13")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1001)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--no-fuse-qkv", action="store_true")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "flex"],
                    help="inner attention (flex has no CPU backward in torch 2.13)")
    ap.add_argument("--no-sp", action="store_true", help="enable_sequence_parallel=False")
    ap.add_argument("--load", default=None, help="a titan/step-N folder to load before training")
    ap.add_argument("--exclude-from-loading", default="",
                    help="comma list for CheckpointManager exclude_from_loading, e.g. dataloader "
                         "(its state is keyed dp_rank_<i>: a larger DP degree misses keys)")
    ap.add_argument("--check-load", default=None, metavar="URL",
                    help="no training: load the tenplex checkpoint URL (e.g. a `tenplex import` of a titan "
                         "checkpoint) under this run's mesh and compare with a DCP load of --check-ref "
                         "(writes OUT/check.json)")
    ap.add_argument("--check-ref", default=None, metavar="DIR",
                    help="the titan checkpoint (titan/step-N) --check-load is compared with")
    ap.add_argument("--then-check", default=None, metavar="MESH",
                    help="after saving: `tenplex import` the titan checkpoint into OUT/tenplex and check a "
                         "load of it under MESH on the same ranks, e.g. dp_shard=4 (as --check-load)")
    ap.add_argument("--checkpointer", default="titan", choices=["titan", "tenplex"],
                    help="tenplex: the job's CheckpointManager is tenplex.native.titan_checkpoint.TenplexCheckpointManager")
    ap.add_argument("--resume-check", default=None, metavar="MESH[;MESH]",
                    help="after training: save with the job's CheckpointManager, then resume under each MESH "
                         "(e.g. 'tp=4;dp_shard=4') on the same ranks and compare (writes OUT/resume.json)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if bool(args.check_load) != bool(args.check_ref):
        ap.error("--check-load and --check-ref go together")
    if "RANK" not in os.environ:
        sys.exit(launch(args, argv))
    worker(args)


if __name__ == "__main__":
    main()
