"""Tensor intrinsics for AVX512-BF16's ``vdpbf16ps``: the micro-kernel of ``products="bf16_dot"``.

One intrinsic is one instruction: ``C[n] += A[0] B[n, 0] + A[1] B[n, 1]`` for the ``lanes``
(16 or 8) fp32 accumulators ``C`` of a register tile, one bf16 pair ``A`` broadcast to every
lane and ``lanes`` pairs ``B`` held as pair words (``tvmflash/pair_words.py``). The kernels'
bf16 product blocks are written in exactly this form, with the reduction split into pairs
(loops ``q``, ``t``); ``schedules/llvm.py: register_tile`` tensorizes their ``(lanes, t)`` loops.
``A`` comes in two forms: the uint16 bits of two adjacent bf16 elements (a row of Q, dO, K or
of dS rounded to bf16) or a pair word (pairs of rows: V, P, dS).

How TVM 0.27 reaches the instruction (DEVELOPING.md): LLVM 22's intrinsic takes ``<32 x
bfloat>`` operands, a type TVM cannot produce (its bf16 legalization turns every bf16 value into
fp32 or uint16). A few lines of LLVM IR do the bitcast; TVM's ``pragma_import_llvm`` attribute
links them into the module, and LLVM inlines them: what remains is the ``vdpbf16ps`` with its
broadcast and load folded in. The helper must only reach LLVM for targets with AVX512-BF16:
for others LLVM aborts the whole process ("Do not know how to split this operator's operand").
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from tvmflash.pair_words import bits_value, half

LANES = (16, 8)


def _helper(lanes: int) -> str:
    width = 32 * lanes
    f32, i32, bf16 = f"<{lanes} x float>", f"<{lanes} x i32>", f"<{2 * lanes} x bfloat>"
    return f"""
define {f32} @tvmflash_dpbf16ps_{width}({f32} %acc, {i32} %a, {i32} %b) {{
  %a16 = bitcast {i32} %a to {bf16}
  %b16 = bitcast {i32} %b to {bf16}
  %r = call {f32} @llvm.x86.avx512bf16.dpbf16ps.{width}({f32} %acc, {bf16} %a16, {bf16} %b16)
  ret {f32} %r
}}
declare {f32} @llvm.x86.avx512bf16.dpbf16ps.{width}({f32}, {bf16}, {bf16})
"""


# The IR every kernel with bf16 products imports (once per function; LLVM keeps one copy).
HELPERS_LL = "".join(_helper(lanes) for lanes in LANES)

# aarch64 (FEAT_BF16): BFDOT does per fp32 lane ``C[n] += A[2n] B[2n] + A[2n+1] B[2n+1]`` on
# 128-bit registers: the same pair-word operands, 4 lanes. LLVM 22 loads the broadcast pair with
# ``ld1r {v.4s}`` (not BFDOT's indexed form); one ``bfdot v.4s, v.8h, v.8h`` per accumulator vector.
ARM_LANES = 4
ARM_HELPERS_LL = """
define <4 x float> @tvmflash_bfdot_128(<4 x float> %acc, <4 x i32> %a, <4 x i32> %b) {
  %a16 = bitcast <4 x i32> %a to <8 x bfloat>
  %b16 = bitcast <4 x i32> %b to <8 x bfloat>
  %r = call <4 x float> @llvm.aarch64.neon.bfdot.v4f32.v8bf16(<4 x float> %acc, <8 x bfloat> %a16, <8 x bfloat> %b16)
  ret <4 x float> %r
}
declare <4 x float> @llvm.aarch64.neon.bfdot.v4f32.v8bf16(<4 x float>, <8 x bfloat>, <8 x bfloat>)
"""


def import_helpers(sch: s_tir.Schedule, loop, lanes: int = 16) -> None:
    """Link the helpers for kernels of ``lanes`` fp32 lanes (HELPERS_LL; 4 lanes: aarch64's
    ARM_HELPERS_LL) into the function of ``loop`` (a ``pragma_*`` loop annotation becomes an
    attribute that TVM's LLVM code generator acts on wherever it meets it). Each architecture's
    helpers only reach LLVM for that architecture."""
    sch.annotate(loop, "pragma_import_llvm", ARM_HELPERS_LL if lanes == ARM_LANES else HELPERS_LL)


def intrinsic_name(lanes: int, a_dtype: str) -> str:
    """The intrinsic for ``lanes`` accumulators whose A operand is of ``a_dtype`` (uint16 bits or
    uint32 words), registering this lane count's on first use. (Not at import: TVMScript's parser
    calls ``inspect.stack()``, which for each frame of the import machinery scans all of
    ``sys.modules``; importing this module inside a transformers model's first call took ~10 s.)"""
    if lanes not in _REGISTERED:
        _register(lanes)
        _REGISTERED.add(lanes)
    return _name(lanes, a_dtype)


def register_all() -> None:
    """Every lane count's intrinsics: what replaying a stored schedule trace needs before any
    schedule has named them (a MetaSchedule database replays its records' traces as it loads)."""
    for lanes in (*LANES, ARM_LANES):
        intrinsic_name(lanes, "uint16")


def _name(lanes: int, a_dtype: str) -> str:
    return f"tvmflash_bf16_dot_{'words_' if a_dtype == 'uint32' else ''}{lanes}"


_REGISTERED: set = set()


def _dot(lanes: int, acc, a_word, b_words):
    """acc + the products of the pairs in a_word (broadcast) and b_words, through the IR helper."""
    helper = "tvmflash_bfdot_128" if lanes == ARM_LANES else f"tvmflash_dpbf16ps_{32 * lanes}"
    return T.call_pure_extern(f"float32x{lanes}", helper, acc,
                              T.broadcast(a_word, lanes), T.reinterpret(b_words, dtype=f"int32x{lanes}"))


def _register(lanes: int) -> None:
    vec = f"float32x{lanes}"

    # A: the bits of two adjacent bf16 elements
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (2,), "uint16", offset_factor=1)
        B = T.match_buffer(b, (lanes,), "uint32", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, scope="local")  # the register tile
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes])
            T.writes(C[0:lanes])
            for n, t in T.grid(lanes, 2):
                with T.sblock("update"):
                    vn, vt = T.axis.remap("SR", [n, t])
                    C[vn] = C[vn] + bits_value(A[vt]) * half(B[vn], vt)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (2,), "uint16", offset_factor=1)
        B = T.match_buffer(b, (lanes,), "uint32", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes])
            T.writes(C[0:lanes])
            # (C[0:lanes] would be a region, which call_pure_extern rejects: a ramp is a vector)
            C[T.ramp(0, 1, lanes)] = _dot(lanes, C.vload([0], vec),
                                          T.reinterpret(A.vload([0], "uint16x2"), dtype="int32"),
                                          B.vload([0], f"uint32x{lanes}"))

    # A: a pair word
    @T.prim_func(s_tir=True)
    def desc_words(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (1,), "uint32", offset_factor=1)
        B = T.match_buffer(b, (lanes,), "uint32", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:1], B[0:lanes])
            T.writes(C[0:lanes])
            for n, t in T.grid(lanes, 2):
                with T.sblock("update"):
                    vn, vt = T.axis.remap("SR", [n, t])
                    C[vn] = C[vn] + half(A[0], vt) * half(B[vn], vt)

    @T.prim_func(s_tir=True)
    def impl_words(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (1,), "uint32", offset_factor=1)
        B = T.match_buffer(b, (lanes,), "uint32", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:1], B[0:lanes])
            T.writes(C[0:lanes])
            C[T.ramp(0, 1, lanes)] = _dot(lanes, C.vload([0], vec), T.reinterpret("int32", A[0]),
                                          B.vload([0], f"uint32x{lanes}"))

    TensorIntrin.register(_name(lanes, "uint16"), desc, impl, override=True)
    TensorIntrin.register(_name(lanes, "uint32"), desc_words, impl_words, override=True)

