"""A Hugging Face ``transformers`` model, elastic in the user's own loop with ``tenplex.ElasticRuntime``.

A small ``LlamaForCausalLM`` built from a ``LlamaConfig`` here (no hub), FSDP2 (``fully_shard`` per
decoder layer, then the root) in the user's ``build(mesh)``, AdamW, one ``with step:`` per step.
Under torchrun (or any env:// launcher) with ``TENPLEX_MEMBERSHIP_STORE=host:port`` (a c10d store
that outlives the workers), a worker's death makes the others rebuild the model for their number
and go on in process from the newest state they hold. ``--kill-at RANK:STEP`` (testing) SIGKILLs
that rank as its forward pass of that step starts; ``RANK:STEP:layer`` inside it (a forward hook on
decoder layer 1, after FSDP2's all-gathers of the layers before).

    TENPLEX_MEMBERSHIP_STORE=127.0.0.1:29400 torchrun --nproc-per-node=4 examples/hf_elastic.py --ckpt /tmp/c

``reference(steps, global_batch)`` is the same training on one process, unsharded (the test's
uninterrupted run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import tenplex
from tenplex.data import DataState, global_batch_ids, stdlib_corpus
from tenplex.data.batches import IndexBatches

SEQ_LEN, SEED = 16, 1


def config() -> LlamaConfig:
    """A small Llama (byte-level vocabulary, 4 layers, grouped-query attention), fp32."""
    return LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def make_model() -> LlamaForCausalLM:
    """The same weights on every rank and in the reference: seeded, fp32."""
    torch.manual_seed(0)
    return LlamaForCausalLM(config()).float()


def train_step(model: Any, optimizer: Any, raw: torch.Tensor, group: Any = None) -> float:
    """Next-token loss on this rank's rows, backward, AdamW step; the mean loss over ``group``'s ranks
    (every rank holds as many rows: the mean of the means is the global mean)."""
    logits = model(input_ids=raw[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), raw[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(out, group=group)
        out /= dist.get_world_size(group)
    return float(out)


def reference(steps: int, global_batch: int) -> dict[int, tuple[float, list[int]]]:
    """The uninterrupted run on one process: loss and samples by step."""
    corpus = stdlib_corpus(SEQ_LEN)
    batches, data = IndexBatches(corpus), DataState(corpus.num_samples, global_batch, seed=SEED)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out = {}
    for step in range(steps):
        out[step] = (train_step(model, opt, batches.batch(data, 1, 0)), global_batch_ids(data).tolist())
        data = data.advance()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--log", default="", help="JSON lines: rank 0's steps and the runtime's events")
    p.add_argument("--kill-at", default="", help="testing: RANK:STEP[:layer], SIGKILL as that step's forward pass "
                                                 "starts (:layer: inside it, in decoder layer 1)")
    args = p.parse_args()
    kill = tuple(map(int, args.kill_at.split(":")[:2])) if args.kill_at else None
    in_layer = args.kill_at.endswith(":layer")
    first_rank = int(os.environ.get("RANK", "0"))
    corpus = stdlib_corpus(SEQ_LEN)
    batches = IndexBatches(corpus)

    def log(record: dict[str, Any]) -> None:
        if args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- the job with tenplex: build for a mesh, a mesh rule, the runtime, one `with step:` per step
    def build(mesh: Any) -> tuple[Any, Any]:
        model = make_model()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    rt = tenplex.ElasticRuntime(build, lambda world: {"dp_shard": world}, ckpt=args.ckpt, ckpt_every=2,
                                data=DataState(corpus.num_samples, args.global_batch, seed=SEED),
                                dead_after=5.0, on_event=log)  # a SIGKILL is seen at once (links); 5 s of heartbeat silence
    for step in rt.steps(args.steps):
        with step:
            raw = batches.batch(rt.data, rt.dp_size, rt.dp_rank)
            if kill == (first_rank, rt.step) and in_layer:  # testing: die inside the forward pass
                rt.model.model.layers[1].register_forward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            elif kill == (first_rank, rt.step):  # testing: die as the forward pass starts
                os.kill(os.getpid(), signal.SIGKILL)
            loss = train_step(rt.model, rt.optimizer, raw, group=rt.group)
            if rt.rank == 0:
                log({"step": rt.step, "loss": loss, "world_size": rt.world_size,
                     "samples": global_batch_ids(rt.data).tolist()})


if __name__ == "__main__":
    main()
