"""bf16 products on Intel AMX tiles (config products="amx": tdpbf16ps; schedules/llvm_amx.py).

* The code, on any x86 machine (compiled for an explicit Sapphire Rapids target, never run
  there): both kernels multiply with tdpbf16ps and configure the tiles; kernels whose reductions
  end on a half chunk (head dims 48, 80; 16-row tiles) fit the 8 tile registers; the helpers'
  IR follows their names; AMX configs where the target, dtype or head dim cannot take them are
  an error, not a crash (LLVM aborts the process on tile code for a target without AMX).
* Which products bf16 kernels get: AMX where the CPU has it, Linux grants the tiles and the
  measured tdpbf16ps rate beats the vector paths by AMX_MIN_GAIN; the override; head dims that
  are no multiple of 16 keep the vector paths.
* On a CPU with AMX (skipped elsewhere, with the reason): forward and backward against float64
  by the flash-attn rule, outputs poisoned first, sizes that are no multiple of any tile: head
  dims 16 to 256, causal or not, GQA, short sequences (16- and 32-row tiles), windows, softcap,
  ALiBi, varlen, flex score mods and block masks; refusal to run where Linux refuses the tiles.
"""

from __future__ import annotations

import re

import pytest
import torch

import tvmflash
from conftest import assert_flash_rule, assert_matches_reference, random_inputs
from test_bf16_products import _kernels_calling
from tvmflash import amx, compiler, padded, product_rates
from tvmflash import target as targets
from tvmflash.config import AMX, BF16_DOT, FP32_FMA, CPUKernelConfig, default_cpu_config
from tvmflash.product_rates import ProductRates
from tvmflash.reference import reference_attention
from tvmflash.schedules import llvm_amx
from tvmflash.spec import AttentionSpec

SAPPHIRE_RAPIDS = {"kind": "llvm", "mcpu": "sapphirerapids"}  # AMX-BF16 and AVX-512, compiled only
HOST_AMX = targets.supports_amx(targets.resolve("llvm"))


def _amx_configs(seqlen: int = 64) -> dict:
    return {kernel: default_cpu_config(kernel, avx512=True, products=AMX, seqlen_q=seqlen,
                                       seqlen_k=seqlen) for kernel in ("forward", "backward")}


def _needs_amx_here():
    if not HOST_AMX:
        pytest.skip("this CPU has no AMX-BF16 (or no AVX-512 with it): AMX kernels are compiled and inspected only")
    if not amx.request_tile_permission():
        pytest.skip("Linux refused this process the AMX tile registers")


# --- the code (any x86 machine) --------------------------------------------------------------------
@pytest.mark.parametrize("head_dim,tiles", [(64, 64), (80, 64), (128, 32), (48, 16)])
def test_both_kernels_multiply_on_tiles(head_dim, tiles):
    kernels = tvmflash.compile(SAPPHIRE_RAPIDS, head_dim=head_dim, dtype="bfloat16", cache=False,
                               config=_amx_configs(tiles))
    assert _kernels_calling(kernels.source(), "llvm.x86.tdpbf16ps.internal") == {"flash_fwd", "flash_bwd"}
    asm = kernels.assembly()
    assert len(re.findall(r"^\s*tdpbf16ps\s", asm, re.M)) >= 7  # two forward products, five backward
    assert re.search(r"^\s*ldtilecfg\s", asm, re.M) and "vdpbf16ps" not in asm


def test_fp32_result_kernels_multiply_on_tiles():
    """bf16 inputs with fp32 results (ring attention's blocks, attention sinks' forward, which
    scales out before its one rounding) on AMX: the same products, out stored as float32."""
    spec = AttentionSpec(64, "bfloat16", "float32")
    kernels = compiler.compile_spec(SAPPHIRE_RAPIDS, spec, config=_amx_configs(64), cache=False)
    assert kernels.out_dtype == "float32"
    assert _kernels_calling(kernels.source(), "llvm.x86.tdpbf16ps.internal") == {"flash_fwd", "flash_bwd"}


def test_helper_ir_follows_the_name():
    name = llvm_amx.helper_name(2, 1, 80, accumulate=True)
    ir = llvm_amx.helper_ir(name)
    assert ir.count("tdpbf16ps.internal(") == 2 * 1 * 3  # chunks of 32, 32 and a half chunk of 16
    assert "i16 16, i16 32, ptr" in ir and "i16 8, i16 64, ptr" in ir  # the half chunk's A and B tiles
    assert ir.count("tileloadd64.internal(i16 16, i16 64, ptr %c0.") == 2 and "tilezero" not in ir
    assert "tilezero" in llvm_amx.helper_ir(llvm_amx.helper_name(1, 1, 32))
    for bad in ((3, 1, 64), (1, 1, 24), (2, 2, 0)):
        with pytest.raises(ValueError, match="no AMX helper"):
            llvm_amx.helper_name(*bad)


@pytest.mark.parametrize("target,dtype,head_dim,match", [
    ({"kind": "llvm", "mcpu": "znver4"}, "bfloat16", 64, "has none"),  # LLVM would abort the process
    (SAPPHIRE_RAPIDS, "float16", 64, "need bfloat16 inputs"),
    (SAPPHIRE_RAPIDS, "bfloat16", 40, "multiple of 16"),
])
def test_amx_where_it_cannot_run_is_an_error(target, dtype, head_dim, match):
    with pytest.raises(ValueError, match=match):
        tvmflash.compile(target, head_dim=head_dim, dtype=dtype, config=_amx_configs(), cache=False)


def test_amx_tiles_are_whole_amx_tiles():
    with pytest.raises(ValueError, match="multiples of 16"):
        CPUKernelConfig("forward", 24, 64, 16, default_cpu_config("forward", True).tiles, AMX)


# --- which products --------------------------------------------------------------------------------
def _products(target, head_dim=64) -> set[str]:
    configs, _ = compiler.choose_configs(targets.resolve(target), AttentionSpec(head_dim, "bfloat16"), tuned=False)
    return {cfg.products for cfg in configs.values()}


def test_the_measured_rates_decide_amx():
    fast = ProductRates(fp32_fma=200.0, bf16_dot=100.0, amx=3000.0)
    assert product_rates.faster_products(fast, amx_allowed=True) == AMX
    assert product_rates.faster_products(fast, amx_allowed=False) == FP32_FMA
    # a slow (shared, throttled) AMX unit below AMX_MIN_GAIN x the vector paths: not worth moving
    slow = ProductRates(fp32_fma=200.0, bf16_dot=400.0, amx=product_rates.AMX_MIN_GAIN * 400.0 - 1)
    assert product_rates.faster_products(slow, amx_allowed=True) == BF16_DOT
    with pytest.raises(ValueError, match="amx rate"):
        ProductRates(100.0, 100.0, amx=-1.0)


def test_cpus_with_amx_default_to_it(monkeypatch):
    monkeypatch.delenv(product_rates.OVERRIDE_ENV, raising=False)
    assert _products(SAPPHIRE_RAPIDS) == {AMX}  # another CPU: its features decide
    assert _products(SAPPHIRE_RAPIDS, head_dim=40) == {BF16_DOT}  # no whole AMX tiles along the head dim
    if not HOST_AMX:
        assert AMX not in _products("llvm")
        return
    rates = product_rates.measured_rates()
    assert rates is not None and rates.amx > 0, "the probe measures tdpbf16ps where the CPU has AMX"
    granted = amx.request_tile_permission()
    expected = product_rates.faster_products(rates, amx_allowed=granted)
    assert _products("llvm") == {expected}
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, FP32_FMA)
    assert _products("llvm") == {FP32_FMA}
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, AMX)
    assert _products("llvm") == ({AMX} if granted else {expected})


# --- on an AMX CPU -----------------------------------------------------------------------------------
def _check(kernels, shape, head_dim, causal, gen, seed):
    q, k, v = random_inputs(gen, head_dim=head_dim, dtype="bfloat16", **shape)
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((shape["batch"], shape["heads"], shape["seqlen_q"]), float("nan"))
    kernels.forward(q, k, v, out, lse, causal=causal)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.backward(dout, q, k, v, out, lse, *grads, causal=causal)
    assert_matches_reference(f"amx {shape} d={head_dim} causal={causal}", (q, k, v, dout), (out, lse, *grads), causal,
                             seed)


@pytest.mark.parametrize("head_dim,causal", [(16, True), (48, False), (64, True), (80, True), (96, False),
                                             (128, True), (256, False)])
def test_amx_kernels_match_float64(head_dim, causal, gen, seed):
    _needs_amx_here()
    kernels = tvmflash.compile("llvm", head_dim=head_dim, dtype="bfloat16", config=_amx_configs())
    for shape in (dict(batch=2, seqlen_q=131, seqlen_k=77, heads=4, heads_k=2),
                  dict(batch=1, seqlen_q=1, seqlen_k=200, heads=3, heads_k=1),
                  dict(batch=1, seqlen_q=150, seqlen_k=150, heads=2, heads_k=2)):
        _check(kernels, shape, head_dim, causal, gen, seed)


@pytest.mark.parametrize("seqlen", [9, 30])
def test_amx_short_sequence_tiles(seqlen, gen, seed):
    """16- and 32-row tiles: reductions over 16 tile rows end on a half chunk (2-tile blocks)."""
    _needs_amx_here()
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="bfloat16", config=_amx_configs(seqlen))
    assert kernels.configs["forward"].block_q == (16 if seqlen <= 16 else 32)
    for causal in (False, True):
        _check(kernels, dict(batch=2, seqlen_q=seqlen, seqlen_k=seqlen, heads=4, heads_k=1), 64, causal, gen, seed)


def test_amx_through_the_torch_api(gen, seed, monkeypatch):
    """Windows, softcap, ALiBi, GQA and varlen through flash_attn_func / flash_attn_varlen_func,
    with the products forced to AMX."""
    _needs_amx_here()
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, AMX)
    q, k, v = random_inputs(gen, 2, 140, 170, 4, 2, 64, "bfloat16", requires_grad=True)
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    variant = dict(window_size=(37, 5), softcap=12.0, alibi_slopes=torch.rand(4, generator=gen) * 0.3)
    out, lse = tvmflash.flash_attn_func(q, k, v, causal=False, return_lse=True, **variant)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_matches_reference("amx window softcap alibi", (q, k, v, dout), (out, lse, *grads), False, seed, **variant)
    # varlen: each packed sequence equals its own call (both on AMX, the same 32-row tiles: the
    # longest sequence chooses a packed call's, each length its own call's)
    lengths = [70, 0, 90, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qv, kv, vv = (torch.randn(int(cu[-1]), 4, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    packed = tvmflash.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lengths), max(lengths), causal=True)
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if n:
            single = tvmflash.flash_attn_func(qv[rows][None], kv[rows][None], vv[rows][None], causal=True)[0]
            assert torch.equal(packed[rows], single), f"sequence {b} (seed {seed})"
    # attention sinks: the fp32-result forward on AMX, rounded once after the rescale
    sinks = torch.randn(4, generator=gen) * 2 + 1
    with torch.no_grad():
        out = padded.attention(q, k, v, torch.ones(2, 170, dtype=torch.bool), causal=True, sinks=sinks)
        want, same = (reference_attention(q, k, v, True, sinks=sinks, dtype=dt)[0]
                      for dt in (torch.float64, torch.bfloat16))
        assert_flash_rule("amx sinks", out, want, same, torch.bfloat16, seed, magnitude=float(v.abs().max()))


def test_amx_flex_score_mod_and_block_mask(gen, seed, monkeypatch):
    """A score mod with a captured tensor and a block mask on AMX kernels, forward and backward,
    against the same flex call on fp32 FMA products (itself tested against float64 in test_flex.py)."""
    _needs_amx_here()
    bias = torch.randn(4, generator=gen, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * torch.tanh((q_idx - kv_idx).float() / 16)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) < 100)

    block_mask = tvmflash.create_block_mask(mask_mod, None, None, 300, 300)
    q, k, v = random_inputs(gen, 1, 300, 300, 4, 4, 64, "bfloat16")
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    results = {}
    for products in (AMX, FP32_FMA):
        monkeypatch.setenv(product_rates.OVERRIDE_ENV, products)
        out = tvmflash.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        results[products] = (out, *torch.autograd.grad(out, (q, k, v, bias), dout))
    for name, ours, fp32_path in zip(("out", "dq", "dk", "dv", "dbias"), results[AMX], results[FP32_FMA]):
        scale = fp32_path.float().abs().max().item() + 1e-6
        # both round P and dS differently (AMX: to bf16 as product inputs); a few bf16 ulps apart
        assert (ours.float() - fp32_path.float()).abs().max().item() <= 4e-2 * scale, f"{name} (seed {seed})"


def test_amx_kernels_refuse_to_run_without_the_tiles(gen, monkeypatch):
    _needs_amx_here()
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="bfloat16", config=_amx_configs(), cache=False)
    monkeypatch.setattr(amx, "request_tile_permission", lambda: False)
    q, k, v = random_inputs(gen, 1, 20, 20, 1, 1, 64, "bfloat16")
    with pytest.raises(RuntimeError, match="AMX tiles, which Linux refused"):
        kernels.forward(q, k, v, torch.empty_like(q), torch.empty(1, 1, 20))
