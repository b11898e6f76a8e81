"""A torchtitan job, elastic in process: torchtitan's Llama 3 and its own ``Trainer`` parts through
``tenplex.train.titan.ElasticTrainer`` (the switch: that trainer class and ``config.elastic``).

Under torchrun (or any env:// launcher) with ``TENPLEX_MEMBERSHIP_STORE=host:port`` (a c10d store
that outlives the workers) on 4 workers it trains FSDP2 2 x TP 2; when a worker dies the others
continue in process as FSDP2 over 3 and, when a worker started with ``--join`` arrives, grow back.
``--stock`` runs the same job as stock torchtitan (``Trainer.train``, its DCP ``CheckpointManager``
every ``--ckpt-every`` steps, torchrun's ``--max-restarts`` as the recovery).

    TENPLEX_MEMBERSHIP_STORE=127.0.0.1:29400 torchrun --nproc-per-node=4 examples/titan_elastic_job.py --out /tmp/t

Testing: ``--kill-at RANK:STEP`` SIGKILLs that launch rank in the forward pass of that step (1-based,
torchtitan's count; only in the first launch of a torchrun restart) after writing the time to
``OUT/killed.json``; ``--events`` gets rank 0's committed steps (``step``, ``loss``, ``world_size``, ``t``)
and the runtime's records as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

import tenplex.train.titan as tt  # noqa: F401 - first: torchtitan's device type (cpu) before its imports
from tenplex.train.titan import ElasticOptions, ElasticTrainer
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 2, 256, 16


def model_config(config: Any) -> Any:
    """torchtitan's Llama 3 (its own layer builder), tiny; SDPA attention and unfused QKV on CPU."""
    mcfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=False, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex"))
    for layer in mcfg.layers:  # FlexAttention has no backward on CPU (docs/titan.md)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    mcfg.update_from_config(config=config)
    return mcfg


def hsdp_rule(world: int) -> dict[str, int]:
    """HSDP 2 x (world / 2) on an even world, FSDP2 over an odd one."""
    return {"dp_replicate": 2, "dp_shard": world // 2} if world % 2 == 0 else {"dp_shard": world}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="dump folder: tenplex checkpoint in OUT/ckpt, torchtitan's in OUT/titan")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=2, help="--stock: the mesh is dp_shard x tp")
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--hsdp", action="store_true",
                   help="HSDP 2 x 2 on 4 workers (each piece held twice), FSDP2 over 3 (global batch: a multiple of 12)")
    p.add_argument("--stock", action="store_true", help="stock torchtitan: Trainer.train, DCP checkpoints, restarts")
    p.add_argument("--join", action="store_true", help="join the running job (no RANK/WORLD_SIZE)")
    p.add_argument("--join-when", default="", help="testing: with --join, wait for this file to exist first")
    p.add_argument("--hold-after", type=int, default=0,
                   help="testing: after committing this step, every worker waits for OUT/joined (a joiner registered)")
    p.add_argument("--events", default="", help="JSON lines file")
    p.add_argument("--kill-at", default="", help="testing: RANK:STEP, SIGKILL in that step's forward pass")
    args = p.parse_args()
    out = Path(args.out)
    kill = tuple(map(int, args.kill_at.split(":"))) if args.kill_at else None
    launch_rank = int(os.environ.get("RANK", "-1"))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    def log(record: dict[str, Any]) -> None:
        if args.events:
            with open(args.events, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- the torchtitan job: its config, with tenplex's trainer class and `elastic`
    config = ElasticTrainer.Config(
        dump_folder=str(out),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        training=TrainingConfig(local_batch_size=args.global_batch // args.dp_shard, seq_len=SEQ, steps=args.steps,
                                mixed_precision_param="float32", dtype="float32", disable_cuda_graphs=True,
                                max_norm=1.0),
        parallelism=ParallelismConfig(data_parallel_shard_degree=args.dp_shard, tensor_parallel_degree=args.tp,
                                      data_parallel_replicate_degree=2 if args.hsdp else 1,
                                      spmd_backend="partial_dtensor"),
        optimizer=OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW",
            optimizer_kwargs=dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))], implementation="foreach"),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        compile=CompileConfig(enable=False),
        debug=DebugConfig(seed=0),
        checkpoint=CheckpointManager.Config(enable=True, folder="titan", interval=args.ckpt_every,
                                            last_save_model_only=False, keep_latest_k=0),
        elastic=ElasticOptions(ckpt=str(out / "ckpt"), global_batch=args.global_batch, ckpt_every=args.ckpt_every,
                               in_process=not args.stock, join=args.join, dead_after=2.0, on_event=log,
                               mesh_rule=hsdp_rule if args.hsdp else None),
    )
    g = torch.Generator().manual_seed(1)
    rows = Dataset.from_dict({"tokens": torch.randint(0, VOCAB, (96, SEQ + 1), generator=g).tolist()})

    class Job(ElasticTrainer):
        def forward_backward_step(self, **kwargs: Any) -> Any:
            if kill == (launch_rank, self.step) and not restarted:
                (out / "killed.json").write_text(json.dumps({"rank": launch_rank, "step": self.step, "t": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            return super().forward_backward_step(**kwargs)

        def committed(self, step: int) -> None:
            while step == args.hold_after and not (out / "joined").exists():
                time.sleep(0.05)
            rank = self.runtime.rank if self.runtime is not None else torch.distributed.get_rank()
            if rank == 0:
                world = self.parallel_dims.world_size
                log({"step": step, "loss": self.losses[step], "world_size": world, "t": time.time(),
                     "launch_rank": launch_rank, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})

    while args.join_when and not Path(args.join_when).exists():
        time.sleep(0.05)
    Job(config, model_config=model_config(config), dataset=rows).train()


if __name__ == "__main__":
    main()
