"""A small Llama-style model in plain torch, parallelized with torch's own APIs.

This is the "typical torch-native job" used by tenplex's tests, benchmark and docs (issue #17
item 4a): a self-contained, torchtitan-like Llama 3 (same module names and FQNs), with

* TP (+ SequenceParallel) via ``torch.distributed.tensor.parallel.parallelize_module``,
* FSDP2 / HSDP via ``torch.distributed.fsdp.fully_shard`` (per block and on the root),
* PP via ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``),

following torchtitan's ``parallelize_llama`` / ``apply_tp`` / ``apply_fsdp`` /
``pipeline_module_split``.  Everything runs in fp32 so that results are bit-comparable with a
single-process reference.  It runs unchanged on CPU with gloo (no workarounds needed).

Typical use, every rank::

    model = Llama(PRESETS["tiny"]); model.init_weights(seed=0)       # full model, same on all ranks
    mesh = build_mesh({"dp_shard": 2, "tp": 2})
    parallelize(model, mesh)
    opt = make_optimizer(model)
    rank, size = dp_rank_and_size(mesh)
    tokens, targets = dp_slice(batch(0, 8, cfg.seq_len, cfg.vocab_size, seed=0), rank, size)
    loss = train_step(model, opt, tokens, targets)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

__all__ = [
    "LlamaConfig", "PRESETS", "RMSNorm", "Attention", "FeedForward", "TransformerBlock", "Llama",
    "MESH_DIMS", "build_mesh", "parallelize", "pipeline_stage", "stage_layers", "loss_fn",
    "batch", "dp_rank_and_size", "dp_slice", "forward_backward", "train_step", "make_optimizer", "init_optimizer_state",
    "reference_model",
]

# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape.  ``n_heads % n_kv_heads == 0``; under TP both must divide by the TP degree."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    # vocab 250 is divisible by neither 4 nor 8: TP / FSDP shards of the embedding and the output
    # are uneven (torch.chunk: 63/63/63/61).  8 heads / 4 KV heads (GQA, 2 queries per KV head)
    # so that TP 4 shards whole KV heads.
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=176, vocab_size=250,
                        seq_len=16),
    # 12.1M parameters (vocab 259: the byte corpus of examples/train_native.py): the job issue #31's
    # recovery goal and scripts/bench_recovery.py measure against torchft (144.9 MB of fp32 weights
    # and AdamW state)
    "12m": LlamaConfig(dim=384, n_layers=7, n_heads=8, n_kv_heads=4, ffn_dim=1088, vocab_size=259, seq_len=16),
    # 110.5M parameters: 24.6M each in the embedding and the output, 5.1M per block.
    "100m": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=1536,
                        vocab_size=32000, seq_len=256),
}

# --------------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    """RMSNorm with a weight (written out: pointwise ops and a mean, so it runs on DTensors)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles, shape (seq_len, head_dim // 2) (Llama's complex RoPE)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (bs, seq, heads, head_dim): torchtitan's complex RoPE."""
    xr = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE (no biases).

    Head counts are taken from the projections' *output* widths, so the module works unchanged
    when TP shards ``wq``/``wk``/``wv`` by heads (ColwiseParallel, local outputs) and ``wo`` by
    input features (RowwiseParallel)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq = x.shape[0], x.shape[1]
        hd = self.head_dim
        q = self.wq(x).view(bs, seq, -1, hd)  # local heads under TP
        k = self.wk(x).view(bs, seq, -1, hd)
        v = self.wv(x).view(bs, seq, -1, hd)
        cos, sin = rope_cos_sin(seq, hd, self.rope_theta, q.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seq, hd)
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(attention_norm(x)), then + feed_forward(ffn_norm(.))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama 3 with torchtitan's FQNs: ``tok_embeddings``, ``layers.<i>.*``, ``norm``, ``output``.

    ``layers`` is an ``nn.ModuleDict`` keyed "0".."n-1": a pipeline stage deletes the blocks it
    does not own and keeps the global names.  ``tok_embeddings``/``norm``/``output`` may be None
    on stages that do not own them; ``forward`` skips them (tokens in -> hidden states out, etc.).
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> "Llama":
        """Deterministic init of the *full* model (call before parallelizing): norms 1, every other
        weight N(0, 0.02) (output projections ``wo``/``w2``: scaled by 1/sqrt(2 n_layers)),
        drawn in FQN order from one seeded generator, so every rank gets the same weights."""
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def reference_model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """The unparallelized model every parallel run is compared with."""
    return Llama(cfg).init_weights(seed)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

# ----------------------------------------------------------------------------------- meshes


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(dims: dict[str, int], device_type: str = "cpu") -> DeviceMesh:
    """A named DeviceMesh over the whole world, dims in ``MESH_DIMS`` order (pp, dp_replicate,
    dp_shard, tp; size-1 dims allowed, missing dims omitted).  The product must be the world size."""
    bad = set(dims) - set(MESH_DIMS)
    if bad:
        raise ValueError(f"unknown mesh dims {sorted(bad)}; use some of {MESH_DIMS}")
    names = tuple(d for d in MESH_DIMS if d in dims)
    if not names:
        names, shape = ("dp_shard",), (1,)
    else:
        shape = tuple(int(dims[d]) for d in names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _size(mesh: DeviceMesh, name: str) -> int:
    return mesh[name].size() if name in (mesh.mesh_dim_names or ()) else 1


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's data-parallel index and the DP degree (dp_replicate * dp_shard, replicate major)."""
    rank, size = 0, 1
    for name in ("dp_replicate", "dp_shard"):
        if name in (mesh.mesh_dim_names or ()):
            sub = mesh[name]
            rank, size = rank * sub.size() + sub.get_local_rank(), size * sub.size()
    return rank, size

# ----------------------------------------------------------------------------- parallelize


def _apply_tp(model: Llama, tp_mesh: DeviceMesh, *, loss_parallel: bool, sequence_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` (Llama 3, no float8, no async TP)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    cfg = model.cfg
    tp = tp_mesh.size()
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        raise ValueError(f"TP {tp} must divide n_heads {cfg.n_heads} and n_kv_heads {cfg.n_kv_heads}")
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()  # the layout of the hidden states between modules
    root: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.norm is not None and sp:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(
            input_layouts=act, output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel)
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)


def _apply_fsdp(model: Llama, dp_mesh: DeviceMesh, *, pp_enabled: bool) -> None:
    """torchtitan's ``apply_fsdp_to_decoder`` (dense, untied): tok_embeddings, each block,
    [norm, output] together, then the root; fp32 parameters and reductions."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    kw: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp}
    rafter = not pp_enabled  # torchtitan's "default" policy: no reshard after forward under PP
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **kw, reshard_after_forward=rafter)
    if model.norm is not None and model.output is not None:
        fully_shard([model.norm, model.output], **kw, reshard_after_forward=False)
    for block in model.layers.values():
        fully_shard(block, **kw, reshard_after_forward=rafter)
    fully_shard(model, **kw)
    # No gloo workaround needed here: with the default gradient divide factor FSDP2 reduces with
    # ReduceOp.AVG, which gloo runs (torch 2.13).  torchtitan's factor 1.0 becomes PREMUL_SUM,
    # which gloo does not (see docs/titan.md, set_force_sum_reduction_for_comms).


def parallelize(model: Llama, mesh: DeviceMesh, *, loss_parallel: bool = False,
                sequence_parallel: bool = True) -> Llama:
    """Apply TP (on ``mesh["tp"]``, with torchtitan's SequenceParallel by default) and FSDP2 (on
    ``mesh["dp_shard"]``, or HSDP on ``mesh["dp_replicate", "dp_shard"]``) in place.

    A ``pp`` dim is ignored (apply this to a stage module, see ``pipeline_stage``).  FSDP is applied
    whenever the mesh has a ``dp_shard`` dim, even of size 1 (torchtitan always applies it), so
    ``{"dp_shard": 1, "tp": 4}`` gives 2-D parameters.  ``loss_parallel`` keeps the logits as a
    vocab-sharded DTensor; ``train_step`` then computes the loss under ``loss_parallel()``."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        _apply_tp(model, mesh["tp"], loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    elif loss_parallel:
        raise ValueError("loss_parallel needs a tp dim of size > 1")
    model.loss_parallel = bool(loss_parallel)  # type: ignore[assignment]
    if "dp_replicate" in names and "dp_shard" not in names:
        raise ValueError("dp_replicate alone is not supported: add dp_shard (size 1 allowed) for HSDP")
    if "dp_shard" in names:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
        _apply_fsdp(model, dp_mesh, pp_enabled="pp" in names and mesh["pp"].size() > 1)
    return model

# ------------------------------------------------------------------------------------ pipeline


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """Layers of ``stage`` when ``n_layers`` are split evenly over ``pp`` stages (the first
    ``n_layers % pp`` stages get one more)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (stage < extra)))


def pipeline_stage(model: Llama, mesh: DeviceMesh, n_microbatches: int, *, schedule: str = "1F1B",
                   sequence_parallel: bool = True) -> tuple[Llama, Any, Any]:
    """Cut the full ``model`` in place to this rank's pipeline stage (``mesh["pp"]``), parallelize it
    on the other mesh dims, and build torch's ``PipelineStage`` and schedule (``"1F1B"`` or
    ``"GPipe"``) with ``loss_fn``.  Stage 0 keeps ``tok_embeddings``, the last stage ``norm`` and
    ``output``; parameter names stay global (``layers.3.*`` on stage 1, etc.).

    Returns (stage_module, stage, schedule).  Batches passed to ``train_step`` must have a multiple
    of ``n_microbatches`` rows."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp_mesh = mesh["pp"]
    pp, s = pp_mesh.size(), pp_mesh.get_local_rank()
    keep = {str(i) for i in stage_layers(model.cfg.n_layers, pp, s)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if s != 0:
        model.tok_embeddings = None
    if s != pp - 1:
        model.norm = None
        model.output = None
    parallelize(model, mesh, sequence_parallel=sequence_parallel)
    device = torch.device(mesh.device_type if mesh.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
    stage = PipelineStage(model, s, pp, device, group=pp_mesh.get_group())
    cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return model, stage, sched

# --------------------------------------------------------------------------------- data, steps


def batch(step: int, global_batch: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (tokens, targets), each (global_batch, seq_len) int64,
    the same for every mesh (seeded by (seed, step))."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tok = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def dp_slice(tokens_targets: tuple[torch.Tensor, torch.Tensor], dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[dp_rank * b, (dp_rank + 1) * b)`` of a global batch, b = global_batch / dp_size."""
    tokens, targets = tokens_targets
    if tokens.shape[0] % dp_size:
        raise ValueError(f"global batch {tokens.shape[0]} not divisible by the DP degree {dp_size}")
    b = tokens.shape[0] // dp_size
    return tokens[dp_rank * b:(dp_rank + 1) * b], targets[dp_rank * b:(dp_rank + 1) * b]


def _global_mean_loss(local: torch.Tensor | None, group: Any = None) -> float:
    """Average the losses of the ranks that hold one (all of them, or the last PP stage's): the
    global mean over DP slices, identical on every rank (of ``group``: default, every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        assert local is not None
        return float(local)
    buf = torch.zeros(2, dtype=torch.float64)
    if local is not None:
        buf[0], buf[1] = float(local), 1.0
    dist.all_reduce(buf, group=group)
    return float(buf[0] / buf[1])


def forward_backward(model_or_schedule: Any, tokens: torch.Tensor, targets: torch.Tensor,
                     loss_scale: float = 1.0) -> torch.Tensor | None:
    """Forward, mean cross-entropy and backward on this rank's slice (gradients accumulate).
    ``model_or_schedule`` is a (parallelized) ``Llama`` or a pipeline schedule from
    ``pipeline_stage`` (then ``tokens`` are used on the first stage, ``targets`` on the last, and
    the loss is the mean over microbatches).  ``loss_scale``: the mean is multiplied by it before the
    backward (``ElasticRuntime.loss_scale``: a DP rank's share of an uneven split, weighed so that
    FSDP2's averaging gives the global batch's gradient; not under PP).  Returns this rank's loss
    (scaled; a plain 0-d tensor), or None on pipeline stages other than the last."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    if isinstance(model_or_schedule, _PipelineSchedule):
        if loss_scale != 1.0:
            raise ValueError(f"loss_scale {loss_scale} under PP: the schedule's loss_fn is fixed at its construction")
        sched = model_or_schedule
        stage = sched._stage
        losses: list[torch.Tensor] = []
        args = (tokens,) if stage.is_first else ()
        sched.step(*args, target=targets if stage.is_last else None, losses=losses)
        return torch.stack([l.detach() for l in losses]).mean() if stage.is_last else None
    model = model_or_schedule
    if getattr(model, "loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = _scaled(loss_fn(model(tokens), targets), loss_scale)
            loss.backward()
    else:
        loss = _scaled(loss_fn(model(tokens), targets), loss_scale)
        loss.backward()
    local = loss.detach()
    return local.full_tensor() if hasattr(local, "full_tensor") else local


def _scaled(loss: torch.Tensor, scale: float) -> torch.Tensor:
    return loss if scale == 1.0 else loss * scale  # an even split's step stays the same ops


def train_step(model_or_schedule: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor, group: Any = None, loss_scale: float = 1.0) -> float:
    """One step on this rank's slice: ``forward_backward``, ``optimizer.step()``, ``zero_grad()``.
    Returns the global mean loss, the same float on every rank of ``group`` (default: every rank;
    a job with spares passes the mesh's ranks, ``ElasticRuntime.group``). ``loss_scale``: this rank's
    weight when the DP ranks read different numbers of samples (``ElasticRuntime.loss_scale``, with
    ``uneven_dp=True``): the average of the scaled means over the ranks is the global batch's mean."""
    local = forward_backward(model_or_schedule, tokens, targets, loss_scale)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _global_mean_loss(local, group)


def make_optimizer(model: nn.Module, lr: float = 1e-3) -> torch.optim.AdamW:
    """AdamW over the (possibly DTensor) parameters; ``foreach=False`` (per-parameter ops)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state (AdamW: step, exp_avg, exp_avg_sq) without changing the
    parameters: one step with zero gradients at lr 0 (the lr is restored after)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


if __name__ == "__main__":
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            n = Llama(cfg).num_params()
        print(f"{name}: {n / 1e6:.1f}M parameters  {cfg}")
