"""bf16 pair words: the operand format of the native bf16 dot products (TIR expressions).

A ``vdpbf16ps`` lane multiplies a *pair* of bf16 values, the elements ``2q`` and ``2q + 1`` of
a reduction, by another pair and adds both products to one fp32 accumulator. Its vector
operand is 16 such pairs, one per lane. A pair word is one lane's pair as a uint32: the bf16
of the even index in the low half, the odd one in the high half (the bytes of two adjacent bf16
in memory). Kernels keep the vector operands of their bf16 products in uint32 buffers of pair
words, and the other operands as uint16 bits or pair words: no bf16-typed value, which TVM
0.27's bf16 legalization would compute in fp32, and vectorized integer code where a bf16 store
at stride 2 would be scalarized (DEVELOPING.md). The tensor intrinsics in ``schedules/llvm_bf16.py`` describe
their instruction with the same expressions, so the kernels' product blocks match them.
"""

from __future__ import annotations

from tvm import tirx

U16, U32 = "uint16", "uint32"


def half(word, t):
    """The bf16 in half ``t`` (0: low, 1: high) of a pair word, as fp32 (exact)."""
    shift = tirx.Cast(U32, t) * tirx.const(16, U32)
    return tirx.reinterpret("float32", tirx.shift_left(tirx.shift_right(word, shift), tirx.const(16, U32)))


def bf16_bits(x):
    """The bits of a bf16 *load* as uint16. (Only of loads: TVM's bf16 legalization computes
    with bf16 values in fp32, where a reinterpret to 16 bits no longer type-checks.)"""
    return tirx.reinterpret(U16, x)


def bits_value(bits):
    """The fp32 value of the bf16 whose bits are ``bits`` (uint16; exact)."""
    return tirx.reinterpret("float32", tirx.shift_left(tirx.Cast(U32, bits), tirx.const(16, U32)))


def pair_word(lo_bits, hi_bits):
    """The pair word of two bf16 (uint16 bits): the even reduction index in the low half."""
    return tirx.bitwise_or(tirx.Cast(U32, lo_bits), tirx.shift_left(tirx.Cast(U32, hi_bits), tirx.const(16, U32)))


def _rounded_high_half(x):
    """fp32 bits whose high half is x rounded to bf16, to nearest even (x finite; a NaN may turn
    into an infinity: P and dS are finite)."""
    bits = tirx.reinterpret(U32, x)
    odd = tirx.bitwise_and(tirx.shift_right(bits, tirx.const(16, U32)), tirx.const(1, U32))
    return bits + tirx.const(0x7FFF, U32) + odd


def rounded_bits(x):
    """The bits of fp32 ``x`` rounded to bf16 (round to nearest even, as torch's cast), uint16."""
    return tirx.Cast(U16, tirx.shift_right(_rounded_high_half(x), tirx.const(16, U32)))


def rounded_pair_word(lo, hi):
    """The pair word of two fp32 values rounded to bf16."""
    return tirx.bitwise_or(tirx.bitwise_and(_rounded_high_half(hi), tirx.const(0xFFFF0000, U32)),
                           tirx.shift_right(_rounded_high_half(lo), tirx.const(16, U32)))
