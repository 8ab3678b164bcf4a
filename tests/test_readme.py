"""Every code block of README.md runs as pasted.

Each Python block runs alone in a fresh interpreter, in an empty directory (nothing defined by
another block). Blocks run at the README's sizes except where ``SMALLER`` shrinks a size for
CI's two cores: only numbers change, and each replaced text must occur as stated, so a block
that changes cannot silently escape the test. The ring-attention block runs under torchrun with
two CPU ranks. Shell blocks are checked as far as they can run here (see each test).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# section heading -> (text, replacement, occurrences): smaller sizes, nothing else
SMALLER = {
    "Programmable attention: `flex_attention`": [("N = 8192", "N = 1024", 1),
                                                 ("[3000, 4000, N - 7000]", "[300, 400, N - 700]", 1)],
    "Ring attention over `torch.distributed` (context parallelism)": [("torch.randn(1, 8192, 8, 64)",
                                                                       "torch.randn(1, 1000, 8, 64)", 1)],
    "Use the compiled kernels directly": [("4096", "1000", 2)],
    "Prebuilt kernels (no compiler at run time)": [('head_dims=(64, 128), dtypes=("float16", "bfloat16")',
                                                    'head_dims=(64,), dtypes=("bfloat16",)', 1)],
}
TORCHRUN = {"Ring attention over `torch.distributed` (context parallelism)"}


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(section heading, language, code) of each fenced block, in order."""
    blocks, heading = [], ""
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("```"):
            language, body = line[3:].strip(), []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            blocks.append((heading, language, "\n".join(body) + "\n"))
    return blocks


BLOCKS = code_blocks(README)
PYTHON = {heading: code for heading, language, code in BLOCKS if language == "python"}
SHELL = [code for _, language, code in BLOCKS if language == "bash"]


def test_blocks_are_known():
    """One Python block per section (the key of SMALLER), and every fence tagged."""
    assert all(language in ("python", "bash") for _, language, _ in BLOCKS), [b[:2] for b in BLOCKS]
    headings = [heading for heading, language, _ in BLOCKS if language == "python"]
    assert len(headings) == len(set(headings)), headings
    assert set(SMALLER) <= set(PYTHON) and TORCHRUN <= set(PYTHON), (set(SMALLER) | TORCHRUN) - set(PYTHON)


def _smaller(heading: str, code: str) -> str:
    for old, new, count in SMALLER.get(heading, ()):
        assert code.count(old) == count, f"README block {heading!r}: {old!r} occurs {code.count(old)} times, not {count}"
        code = code.replace(old, new)
    return code


def _env() -> dict:
    return {**os.environ, "TVMFLASH_QUIET": "1"}


@pytest.mark.parametrize("heading", sorted(PYTHON))
def test_python_block_runs_as_pasted(heading, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(_smaller(heading, PYTHON[heading]))
    if heading in TORCHRUN:  # 2 ranks on CPU (gloo); the first comment line says how to run it
        # (--log-dir: else torchrun leaves a torchelastic_* directory of logs in /tmp every run)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--log-dir", str(tmp_path / "torchrun-logs"), str(script)]
    else:
        command = [sys.executable, str(script)]
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"README block {heading!r} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"


def test_setup_commands_are_the_two_and_use_the_venv_explicitly():
    """The two set-up commands (demo, tests) need no activated venv: every tool runs as .venv/bin/...;
    the test command is the one CI runs (.ci/run). Other shell blocks call the venv's tools too."""
    setup = [code for code in SHELL if code.startswith("python3 -m venv .venv")]
    assert len(setup) == 2, SHELL
    assert setup[0].strip().endswith(".venv/bin/python -m tvmflash.demo")
    ci = README.split("<!-- ci: test command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert ci == setup[1].strip()
    for code in SHELL:
        for command in re.split(r"&&|\n", code):
            words = shlex.split(command, comments=True)
            if words and words[0] not in ("python3",):
                assert words[0].startswith(".venv/bin/"), f"{command!r} needs an activated venv; write .venv/bin/..."


def test_tune_command_parses():
    """The README's tuning command (minutes of search: tests/test_tune.py runs the tuner at small
    sizes) names options the tuner has."""
    from tvmflash import tune

    command = next(code for code in SHELL if "tvmflash.tune" in code)
    words = shlex.split(command)
    args = words[words.index("tvmflash.tune") + 1:]
    parsed = tune.command_line().parse_args(args)
    assert parsed.trials > 0 and parsed.target == "llvm"


@pytest.mark.parametrize("module", ["psutil", "xgboost"])
def test_tuner_without_its_extra_names_the_extra(module, monkeypatch, capsys):
    from tvmflash import tune

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=rf"{module}.*pip install 'tvmflash\[tune\]'"):
        tune.require_tune_extra()
    with pytest.raises(SystemExit) as exited:
        tune.main(["--trials", "1"])
    assert exited.value.code == 2
    assert "pip install 'tvmflash[tune]'" in capsys.readouterr().err


def test_transformers_integration_without_transformers_names_the_extra(monkeypatch):
    from tvmflash.integrations import transformers as tvm_hf

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"needs transformers: pip install 'tvmflash\[hf\]'"):
        tvm_hf.register()


def test_older_transformers_than_tested_is_refused_clearly(monkeypatch):
    """README and pyproject claim the oldest transformers tested (tvmflash/version.py); an older
    one gets an ImportError naming both versions (before: 4.56 claimed, untested)."""
    import transformers

    from tvmflash.integrations import transformers as tvm_hf
    from tvmflash.version import MIN_TRANSFORMERS

    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    with pytest.raises(ImportError, match=r"transformers >= 5\.23 .*found transformers 4\.56\.2"):
        tvm_hf.register("tvm_old_transformers")
    assert MIN_TRANSFORMERS == (5, 23)


@pytest.mark.parametrize("entry", ["flash_attn_func", "flash_attn_with_kvcache"])
def test_older_torch_than_tested_is_refused_clearly(entry):
    """README said "any torch >= 2.5 works", untested (the PyTorch layer uses private torch APIs
    that move between releases). The claim is now the tested release, in README, pyproject and
    tvmflash/version.py; a torch older than it gets an ImportError on first use of the PyTorch
    functions, in a fresh process whose torch reports 2.5.1."""
    import tomllib

    from tvmflash.version import MIN_TORCH

    code = ("import torch; torch.__version__ = '2.5.1'\n"
            "import tvmflash\n"
            "try:\n"
            f"    tvmflash.{entry}\n"
            "except ImportError as err:\n"
            "    print('ImportError:', err)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TVMFLASH_QUIET": "1"})
    assert "ImportError: tvmflash needs torch >= 2.13 (the oldest release it is tested with), found torch 2.5.1" in (
        run.stdout), run.stdout + run.stderr
    # a machine whose torch cannot be replaced (the GPU machines) may run it anyway, told so
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TVMFLASH_QUIET": "1", "TVMFLASH_ALLOW_UNTESTED": "1"})
    assert "ImportError" not in run.stdout and run.returncode == 0, run.stdout + run.stderr
    assert "tvmflash runs with torch 2.5.1, older than 2.13" in run.stderr
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}" in deps
    assert f"`torch=={MIN_TORCH[0]}.{MIN_TORCH[1]}.0` is the CPU build the project is tested with, and the oldest" in (
        (ROOT / "README.md").read_text())


def test_benchmark_plots_without_matplotlib_name_the_extra(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'tvmflash\[bench\]'"):
        common.plt()
