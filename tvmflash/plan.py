"""Launch planning for the CPU kernels: sequence tables, work split, scratch memory (no TVM).

Every CPU kernel call describes its sequences with a small int32 table, so that one compiled
kernel serves batched tensors ``(batch, seqlen, heads, dim)`` and packed "varlen" sequences
``(total, heads, dim)`` with ``cu_seqlens`` alike:

``table[b] = (q_batch, q_start, q_len, k_batch, k_start, k_len, q_tile0, k_tile0, k_super0,
diagonal)``: where sequence ``b``'s queries and keys sit in the tensors (batch index, first row,
length), the index of its first query tile, key tile and key super tile in the kernels' global
numbering, and the key that query 0 is aligned with (masks and ALiBi: query q's diagonal is key
q + diagonal; ``k_len - q_len`` for flash-attn's bottom-right alignment, other values for blocks
of a longer sequence, as in ring attention). ``q_tile_seq``/``k_tile_seq``/``k_super_seq`` map
global tiles back to sequences.

The backward runs in *rounds* (kernels/cpu.py): in round r, key super tile J of a sequence with M
super tiles meets query super tile (J + r) mod M, so no two tasks of a round touch the same
query or key rows and every gradient is summed in an order fixed by the problem, not by the
thread count. A super tile is ``super_tile`` tiles; it depends on the problem size only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .config import AMX, BF16_OPERANDS, FP32_FMA

Q_BATCH, Q_START, Q_LEN, K_BATCH, K_START, K_LEN, Q_TILE0, K_TILE0, K_SUPER0, DIAGONAL = range(10)
TABLE_COLUMNS = 10
# Pair tasks per backward round worth having: enough for this many threads.
PARALLEL_TASKS = 64
SUPER_TILES = (8, 4, 2, 1)


@dataclass(frozen=True)
class Sequences:
    table: np.ndarray  # (sequences, TABLE_COLUMNS) int32
    q_tile_seq: np.ndarray  # (query tiles,) int32
    k_tile_seq: np.ndarray  # (key tiles,) int32
    k_super_seq: np.ndarray  # (key super tiles,) int32
    super_tile: int
    rounds: int  # backward rounds: max over sequences of max(query, key) super tiles

    @property
    def count(self) -> int:
        return int(self.table.shape[0])

    @property
    def max_key_tiles(self) -> int:
        """Key tiles of the longest key sequence (the CUDA backward's blocks per sequence)."""
        return int(np.bincount(self.k_tile_seq, minlength=1).max()) if self.key_tiles else 0

    @property
    def query_tiles(self) -> int:
        return int(self.q_tile_seq.shape[0])

    @property
    def key_tiles(self) -> int:
        return int(self.k_tile_seq.shape[0])

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.table, self.q_tile_seq, self.k_tile_seq, self.k_super_seq


# Tile states: block masks store them per tile (int8, flex.tile_maps), the kernels compute the
# window's and read the stored ones.
EMPTY, PARTIAL, FULL = 0, 1, 2


def ceildiv(a, b):
    """ceil(a / b) for b > 0: Python ints and TIR expressions alike."""
    return (a + b - 1) // b


def super_tile_size(key_tiles: int, heads_k: int) -> int:
    """Tiles per backward super tile: the largest that leaves PARALLEL_TASKS pair tasks per
    round (bigger super tiles reuse each loaded tile more), a function of the problem alone."""
    for size in SUPER_TILES:
        if heads_k * key_tiles >= PARALLEL_TASKS * size:
            return size
    return 1


def sequences(q_starts, q_lens, k_starts, k_lens, *, packed: bool, block_q: int, block_k: int,
              heads_k: int, diagonal=None, rows=None) -> Sequences:
    """The table for sequences at the given rows (packed: all in batch row 0; else sequence b in
    batch row b, or in ``rows[b]``: several sequences may share a row)."""
    q_lens, k_lens = np.asarray(q_lens, np.int64), np.asarray(k_lens, np.int64)
    count = len(q_lens)
    q_tiles, k_tiles = ceildiv(q_lens, block_q), ceildiv(k_lens, block_k)
    key_tiles = int(k_tiles.sum())
    size = super_tile_size(key_tiles, heads_k)
    k_supers, q_supers = ceildiv(k_tiles, size), ceildiv(q_tiles, size)
    table = np.zeros((count, TABLE_COLUMNS), np.int64)
    batch = np.zeros(count, np.int64) if packed else np.arange(count) if rows is None else np.asarray(rows, np.int64)
    table[:, Q_BATCH], table[:, K_BATCH] = batch, batch
    table[:, Q_START], table[:, K_START] = q_starts, k_starts
    table[:, Q_LEN], table[:, K_LEN] = q_lens, k_lens
    table[:, Q_TILE0] = np.cumsum(q_tiles) - q_tiles
    table[:, K_TILE0] = np.cumsum(k_tiles) - k_tiles
    table[:, K_SUPER0] = np.cumsum(k_supers) - k_supers
    table[:, DIAGONAL] = k_lens - q_lens if diagonal is None else diagonal
    if np.abs(table).max(initial=0) >= 2**31:
        raise ValueError("sequences too long for the kernels' int32 tables (2^31 rows)")
    index = np.arange(count, dtype=np.int32)
    rounds = int(np.maximum(q_supers, k_supers).max(initial=0))
    return Sequences(table.astype(np.int32), np.repeat(index, q_tiles), np.repeat(index, k_tiles),
                     np.repeat(index, k_supers), size, rounds)


def batched(batch: int, seqlen_q: int, seqlen_k: int, *, block_q: int, block_k: int, heads_k: int,
            diagonal: int | None = None) -> Sequences:
    zeros = np.zeros(batch, np.int64)
    return sequences(zeros, np.full(batch, seqlen_q), zeros, np.full(batch, seqlen_k), packed=False,
                     block_q=block_q, block_k=block_k, heads_k=heads_k, diagonal=diagonal)


def varlen(cu_seqlens_q, cu_seqlens_k, *, block_q: int, block_k: int, heads_k: int) -> Sequences:
    """Packed sequences: sequence b holds rows cu_seqlens[b] ... cu_seqlens[b + 1] - 1."""
    cu_q, cu_k = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    return sequences(cu_q[:-1], np.diff(cu_q), cu_k[:-1], np.diff(cu_k), packed=True,
                     block_q=block_q, block_k=block_k, heads_k=heads_k)


# --- scratch memory --------------------------------------------------------------------------
F32, I64 = 4, 8


def forward_workspace_bytes(seqs: Sequences, *, heads: int, heads_k: int, head_dim: int, block_q: int,
                            block_k: int, threads: int, products: str = FP32_FMA) -> int:
    """K and V packed (zero-padded tiles), plus each thread's tile buffers. K and V take 4 bytes
    per element as fp32 and 2 as bf16 operands (``products`` bf16_dot or amx: bits and pair
    words), which also halve the query tile and add P's pair words; AMX's products add into O
    (no tile of P V) and keep one more state slot (whether a max moved)."""
    bf16, amx = products in BF16_OPERANDS, products == AMX
    operand = 2 if bf16 else F32  # bytes per element of a packed operand
    packed = 2 * heads_k * seqs.key_tiles * block_k * head_dim * operand
    # O (and P V), S and P, six row vectors; state and task indices
    per_thread = ((1 if amx else 2) * head_dim * block_q + 2 * block_k * block_q + 6 * block_q) * F32
    per_thread += (7 if amx else 6) * I64
    per_thread += head_dim * block_q * operand + (block_k * block_q * 2 if bf16 else 0)
    return packed + threads * per_thread


def backward_workspace_bytes(seqs: Sequences, *, heads: int, heads_k: int, head_dim: int, block_q: int,
                             block_k: int, threads: int, grad_input_elements: int = 1, score_mods: bool = False,
                             products: str = FP32_FMA) -> int:
    """Q and dO packed with their row statistics, K, K^T and V^T packed, the fp32 dQ, dK and dV
    accumulators: 3 fp32 copies of q and 5 of k at any thread count (bf16 products: Q and dO
    twice as 2-byte operands, rows and pairs of rows: still 3 of q; K, K^T, V^T as 2-byte pair
    words: 3.5 of k). Per thread: its tile buffers (bf16: plus P and dS as pair words, dS as
    bf16) and its partial gradients of captured tensors (all of them, one row)."""
    bf16_products, amx = products in BF16_OPERANDS, products == AMX  # (AMX: no dK, dV tiles of one query tile)
    rows_q = heads * seqs.query_tiles * block_q
    rows_k = heads_k * seqs.key_tiles * block_k
    operand = 2 if bf16_products else F32
    shared = (rows_q * head_dim + 3 * rows_q + 2 * rows_k * head_dim + 1) * F32  # (+1: the LSE check's max)
    shared += (4 if bf16_products else 2) * rows_q * head_dim * operand + 3 * rows_k * head_dim * operand
    tiles = ((4 + score_mods) * block_q * block_k + (2 if amx else 4) * block_k * head_dim + block_q * head_dim
             + 3 * block_q)
    per_thread = (tiles + grad_input_elements) * F32 + 6 * I64 + (3 * block_q * block_k * 2 if bf16_products else 0)
    return shared + threads * per_thread


# --- decoding against a KV cache (kernels/decode.py) ---------------------------------------------
# seq_info[b] = (k_start, k_end, first unit, end unit);
# units[u] = (sequence, first key tile, end key tile, first kv head, end kv head)
DEC_K_START, DEC_K_END, DEC_UNIT_FIRST, DEC_UNIT_END = range(4)
DECODE_SEQ_COLUMNS = 4
DEC_U_SEQ, DEC_U_TILE_FIRST, DEC_U_TILE_END, DEC_U_HEAD_FIRST, DEC_U_HEAD_END = range(5)
DECODE_UNIT_COLUMNS = 5
# Automatic splits (num_splits=0): about this many units (tasks: every kv head of a split) per
# thread, so that the cyclic distribution over threads stays balanced, and units of at least this
# many key tiles.
DECODE_TASKS_PER_THREAD = 8
DECODE_MIN_SPLIT_TILES = 4
# A unit reads the kv heads of a group together, a key tile at a time (this many bytes of keys
# at most, unless one head alone is more): the tile, this tile's values and the next tile's keys
# (prefetched) live in L2 together. 256 KB keeps the 8 kv heads of 128 fp32 dims together (on
# Zen 4, groups of 4 or 2 of them were slower: each unit then reads 2 KB or 1 KB of every 4 KB
# cache row); it splits caches with many more heads.
DECODE_TILE_BYTES = 256 * 1024


def decode_head_group(heads_k: int, block_k: int, head_dim: int, elem_bytes: int) -> int:
    """kv heads a unit reads together: as many as fit ``DECODE_TILE_BYTES`` per key tile."""
    return max(1, min(heads_k, DECODE_TILE_BYTES // (block_k * head_dim * elem_bytes)))


def decode_units(k_start, k_end, *, seqlen_q: int, window: tuple[int, int], block_k: int, heads_k: int,
                 threads: int, num_splits: int = 0, head_group: int | None = None,
                 seq_info: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The tables of one ``flash_decode`` call: which key tiles each sequence's queries can see
    (keys ``k_start <= k < k_end``, the window bottom-right aligned at ``k_end - seqlen_q``), cut
    into units (one kernel task each): a split of the tiles times a group of ``head_group`` kv
    heads (default all). ``num_splits`` > 0: that many splits per sequence (fewer if it has
    fewer tiles); 0: splits of equal size, about ``DECODE_TASKS_PER_THREAD`` units per thread.
    Plain Python: a decode step calls this every token, and numpy's per-call overhead on a few
    sequences was ~100 us. The units depend on the visible tiles only, which change once per
    ``block_k`` tokens of a growing cache: they are memoized (the returned units array is shared:
    read it, never write it). ``seq_info``: a (batch, DECODE_SEQ_COLUMNS) int32 array to fill in
    place of a new one (a repeated decode step's own)."""
    group = heads_k if head_group is None else max(1, min(head_group, heads_k))
    bounds = [(int(start), int(end)) for start, end in zip(k_start, k_end)]
    if max((abs(x) for pair in bounds for x in pair), default=0) >= 2**31:
        raise ValueError("sequences too long for the kernels' int32 tables (2^31 keys)")
    spans = visible_tiles(bounds, seqlen_q, window, block_k)
    units, unit_ranges = _split_units(spans, heads_k, group, threads, num_splits)
    rows = [(start, end, u0, u1) for (start, end), (u0, u1) in zip(bounds, unit_ranges)]
    if seq_info is None:
        return np.array(rows, np.int32).reshape(-1, DECODE_SEQ_COLUMNS), units
    seq_info[:] = rows
    return seq_info, units


def visible_tiles(bounds, seqlen_q: int, window: tuple[int, int], block_k: int) -> tuple:
    """Each sequence's (first key tile, tile count) that its queries can see, for (start, end) int
    pairs: what the units depend on (a growing cache's new end changes them once per key tile)."""
    left, right = window
    return tuple(_visible_tiles(start, end, seqlen_q, left, right, block_k) for start, end in bounds)


def _visible_tiles(start: int, end: int, seqlen_q: int, left: int, right: int, block_k: int) -> tuple[int, int]:
    """(first key tile, tile count) that queries of a sequence with keys [start, end) can see."""
    lo = max(start, end - seqlen_q - left, 0)
    hi = min(end, end + right)
    first = lo // block_k
    return first, (ceildiv(hi, block_k) - first if hi > lo else 0)


@functools.lru_cache(maxsize=1024)
def _split_units(spans: tuple, heads_k: int, group: int, threads: int, num_splits: int):
    """The unit table for sequences seeing ``spans`` (first tile, tiles), and each sequence's
    [first, end) unit range."""
    groups = [(h, min(h + group, heads_k)) for h in range(0, heads_k, group)]
    if num_splits <= 0:
        total = sum(tiles for _, tiles in spans) * len(groups)
        chunk = max(DECODE_MIN_SPLIT_TILES, ceildiv(total, max(1, threads * DECODE_TASKS_PER_THREAD)))
    units, ranges = [], []
    for b, (first, tiles) in enumerate(spans):
        if num_splits > 0:
            chunk = ceildiv(tiles, max(1, min(tiles, num_splits)))
        unit0 = len(units)
        units += [(b, t, min(t + chunk, first + tiles), h0, h1)
                  for t in range(first, first + tiles, max(chunk, 1)) for h0, h1 in groups]
        ranges.append((unit0, len(units)))
    return np.array(units, np.int32).reshape(-1, DECODE_UNIT_COLUMNS), tuple(ranges)
