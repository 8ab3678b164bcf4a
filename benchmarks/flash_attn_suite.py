"""Run flash-attn's own test suite (tests/test_flash_attn.py) against tvmflash on CPU tensors.

    pip install einops   # the suite's one extra dependency
    python benchmarks/flash_attn_suite.py --repo /path/to/flash-attention [--per-test 40] [--seed 0]
        [--tests test_flash_attn_output test_flash_attn_varlen_output ...] [--markdown FILE]

flash-attn's tests are the reference for its API's semantics (window_size, softcap, ALiBi,
varlen, GQA, return values). This script reads them from a flash-attention checkout (nothing of
them is copied into tvmflash), and runs them in a temporary directory where

* ``import flash_attn`` is a small shim package exporting tvmflash's functions, with our own
  ``pad_input`` / ``unpad_input`` / ``apply_rotary_emb`` helpers (the tests use them to build
  inputs and references);
* the test file is rewritten for the CPU: ``device="cuda"`` -> ``"cpu"``, the GPU capability
  queries answer sm80 with plenty of memory;
* each test function runs a deterministic random sample of ``--per-test`` of its parametrizations
  (the full grid is ~100k cases, days of CPU time); cases we do not support by design are
  deselected and counted: dropout > 0 (tvmflash has no dropout), paged KV outside
  ``flash_attn_with_kvcache`` and ``flash_attn_varlen_func``, flash-attn's private C++ entry points.

The tests' own assertions are flash-attn's rule: error vs an fp32 reference <= 2x (3x for the
gradients) the error of PyTorch in the same 16-bit dtype. Prints a table of passed / failed /
deselected per test function; exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, markdown_table  # noqa: E402

# --- the shim package ---------------------------------------------------------------------------
SHIM_INIT = '''
import tvmflash
from tvmflash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                      flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                      flash_attn_varlen_qkvpacked_func)

flash_attn_with_kvcache = getattr(tvmflash, "flash_attn_with_kvcache", None)
'''

SHIM_INTERFACE = '''
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    return 64  # used by the tests only to decode dropout masks, which tvmflash does not produce
'''

SHIM_BERT_PADDING = '''
import torch


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(total, ...) rows of the kept tokens, their flat indices, cu_seqlens, max length, used lengths."""
    keep = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    lengths = keep.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max()), attention_mask.sum(-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)  # differentiable
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
'''

SHIM_ROTARY = '''
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, heads, dim); cos, sin (seqlen_ro, rotary_dim / 2): rotate the first
    rotary_dim features of each position (GPT-NeoX halves, or GPT-J interleaved pairs)."""
    assert cu_seqlens is None, "the shim supports padded batches only"
    rotary_dim = 2 * cos.shape[-1]
    seqlen = x.shape[1]
    offsets = torch.as_tensor(seqlen_offsets).reshape(-1, 1) + torch.arange(seqlen)
    c, s = cos[offsets].unsqueeze(-2), sin[offsets].unsqueeze(-2)  # (batch or 1, seqlen, 1, rd / 2)
    rot = x[..., :rotary_dim].float()
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
        rotated = torch.cat((a * c - b * s, a * s + b * c), -1)
    out = torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), -1)
    if inplace:
        x.copy_(out)
        return x
    return out
'''

CONFTEST = '''
import random

import pytest

PER_TEST = {per_test}
SEED = {seed}
UNSUPPORTED = (
    (lambda p: float(p.get("dropout_p", 0.0)) > 0.0, "dropout (tvmflash has no dropout)"),
    (lambda p: p.get("paged_kv_block_size") is not None and "kvcache" not in p["__name__"]
     and "varlen" not in p["__name__"], "paged KV outside flash_attn_with_kvcache and flash_attn_varlen_func"),
    (lambda p: p["__name__"] in ("test_flash_attn_varlen_paged_kv_num_splits",
                                 "test_flash_attn_generator_arg_must_be_none"),
     "flash-attn's private C++ entry points (_flash_attn_varlen_forward, flash_attn_gpu)"),
)


def pytest_collection_modifyitems(config, items):
    by_function, deselected = {{}}, []
    for item in items:
        params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {{}}
        params["__name__"] = item.originalname
        reason = next((why for test, why in UNSUPPORTED if test(params)), None)
        if reason is not None:
            deselected.append(item)
            item.user_properties.append(("unsupported", reason))
            continue
        by_function.setdefault(item.originalname, []).append(item)
    kept = []
    rng = random.Random(SEED)
    for name in sorted(by_function):
        cases = by_function[name]
        kept += cases if len(cases) <= PER_TEST else rng.sample(cases, PER_TEST)
    counts = {{}}
    for item in deselected:
        counts[item.originalname] = counts.get(item.originalname, 0) + 1
    with open("deselected.txt", "w") as f:
        for name, n in sorted(counts.items()):
            f.write(f"{{name}} {{n}}\\n")
        for name, cases in sorted(by_function.items()):
            f.write(f"{{name}}.grid {{len(cases)}}\\n")
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = kept
'''


def cpu_test_file(source: str) -> str:
    """flash-attn's test module with the GPU queries answered for a CPU run."""
    source = source.replace('torch.cuda.get_device_capability("cuda")', "(8, 0)")
    source = re.sub(r'torch\.cuda\.get_device_properties\("cuda"\)\.total_memory', "(1 << 40)", source)
    source = source.replace('device="cuda"', 'device="cpu"').replace("device = \"cuda\"", "device = \"cpu\"")
    source = source.replace("torch.cuda.synchronize()", "None")
    # test_flash_attn_race_condition repeats a batch-60 call 250 times to catch GPU races
    # (~100 TFLOP per case on a CPU); 3 repeats still check that repeated calls agree bitwise
    source = source.replace("for i in range(250):", "for i in range(3):")
    return source


def write_shim(root: Path, per_test: int, seed: int, test_source: str) -> None:
    package = root / "flash_attn"
    (package / "layers").mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(SHIM_INIT))
    (package / "flash_attn_interface.py").write_text(textwrap.dedent(SHIM_INTERFACE))
    (package / "bert_padding.py").write_text(textwrap.dedent(SHIM_BERT_PADDING))
    (package / "layers" / "__init__.py").write_text("")
    (package / "layers" / "rotary.py").write_text(textwrap.dedent(SHIM_ROTARY))
    (root / "conftest.py").write_text(CONFTEST.format(per_test=per_test, seed=seed))
    (root / "test_flash_attn.py").write_text(cpu_test_file(test_source))


def summarize(root: Path) -> dict[str, Counter]:
    results: dict[str, Counter] = {}
    for case in ET.parse(root / "results.xml").getroot().iter("testcase"):
        name = case.get("name").split("[")[0]
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        results.setdefault(name, Counter())[outcome] += 1
    for line in (root / "deselected.txt").read_text().splitlines():
        name, n = line.split()
        key = "grid" if name.endswith(".grid") else "unsupported"
        results.setdefault(name.removesuffix(".grid"), Counter())[key] += int(n)
    return results


def failures(root: Path, limit: int = 20) -> list[str]:
    found = []
    for case in ET.parse(root / "results.xml").getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None and len(found) < limit:
            message = (bad.get("message") or "").splitlines()[0][:200]
            found.append(f"{case.get('name')}: {message}")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=os.environ.get("FLASH_ATTN_REPO"),
                   help="a flash-attention checkout (default: $FLASH_ATTN_REPO)")
    p.add_argument("--per-test", type=int, default=40, help="parametrizations sampled per test function")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tests", nargs="*", default=None, help="test functions to run (default: all)")
    p.add_argument("--timeout", type=int, default=7200)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    if not args.repo or not (Path(args.repo) / "tests" / "test_flash_attn.py").exists():
        p.error("--repo must point at a flash-attention checkout (with tests/test_flash_attn.py)")
    try:
        import einops  # noqa: F401
    except ImportError:
        p.error("flash-attn's tests need einops: pip install einops")

    root = Path(tempfile.mkdtemp(prefix="tvmflash-fa-suite-"))
    try:
        write_shim(root, args.per_test, args.seed, (Path(args.repo) / "tests" / "test_flash_attn.py").read_text())
        selection = ["-k", " or ".join(args.tests)] if args.tests else []
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=results.xml",
                   "test_flash_attn.py", *selection]
        env = {**os.environ, "TVMFLASH_QUIET": "1",
               "PYTHONPATH": os.pathsep.join([str(root), str(Path(__file__).resolve().parents[1]),
                                              *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=args.timeout)
        if not (root / "results.xml").exists():
            print(proc.stdout[-5000:], proc.stderr[-5000:])
            return 2
        results = summarize(root)
        bad = failures(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = [(name, c["passed"], c["failed"], c["skipped"], c["unsupported"], c["grid"])
            for name, c in sorted(results.items()) if c["passed"] + c["failed"] + c["skipped"]]
    total = Counter()
    for c in results.values():
        total.update(c)
    lines = [f"machine: {machine()}", f"command: python benchmarks/flash_attn_suite.py {' '.join(argv or sys.argv[1:])}",
             "", markdown_table(["test", "passed", "failed", "skipped", "deselected (unsupported)",
                                 "supported grid (sampled from)"], rows), "",
             f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped by the tests "
             f"themselves, {total['unsupported']} unsupported by design (not run)"]
    if bad:
        lines += ["", "first failures:", *(f"- {line}" for line in bad)]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
