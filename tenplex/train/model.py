"""A Llama-style decoder stage with Megatron tensor parallelism, written over PTC shards.

Parameters are the rank's local shards under the PTC names of ``tenplex.layout.models`` (so a
checkpoint is just the dict of them): column-parallel QKV ([q; k; v] blocks, GQA) and
[gate; up], row-parallel output projections, a vocabulary-parallel embedding, LM head and
cross-entropy. Vocabulary padding columns are masked out of the softmax, so the loss does
not depend on the TP size.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..layout.config import ParallelConfig
from ..layout.models import ModelSpec
from ..layout.ptc import PTC
from ..planning.memory import RECOMPUTE
from .parallel import all_reduce, copy_to_tp, reduce_from_tp

__all__ = ["StageModel", "init_global_tensor", "vocab_parallel_cross_entropy"]


def init_global_tensor(ptc: PTC, name: str, seed: int) -> torch.Tensor:
    """The initial value of logical tensor ``name``: the same whatever the layout.

    Each tensor draws from its own generator seeded by (seed, name), so a rank builds only the
    tensors it holds. Norm weights start at one, output projections are scaled by 1/sqrt(2L).
    """
    spec = ptc.tensors[name]
    if name.endswith("norm.weight"):
        return torch.ones(spec.shape, dtype=spec.dtype)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    std = 0.02
    if name.endswith(("attn.proj.weight", "mlp.down.weight")):
        std /= math.sqrt(2 * max(ptc.num_layers, 1))
    return (torch.randn(spec.shape, generator=gen, dtype=torch.float32) * std).to(spec.dtype)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary across TP ranks (Megatron style)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        logits = logits.float()
        m = logits.max(dim=-1).values
        all_reduce(m, group, torch.distributed.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        local_t = target - vocab_start
        in_range = (local_t >= 0) & (local_t < logits.shape[-1])
        safe_t = torch.where(in_range, local_t, torch.zeros_like(local_t))
        t_logit = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1) * in_range
        all_reduce(t_logit, group)
        loss = sum_exp.log() - t_logit
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), safe_t, in_range)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, safe_t, in_range = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, safe_t.unsqueeze(-1), -in_range.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
    return _VocabParallelCE.apply(logits, target, vocab_start, group)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _swiglu(gu: torch.Tensor, ffn: int) -> torch.Tensor:
    """SiLU(gate) * up of the fused [gate; up] projection's output."""
    return F.silu(gu[..., :ffn]) * gu[..., ffn:]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class StageModel:
    """The layers of one pipeline stage on one TP rank, as a functional forward over ``params``.

    ``recompute`` (``tenplex.planning.memory.RECOMPUTE``): ``full`` keeps only each layer's input and
    recomputes the layer in the backward pass; ``selective`` recomputes the norms and the SwiGLU
    activation (``torch.utils.checkpoint``, non-reentrant). Results are bit-identical.
    """

    def __init__(self, spec: ModelSpec, cfg: ParallelConfig, rank: int, params: dict[str, torch.Tensor],
                 tp_group: Any, recompute: str = "none") -> None:
        if spec.arch != "llama":
            raise ConfigError(f"the reference trainer implements the Llama family (arch='llama'), not "
                              f"arch={spec.arch!r}")
        assert spec.kv_heads is not None and spec.ffn_hidden is not None
        if spec.rope_scaling is not None:
            raise ConfigError(f"the reference trainer implements unscaled RoPE; this model scales it "
                              f"({spec.rope_scaling})")
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        self.spec, self.cfg, self.params, self.group = spec, cfg, params, tp_group
        self.recompute = recompute
        c = cfg.coords(rank)
        self.tp_rank = c.tp
        self.is_first, self.is_last = c.pp == 0, c.pp == cfg.pp - 1
        counts = cfg.layers_per_stage(spec.num_layers)
        first = sum(counts[: c.pp])
        self.layers = list(range(first, first + counts[c.pp]))
        t = cfg.tp
        self.heads, self.kv_heads = spec.heads // t, spec.kv_heads // t
        self.hd = spec.head_dim
        self.ffn = spec.ffn_hidden // t
        self.vocab_local = spec.padded_vocab(t) // t
        self.vocab_start = c.tp * self.vocab_local
        hp = spec.resolved()  # norm epsilon and RoPE base: the model's own, tenplex's defaults unless stated
        assert hp.norm_eps is not None and hp.rope_theta is not None
        self.eps = hp.norm_eps
        pos = torch.arange(spec.seq_len, dtype=torch.float32)
        inv = 1.0 / (hp.rope_theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = torch.outer(pos, inv)
        self.cos, self.sin = ang.cos(), ang.sin()

    def to(self, device: torch.device) -> StageModel:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.params["embedding.word"]
        local = tokens - self.vocab_start
        mask = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(torch.where(mask, local, torch.zeros_like(local)), w) * mask.unsqueeze(-1).to(w.dtype)
        return reduce_from_tp(out, self.group)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.recompute == "selective" and torch.is_grad_enabled():
            return checkpoint(_rms_norm, x, w, self.eps, use_reentrant=False)
        return _rms_norm(x, w, self.eps)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        if self.recompute == "selective" and torch.is_grad_enabled():
            return checkpoint(_swiglu, gu, self.ffn, use_reentrant=False)
        return _swiglu(gu, self.ffn)

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._layer, i, x, use_reentrant=False)
        return self._layer(i, x)

    def _layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p, pre = self.params, f"layers.{i}."
        b, s, _ = x.shape
        h = copy_to_tp(self._norm(x, p[pre + "attn_norm.weight"]), self.group)
        qkv = h @ p[pre + "attn.qkv.weight"].t()
        q_n, kv_n = self.heads * self.hd, self.kv_heads * self.hd
        q = qkv[..., :q_n].reshape(b, s, self.heads, self.hd).transpose(1, 2)
        k = qkv[..., q_n : q_n + kv_n].reshape(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = qkv[..., q_n + kv_n :].reshape(b, s, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, q_n)
        x = x + reduce_from_tp(a @ p[pre + "attn.proj.weight"].t(), self.group)
        h = copy_to_tp(self._norm(x, p[pre + "mlp_norm.weight"]), self.group)
        m = self._swiglu(h @ p[pre + "mlp.gate_up.weight"].t())
        return x + reduce_from_tp(m @ p[pre + "mlp.down.weight"].t(), self.group)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Tokens (first stage) or hidden states in, hidden states out (final-normed on the last stage)."""
        x = self.embed(inp) if self.is_first else inp
        for i in self.layers:
            x = self.layer(i, x)
        if self.is_last:
            x = _rms_norm(x, self.params["final_norm.weight"], self.eps)
        return x

    def loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of a micro-batch (last stage only)."""
        logits = copy_to_tp(hidden, self.group) @ self.params["lm_head.weight"].t()
        cols = self.vocab_start + torch.arange(self.vocab_local, device=logits.device)
        logits = logits.masked_fill(cols >= self.spec.vocab, float("-inf"))
        return vocab_parallel_cross_entropy(logits.reshape(-1, self.vocab_local), target.reshape(-1),
                                            self.vocab_start, self.group).mean()
