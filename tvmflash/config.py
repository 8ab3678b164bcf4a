"""How a fused kernel is tiled: one frozen config per kernel (pure Python, no TVM).

``CPUKernelConfig`` holds every choice of a CPU kernel's loop nest and schedule: the tile shape
(``block_q`` x ``block_k``, which the kernel's loops are built around), how the matrix products
run (``products``) and the schedule's knobs (vector lanes, the register tile of each matrix
product). The hand-written defaults follow from the ISA and the input dtype; the autotuner
searches the same fields; ``compiler.choose_configs`` is the one place that decides which config
a compile uses (tuned record or default).

``products``: ``"fp32_fma"`` converts the operands to fp32 tiles and multiplies with fp32 FMAs
(any x86 CPU, any input dtype); ``"bf16_dot"`` keeps bf16 inputs in bf16 and multiplies with
AVX512-BF16's ``vdpbf16ps`` (two bf16 products summed into each fp32 lane: twice the FMA's
FLOPs per instruction), rounding P and dS to bf16 as product inputs only (row statistics and
accumulators stay fp32). It needs bf16 inputs and a CPU with AVX512-BF16
(``target.supports_bf16_dot``), and is the default where it multiplies faster than the FMAs
(``product_rates``: on some Xeons it issues at half their rate). fp16
inputs use fp32 FMAs: no CPU of this project has an fp16 product that accumulates in fp32
(AVX512-FP16 accumulates in fp16). ``"amx"`` runs the bf16 products on Intel's AMX tiles
(``tdpbf16ps``: a 16 x 16 fp32 tile += 16 x 32 bf16 times 32 x 16 bf16, ~10x the FMAs' FLOP
rate), the same bf16 operands and rounding as ``"bf16_dot"``; tile edges and the head dim are
multiples of 16 (``target.supports_amx``, ``amx.request_tile_permission``).

Defaults: AVX-512 has 32 vector registers of 16 floats, AVX2 16 of 8; an FMA has a latency of ~4
cycles and two issue ports, so at least 8 independent accumulators keep both busy, and
accumulators + operands must fit the register file. Measured (DEVELOPING.md): 16 accumulators,
4 x 4 vectors in the forward and 8 x 2 in the backward on AVX-512; 4 x 2 on AVX2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# The matrix products of each kernel, (row, col, reduction) blocks named as in kernels/cpu.py.
PRODUCTS = {"forward": ("scores", "pv"), "backward": ("scores", "dv", "dprobs", "dk", "dq")}
KERNELS = tuple(PRODUCTS)
MAX_TILE_ROWS = 8
MAX_TILE_VECTORS = 4
FP32_FMA, BF16_DOT, AMX = "fp32_fma", "bf16_dot", "amx"
PRODUCT_KINDS = (FP32_FMA, BF16_DOT, AMX)
BF16_OPERANDS = (BF16_DOT, AMX)  # the products that keep bf16 inputs as bf16 operands
AMX_TILE = 16  # rows and fp32 columns of an AMX tile: tile edges and head dims are multiples of it


@dataclass(frozen=True)
class RegisterTile:
    rows: int
    vectors: int  # accumulator vectors per row


@dataclass(frozen=True)
class CPUKernelConfig:
    kernel: str  # "forward" or "backward"
    block_q: int = 64  # query rows per tile
    block_k: int = 64  # key rows per tile
    lanes: int = 16  # fp32 lanes of one vector register
    tiles: tuple = ()  # ((product, RegisterTile), ...) for every product of the kernel
    products: str = FP32_FMA  # how the matrix products run: one of PRODUCT_KINDS

    def __post_init__(self):
        if self.kernel not in PRODUCTS:
            raise ValueError(f"unknown kernel {self.kernel!r}: one of {KERNELS}")
        if self.products not in PRODUCT_KINDS:
            raise ValueError(f"unknown products {self.products!r}: one of {PRODUCT_KINDS}")
        if self.products == BF16_DOT and (self.lanes not in (16, ARM_LANES) or self.block_q % 8 or self.block_k % 8):
            # bf16 pairs along every tile edge, 8- or 16-lane dot products (AVX-512), 4 (aarch64 BFDOT)
            raise ValueError(f"bf16_dot needs 16 lanes (4 on aarch64) and tile sizes that are multiples of 8, got lanes="
                             f"{self.lanes}, {self.block_q}x{self.block_k}")
        if self.products == AMX and (self.lanes != 16 or self.block_q % AMX_TILE or self.block_k % AMX_TILE):
            raise ValueError(f"amx needs 16 lanes and tile sizes that are multiples of {AMX_TILE}, got lanes="
                             f"{self.lanes}, {self.block_q}x{self.block_k}")
        missing = set(PRODUCTS[self.kernel]) - {name for name, _ in self.tiles}
        if missing:
            raise ValueError(f"{self.kernel} config lacks register tiles for {sorted(missing)}")

    def tile(self, product: str) -> RegisterTile:
        return dict(self.tiles)[product]

    def with_tiles(self, **tiles: RegisterTile) -> CPUKernelConfig:
        return replace(self, tiles=tuple({**dict(self.tiles), **tiles}.items()))

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "block_q": self.block_q, "block_k": self.block_k, "lanes": self.lanes,
                "tiles": {name: [t.rows, t.vectors] for name, t in self.tiles}, "products": self.products}

    @classmethod
    def from_json(cls, d: dict) -> CPUKernelConfig:
        tiles = tuple((name, RegisterTile(*rv)) for name, rv in d["tiles"].items())
        return cls(d["kernel"], int(d["block_q"]), int(d["block_k"]), int(d["lanes"]), tiles,
                   str(d.get("products", FP32_FMA)))


# Tile edges (block_q, block_k) by sequence length: a 64 x 64 tile of a 16-token sequence
# computes 16 times the real work (padding rows and keys). The forward at B1 N16 H8 D64 took
# 162 us with 64 x 64 tiles, 28.5 us with 16 x 16 (Zen 4). Up to ~200 tokens the last tile's
# padding decides (``tile_edge``; DEVELOPING.md, "Tiles for short sequences" and "Tiles between
# 32 and 200 tokens").
TILE_EDGES = (16, 32, 64)


# The bf16 backward (AMX) on seven 16-row tiles (100-110 tokens) took 10-25 % longer than on two
# 64-row ones, though they pad less; up to four of them it is faster.
SMALLEST_TILE_UP_TO = 64


def tile_edge(seqlen: int | None) -> int:
    """The tile edge for sequences of this length: the largest of ``TILE_EDGES`` whose last tile
    pads the sequence by at most an eighth of it, else the one that pads it least (the larger on
    a tie); 16 rows only up to ``SMALLEST_TILE_UP_TO`` tokens; the largest edge when the length
    is not known. What the padding costs decides between 33 and ~200 tokens: a 48-token sequence
    in 64-row tiles computes 64 x 64 scores per head where 16-row ones compute 6 x 16 x 16 (Xeon
    AMX, fp32 B4 H8/2 N48 causal: forward 270 -> 164 us, forward + backward 1171 -> 915;
    DEVELOPING.md)."""
    if seqlen is None:
        return TILE_EDGES[-1]
    edges = [edge for edge in reversed(TILE_EDGES) if edge > TILE_EDGES[0] or seqlen <= SMALLEST_TILE_UP_TO]
    for edge in edges:
        if -seqlen % edge * 8 <= seqlen:
            return edge
    return min(edges, key=lambda edge: -seqlen % edge)


def tile_class(seqlen) -> tuple[int, int]:
    """The (block_q, block_k) tile edges for ``seqlen``: None (unknown), an int (queries and keys),
    or (queries, keys). ``LONG_TILES`` serve long and unknown lengths."""
    seqlen_q, seqlen_k = seqlen if isinstance(seqlen, tuple) else (seqlen, seqlen)
    return tile_edge(seqlen_q), tile_edge(seqlen_k)


LONG_TILES = (TILE_EDGES[-1], TILE_EDGES[-1])
# every class a call can fall in (queries and keys are classed apart: a short prompt after a long cache)
TILE_CLASSES = tuple((edge_q, edge_k) for edge_q in TILE_EDGES for edge_k in TILE_EDGES)


def default_cpu_config(kernel: str, avx512: bool, products: str = FP32_FMA, seqlen_q: int | None = None,
                       seqlen_k: int | None = None) -> CPUKernelConfig:
    """The hand-written schedule's choices for a CPU with (or without) AVX-512, and tiles for
    sequences of ``seqlen_q`` queries and ``seqlen_k`` keys (``tile_edge``; unknown: 64 x 64).

    The register tiles hold 16 accumulators with either products: ``vdpbf16ps`` has a latency of
    ~6 cycles at one per cycle (Zen 4, DEVELOPING.md), so it needs >= 6 independent ones. The
    forward's products have the query tile in their vector lanes (``block_q / lanes`` vectors):
    with 16 or 32 queries its 4 x 4 tile becomes 8 x 1 or 8 x 2 (``schedules/llvm.py`` would
    otherwise cut it to 4 x 1: 4 accumulators).
    """
    block_q, block_k = tile_edge(seqlen_q), tile_edge(seqlen_k)
    if avx512:
        lanes = 16
        if kernel == "forward":
            vectors = max(1, min(4, block_q // lanes))
            tile = RegisterTile(min(MAX_TILE_ROWS, 16 // vectors), vectors)
        else:
            tile = RegisterTile(8, 2)
    else:  # AVX2: 8 accumulators + 2 loads + 1 broadcast of 16 registers
        tile, lanes = RegisterTile(4, 2), 8
    tiles = tuple((name, tile) for name in PRODUCTS[kernel])
    return CPUKernelConfig(kernel, block_q, block_k, lanes=lanes, tiles=tiles, products=products)


# aarch64: NEON's 128-bit vectors (4 fp32 lanes) and 32 vector registers
ARM_LANES = 4


def default_arm_config(kernel: str, products: str = FP32_FMA) -> CPUKernelConfig:
    """The hand-written schedule's choices for aarch64 (NEON, or SVE CPUs through NEON): 16
    accumulators of 4 lanes (the AVX-512 tiles' shapes), leaving 16 of the 32 registers for the
    loaded vectors and the broadcast; ``fmla`` / ``bfdot`` latency ~4 cycles at up to 4 per cycle
    (Neoverse V1/V2) needs >= 16 independent accumulators. Not measured on Arm hardware."""
    tile = RegisterTile(4, 4) if kernel == "forward" else RegisterTile(8, 2)
    return CPUKernelConfig(kernel, lanes=ARM_LANES, tiles=tuple((name, tile) for name in PRODUCTS[kernel]),
                           products=products)


# CUDA: the kernels' warp layout is fixed (kernels/cuda.py: 4 warps x 16 query rows per thread
# block, tiles in the mma.m16n8k16 register layout); these are the knobs around it.
CUDA_WARPS = 4
CUDA_ROWS_PER_WARP = 16
CUDA_BLOCK_Q = CUDA_WARPS * CUDA_ROWS_PER_WARP
# One vector copy between global and shared memory (CUDA) is 16 bytes: 8 fp16/bf16 elements.
VECTOR_BYTES = 16


@dataclass(frozen=True)
class CUDAKernelConfig:
    kernel: str  # "forward" or "backward" (the backward's pre-pass and dQ conversion included)
    block_k: int = 64  # key rows per tile (the backward needs block_k == CUDA_BLOCK_Q)
    vector_bytes: int = VECTOR_BYTES  # width of one global -> shared copy
    pad_bytes: int = 16  # shared-memory row padding against ldmatrix bank conflicts

    @property
    def block_q(self) -> int:
        return CUDA_BLOCK_Q

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "block_k": self.block_k, "vector_bytes": self.vector_bytes,
                "pad_bytes": self.pad_bytes}

    @classmethod
    def from_json(cls, d: dict) -> CUDAKernelConfig:
        return cls(**d)


def config_from_json(d: dict):
    """A CPU or CUDA kernel config from its JSON (CUDA configs have no register tiles)."""
    return CPUKernelConfig.from_json(d) if "tiles" in d else CUDAKernelConfig.from_json(d)


# --- decoding against a KV cache (kernels/decode.py) ---------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """The ``flash_decode`` kernel's loop nest and schedule: query rows per block (the GQA
    group's rows are processed ``block_rows`` at a time), keys per tile (a tile never straddles
    a page: paged caches need ``page_size % block_k == 0``), vector lanes of the score products
    (the head dim is split over them, then summed) and of the rest, and the register tile of
    the P . V product."""

    block_rows: int = 4
    block_k: int = 64
    score_lanes: int = 8
    lanes: int = 16
    pv: RegisterTile = RegisterTile(4, 4)
    score_keys: int = 2  # keys per register tile of the score product (x block_rows accumulators)

    kernel = "decode"

    def tile(self, product: str) -> RegisterTile:
        return {"pv": self.pv}[product]

    def to_json(self) -> dict:
        return {"kernel": "decode", "block_rows": self.block_rows, "block_k": self.block_k,
                "score_lanes": self.score_lanes, "lanes": self.lanes, "pv": [self.pv.rows, self.pv.vectors],
                "score_keys": self.score_keys}

    @classmethod
    def from_json(cls, d: dict) -> DecodeConfig:
        return cls(int(d["block_rows"]), int(d["block_k"]), int(d["score_lanes"]), int(d["lanes"]),
                   RegisterTile(*d["pv"]), int(d["score_keys"]))


def default_decode_config(avx512: bool, dtype: str = "float32") -> DecodeConfig:
    """Hand-written decode choices: 4 query rows (a GQA group of 4 heads x 1 query) at a time;
    scores as keys x 4 rows of accumulator vectors, their lanes summed by a transposing shuffle
    tree: AVX-512, 2 keys x 4 rows of 16 lanes for both dtypes (512 bytes: TVM keeps a local
    buffer on the stack, where LLVM promotes it to registers, below 1 KB; Xeon with AMX, 1 thread,
    H8/2 D64 at 128 keys: 6.1-6.3 us a call, against 8.7 with 8-lane folds per accumulator);
    AVX2, 8 lanes and (4 keys fp32, 2 keys 16-bit), as measured on Zen 4 with those folds; P . V
    as 4 rows x 4 vectors of 16 lanes (AVX-512) or 4 x 2 of 8. DEVELOPING.md."""
    keys = 4 if dtype == "float32" else 2
    if avx512:
        return DecodeConfig(score_lanes=16, score_keys=2)
    return DecodeConfig(lanes=8, pv=RegisterTile(4, 2), score_keys=keys)
