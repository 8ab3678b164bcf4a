"""The CPU target follows the CPU's own features, and bf16 kernels follow its measured rates (issue 24).

* Target from features: this CPU's target keeps LLVM's model name (``mcpu``) and carries in
  ``mattr`` what /proc/cpuinfo says beyond or short of that model. Simulated here with a fake
  model name and fake flags (nothing runs that this CPU could not run): an Emerald Rapids that a
  hypervisor reports as model 167 (``rocketlake``: no AVX512-BF16, no AMX) still gets
  ``vdpbf16ps`` and its AMX features; a model that claims AVX512-BF16 its flags lack gets none,
  and kernels built for the model's features refuse to run. Where flags and model agree the
  target is what it always was.
* Products by measurement: the decision from injected rates (no timing asserts), the override,
  and the stored measurement: once per machine, trusted only when it is this user's file.
* AMX plumbing: which AMX extensions a target has; Linux's per-process tile permission, refused
  here (and simulated refusals: one warning).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import stat
import warnings

import pytest
import tvm

import tvmflash
from tvmflash import amx, compiler, product_rates
from tvmflash import target as targets
from tvmflash.cache import c_compiler
from tvmflash.config import AMX, BF16_DOT, FP32_FMA, default_cpu_config
from tvmflash.product_rates import ProductRates
from tvmflash.settings import TvmflashWarning
from tvmflash.spec import AttentionSpec

ZEN4_LIKE = ProductRates(fp32_fma=115.0, bf16_dot=232.0)  # measured here: vdpbf16ps at the FMA's issue rate
# Emerald Rapids: two 512-bit FMA ports, vdpbf16ps at half their issue rate: the same FLOPs
XEON_LIKE = ProductRates(fp32_fma=200.0, bf16_dot=200.0)


def _flags_of(mcpu: str, plus=(), minus=()) -> frozenset[str]:
    """/proc/cpuinfo flags (normalized, as ``host_isa_features`` returns them) of a CPU that has
    exactly LLVM's ``mcpu`` model's extensions, plus and minus some."""
    model = {targets._normal(name) for name in targets.isa_features(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))}
    return frozenset((model | {targets._normal(f) for f in plus}) - {targets._normal(f) for f in minus})


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend this machine is LLVM's model ``mcpu`` with these cpuinfo flags (compile only)."""

    def pretend(mcpu: str, flags: frozenset[str]):
        monkeypatch.setattr(targets, "host_cpu", lambda: mcpu)
        monkeypatch.setattr(targets, "host_isa_features", lambda: flags)
        monkeypatch.setattr(targets.platform, "machine", lambda: "x86_64")

    return pretend


def _bf16_products(target) -> set[str]:
    configs, _ = compiler.choose_configs(targets.resolve(target), AttentionSpec(64, "bfloat16"), tuned=False)
    return {cfg.products for cfg in configs.values()}


# --- target from features -----------------------------------------------------------------------
def test_a_cpu_whose_model_name_lacks_its_features_still_gets_them(fake_cpu, monkeypatch):
    """Before: the target was the model (rocketlake), so bf16 took fp32 FMAs on a CPU with AVX512-BF16."""
    fake_cpu("rocketlake", _flags_of("rocketlake", plus=("avx512bf16", "amx-tile", "amx-bf16")))
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, BF16_DOT)  # this machine's rates are not that CPU's
    target = targets.resolve("llvm")
    assert target.attrs["mcpu"] == "rocketlake"  # the scheduling model stays
    assert list(target.attrs["mattr"]) == ["+amx-bf16", "+amx-tile", "+avx512bf16", "-prefer-256-bit"]
    assert targets.supports_bf16_dot(target) and targets.amx_features(target) == ("amx-tile", "amx-bf16")
    assert targets.supports_amx(target)
    assert _bf16_products("llvm") == {BF16_DOT}
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="bfloat16", cache=False)  # compiled, never run
    assert {cfg.lanes for cfg in kernels.configs.values()} == {16}
    assert re.search(r"^\s*vdpbf16ps\s[^\n]*zmm", kernels.assembly(), re.M)
    assert "avx512bf16" in kernels.meta["isa_features"] and kernels.meta["target"]["mattr"] == list(target.attrs["mattr"])


def test_a_model_claiming_features_the_cpu_lacks_never_uses_them(fake_cpu):
    """A hypervisor hiding AVX512-BF16 from a Zen 4: the target disables it, bf16 takes fp32
    FMAs, and kernels built for the model's features (an explicit empty ``mattr``) refuse to run.
    Before: kernels for this CPU's own model were trusted and would have run (SIGILL)."""
    fake_cpu("znver4", _flags_of("znver4", minus=("avx512bf16",)))
    target = targets.resolve("llvm")
    assert list(target.attrs["mattr"]) == ["-avx512bf16"]
    assert not targets.supports_bf16_dot(target) and "avx512bf16" not in targets.isa_features(target)
    assert _bf16_products("llvm") == {FP32_FMA}
    assert not targets.missing_isa_features(targets.isa_features(target))  # what it builds runs here
    as_the_model = tvmflash.compile({"kind": "llvm", "mcpu": "znver4", "mattr": []}, head_dim=16, dtype="float32",
                                    cache=False)
    assert "avx512bf16" in as_the_model._missing_features  # checked first: never call code that could fault
    import torch

    q = torch.zeros(1, 8, 1, 16)
    with pytest.raises(RuntimeError, match="instructions this CPU lacks .*avx512bf16"):
        as_the_model.forward(q, q, q, torch.empty_like(q), torch.empty(1, 1, 8))


@pytest.mark.parametrize("mcpu,plus,minus,lanes", [
    ("haswell", ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"), (), 16),  # AVX-512 the model lacks
    ("skylake-avx512", (), ("avx512f",), 8),  # AVX-512 hidden by the hypervisor
])
def test_the_vector_width_follows_the_flags(fake_cpu, mcpu, plus, minus, lanes):
    fake_cpu(mcpu, _flags_of(mcpu, plus=plus, minus=minus))
    configs, _ = compiler.choose_configs(targets.resolve("llvm"), AttentionSpec(64, "float32"), tuned=False)
    assert {cfg.lanes for cfg in configs.values()} == {lanes}
    assert compiler.choose_decode_config(targets.resolve("llvm"), AttentionSpec(64, "float32")).lanes == lanes


def test_the_target_is_the_model_where_flags_and_model_agree(fake_cpu):
    """No ``mattr``: the same target JSON, cache keys and code as before (the generated IR and
    assembly of a fp32 and a bf16 kernel here were compared before/after: identical)."""
    fake_cpu("znver4", _flags_of("znver4"))
    assert "mattr" not in targets.resolve("llvm").attrs
    assert targets.code_json(targets.resolve("llvm")) == targets.code_json(
        tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))
    # another model named explicitly is compiled for that model, not for this CPU's flags
    assert "mattr" not in targets.resolve({"kind": "llvm", "mcpu": "skylake-avx512"}).attrs


def test_the_cache_key_follows_the_feature_set(fake_cpu):
    fake_cpu("rocketlake", _flags_of("rocketlake", plus=("avx512bf16",)))
    with_bf16 = targets.code_json(targets.resolve("llvm"))
    fake_cpu("rocketlake", _flags_of("rocketlake"))
    assert with_bf16 != targets.code_json(targets.resolve("llvm"))
    assert "num-cores" not in json.dumps(with_bf16)


@pytest.mark.parametrize("mcpu,plus,minus,dtype", [
    ("rocketlake", ("avx512bf16",), (), "bfloat16"),  # an Emerald Rapids reported as model 167: bf16 dots
    ("skylake-avx512", (), ("avx512f",), "float32"),  # AVX-512 hidden by the hypervisor
])
def test_tuning_records_are_filed_by_the_feature_set(fake_cpu, monkeypatch, tmp_path, mcpu, plus, minus, dtype):
    """A record tuned on a CPU of the same model but other extensions is not applied (before:
    filed under 'llvm-<mcpu>' alone, the 16-lane config of the full CPU compiled for a CPU without
    AVX-512, and a record tuned with bf16 dot products present applied where they are absent);
    where flags and model agree the key is 'llvm-<mcpu>', as records were filed before."""
    from tvmflash import records
    from tvmflash.config import CPUKernelConfig

    monkeypatch.setenv("TVMFLASH_TUNE_LOGS", str(tmp_path))
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, FP32_FMA)  # this machine's rates are not that CPU's
    spec = AttentionSpec(64, dtype)
    fake_cpu(mcpu, _flags_of(mcpu, plus=plus))
    tuned_on = targets.resolve("llvm")
    tuned = compiler.choose_configs(tuned_on, spec, tuned=False)[0]["forward"]
    tuned = CPUKernelConfig("forward", 32, 32, tuned.lanes, tuned.tiles, tuned.products)  # not the default
    entry = {"config": tuned.to_json(), "tuned_at": {"batch": 1, "heads": 8, "seqlen": 2048}, "speedup": 1.2,
             "verified": True}
    records.write(tmp_path, targets.key(tuned_on), spec, "forward", entry)
    assert compiler.choose_configs(tuned_on, spec)[0]["forward"] == tuned  # applied on the CPU it was tuned on

    fake_cpu(mcpu, _flags_of(mcpu, minus=minus))  # the same model without the extensions it was tuned with
    other = targets.resolve("llvm")
    configs, used = compiler.choose_configs(other, spec)
    assert used is None and configs["forward"] == compiler.choose_configs(other, spec, tuned=False)[0]["forward"]
    assert targets.key(other) != targets.key(tuned_on)
    fake_cpu(mcpu, _flags_of(mcpu))
    # flags equal to the model: the key of before (Intel's AVX-512 models: and full-width vectors)
    assert targets.key(targets.resolve("llvm")) == f"llvm-{mcpu}" + "".join(targets.full_width_vectors(mcpu, ()))


@pytest.mark.parametrize("mcpu,minus,full_width", [
    ("skylake-avx512", (), True), ("sapphirerapids", (), True), ("rocketlake", (), True),
    ("skylake-avx512", ("avx512f",), False),  # AVX-512 hidden: 8-lane code, nothing to widen
    ("znver4", (), False),  # AMD's models prefer 512-bit vectors already
    ("haswell", (), False),
])
def test_avx512_cpus_get_full_width_vectors(fake_cpu, mcpu, minus, full_width):
    """LLVM's Intel AVX-512 models prefer 256-bit vectors, which split the kernels' 16-lane
    vectors into ymm halves; this CPU's target turns that off, and its code then uses zmm."""
    fake_cpu(mcpu, _flags_of(mcpu, minus=minus))
    target = targets.resolve("llvm")
    assert ("-prefer-256-bit" in list(target.attrs.get("mattr", []))) == full_width
    if full_width:
        assert not targets.has_features(target, "prefer-256-bit")
        kernels = tvmflash.compile("llvm", head_dim=32, dtype="float32", cache=False, config={
            kernel: default_cpu_config(kernel, avx512=True) for kernel in ("forward", "backward")})
        widths = set(re.findall(r"^\s*vfmadd\w+ps\s[^\n]*%([xyz]mm)", kernels.assembly(), re.M))
        assert "zmm" in widths and "ymm" not in widths, widths


def test_without_readable_flags_only_this_models_kernels_are_trusted(monkeypatch):
    """Neither x86 nor aarch64 Linux: no flags to compare, so this CPU's model is trusted (there
    is nothing to check it against) and every other model's extensions count as missing."""
    monkeypatch.setattr(targets.platform, "machine", lambda: "riscv64")
    features = ["avx2", "fma"]
    assert targets.missing_for_cpu_kernels({"kind": "llvm", "mcpu": targets.host_cpu()}, features) == []
    assert targets.missing_for_cpu_kernels({"kind": "llvm", "mcpu": "not-this-cpu"}, features) == features
    assert targets.missing_for_cpu_kernels({"kind": "cuda", "arch": "sm_90"}, features) == []


def test_this_cpus_kernels_need_nothing_it_lacks():
    assert targets.missing_isa_features(targets.isa_features(targets.resolve("llvm"))) == []


# --- products by measurement --------------------------------------------------------------------
def test_the_faster_products_win_by_flops():
    assert product_rates.faster_products(ZEN4_LIKE) == BF16_DOT
    assert product_rates.faster_products(XEON_LIKE) == FP32_FMA  # equal FLOP/s: the packing is not paid back
    assert product_rates.faster_products(ProductRates(200.0, 120.0)) == FP32_FMA
    assert product_rates.faster_products(ProductRates(200.0, 220.0)) == FP32_FMA  # within noise of equal
    for bad in (0.0, -1.0, float("nan"), float("inf"), "100", True):
        with pytest.raises(ValueError, match="positive number of GFLOP/s"):
            ProductRates(100.0, bad)


@pytest.mark.parametrize("rates,products", [(ZEN4_LIKE, BF16_DOT), (XEON_LIKE, FP32_FMA)])
def test_this_cpus_bf16_kernels_follow_its_rates(fake_cpu, monkeypatch, rates, products):
    fake_cpu("znver4", _flags_of("znver4"))
    monkeypatch.delenv(product_rates.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(product_rates, "measured_rates", lambda: rates)
    assert _bf16_products("llvm") == {products}
    configs, _ = compiler.choose_configs(targets.resolve("llvm"), AttentionSpec(64, "float32"), tuned=False)
    assert {cfg.products for cfg in configs.values()} == {FP32_FMA}  # fp32 inputs: never asked


def test_only_this_cpus_own_target_follows_its_rates(fake_cpu, monkeypatch):
    """Same model, other extensions (``mattr``): another CPU, whose rates were not measured here.
    Before, the model name alone decided, so this machine's rates chose for it."""
    fake_cpu("znver4", _flags_of("znver4"))
    monkeypatch.delenv(product_rates.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(product_rates, "measured_rates", lambda: XEON_LIKE)
    assert _bf16_products("llvm") == {FP32_FMA}
    assert _bf16_products({"kind": "llvm", "mcpu": "znver4", "mattr": ["-avx512vnni"]}) == {BF16_DOT}


def test_the_override_chooses_between_the_paths_the_target_has(fake_cpu, monkeypatch):
    fake_cpu("znver4", _flags_of("znver4"))
    monkeypatch.setattr(product_rates, "measured_rates", lambda: XEON_LIKE)
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, BF16_DOT)
    assert _bf16_products("llvm") == {BF16_DOT}
    assert _bf16_products({"kind": "llvm", "mcpu": "skylake-avx512"}) == {FP32_FMA}  # no AVX512-BF16 there
    monkeypatch.setattr(product_rates, "measured_rates", lambda: ZEN4_LIKE)
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, FP32_FMA)
    assert _bf16_products("llvm") == {FP32_FMA}
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, AMX)  # a Zen 4 has no AMX: the measured choice
    assert _bf16_products("llvm") == {BF16_DOT}
    monkeypatch.setenv(product_rates.OVERRIDE_ENV, "tiles")
    with pytest.raises(ValueError, match="TVMFLASH_BF16_PRODUCTS='tiles'"):
        _bf16_products("llvm")
    # the memo of compile results sees the variable
    assert product_rates.OVERRIDE_ENV in compiler._STEERING_ENV


def test_another_cpus_bf16_kernels_follow_its_features(monkeypatch):
    monkeypatch.delenv(product_rates.OVERRIDE_ENV, raising=False)

    def not_this_cpu():
        raise AssertionError("measured this machine for another CPU's kernels")

    monkeypatch.setattr(product_rates, "measured_rates", not_this_cpu)
    # (a Zen 4's kernels take its bf16 dot products; a Sapphire Rapids' its AMX tiles)
    other, products = ("znver4", BF16_DOT) if targets.host_cpu() != "znver4" else ("sapphirerapids", AMX)
    assert _bf16_products({"kind": "llvm", "mcpu": other}) == {products}


@pytest.fixture
def rate_store(tmp_path, monkeypatch):
    """An empty cache directory, a probe that counts its runs (the real one needs AVX512-BF16)."""
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(targets, "missing_isa_features", lambda features: [])
    runs = []

    def probe(path):
        runs.append(path)
        return ProductRates(100.0, 150.0 + len(runs))

    monkeypatch.setattr(product_rates, "_run_probe", probe)
    monkeypatch.setattr(product_rates, "_build_probe", lambda: tmp_path / "cache" / "probe")
    product_rates.forget_measurements()
    yield tmp_path / "cache", runs
    product_rates.forget_measurements()


def _stored(directory):
    (path,) = directory.glob("product-rates-*.json")
    return path


def test_the_rates_are_measured_once_per_machine(rate_store, monkeypatch):
    directory, runs = rate_store
    first = product_rates.measured_rates()
    assert first == ProductRates(100.0, 151.0) and len(runs) == 1
    path = _stored(directory)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    product_rates.forget_measurements()  # a new process: read from the cache directory
    assert product_rates.measured_rates() == first and len(runs) == 1
    monkeypatch.setattr(product_rates, "machine_key", lambda: "another-machine")
    assert product_rates.measured_rates() == ProductRates(100.0, 152.0) and len(runs) == 2


@pytest.mark.parametrize("damage", ["group-writable", "not rates", "negative"])
def test_stored_rates_are_trusted_only_when_safe_and_sound(rate_store, damage):
    directory, runs = rate_store
    product_rates.measured_rates()
    path = _stored(directory)
    if damage == "group-writable":
        os.chmod(path, 0o660)
    else:
        path.write_text("[1, 2]" if damage == "not rates" else '{"fp32_fma": 100, "bf16_dot": -5}')
    product_rates.forget_measurements()
    with pytest.warns(TvmflashWarning, match="measuring again"):
        assert product_rates.measured_rates() == ProductRates(100.0, 152.0)
    assert len(runs) == 2 and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_probe_another_user_could_have_written_is_not_run(tmp_path, monkeypatch):
    """The probe executable itself: group-writable means not ours alone, so it is never started
    (one warning; bf16 kernels then follow the features)."""
    if c_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    probe = product_rates._build_probe()
    assert probe.parent == tmp_path / "cache" and os.access(probe, os.X_OK)
    os.chmod(probe, 0o775)
    started = []
    monkeypatch.setattr(product_rates.subprocess, "run", lambda *a, **k: started.append(a))
    monkeypatch.setattr(targets, "missing_isa_features", lambda features: [])
    product_rates.forget_measurements()
    try:
        with pytest.warns(TvmflashWarning, match="will not load .*writable by group"):
            assert product_rates.measured_rates() is None
    finally:
        product_rates.forget_measurements()
    assert started == [] and not list((tmp_path / "cache").glob("product-rates-*"))


def test_the_machine_key_ignores_microcode_and_clock():
    cpu = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
           "stepping\t: 0\nmicrocode\t: 0xa101148\ncpu MHz\t\t: 2600.000\nflags\t\t: fpu avx512f avx512_bf16\n"
           "bogomips\t: 5200.00\n\nprocessor\t: 1\n")
    same = cpu.replace("0xa101148", "0xa10115b").replace("2600.000", "3700.000").replace("5200.00", "5199.9")
    assert product_rates.machine_key(cpu) == product_rates.machine_key(same)
    assert product_rates.machine_key(cpu) != product_rates.machine_key(cpu.replace(" avx512_bf16", ""))
    assert product_rates.machine_key(cpu) != product_rates.machine_key(cpu.replace(": 17", ": 160"))


@pytest.mark.skipif(targets.missing_isa_features(targets.BF16_DOT_FEATURES) != [], reason="no AVX512-BF16 here")
def test_the_real_probe_measures_this_cpu(tmp_path, monkeypatch):
    if c_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    product_rates.forget_measurements()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", TvmflashWarning)
            rates = product_rates.measured_rates()
    finally:
        product_rates.forget_measurements()
    assert rates.fp32_fma > 1 and rates.bf16_dot > 1  # GFLOP/s of one core: no speed asserted
    print(f"this CPU: fp32 FMA {rates.fp32_fma:.0f}, bf16 dot {rates.bf16_dot:.0f} GFLOP/s per core -> "
          f"{product_rates.faster_products(rates)}")


# --- AMX plumbing --------------------------------------------------------------------------------
def test_amx_features_follow_the_target():
    assert targets.amx_features(targets.resolve({"kind": "llvm", "mcpu": "znver4"})) == ()
    assert targets.amx_features(targets.resolve({"kind": "llvm", "mcpu": "sapphirerapids"})) == ("amx-tile", "amx-bf16")
    assert targets.amx_features(targets.resolve({"kind": "llvm", "mcpu": "graniterapids"})) == targets.AMX_FEATURES
    assert targets.amx_features(targets.resolve({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": ["-amx-tile"]})) == ()


@pytest.fixture
def fresh_amx_request():
    amx._forget()
    yield
    amx._forget()


@pytest.mark.skipif("amxtile" in (targets.host_isa_features() or ()), reason="this CPU has AMX: Linux grants it")
def test_the_tile_permission_is_refused_here_with_one_warning(fresh_amx_request):
    with pytest.warns(TvmflashWarning, match="AMX tiles are not available") as caught:
        assert amx.request_tile_permission() is False
        assert amx.request_tile_permission() is False  # asked once per process
    assert len([w for w in caught if issubclass(w.category, TvmflashWarning)]) == 1


def test_a_refused_tile_request_is_reported_once(fresh_amx_request, monkeypatch):
    calls = []

    def refuse(code, argument):
        calls.append((code, argument))
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(amx, "_arch_prctl", refuse)
    monkeypatch.setattr(amx.platform, "system", lambda: "Linux")
    monkeypatch.setattr(amx.platform, "machine", lambda: "x86_64")
    with pytest.warns(TvmflashWarning, match="EPERM") as caught:
        assert amx.request_tile_permission() is False
        assert amx.request_tile_permission() is False
    assert len(caught) == 1 and calls == [(0x1023, 18)]


def test_a_granted_tile_request_warns_nothing(fresh_amx_request, monkeypatch):
    monkeypatch.setattr(amx, "_arch_prctl", lambda code, argument: 0)
    monkeypatch.setattr(amx.platform, "system", lambda: "Linux")
    monkeypatch.setattr(amx.platform, "machine", lambda: "x86_64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert amx.request_tile_permission() is True


def test_no_tile_request_off_linux_x86(fresh_amx_request, monkeypatch):
    monkeypatch.setattr(amx, "_arch_prctl", lambda code, argument: pytest.fail("called arch_prctl"))
    monkeypatch.setattr(amx.platform, "machine", lambda: "aarch64")
    with pytest.warns(TvmflashWarning, match="Linux's on x86-64"):
        assert amx.request_tile_permission() is False



def test_the_record_key_of_a_long_feature_difference_stays_a_file_name():
    hidden = [f"-avx512{n}" for n in ("f", "bw", "cd", "dq", "vl", "bf16", "fp16", "vnni", "vbmi", "vbmi2", "bitalg",
                                       "vpopcntdq", "ifma")] + ["-amx-tile", "-amx-bf16", "-amx-int8", "-amx-fp16"]
    long_key = targets.key({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": hidden})
    assert long_key.startswith("llvm-sapphirerapids+mattr-") and len(long_key) < 64
    assert long_key != targets.key({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": hidden[1:]})
