"""Which kernel calls one ring step makes: the global mask and ALiBi distances, cut exactly.

Each rank holds its tokens as *segments* of the global sequence: one (contiguous layout: rank r
holds r*n ... (r+1)*n - 1) or two (zigzag: chunks r and 2w-1-r of 2w chunks, n/2 tokens each,
at local rows 0 and n/2). A ring step pairs this rank's query segments with the held block's
key segments: up to 2 x 2 *cells*. Inside a cell (queries at global position p + i, keys at
t + j) the mask depends on the offset d = j - i only: with the cell's diagonal e = p - t (what
the kernels call ``diagonal``), query i sees key j iff ``e - left <= d <= e + right``
(flash-attn's window, bottom-right aligned over the whole sequence: causal is right = 0, -1 is
no limit), and ALiBi adds ``-slope * |e - d|``.

A kernel call covers a rectangle of cells (contiguous local rows x contiguous local keys) and
applies one band in its own coordinates: query i sees key j iff ``diagonal - left' <= j - i <=
diagonal + right'``. A cell at offset c = (its first key - its first query) inside the call
sees the offsets d with ``lo - c <= d <= hi - c`` (lo = diagonal - left', hi = diagonal +
right'). The call is *exact* when, for each of its cells, that set equals the cell's visible
set on the offsets the cell has (``-(rows - 1) ... keys - 1``: integer intervals, compared
directly, so the check holds at every size), and with ALiBi when ``diagonal = c + e`` for every
cell that sees anything (the kernels' distance |i + diagonal - j| is then the global one).

``block_plan`` tries the groupings of the cells (all in one call; one call per query segment;
one per key segment; one per cell), drops cells that see nothing from the edges of each group,
and keeps the grouping with the fewest calls whose every call is exact. One call per cell is
always exact (c = 0, the cell's own diagonal and window), so a plan always exists; a cell that
sees nothing is never computed, and a step whose cells all see nothing makes no call (its K/V
block still travels). The plans that matter:

- full attention, any layout: one call (the whole block, no mask); zigzag with ALiBi: one call
  per cell whose chunks are not globally adjacent (4, 2 or 1).
- causal, no window: contiguous, block s of rank r: s == r the causal diagonal, s < r the whole
  block unmasked, s > r nothing. Zigzag: s == r one causal call over both chunks (the first
  chunk's keys come before the second chunk's queries, so the local order is the global one);
  s < r both local chunks against chunk s (unmasked), nothing of chunk 2w-1-s; s > r only chunk
  2w-1-r, against the whole block (unmasked). One diagonal + w - 1 half blocks per rank.
- sliding windows: a cell whose offsets all fall outside the band is skipped. With a causal
  window of left <= n/2 (a chunk) in the zigzag layout, chunk a meets only chunks a and a - 1:
  rank r computes its own chunks (step 0), chunk r against chunk r - 1 (rank r - 1's first
  chunk, step 1) and chunk 2w-1-r against chunk 2w-2-r (rank r + 1's second chunk, step w - 1);
  the last rank's two chunks are adjacent (w - 1, w), one call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .shard import zigzag_chunks

CONTIGUOUS, ZIGZAG = 0, 1
INF = math.inf


@dataclass(frozen=True)
class Segment:
    local: int  # first row in the rank's shard
    start: int  # first position in the global sequence
    length: int


@dataclass(frozen=True)
class Call:
    """One kernel call: ``rows`` of this rank's queries against ``keys`` of the held block, with
    flash-attn's ``window`` (left, right; -1 = no limit) around ``diagonal`` (the key query 0
    is aligned with)."""
    rows: slice
    keys: slice
    diagonal: int
    window: tuple[int, int]


def segments(layout: int, rank: int, world: int, n: int) -> tuple[Segment, ...]:
    """Where rank ``rank``'s ``n`` tokens sit in the global sequence."""
    if layout == CONTIGUOUS:
        return (Segment(0, rank * n, n),)
    half = n // 2
    first, second = zigzag_chunks(rank, world)
    return Segment(0, first * half, half), Segment(half, second * half, half)


def _limit(x: int) -> float:
    return INF if x < 0 else x


def _visible(lo: float, hi: float, rows: int, keys: int) -> tuple[float, float]:
    """The offsets d = j - i in [lo, hi] that a rows x keys cell has (empty: first > second)."""
    return max(lo, -(rows - 1)), min(hi, keys - 1)


def _same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return (a[0] > a[1] and b[0] > b[1]) or a == b


@dataclass(frozen=True)
class _Cell:
    q: Segment
    k: Segment
    diagonal: int  # e = q.start - k.start
    visible: tuple[float, float]  # offsets d = j - i this cell sees

    @property
    def empty(self) -> bool:
        return self.visible[0] > self.visible[1]


def _cell(q: Segment, k: Segment, left: float, right: float) -> _Cell:
    e = q.start - k.start
    return _Cell(q, k, e, _visible(e - left, e + right, q.length, k.length))


def _solve(cells: list[_Cell], left: float, right: float, alibi: bool) -> Call | None:
    """One exact call for these cells (a rectangle of adjacent segments), or None."""
    rows = slice(min(c.q.local for c in cells), max(c.q.local + c.q.length for c in cells))
    keys = slice(min(c.k.local for c in cells), max(c.k.local + c.k.length for c in cells))
    offset = {c: (c.k.local - keys.start) - (c.q.local - rows.start) for c in cells}
    seeing = [c for c in cells if not c.empty]
    natural = {offset[c] + c.diagonal for c in seeing}
    if alibi and len(natural) > 1:
        return None  # distances would be off in some cell
    los = [-INF] + sorted({offset[c] + c.diagonal - left for c in seeing if left != INF})
    his = [INF] + sorted({offset[c] + c.diagonal + right for c in seeing if right != INF})
    first = offset[seeing[0]] + seeing[0].diagonal
    for lo in los:
        for hi in his:
            if lo > hi or (alibi and not lo <= first <= hi):
                continue
            if all(_same(_visible(lo - offset[c], hi - offset[c], c.q.length, c.k.length), c.visible)
                   for c in cells):
                diagonal = int(min(max(first, lo), hi))  # ALiBi: exactly `first` (checked above)
                window = (-1 if lo == -INF else int(diagonal - lo), -1 if hi == INF else int(hi - diagonal))
                return Call(rows, keys, diagonal, window)
    return None


def _groupings(nq: int, nk: int):
    every_q, every_k = tuple(range(nq)), tuple(range(nk))
    yield [(every_q, every_k)]
    if nq > 1:
        yield [((a,), every_k) for a in every_q]
    if nk > 1:
        yield [(every_q, (b,)) for b in every_k]
    if nq > 1 and nk > 1:
        yield [((a,), (b,)) for a in every_q for b in every_k]


@functools.lru_cache(maxsize=4096)
def block_plan(layout: int, rank: int, source: int, world: int, n: int, window: tuple[int, int] = (-1, -1),
               alibi: bool = False) -> tuple[Call, ...]:
    """The kernel calls of rank ``rank`` against rank ``source``'s K/V block (``n`` tokens
    each), for flash-attn's ``window`` over the whole sequence (causal folded in as right = 0)
    and ALiBi or not. Empty: nothing of the block is visible."""
    left, right = (_limit(x) for x in window)
    qs, ks = segments(layout, rank, world, n), segments(layout, source, world, n)
    grid = {(a, b): _cell(qs[a], ks[b], left, right) for a in range(len(qs)) for b in range(len(ks))}
    best = None
    for grouping in _groupings(len(qs), len(ks)):
        calls = []
        for part_q, part_k in grouping:
            # drop query / key segments that see nothing in this part (the edges of a 2 x 2 grid)
            part_q = [a for a in part_q if any(not grid[a, b].empty for b in part_k)]
            part_k = [b for b in part_k if any(not grid[a, b].empty for a in part_q)]
            if not part_q:
                continue
            call = _solve([grid[a, b] for a in part_q for b in part_k], left, right, alibi)
            if call is None:
                break
            calls.append(call)
        else:
            if best is None or len(calls) < len(best):
                best = calls
    return tuple(best)
