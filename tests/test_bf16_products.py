"""bf16 inputs on native bf16 dot products (config products="bf16_dot", AVX512-BF16 vdpbf16ps).

* Which products a compile chooses: bf16 dot products for bf16 inputs where the target has
  AVX512-BF16 (on this CPU: and they multiply faster, test_cpu_features.py), fp32 FMAs everywhere else (fp16, fp32, AVX2, AVX-512 without BF16); asking for
  bf16 dot products where they cannot run is an error, not a crash.
* The code: compiled for an explicit Zen 4 target (checkable on any machine), every product is
  a vdpbf16ps (zmm; ymm where the head dim's vectors are 8 floats), in both kernels; compiled for
  Skylake-AVX512 or for fp16, none is. Kernels whose instructions this CPU lacks refuse to run.
* The rounding of P and dS (pair_words.py) is torch's round-to-nearest-even, bit for bit.
* Correctness by the flash-attn rule on random shapes (head dims 32 to 256, 40 for the 8-lane
  dot products, lengths that are no multiple of the tiles, causal or not, GQA) and at 4K keys.
  Varlen, GQA and score mods with bf16 inputs run through the same kernels in
  test_flash_attn_api.py and test_flex.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import tvm
from tvm.script import tirx as T

import tvmflash
from conftest import assert_flash_rule, assert_matches_reference, random_inputs, reference_attention
from test_attention import check_against_reference, draw_shape
from tvmflash import compiler, pair_words, product_rates
from tvmflash.config import BF16_DOT, FP32_FMA, default_cpu_config
from tvmflash.spec import AttentionSpec
from tvmflash.target import host_isa_features, resolve, supports_bf16_dot

ZEN4 = {"kind": "llvm", "mcpu": "znver4"}  # AVX-512 with AVX512-BF16, no AMX
SKYLAKE = {"kind": "llvm", "mcpu": "skylake-avx512"}  # AVX-512 without BF16
HASWELL = {"kind": "llvm", "mcpu": "haswell"}  # AVX2
HOST_HAS_BF16 = "avx512bf16" in (host_isa_features() or ())


def _products(target, dtype: str) -> set[str]:
    configs, _ = compiler.choose_configs(resolve(target), AttentionSpec(64, dtype), tuned=False)
    return {cfg.products for cfg in configs.values()}


def test_bf16_inputs_use_bf16_dot_products_where_the_target_has_them():
    assert _products(ZEN4, "bfloat16") == {BF16_DOT}
    for target, dtype in ((ZEN4, "float16"), (ZEN4, "float32"), (SKYLAKE, "bfloat16"), (HASWELL, "bfloat16")):
        assert _products(target, dtype) == {FP32_FMA}, (target, dtype)
    # the host: whatever its CPU has, and multiplies faster with (product_rates; test_cpu_features.py)
    assert _products("llvm", "bfloat16") == {product_rates.bf16_products(resolve("llvm"))}
    if not supports_bf16_dot(resolve("llvm")):
        assert _products("llvm", "bfloat16") == {FP32_FMA}


@pytest.mark.parametrize("target,dtype,match", [
    (SKYLAKE, "bfloat16", "skylake-avx512 has none"),  # LLVM would abort the process
    (ZEN4, "float16", "need bfloat16 inputs"),
])
def test_bf16_dot_products_where_they_cannot_run_are_an_error(target, dtype, match):
    config = {kernel: default_cpu_config(kernel, avx512=True, products=BF16_DOT) for kernel in ("forward", "backward")}
    with pytest.raises(ValueError, match=match):
        tvmflash.compile(target, head_dim=64, dtype=dtype, config=config)


def _kernels_calling(llvm_ir: str, intrinsic: str) -> set[str]:
    """The kernels (flash_fwd, flash_bwd) whose code calls ``intrinsic``, directly or in the
    functions they call (TVM outlines parallel loop bodies into functions of their own)."""
    bodies = {}
    for text in llvm_ir.split("\ndefine ")[1:]:
        name = re.match(r"[^@]*@([\w.$]+)\(", text)
        if name:
            bodies[name.group(1)] = text.split("\n}\n")[0]

    def calls(name, seen):
        body = bodies.get(name, "")
        if f"@{intrinsic}(" in body:
            return True
        seen.add(name)
        return any(calls(callee, seen) for callee in set(re.findall(r"@([\w.$]+)", body)) - seen if callee in bodies)

    return {kernel for kernel in ("flash_fwd", "flash_bwd") if calls(f"__tvm_ffi_{kernel}", set())}


@pytest.mark.parametrize("head_dim", [64, 40])
def test_every_product_is_a_vdpbf16ps_on_avx512_bf16(head_dim, gen, seed):
    """Zen 4 target: vdpbf16ps in the forward's and the backward's code, at least one per accumulator
    of every product's register tile; zmm, and ymm for the head-dim vectors of D = 40 (8 floats).
    Run here if this CPU has every extension of znver4; elsewhere calling the kernels is refused."""
    kernels = tvmflash.compile(ZEN4, head_dim=head_dim, dtype="bfloat16", cache=False)
    assert {cfg.products for cfg in kernels.configs.values()} == {BF16_DOT}
    asm = kernels.assembly()
    zmm = len(re.findall(r"^\s*vdpbf16ps\s[^\n]*zmm", asm, re.M))
    ymm = len(re.findall(r"^\s*vdpbf16ps\s[^\n]*ymm", asm, re.M))
    accumulators = sum(t.rows * t.vectors for cfg in kernels.configs.values() for _, t in cfg.tiles)
    assert zmm + ymm >= accumulators, (zmm, ymm, accumulators)
    assert (ymm > 0) == (head_dim % 16 != 0), (zmm, ymm)
    assert _kernels_calling(kernels.source(), "llvm.x86.avx512bf16.dpbf16ps.512") == {"flash_fwd", "flash_bwd"}
    q, k, v = random_inputs(gen, 1, 70, 90, 2, 1, head_dim, "bfloat16")
    out, lse = torch.full_like(q, float("nan")), torch.full((1, 2, 70), float("nan"))
    missing = kernels._missing_features  # AVX512-BF16 where this CPU lacks it; AMD's sse4a on Intel CPUs
    assert ("avx512bf16" in missing) == (not HOST_HAS_BF16), missing
    if missing:
        with pytest.raises(RuntimeError, match="instructions this CPU lacks"):
            kernels.forward(q, k, v, out, lse)
        pytest.skip(f"this CPU lacks {', '.join(missing)} of znver4: compiled and inspected only")
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    kernels.forward(q, k, v, out, lse, causal=True)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads, causal=True)
    assert_matches_reference(f"znver4 d={head_dim}", (q, k, v, dout), (out, lse, *grads), True, seed)


@pytest.mark.parametrize("target,dtype", [(SKYLAKE, "bfloat16"), (ZEN4, "float16")])
def test_no_vdpbf16ps_without_bf16_dot_products(target, dtype):
    kernels = tvmflash.compile(target, head_dim=64, dtype=dtype, cache=False)
    assert {cfg.products for cfg in kernels.configs.values()} == {FP32_FMA}
    assert "vdpbf16ps" not in kernels.assembly() and "dpbf16ps" not in kernels.source()


def test_bf16_on_avx512_without_bf16_runs_the_fp32_path(gen, seed):
    """The fallback where AVX-512 has no BF16 (Skylake): bf16 converted to fp32, fp32 FMAs."""
    if not {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= (host_isa_features() or set()):
        pytest.skip("this CPU cannot run Skylake-AVX512 code")
    kernels = tvmflash.compile(SKYLAKE, head_dim=64, dtype="bfloat16")
    q, k, v = random_inputs(gen, 1, 100, 130, 4, 2, 64, "bfloat16")
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    out, lse = torch.full_like(q, float("nan")), torch.full((1, 4, 100), float("nan"))
    kernels.forward(q, k, v, out, lse)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads)
    assert_matches_reference("skylake-avx512 bf16", (q, k, v, dout), (out, lse, *grads), False, seed)


@T.prim_func
def _round(x: T.Buffer((256,), "float32"), words: T.Buffer((128,), "uint32"), bits: T.Buffer((256,), "uint16")):
    for i in T.serial(128):
        words[i] = pair_words.rounded_pair_word(x[2 * i], x[2 * i + 1])
    for i in T.serial(256):
        bits[i] = pair_words.rounded_bits(x[i])


def test_p_and_ds_round_to_nearest_even_as_torch_does(gen):
    """rounded_pair_word / rounded_bits (how the kernels round P and dS) equal torch's fp32 -> bf16
    cast bit for bit: random values, exact ties (even and odd), values that round up into the next
    binade or to infinity, subnormals, zeros, infinities."""
    lib = tvm.compile(tvm.IRModule({"main": _round}), target="llvm")
    ties = [1 + k * 2.0**-8 + 2.0**-9 for k in range(4)]  # halfway between two bf16: to the even one
    special = [0.0, -0.0, float("inf"), float("-inf"), 1e-40, -3e-39, 3.4e38, -3.4e38, 1 - 2.0**-10, 65535.0, 1.0]
    x = torch.randn(256, generator=gen) * torch.logspace(-30, 30, 256)
    x[:len(ties) + len(special)] = torch.tensor(ties + special)
    words, bits = torch.zeros(128, dtype=torch.uint32), torch.zeros(256, dtype=torch.uint16)
    lib["main"](x, words, bits)
    expected = x.to(torch.bfloat16).view(torch.uint16)
    assert torch.equal(bits, expected)
    assert torch.equal(words.view(torch.uint16), expected)  # pairs: the even element in the low half


# head dims from 32 to 256 (40: dot products of 8 floats along the head dim), causal or not;
# test_attention.py runs bf16 at 64 (both masks) and 128 (causal) with the same rule
@pytest.mark.parametrize("head_dim,causal", [(32, True), (40, False), (80, True), (128, False), (256, True)])
def test_random_shapes(head_dim, causal, gen, seed):
    for _ in range(2):
        check_against_reference(draw_shape(gen), "bfloat16", head_dim, causal, gen, seed)


def test_long_sequence_accumulation(gen, seed):
    """4K keys, causal and not: errors that grow with length (bf16 row statistics or accumulators,
    P rounded before the row sum) would show here."""
    for causal in (False, True):
        check_against_reference(dict(batch=1, seqlen_q=257, seqlen_k=4099, heads=2, heads_k=1), "bfloat16", 128,
                                causal, gen, seed)


def test_long_rows_of_equal_scores(gen, seed):
    """Every score equal (q = 0): P = 1 everywhere, out = mean of v over 4K keys. P rounds to bf16
    exactly here; the fp32 row sum and accumulators must keep the mean to fp32 accuracy."""
    q = torch.zeros(1, 3, 1, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4096, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    out = tvmflash.flash_attn_func(q, k, v)
    ref = v.double().mean(1, keepdim=True).expand(1, 3, 1, 64)
    same = reference_attention(q, k, v, False, dtype=torch.bfloat16)[0]
    assert_flash_rule("out", out, ref, same, torch.bfloat16, seed)
