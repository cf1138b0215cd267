"""The tensor-parallel baseline megatape's TP=2 decoder is timed against (bench/tp_bench.py): the same
sharded model as per-GPU torch ops, the ranks joined by all-reduces between the kernel segments.

Rank ``r`` holds the same shard as megatape's rank (``opcodes.tp.shard_weights``: its query / KV
heads, the O columns, the gate / up rows and down columns of its half of the FFN, its half of the
LM head; norms and the embedding replicated) and its KV heads' cache. One decode step per rank:

* every layer: RMSNorm, the q / k / v projections of its heads (``F.linear``), RoPE, the K/V row
  written at the device-held position (``index_copy_``), attention over the whole static cache with
  a ``t <= pos`` mask (SDPA with ``enable_gqa``, as ``bench.baselines.compiled_step``), the partial O
  projection in fp32, **all-reduce**, added to the residual once; the same for the MLP's partial
  down projection (**all-reduce**): the TP reference's semantics (``opcodes.tp.tp_layer_ref``: fp32
  partials summed, rounded once);
* the final norm, the rank's LM head slice (fp32 logits), its (max, argmax), an **all-gather** of
  the ranks' pairs and the greedy token (largest logit, ties to the lowest rank), written to the
  device token buffer the next step embeds; the position advances on the device.

So one step is a fixed sequence of kernels and collectives: on GPUs it is captured in ONE CUDA
graph (NCCL collectives can be captured) and replayed per token. ``all_reduce`` / ``all_gather``
are injected (``torch.distributed`` on GPUs; two threads on the CPU in tests/test_tp_bench.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opcodes.config import ModelConfig
from opcodes.reference import rope_tables
from opcodes.tp import shard_config

from .baselines import _Layer


class _TPLayer(_Layer):
    """``bench.baselines._Layer`` on a rank's shard, an all-reduce after O and after down."""

    def __init__(self, lw: dict, kc: torch.Tensor, vc: torch.Tensor, sc: ModelConfig, all_reduce):
        super().__init__(lw, kc, vc, sc)
        self.all_reduce = all_reduce

    def forward(self, x, input_pos, c, s, mask):
        part = F.linear(self._attention(x, input_pos, c, s, mask), self.o).float()
        self.all_reduce(part)
        x = (x.float() + part).to(x.dtype)
        part = self._mlp(x).float()
        self.all_reduce(part)
        return (x.float() + part).to(x.dtype)


class TPTorchDecoder(torch.nn.Module):
    """One rank of the baseline: ``step()`` embeds ``self.tok``, runs the layers at ``self.pos``,
    leaves this rank's logits slice in ``self.logits`` and the greedy token in ``self.tok``, and
    advances ``self.pos`` (all on the device: a captured step replays as the next token).

    shard     : the rank's weights (``shard_weights(..., rank, 2)``: ``layers``, ``embed``,
                ``final_norm``, its ``lm_head`` slice)
    kv_cache  : the rank's cache (``shard_kv_cache``), each (1, n_kv / 2, max_seq, hd), written in place
    cfg       : the FULL model's config; ``rank``: 0 or 1
    all_reduce(t): sums the fp32 tensor ``t`` over the ranks in place
    all_gather(t) -> (2, *t.shape): the ranks' ``t`` stacked in rank order
    """

    def __init__(self, shard: dict, kv_cache: list, cfg: ModelConfig, rank: int, max_seq: int, all_reduce, all_gather):
        super().__init__()
        cfg = ModelConfig.from_dict(cfg)
        if not cfg.vocab:
            raise ValueError("cfg: a whole model (vocab > 0)")
        sc = shard_config(cfg, rank, 2)
        dev = shard["layers"][0]["q"].device
        self.cfg, self.sc, self.rank, self.max_seq = cfg, sc, rank, max_seq
        self.vocab0 = rank * (cfg.vocab // 2)
        self.all_gather = all_gather
        self.layers = torch.nn.ModuleList(
            _TPLayer(lw, kc, vc, sc, all_reduce) for lw, (kc, vc) in zip(shard["layers"], kv_cache))
        cos, sin = rope_tables(sc, max_seq, device=dev)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1).contiguous(), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], dim=-1).contiguous(), persistent=False)
        self.register_buffer("seq", torch.arange(max_seq, device=dev, dtype=torch.int64), persistent=False)
        self.embed, self.fnorm, self.lm_head = shard["embed"], shard["final_norm"], shard["lm_head"]
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(1, cfg.vocab // 2, dtype=torch.float32, device=dev)
        self.eps = float(cfg.eps)

    def set(self, token: int, pos: int) -> None:
        """The token the next step embeds and its position (device writes)."""
        self.tok.fill_(int(token))
        self.pos.fill_(int(pos))

    @torch.no_grad()
    def step(self) -> None:
        p = self.pos
        c = self.cos[p].view(1, 1, -1)
        s = self.sin[p].view(1, 1, -1)
        mask = (self.seq <= p).view(1, 1, 1, -1)
        x = self.embed[self.tok].view(1, -1)
        for layer in self.layers:
            x = layer(x, p, c, s, mask)
        xf = x.float()
        h = self.fnorm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        self.logits.copy_(F.linear(h, self.lm_head).float())     # bf16 GEMV (fp32 accumulation)
        mx, ix = torch.max(self.logits, dim=-1)                  # the first index of the max
        pair = torch.stack([mx.reshape(()), (ix.reshape(()) + self.vocab0).float()])
        both = self.all_gather(pair)                              # (2, 2): [rank][max, id]
        # the larger maximum, rank 0's on ties; no tensor-valued index (a host read: not capturable)
        self.tok.copy_(torch.where(both[0, 0] >= both[1, 0], both[0, 1], both[1, 1]).long().reshape(1))
        self.pos.add_(1)

    def logits_full(self) -> torch.Tensor:
        """(1, vocab): both ranks' slices of the last step (an all-gather; not in the captured step)."""
        return self.all_gather(self.logits.reshape(-1)).reshape(1, -1)


def nccl_collectives(group):
    """(all_reduce, all_gather) over ``group`` with torch.distributed (NCCL on GPUs), in the form
    :class:`TPTorchDecoder` takes; both capturable in a CUDA graph."""
    import torch.distributed as dist
    n = dist.get_world_size(group)

    def all_reduce(t):
        dist.all_reduce(t, group=group)

    def all_gather(t):
        out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)     # flat: NCCL and gloo take it
        dist.all_gather_into_tensor(out, t.contiguous().reshape(-1), group=group)
        return out.view((n,) + tuple(t.shape))

    return all_reduce, all_gather


def capture_step(model: TPTorchDecoder, warmup: int = 2):
    """One decode step of ``model`` captured in a CUDA graph after ``warmup`` eager steps on a side
    stream (the model's token and position are restored afterwards). Returns the graph: each
    ``replay()`` is one token (the next position, the token the last replay chose)."""
    dev = model.tok.device
    tok0, pos0 = model.tok.clone(), model.pos.clone()
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(warmup):
            model.step()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize(dev)
    model.tok.copy_(tok0)
    model.pos.copy_(pos0)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    # thread_local: other threads' CUDA calls (NCCL's watchdog polls its events) do not void the capture
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        model.step()
    torch.cuda.synchronize(dev)
    model.tok.copy_(tok0)                 # capturing ran nothing; keep the state as set
    model.pos.copy_(pos0)
    return g

