"""Ring attention (context parallelism) over torch.distributed: forward and backward.

Each of the ``world`` ranks of a process group holds a shard of the sequence: q, k, v of shape
``(batch, n, heads, head_dim)`` with ``n = N / world``. Rank r computes attention of its own
query rows against every rank's key/value block, one block per step, while the blocks travel
around the ring (rank r sends to r + 1, receives from r - 1):

    step i: rank r holds the K/V block of rank s = (r - i) mod world
            post send(K/V -> r + 1), recv(next K/V <- r - 1)     # in flight during ...
            the block's kernel calls (``_plan.block_plan``)       # ... this compute
            merge each call's fp32 (out, lse) into the fp32 (out, lse)
            wait for the transfer; the received block is held next

Masks and ALiBi: every kernel call gets the *global* causal mask, sliding window and ALiBi
distances through the kernels' ``diagonal`` (the key that the call's query 0 is aligned with;
``q0 - k0`` for queries at global position q0 and keys at k0). ``_plan.py`` cuts a step into
calls (one for a contiguous shard; up to one per pair of chunks for a zigzag shard), proves each
exact, and leaves out the ones the mask leaves empty: such blocks cost no compute (their K/V
still travel on).

Partial results are float32 (the kernels' ``fp32_results``): each call writes its output and
its dQ/dK/dV in float32 for every input dtype, the ring merges and sums them in float32 and
rounds to the input dtype once, at the end, as a single-process call does.

Forward merge (exact, fp32): the first call that covers rows writes (out, lse) there directly;
every later call merges in with w = sigmoid(lse_block - lse) = exp(lse_block - lse_new): ``out
+= w * (out_block - out)`` (computed in the block's own fp32 buffer), ``lse = logaddexp(lse,
lse_block)``. Rows that see no key of a call have lse_block = -inf and weight 0; the undefined
sigmoid(-inf - -inf) is taken as 0 (nothing seen in either). Step 0 (the own block) covers
every row: a token always sees itself.

Backward: the same ring of K/V blocks. The fused backward kernel runs each call with the
*global* out and lse, so its P and Delta = rowsum(dO * O) are the global ones and the call
gradients simply add up. dQ is summed locally in fp32. dK/dV of a block are summed in fp32 by
the ranks it visits: the fp32 sum travels one step behind its block (received while the next
block's kernels run) and, after ``world`` hops, comes home to the block's owner. Per step a
rank sends one K/V block (input dtype) and one dK/dV block (fp32); the last K/V transfer of
each pass is skipped (nobody needs it). No rank holds more than two K/V blocks and two dK/dV
blocks at once, nothing N x N. Memory per rank, in units of one fp32 shard of q (heads_k =
heads, float32 inputs): forward 6 (fp32 out, two K/V buffers, a call's fp32 out), backward 12
(fp32 dQ, two dK/dV, two K/V, a step's dK/dV, a call's dQ) + the kernels' own workspace; 16-bit
inputs halve the K/V buffers. Zigzag steps whose calls share keys (windows, ALiBi) add one more
dK/dV scratch. A world of one allocates no ring buffers and copies nothing.

Causal masks without a window, with the block of rank s seen from rank r (``_plan.py`` has
the windowed cases):

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
from ._comm import Ring, agree, resolve_group
from ._plan import CONTIGUOUS, ZIGZAG, block_plan

__all__ = ["CONTIGUOUS", "ZIGZAG", "block_plan", "merge_block", "ring_flash_attn_func",
           "zigzag_ring_flash_attn_func"]

_TAG_KV, _TAG_DKV = 1, 2
F32 = torch.float32


def check_options(dropout_p, window_size, causal, alibi_slopes, q, **options):
    """flash-attn's options, checked by the single-process op's checks (``options``: its other
    keywords, ``softmax_scale=``, ``deterministic=``, ...): (window (left, right) with causal folded
    in, -1 = no limit; ALiBi slopes as the kernels read them, or None)."""
    checked = _blocks.flash_options(q.shape[-1], dropout_p=dropout_p, window_size=window_size, causal=causal,
                                    **options)
    window = _blocks.window_pair(window_size, checked.causal)
    slopes = _blocks.alibi_slopes(alibi_slopes, q)
    if q.device.type == "cuda" and (window not in ((-1, -1), (-1, 0)) or slopes is not None):
        raise NotImplementedError("ring attention on CUDA tensors supports full and causal attention only (the CUDA "
                                  "kernels have no sliding window or ALiBi yet)")
    return window, slopes


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one call's (out, lse) into the running fp32 (out, lse), in place.

    out (B, n, H, D) float32, lse (B, H, n) float32 (views are fine); block_out float32, used as
    scratch (overwritten), block_lse float32. -inf LSEs (rows that saw no key) merge without NaN.
    """
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(nan=0.0)  # -inf - -inf: neither saw a key
    lse.copy_(torch.logaddexp(lse, block_lse))
    block_out.sub_(out).mul_(weight.transpose(1, 2).unsqueeze(-1))
    out.add_(block_out)


class _Written:
    """Which local rows (or keys) of a sum have been written: the first call to reach a row
    writes it in place, later ones add (or merge) into it. Rows a later call reaches that no one
    wrote are first set by ``fill`` (0; the forward's lse -inf), so adding is exact."""

    def __init__(self):
        self.done: list[tuple[int, int]] = []

    def _missing(self, rows: slice) -> list[slice]:
        parts, start = [], rows.start
        for a, b in sorted(self.done):
            if b > start and a < rows.stop:
                if a > start:
                    parts.append(slice(start, a))
                start = max(start, b)
        if start < rows.stop:
            parts.append(slice(start, rows.stop))
        return parts

    def claim(self, rows: slice, fill) -> bool:
        """True: no row of ``rows`` was written (write them); False: add into them."""
        missing = self._missing(rows)
        self.done.append((rows.start, rows.stop))
        if missing == [rows]:
            return True
        for part in missing:
            fill(part)
        return False

    def written(self) -> list[slice]:
        """The written rows, as disjoint slices."""
        merged: list[list[int]] = []
        for a, b in sorted(self.done):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [slice(a, b) for a, b in merged]

    def complete(self, n: int, fill) -> None:
        """Fill the rows nobody wrote (none after a step 0: every token sees itself)."""
        for part in self._missing(slice(0, n)):
            fill(part)
        self.done = [(0, n)]


def _kv_buffer(k, v, world: int):
    """K and V in one buffer (one message per step); a world of one sends nothing: no copy."""
    return torch.stack((k, v)) if world > 1 else (k, v)


def _plan(layout: int, rank: int, source: int, world: int, n: int, window, slopes):
    return block_plan(layout, rank, source, world, n, tuple(window), slopes is not None)


def _ring_forward(q, k, v, scale: float, window, slopes, layout: int, deterministic: bool, group):
    ring = Ring(group, q.device, "forward")
    rank, world = ring.rank, ring.world
    batch, n, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=F32, device=q.device)  # fp32 running output and LSE
    lse = torch.empty((batch, heads, n), dtype=F32, device=q.device)
    written = _Written()

    def fill(rows):
        out[:, rows] = 0.0
        lse[:, :, rows] = float("-inf")

    kv = _kv_buffer(k, v, world)
    spare = torch.empty_like(kv) if world > 1 else None
    stats = _Stats(ring)
    for step in range(world):
        pending = ring.start(kv, spare, "K/V blocks", step, _TAG_KV) if step + 1 < world else None
        calls = _plan(layout, rank, (rank - step) % world, world, n, window, slopes)
        if calls:
            with stats.compute(calls=len(calls)):
                for call in calls:
                    rows, keys = call.rows, call.keys
                    args = (q[:, rows], kv[0][:, keys], kv[1][:, keys], scale, call.diagonal, call.window, slopes,
                            deterministic)
                    if written.claim(rows, fill):
                        lse[:, :, rows] = _blocks.block_forward(*args, out=out[:, rows])[1]
                    else:
                        block_out, block_lse = _blocks.block_forward(*args)
                        merge_block(out[:, rows], lse[:, :, rows], block_out, block_lse)
                        del block_out, block_lse
        if step == 0:
            written.complete(n, fill)
        if pending is not None:
            ring.wait(pending)
            kv, spare = spare, kv
    return out.to(q.dtype), lse, stats.done()


class _Stats:
    """What one ring call did on this rank (for the benchmarks): bytes and messages sent, time
    blocked waiting for transfers, blocks computed (steps with at least one kernel call), kernel
    calls, and the time spent on them (meaningful for CPU tensors; CUDA kernels run
    asynchronously)."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.blocks = 0
        self.calls = 0
        self.compute_s = 0.0

    @contextlib.contextmanager
    def compute(self, calls: int = 0):
        start = time.perf_counter()
        yield
        self.compute_s += time.perf_counter() - start
        self.blocks += calls > 0
        self.calls += calls

    def done(self) -> dict:
        return {"bytes_sent": self.ring.bytes_sent, "messages": self.ring.messages, "wait_s": self.ring.wait_s,
                "blocks": self.blocks, "calls": self.calls, "compute_s": self.compute_s, "world": self.ring.world}


def _flat_view(buffer: torch.Tensor, shape) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return buffer[:numel].view(shape)


class _Scratch:
    """Flat fp32 buffers of a given size, made on first use, for gradients that are added."""

    def __init__(self, numel: int, device):
        self.numel, self.device, self.buffer = numel, device, None

    def view(self, shape) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=F32, device=self.device)
        return _flat_view(self.buffer, shape)


def _ring_backward(dout, q, k, v, out, lse, scale: float, window, slopes, layout: int, deterministic: bool, group):
    ring = Ring(group, q.device, "backward")
    rank, world = ring.rank, ring.world
    n = q.shape[1]
    # fp32 sums: dq, and dk/dv of the block held now (first our own). The first call to reach
    # rows (keys) of a sum writes them in place; later calls' gradients go to scratch and are added.
    dq = torch.empty(q.shape, dtype=F32, device=q.device)
    dkv = torch.empty((2, *k.shape), dtype=F32, device=q.device)
    dkv_spare = torch.empty_like(dkv) if world > 1 else None
    step_dkv = None  # steps > 0: this step's dk/dv of the held block, added to its sums on arrival
    kv = _kv_buffer(k, v, world)
    kv_spare = torch.empty_like(kv) if world > 1 else None
    scratch_q, scratch_k, scratch_v = (_Scratch(t.numel(), q.device) for t in (q, k, k))
    dq_written = _Written()

    def zero_dq(rows):
        dq[:, rows] = 0.0

    stats = _Stats(ring)
    dkv_pending = None
    for step in range(world):
        kv_pending = ring.start(kv, kv_spare, "K/V blocks", step, _TAG_KV) if step + 1 < world else None
        calls = _plan(layout, rank, (rank - step) % world, world, n, window, slopes)
        if step == 0:
            sums = dkv
        elif calls:
            sums = step_dkv = torch.empty_like(dkv) if step_dkv is None else step_dkv
        keys_written = _Written()

        def zero_keys(keys):
            sums[:, :, keys] = 0.0

        if calls:
            with stats.compute(calls=len(calls)):
                for call in calls:
                    rows, keys = call.rows, call.keys
                    qb, kb, vb = q[:, rows], kv[0][:, keys], kv[1][:, keys]
                    direct_q, direct_kv = dq_written.claim(rows, zero_dq), keys_written.claim(keys, zero_keys)
                    dq_b = dq[:, rows] if direct_q else scratch_q.view(qb.shape)
                    dk_b, dv_b = ((sums[0][:, keys], sums[1][:, keys]) if direct_kv
                                  else (scratch_k.view(kb.shape), scratch_v.view(vb.shape)))
                    _blocks.block_backward(dout[:, rows], qb, kb, vb, out[:, rows], lse[:, :, rows], scale,
                                           call.diagonal, call.window, dq_b, dk_b, dv_b, slopes, deterministic)
                    if not direct_q:
                        dq[:, rows] += dq_b
                    if not direct_kv:
                        sums[0][:, keys] += dk_b
                        sums[1][:, keys] += dv_b
        if step == 0:  # every row and key has been written (a token sees itself); else zeros
            dq_written.complete(n, zero_dq)
            keys_written.complete(n, zero_keys)
        if dkv_pending is not None:  # the sums for the block we now hold, from the previous rank
            ring.wait(dkv_pending)
            dkv, dkv_spare = dkv_spare, dkv
        if calls and step > 0:
            with stats.compute():  # add this step's gradients of the held block to its sums
                for keys in keys_written.written():
                    dkv[:, :, keys] += step_dkv[:, :, keys]
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
    def forward(ctx, q, k, v, scale, window, slopes, layout, deterministic, group):
        out, lse, stats = _ring_forward(q, k, v, scale, window, slopes, layout, deterministic, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, window, slopes, layout, deterministic, group)
        ctx.mark_non_differentiable(lse)
        last_call_stats["forward"] = stats
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, stats = _ring_backward(_blocks.kernel_layout(dout), q, k, v, out, lse, *ctx.args)
        last_call_stats["backward"] = stats
        return dq, dk, dv, None, None, None, None, None, None


# What this process's last ring forward and backward did (``_Stats.done()``; benchmarks, tests).
last_call_stats: dict[str, dict] = {}


def _validate(q, k, v, dropout_p, window_size, causal, alibi_slopes, layout: int, **options):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _blocks.check_inputs(q, k, v)
    window, slopes = check_options(dropout_p, window_size, causal, alibi_slopes, q, **options)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention over one sharded sequence: q and k must hold "
                         f"the same tokens, got local lengths {q.shape[1]} and {k.shape[1]}")
    if q.shape[1] == 0 or q.shape[0] == 0:
        raise ValueError(f"every rank's shard must hold at least one token and one batch entry, got q shape "
                         f"{tuple(q.shape)}")
    if layout == ZIGZAG and q.shape[1] % 2:
        raise ValueError(f"zigzag layout: each rank holds two chunks of equal length, so its shard length must "
                         f"be even, got {q.shape[1]} (shard with zigzag_shard)")
    return window, slopes


def _attention(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_attn_probs, group):
    group = resolve_group(group)
    local_error, scale, window, slopes = None, None, (-1, -1), None
    try:
        window, slopes = _validate(q, k, v, dropout_p, window_size, causal, alibi_slopes, layout,
                                   softmax_scale=softmax_scale, deterministic=deterministic,
                                   return_attn_probs=return_attn_probs)
        scale = _blocks.softmax_scale(softmax_scale, q.shape[-1])
    except (TypeError, ValueError, NotImplementedError) as err:
        local_error = err
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    agree(group, q, k, v, scale, bool(causal), layout, bool(deterministic), local_error, device, window, slopes)
    q, k, v = (_blocks.kernel_layout(t) for t in (q, k, v))
    out, lse = _RingFlashAttn.apply(q, k, v, scale, window, slopes, layout, bool(deterministic), group)
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
    ``(batch, heads, n)`` float32, the global LSE of these rows). Masks and ALiBi are those of
    ``flash_attn_func`` on the whole sequence (N x N, so bottom-right alignment is the plain
    diagonal): ``causal``, ``window_size = (left, right)`` (query p sees key t iff ``p - left
    <= t <= p + right``; -1 = no limit) and ``alibi_slopes`` ((heads,) or (batch, heads) float32,
    the same on every rank; bias ``-slope * |p - t|``). Blocks the mask leaves empty are not
    computed (their K/V still travel). ``dropout_p`` must be 0. ``deterministic`` is passed to
    the kernels (CPU: always deterministic; the ring's order of summation is fixed). With
    ``causal=True`` the load is unbalanced (rank r computes r + 1 blocks): prefer
    ``zigzag_ring_flash_attn_func``. CUDA tensors: full and causal attention only (no window or
    ALiBi in the CUDA kernels yet).

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
    arguments and results as ``ring_flash_attn_func``; with ``causal=True`` each rank computes one
    causal diagonal block and world - 1 half blocks. Windows and ALiBi apply to the global
    positions of both chunks (``_plan.py``: a step may take one kernel call per pair of chunks).
    With ``causal=False``, no window and no ALiBi the order of tokens does not matter and this is
    the plain ring.
    """
    return _attention(ZIGZAG, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs, group)
