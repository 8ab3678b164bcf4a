"""Prebuilt kernels: compiled and exported here, loaded by a process that has TVM's runtime only."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tvmflash
from tvmflash import cache, compiler, cuda_binaries
from tvmflash.spec import AttentionSpec, Softcap

RUNTIME_ONLY_CHECK = r"""
import sys, torch, tvm
from tvm import base
assert base._RUNTIME_ONLY, "TVM's compiler library was loaded"
sys.path.insert(0, sys.argv[1])
from conftest import reference_attention
from tvmflash import flash_attn_func
g = torch.Generator().manual_seed(int(sys.argv[2]))
q, k, v = (torch.randn(1, n, h, 32, generator=g).requires_grad_() for n, h in ((70, 4), (90, 2), (90, 2)))
slopes = torch.rand(4, generator=g)
errors = []
for mods in ({}, {"softcap": 3.0, "alibi_slopes": slopes}):  # the plain library and the softcap+alibi one
    out = flash_attn_func(q, k, v, causal=True, **mods)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*leaves, True, **mods)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errors += [(out.double() - ref).abs().max().item()] + [(a.double() - b).abs().max().item()
                                                           for a, b in zip(grads, ref_grads)]
assert max(errors) < 1e-5, errors
# bf16 inputs, fp32 results (ring attention's and attention sinks' forward): their own library
bf16 = [t.detach().bfloat16() for t in (q, k, v)]
out32, _ = torch.ops.tvmflash.flash_attn_forward(*bf16, None, None, None, 32 ** -0.5, -1, 0, 0.0, False, True, None)
assert out32.dtype == torch.float32
error = (out32.double() - reference_attention(*(t.double() for t in bf16), True)[0]).abs().max().item()
assert error < 0.02, error
from test_architecture import LAYERS, layer_of
generators = [m for m in sys.modules if m.startswith("tvmflash.")
              and LAYERS[layer_of(m)].name in ("code generation", "mod tracing")]
assert not generators, generators
print("ok", errors)
"""


def test_prebuilt_cpu_kernels_run_with_the_tvm_runtime_alone(tmp_path, seed):
    # (no short sequences' tile classes: these calls (70 queries, 90 keys) run on the long class's)
    written = tvmflash.prebuild(tmp_path, "llvm", head_dims=(32,), dtypes=("float32",),
                                score_mods=("none", "softcap+alibi"), fp32_results=(False, True), short_sequences=False)
    written += tvmflash.prebuild(tmp_path, "llvm", head_dims=(32,), dtypes=("bfloat16",), fp32_results=(True,),
                                 short_sequences=False)
    # kernels take the mask per call: one library serves causal and full attention; float32's
    # results are float32 (no second library)
    stem = f"{written[0].name.split('-d32')[0]}-d32"
    kernels = [p.name for p in written if not p.name.startswith(("threads-", "launch-"))]  # (and the helpers in C)
    assert kernels == [f"{stem}-float32.so", f"{stem}-float32-softcap+alibi.so", f"{stem}-bfloat16-fp32-results.so"]
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVMFLASH_PREBUILT=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_CHECK, str(Path(__file__).parent), str(seed)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "ok" in run.stdout


RUNTIME_ONLY_GENERATE = r"""
import copy, sys, torch, transformers
from tvm import base
assert base._RUNTIME_ONLY, "TVM's compiler library was loaded"
import os, warnings
os.environ["CC"] = os.environ["PATH"] = sys.argv[1] + "/no-compiler"  # (none: the helpers in C are prebuilt)
import tvmflash
from tvmflash import compiler, kvcache, launch, sinks, torch_op
from tvmflash.integrations import transformers as tvm_hf
from tvmflash.settings import TvmflashWarning
warnings.simplefilter("error", TvmflashWarning)  # (TVM's thread pool, calls from Python: each warns)
prebuilt = sys.argv[1]
torch.manual_seed(int(sys.argv[2]))
# gpt-oss: attention sinks, sliding and full layers in turn; head dim 16
config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1)
eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
with torch.no_grad():
    for layer in eager.model.layers:
        layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 1.5 + 1)
ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=tvm_hf.register())
ours.load_state_dict(eager.state_dict())
ids = torch.randint(1, 128, (2, 11))
mask = torch.ones_like(ids)
mask[0, :3] = 0  # left padding
ids = ids.masked_fill(mask == 0, 0)
kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
with torch.no_grad():
    want = eager.generate(ids, **kwargs)
    got = ours.eval().generate(ids, **kwargs)
errors = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got.scores, want.scores)]
assert max(errors) <= 1e-4, errors
assert torch.equal(got.sequences, want.sequences)
# every kernel came from the prebuilt directory: the flash kernels, the decode kernel, the sinks'
used = [k for k in kvcache._kernels.values()] + [k for k in sinks._kernels.values()]
assert {type(k).__name__ for k in used} == {"DecodeKernels", "SinkKernels"}, used
assert all(str(k._library).startswith(prebuilt) for k in used), [k._library for k in used]
# the prompts (11 tokens) ran on the short sequences' tiles, not on 64-row ones
flash_used = [k for k in compiler._prebuilt_cache.values() if type(k).__name__ == "FlashKernels"]
assert [k._library.name.split("-")[-1] for k in flash_used] == ["tiles16x16.so"], flash_used
assert compiler.builds == 0
# on torch's threads, repeated calls launched from C: the helpers in C came from the directory too
flash = torch_op.kernels_for(ids.new_zeros((1, 1, 1, 16), dtype=torch.float32))
assert all(k._on_torch_threads for k in (flash, *used)) and launch.module() is not None
print("ok", max(errors))
"""


def test_prebuilt_decode_and_sink_kernels_serve_generate_with_the_runtime_alone(tmp_path, seed):
    """A deployment without TVM's compiler: gpt-oss's greedy generate() (prefill, decode steps,
    attention sinks, a left-padded prompt) on prebuilt kernels alone, scores and tokens as the
    eager model's."""
    pytest.importorskip("transformers")
    written = tvmflash.prebuild(tmp_path, "llvm", head_dims=(16,), dtypes=("float32",), decode=True, sinks=True)
    stem = f"{written[0].name.split('-d16')[0]}-d16-float32"
    classes = [f"{stem}-tiles{q}x{k}.so" for q in (16, 32, 64) for k in (16, 32, 64) if (q, k) != (64, 64)]
    assert [p.name for p in written[:11]] == [f"{stem}.so", *classes, f"{stem}-decode.so", f"{stem}-sinks.so"]
    assert [p.name.split("-")[0] for p in written[11:]] == ["threads", "launch"]  # (the helpers in C)
    loaded = [tvmflash.load(p) for p in [written[0], written[1], *written[9:11]]]  # each loads as its own kind
    assert [type(k).__name__ for k in loaded] == ["FlashKernels", "FlashKernels", "DecodeKernels", "SinkKernels"]
    assert [k.meta["configs"]["forward"]["block_q"] for k in loaded[:2]] == [64, 16]
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVMFLASH_PREBUILT=str(tmp_path),
               TVMFLASH_CACHE_DIR=str(tmp_path / "empty-cache"))
    run = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_GENERATE, str(tmp_path), str(seed)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "ok" in run.stdout


def test_prebuilt_files_are_loadable_whatever_the_umask(tmp_path, monkeypatch):
    """Under umask 002 (Debian's and Ubuntu's default for users with their own group) prebuild
    wrote group-writable libraries, which $TVMFLASH_PREBUILT then skipped: every one of its own."""
    old = os.umask(0o002)
    try:
        written = tvmflash.prebuild(tmp_path / "kernels", "llvm", head_dims=(32,), dtypes=("float32",), decode=True,
                                    short_sequences=False)
        binary = cuda_binaries.write(tmp_path / "kernels", "extern \"C\" __global__ void f() {}", "sm_90", b"fatbin")
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "kernels").iterdir()]
    assert len(files) == 10 and not [p.name for p in files if p.stat().st_mode & 0o022]  # (4 of the helpers in C)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a skipped library warns)
        assert [so for so, _ in cache.prebuilt_libraries(tmp_path / "kernels")] == sorted(written[:2])
        assert [cache.prebuilt_helper(p.name) for p in written[2:]] == [None, None]  # ($TVMFLASH_PREBUILT unset)
        monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path / "kernels"))
        assert [cache.prebuilt_helper(p.name) for p in written[2:]] == written[2:]
    assert cuda_binaries.find(binary.parent, "extern \"C\" __global__ void f() {}", "sm_90") == b"fatbin"


def test_prebuild_again_replaces_files_instead_of_rewriting_them(tmp_path):
    """A process running kernels from a directory while prebuild refreshes it died of SIGBUS:
    the files were rewritten in place, under its mappings. Each is now a new file renamed into
    place (another inode); the loaded kernels keep theirs and run."""
    written = tvmflash.prebuild(tmp_path, "llvm", head_dims=(32,), dtypes=("float32",), short_sequences=False)
    loaded = tvmflash.load(written[0])
    inodes = {p: p.stat().st_ino for p in tmp_path.iterdir()}
    again = tvmflash.prebuild(tmp_path, "llvm", head_dims=(32,), dtypes=("float32",), short_sequences=False)
    assert again == written and sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in inodes)
    assert all(p.stat().st_ino != inode for p, inode in inodes.items())  # (no temporary file left either)
    import torch

    q = torch.randn(1, 20, 2, 32)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 20)
    loaded.forward(q, q, q, out, lse)
    assert torch.isfinite(out).all()


def test_prebuilt_libraries_serve_only_their_own_kind(tmp_path, monkeypatch):
    """A decode or sink library shares its spec with the flash kernels of that head dim and dtype:
    none may stand in for another (the flash kernels' functions are not in it)."""
    spec = AttentionSpec(32, "float32")
    decode = compiler.compile_decode("llvm", spec)
    decode.export_library(tmp_path / "a-decode.so")
    compiler.compile_sinks("llvm", spec).export_library(tmp_path / "b-sinks.so")
    monkeypatch.setenv("TVMFLASH_PREBUILT", str(tmp_path))
    compiler._prebuilt_cache.clear()
    assert compiler._find_prebuilt("flash", "llvm", spec) is None
    assert type(compiler._find_prebuilt("decode", "llvm", spec)).__name__ == "DecodeKernels"
    assert compiler._find_prebuilt("decode", "llvm", spec, config=decode.config) is not None  # its own config
    other = dataclasses.replace(decode.config, block_k=decode.config.block_k * 2)
    assert compiler._find_prebuilt("decode", "llvm", spec, config=other) is None
    assert type(compiler._find_prebuilt("sinks", "llvm", spec)).__name__ == "SinkKernels"
    assert compiler._find_prebuilt("decode", "llvm", AttentionSpec(32, "float32", score_mods=(Softcap(),))) is None
    with pytest.raises(ValueError, match="run on CPUs only"):
        tvmflash.prebuild(tmp_path / "cuda", {"kind": "cuda", "arch": "sm_90"}, head_dims=(64,), decode=True)


def test_cuda_kernels_export_for_a_gpu_machine(tmp_path):
    """Without a GPU TVM keeps the CUDA source in the module; it exports, and with nvcc here
    prebuild compiles each library's binary beside it (TVM's runtime alone cannot compile)."""
    written = tvmflash.prebuild(tmp_path, {"kind": "cuda", "arch": "sm_90"}, head_dims=(64,), dtypes=("float16",),
                                deterministic=(False, True))
    libraries = [p for p in written if p.suffix == ".so"]
    assert [p.name for p in libraries] == ["cuda-sm_90-d64-float16.so", "cuda-sm_90-d64-float16-deterministic.so"]
    for path in libraries:
        meta = json.loads(Path(str(path) + ".json").read_text())
        assert meta["target"]["kind"] == "cuda" and meta["target"]["arch"] == "sm_90" and meta["spec"]["head_dim"] == 64
        assert path.stat().st_size > 10_000
    assert json.loads(Path(str(libraries[1]) + ".json").read_text())["deterministic"] is True
    binaries = [p for p in written if p.suffix == cuda_binaries.SUFFIX]
    assert len(binaries) == (2 if shutil.which("nvcc") else 0)


RUNTIME_ONLY_CUDA_CALLBACK = r"""
import struct, sys, tvm, tvm_ffi
from pathlib import Path
assert tvm.base._RUNTIME_ONLY
from tvmflash import cuda_binaries
directory = Path(sys.argv[1])
compile_source = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
try:  # TVM's own callback needs its compiler library: the reason cuda_binaries exists
    compile_source('extern "C" __global__ void f() {}')
    print("TVM's callback compiled")
except Exception as err:
    print("TVM's callback failed:", type(err).__name__)
cuda_binaries.serve(directory, "sm_90")  # what runtime.load does before loading a CUDA library
compile_source = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
for library in sorted(directory.glob("*.so")):
    data = library.read_bytes()
    # the module holds its source as a length-prefixed string: what TVM's runtime passes the callback
    start = data.index(b"\n#ifdef __CUDACC_RTC__")
    source = data[start:start + struct.unpack("<Q", data[start - 8:start])[0]].decode()
    binary = bytes(compile_source(source))
    print(library.name, (directory / cuda_binaries.binary_name(source, "sm_90")).read_bytes() == binary)
try:
    compile_source('extern "C" __global__ void g() {}')
except Exception as err:
    print("unknown source:", err)
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc compiles the binaries prebuild bundles")
def test_prebuilt_cuda_binaries_serve_the_runtime_alone(tmp_path):
    """A GPU machine with TVM's runtime only (the GPU bundle's) gets each library's binary from
    the prebuilt directory when the library's source asks to be compiled."""
    tvmflash.prebuild(tmp_path, {"kind": "cuda", "arch": "sm_90"}, head_dims=(64,), dtypes=("bfloat16",),
                      score_mods=("none", "softcap"))
    run = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_CUDA_CALLBACK, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"))
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert lines[0].startswith("TVM's callback failed")
    assert lines[1:3] == ["cuda-sm_90-d64-bfloat16-softcap.so True", "cuda-sm_90-d64-bfloat16.so True"]
    assert lines[3].startswith("unknown source:") and "run tvmflash.prebuild on a machine with" in lines[3]


def test_cuda_binaries_are_loaded_only_when_safe_and_unmodified(tmp_path):
    source, binary = "extern \"C\" __global__ void f() {}", b"\x7fELF fake fatbin"
    path = cuda_binaries.write(tmp_path, source, "sm_90", binary)
    assert path.name == cuda_binaries.binary_name(source, "sm_90") and path.suffix == ".fatbin"
    assert cuda_binaries.find(tmp_path, source, "sm_90") == binary
    with pytest.raises(RuntimeError, match="has no binary of these kernels for sm_80"):
        cuda_binaries.find(tmp_path, source, "sm_80")  # named by arch too
    with pytest.raises(RuntimeError, match="has no binary"):
        cuda_binaries.find(tmp_path, source + " ", "sm_90")  # and by the exact source
    path.write_bytes(binary + b"!")
    with pytest.raises(RuntimeError, match="does not match the checksum"):
        cuda_binaries.find(tmp_path, source, "sm_90")
    Path(str(path) + ".json").write_text("{")
    with pytest.raises(RuntimeError, match="is no binary's metadata"):
        cuda_binaries.find(tmp_path, source, "sm_90")
    cuda_binaries.write(tmp_path, source, "sm_90", binary)
    os.chmod(path, 0o664)
    with pytest.raises(RuntimeError, match="writable by group"):
        cuda_binaries.find(tmp_path, source, "sm_90")


RUNTIME_ONLY_MISSING = r"""
import torch
from tvmflash import flash_attn_func, flash_attn_with_kvcache
q = torch.randn(1, 20, 2, 32)
qb = q.bfloat16()
for call in (lambda: flash_attn_func(q, q, q), lambda: flash_attn_func(q, q, q, softcap=5.0),
             lambda: flash_attn_with_kvcache(q[:, :1], q, q),
             lambda: torch.ops.tvmflash.flash_attn_forward(qb, qb, qb, None, None, None, 0.2, -1, -1, 0.0, False, True,
                                                           None)):
    try:
        call()
    except RuntimeError as e:
        print("ERROR", e)
"""


def test_runtime_only_without_a_matching_prebuilt_kernel_says_what_to_prebuild(tmp_path):
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVMFLASH_PREBUILT=str(tmp_path),
               TVMFLASH_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_MISSING], env=env, capture_output=True, text=True,
                         timeout=600)
    errors = [line for line in run.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 4, run.stdout + run.stderr[-3000:]
    plain, softcap, decode, fp32_results = errors
    assert "tvmflash.prebuild(DIR, {'kind': 'llvm'}, head_dims=(32,), dtypes=('float32',))" in plain
    assert f"no kernel in $TVMFLASH_PREBUILT={tmp_path} matches" in plain
    assert "score_mods=('softcap',)) and point $TVMFLASH_PREBUILT at DIR" in softcap
    assert "(the decode kernel of flash_attn_with_kvcache)" in decode
    assert "dtypes=('float32',), decode=True) and point $TVMFLASH_PREBUILT at DIR" in decode
    assert "llvm_get_system_cpu" not in run.stdout + run.stderr
    # (fp32 results of bf16 inputs: ring attention's, and attention sinks' forward, rounded once after the rescale)
    assert "dtypes=('bfloat16',), fp32_results=(True,)) and point $TVMFLASH_PREBUILT at DIR" in fp32_results
