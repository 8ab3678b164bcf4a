"""Ring attention (context parallelism) over torch.distributed: forward and backward.

Each of the ``world`` ranks of a process group holds a shard of the sequence: q, k, v of shape
``(batch, n, heads, head_dim)`` with ``n = N / world``. Rank r computes attention of its own
query rows against every rank's key/value block, one block per step, while the blocks travel
around the ring (rank r sends to r + 1, receives from r - 1):

    step i: rank r holds the K/V block of rank s = (r - i) mod world
            post send(K/V -> r + 1), recv(next K/V <- r - 1)     # in flight during ...
            block attention of q against the held block          # ... this compute
            merge the block's (out, lse) into the fp32 (out, lse)
            wait for the transfer; the received block is held next

Forward merge (exact, fp32): step 0's block (always every row: the diagonal) starts the fp32
(out, lse); each later block merges in with w = sigmoid(lse_block - lse) = exp(lse_block -
lse_new): ``out += w * (out_block - out)``, ``lse = logaddexp(lse, lse_block)``. Rows that see no key of
a block have lse_block = -inf and weight 0; a row that has seen nothing yet (lse = -inf) takes
the block as it is; the undefined sigmoid(-inf - -inf) is taken as 0 (nothing seen in either).
The output is cast to the input dtype once, at the end; the LSE stays fp32.

Backward: the same ring of K/V blocks. The fused backward kernel runs against each block with
the *global* out and lse, so its P and Delta = rowsum(dO * O) are the global ones and the block
gradients simply add up. dQ is summed locally in fp32. dK/dV of a block are summed in fp32 by
the ranks it visits: the fp32 sum travels one step behind its block (received while the next
block's kernel runs) and, after ``world`` hops, comes home to the block's owner. Per step a
rank sends one K/V block (input dtype) and one dK/dV block (fp32); the last K/V transfer of
each pass is skipped (nobody needs it). No rank holds more than two K/V blocks and two dK/dV
blocks at once, nothing N x N. Memory per rank, in units of one fp32 shard of q (heads_k =
heads): forward 7 (fp32 out, two K/V buffers, a block's out, the merge's difference), backward
12 (fp32 dQ, two dK/dV, two K/V, scratch for a block's dQ/dK/dV) + the kernels' own workspace;
a world of one allocates no ring buffers and copies nothing.

Causal masks, with the block of rank s seen from rank r:

- contiguous layout (rank r holds tokens r*n ... (r+1)*n - 1): s == r is the causal diagonal
  block, s < r is fully visible, s > r is fully masked and skipped (the block is still passed
  on). Rank r computes r + 1 blocks: the last rank does ``world`` blocks, the first one.
- zigzag layout (rank r holds chunks r and 2*world-1-r of 2*world, each n/2 tokens): s == r is
  causal over the local 2 chunks; s < r: all local queries see the first half of the block
  (chunk s) and nothing of its second; s > r: only the second local chunk sees anything, and
  it sees the whole block. Every rank computes 1 diagonal + (world - 1) half blocks: balanced.
"""

from __future__ import annotations

import contextlib
import time

import torch

from . import _blocks
from ._comm import Ring, agree, default_scale, resolve_group

CONTIGUOUS, ZIGZAG = 0, 1
_TAG_KV, _TAG_DKV = 1, 2


def check_unsupported(dropout_p, window_size, alibi_slopes) -> None:
    """Parameters of flash-attn's signature that the kernels do not implement yet: one place, so
    they are easy to wire when the kernels learn sliding windows and ALiBi."""
    if dropout_p:
        raise ValueError(f"dropout is not supported by tvmflash (dropout_p={dropout_p}); use 0.0")
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if (left, right) != (-1, -1):
        raise NotImplementedError(
            f"window_size={tuple(window_size)}: sliding-window attention is not supported by tvmflash's ring "
            "attention yet (the kernels do not implement it); use window_size=(-1, -1)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not supported by tvmflash's ring attention yet "
                                  "(the kernels do not implement it); use alibi_slopes=None")


def block_plan(layout: int, causal: bool, rank: int, source: int, n: int):
    """(query rows, key rows, causal) of rank ``rank``'s block against rank ``source``'s K/V,
    as slices of the local sequence; None if the block is entirely masked."""
    every = slice(0, n)
    if not causal:
        return every, every, False
    if source == rank:
        return every, every, True
    if layout == CONTIGUOUS:
        return (every, every, False) if source < rank else None
    half = n // 2
    if source < rank:
        return every, slice(0, half), False  # both local chunks see chunk `source`, not 2w-1-source
    return slice(half, n), every, False  # only chunk 2w-1-rank sees anything: all of the block


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's (out, lse) into the running fp32 (out, lse), in place.

    out (B, n, H, D) float32, lse (B, H, n) float32 (views are fine); block_out in any float
    dtype, block_lse float32. -inf LSEs (rows that saw no key) merge without NaN.
    """
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(nan=0.0)  # -inf - -inf: neither saw a key
    lse.copy_(torch.logaddexp(lse, block_lse))
    delta = torch.sub(block_out, out)  # float32 (type promotion), one temporary of the block's size
    delta.mul_(weight.transpose(1, 2).unsqueeze(-1))
    out.add_(delta)


def _kv_buffer(k, v, world: int):
    """K and V in one buffer (one message per step); a world of one sends nothing: no copy."""
    return torch.stack((k, v)) if world > 1 else (k, v)


def _ring_forward(q, k, v, scale: float, causal: bool, layout: int, deterministic: bool, group):
    ring = Ring(group, q.device, "forward")
    rank, world = ring.rank, ring.world
    n = q.shape[1]
    out = lse = None  # fp32 running output and LSE: step 0's block (always all rows), then merged
    kv = _kv_buffer(k, v, world)
    spare = torch.empty_like(kv) if world > 1 else None
    stats = _Stats(ring)
    for step in range(world):
        pending = ring.start(kv, spare, "K/V blocks", step, _TAG_KV) if step + 1 < world else None
        plan = block_plan(layout, causal, rank, (rank - step) % world, n)
        if plan is not None:
            rows, keys, block_causal = plan
            with stats.compute():
                block_out, block_lse = _blocks.block_forward(q[:, rows], kv[0][:, keys], kv[1][:, keys], scale,
                                                             block_causal, deterministic)
                if out is None:
                    out, lse = block_out.to(torch.float32), block_lse
                else:
                    merge_block(out[:, rows], lse[:, :, rows], block_out, block_lse)
                del block_out, block_lse
        if pending is not None:
            ring.wait(pending)
            kv, spare = spare, kv
    return out.to(q.dtype), lse, stats.done()


class _Stats:
    """What one ring call did on this rank (for the benchmarks): bytes and messages sent, time
    blocked waiting for transfers, blocks computed and the time spent on them (meaningful for CPU
    tensors; CUDA kernels run asynchronously)."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.blocks = 0
        self.compute_s = 0.0

    @contextlib.contextmanager
    def compute(self, new_block: bool = True):
        start = time.perf_counter()
        yield
        self.compute_s += time.perf_counter() - start
        self.blocks += new_block

    def done(self) -> dict:
        return {"bytes_sent": self.ring.bytes_sent, "messages": self.ring.messages, "wait_s": self.ring.wait_s,
                "blocks": self.blocks, "compute_s": self.compute_s, "world": self.ring.world}


def _flat_view(buffer: torch.Tensor, offset: int, shape) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return buffer[offset:offset + numel].view(shape)


def _ring_backward(dout, q, k, v, out, lse, scale: float, causal: bool, layout: int, deterministic: bool, group):
    ring = Ring(group, q.device, "backward")
    rank, world = ring.rank, ring.world
    n = q.shape[1]
    f32 = dict(dtype=torch.float32, device=q.device)
    # fp32 sums: dq, and dk/dv of the block held now (first our own). Step 0 (always all rows and
    # keys) writes them; later blocks' gradients go to scratch and are added.
    dq = torch.empty(q.shape, **f32)
    dkv = torch.empty((2, *k.shape), **f32)
    dkv_spare = torch.empty_like(dkv) if world > 1 else None
    kv = _kv_buffer(k, v, world)
    kv_spare = torch.empty_like(kv) if world > 1 else None
    scratch_q = scratch_kv = None
    stats = _Stats(ring)
    dkv_pending = None
    for step in range(world):
        kv_pending = ring.start(kv, kv_spare, "K/V blocks", step, _TAG_KV) if step + 1 < world else None
        plan = block_plan(layout, causal, rank, (rank - step) % world, n)
        if plan is not None:
            rows, keys, block_causal = plan
            qb, kb, vb = q[:, rows], kv[0][:, keys], kv[1][:, keys]
            if step == 0:
                dq_b, dk_b, dv_b = dq, dkv[0], dkv[1]
            else:
                if scratch_q is None:
                    scratch_q, scratch_kv = torch.empty(q.numel(), **f32), torch.empty(2 * k.numel(), **f32)
                dq_b = _flat_view(scratch_q, 0, qb.shape)
                dk_b = _flat_view(scratch_kv, 0, kb.shape)
                dv_b = _flat_view(scratch_kv, kb.numel(), kb.shape)
            with stats.compute():
                _blocks.block_backward(dout[:, rows], qb, kb, vb, out[:, rows], lse[:, :, rows], scale,
                                       block_causal, dq_b, dk_b, dv_b, deterministic)
        if dkv_pending is not None:  # the sums for the block we now hold, from the previous rank
            ring.wait(dkv_pending)
            dkv, dkv_spare = dkv_spare, dkv
        if plan is not None and step > 0:
            with stats.compute(new_block=False):  # the sums of the block computed above
                dq[:, rows] += dq_b
                dkv[0, :, keys] += dk_b
                dkv[1, :, keys] += dv_b
        if kv_pending is not None:
            ring.wait(kv_pending)
            kv, kv_spare = kv_spare, kv
        if world > 1:  # pass the sums on with (one step behind) their block; the last hop is home
            dkv_pending = ring.start(dkv, dkv_spare, "dK/dV sums", step, _TAG_DKV)
    if dkv_pending is not None:
        ring.wait(dkv_pending)
        dkv = dkv_spare  # our own block's sums, back from their trip around the ring
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), stats.done()


class _RingFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, deterministic, group):
        out, lse, stats = _ring_forward(q, k, v, scale, causal, layout, deterministic, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, layout, deterministic, group)
        ctx.mark_non_differentiable(lse)
        last_call_stats["forward"] = stats
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, stats = _ring_backward(_blocks.kernel_layout(dout), q, k, v, out, lse, *ctx.args)
        last_call_stats["backward"] = stats
        return dq, dk, dv, None, None, None, None, None


# What this process's last ring forward and backward did (``_Stats.done()``; benchmarks, tests).
last_call_stats: dict[str, dict] = {}


def _validate(q, k, v, dropout_p, window_size, alibi_slopes, layout: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_unsupported(dropout_p, window_size, alibi_slopes)
    _blocks.check_inputs(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention over one sharded sequence: q and k must hold "
                         f"the same tokens, got local lengths {q.shape[1]} and {k.shape[1]}")
    if q.shape[1] == 0 or q.shape[0] == 0:
        raise ValueError(f"every rank's shard must hold at least one token and one batch entry, got q shape "
                         f"{tuple(q.shape)}")
    if layout == ZIGZAG and q.shape[1] % 2:
        raise ValueError(f"zigzag layout: each rank holds two chunks of equal length, so its shard length must "
                         f"be even, got {q.shape[1]} (shard with zigzag_shard)")


def _attention(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_attn_probs, group):
    group = resolve_group(group)
    local_error, scale = None, None
    try:
        _validate(q, k, v, dropout_p, window_size, alibi_slopes, layout)
        scale = default_scale(q.shape[-1], softmax_scale)
    except (TypeError, ValueError, NotImplementedError) as err:
        local_error = err
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    agree(group, q, k, v, scale, bool(causal), layout, bool(deterministic), local_error, device)
    q, k, v = (_blocks.kernel_layout(t) for t in (q, k, v))
    out, lse = _RingFlashAttn.apply(q, k, v, scale, bool(causal), layout, bool(deterministic), group)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """Exact attention over a sequence sharded contiguously across the ranks of ``group``.

    Rank r passes its shard (tokens r*n ... (r+1)*n - 1) of q ``(batch, n, heads, head_dim)`` and
    k, v ``(batch, n, heads_k, head_dim)`` (GQA/MQA: ``heads % heads_k == 0``); float32, float16
    or bfloat16; CPU tensors on gloo, CUDA tensors on NCCL. Every rank of the group must call it
    (and, for gradients, run the backward) with equally shaped shards and the same arguments:
    this is checked up front, on every rank, before any block moves. Returns this rank's shard
    of the output, or ``(out, softmax_lse, None)`` with ``return_attn_probs=True`` (lse
    ``(batch, heads, n)`` float32, the global LSE of these rows). ``dropout_p`` must be 0;
    ``window_size`` and ``alibi_slopes`` are accepted and, for non-default values, raise
    ``NotImplementedError``. ``deterministic`` is passed to the kernels (CPU: always
    deterministic; the ring's order of summation is fixed). With ``causal=True`` the load is
    unbalanced (rank r computes r + 1 blocks): prefer ``zigzag_ring_flash_attn_func``.

    A rank that fails makes the others fail (with an error naming the step and peer) within the
    process group's timeout: pass ``timeout=`` to ``init_process_group``.
    """
    return _attention(CONTIGUOUS, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """Ring attention over a zigzag-sharded sequence: causal work balanced across the ranks.

    The sequence is cut into 2*world equal chunks; rank r holds chunks r and 2*world-1-r, in that
    order (``zigzag_shard`` makes such shards, ``zigzag_unshard`` puts them back together). Same
    arguments and results as ``ring_flash_attn_func``; each rank computes one causal diagonal
    block and world - 1 half blocks. With ``causal=False`` the order of tokens does not matter
    and this is the plain ring.
    """
    return _attention(ZIGZAG, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs, group)
