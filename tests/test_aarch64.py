"""aarch64 (issue 20), checked here on x86 without an Arm CPU: targets and configs from Arm's
features, cross-compiled kernels' code (NEON ``fmla``, BFDOT for bf16 where FEAT_BF16 is there),
and cross-compiled kernels refused, not loaded. Running them: ``tools/aarch64_test.sh`` (qemu-user)."""

from __future__ import annotations

import platform
import re

import pytest
import tvm

import tvmflash
from tvmflash import target as targets
from tvmflash.config import ARM_LANES, BF16_DOT, FP32_FMA

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="cross-compiles from x86")


def arm(mcpu, **extra):
    return {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": mcpu, **extra}


GRAVITON3 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
             "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 "
             "i8mm bf16 dgh rng")


def test_cpuinfo_features_of_arm():
    text = f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {GRAVITON3}\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    found = targets.cpuinfo_features(text, arm=True)
    assert {"neon", "fparmv8", "fullfp16", "dotprod", "bf16", "i8mm", "sve"} <= found and "sve2" not in found
    assert targets.cpuinfo_features(text) is None  # no x86 "flags" line
    assert targets.cpuinfo_features("flags\t\t: fpu sse2 avx2 pni\n") >= {"avx2", "sse3"}


def test_arm_targets_and_configs():
    v1, n1 = tvm.target.Target(arm("neoverse-v1")), tvm.target.Target(arm("neoverse-n1"))
    assert targets.is_aarch64(v1) and not targets.is_aarch64(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))
    assert targets.supports_bf16_dot(v1) and not targets.supports_bf16_dot(n1)
    assert targets.supports_bf16_dot(tvm.target.Target(arm("neoverse-n1", mattr=["+bf16"])))
    assert set(targets.isa_features(v1)) == {"fp-armv8", "neon", "fullfp16", "dotprod", "bf16", "i8mm", "sve"}
    assert targets.bf16_dot_features(arm("neoverse-v2")) == ("neon", "bf16")
    assert targets.other_architecture(arm("generic")) and not targets.other_architecture({"kind": "llvm"})


@pytest.mark.parametrize("mcpu, dtype, products", [("neoverse-v1", "float32", FP32_FMA),
                                                    ("neoverse-v2", "bfloat16", BF16_DOT),
                                                    ("neoverse-n1", "bfloat16", FP32_FMA)])
def test_cross_compiled_code(mcpu, dtype, products):
    """NEON fmla on 4 lanes for fp32; every bf16 product a bfdot where the CPU has FEAT_BF16
    (at least one per accumulator of each register tile), none elsewhere; not runnable here."""
    kernels = tvmflash.compile(arm(mcpu), head_dim=32, dtype=dtype, cache=False, tuned=False)
    assert {(c.products, c.lanes) for c in kernels.configs.values()} == {(products, ARM_LANES)}
    asm = kernels.assembly()
    assert "ymm" not in asm and "zmm" not in asm
    bfdot = len(re.findall(r"^\s*bfdot\s+v\d+\.4s", asm, re.M))
    if products == BF16_DOT:
        accumulators = sum(t.rows * t.vectors for cfg in kernels.configs.values() for _, t in cfg.tiles)
        assert bfdot >= accumulators and "llvm.aarch64.neon.bfdot" in kernels.source()
    else:
        assert bfdot == 0 and len(re.findall(r"^\s*fmla\s+v\d+\.4s", asm, re.M)) > 100
    with pytest.raises(RuntimeError, match="neon"):
        kernels._check_runs_here()
