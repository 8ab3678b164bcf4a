"""Issue 21's defects (reliability, third pass), each with a regression test: kernels in forked
children and DataLoader workers, ..."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest


def _run_isolated(script: str, tmp_path, *args, env=None, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python in a session of its own; on a hang the whole session (the
    script and every process it forked) is killed, so nothing is left behind."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=tmp_path, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{path.name} {' '.join(args)} hung for {timeout} s (killed)\n{out[-2000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers the script may have left
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# --- 1. fork: TVM's thread pool does not survive it -------------------------------------------------
_FORK_SCRIPT = """
    import os, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import tvmflash

    def inputs():
        g = torch.Generator().manual_seed(int(os.environ["SEED"]))
        q, k, v = (torch.randn(2, 77, 4, 32, generator=g) for _ in range(3))
        return q, k, v, torch.randn(q.shape, generator=g)

    def attention():
        q, k, v, dout = inputs()
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = tvmflash.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
        k_cache, v_cache = (t.detach()[:, :70].clone() for t in (k, v))
        decoded = tvmflash.flash_attn_with_kvcache(q.detach()[:, :1], k_cache, v_cache,
                                                   cache_seqlens=torch.tensor([50, 70], dtype=torch.int32))
        return torch.stack([out.detach(), q.grad, k.grad, v.grad]), decoded

    class Attention(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return attention()

    if __name__ == "__main__":
        mode = sys.argv[1]
        expected = attention()  # TVM's pool is running in this process now
        if mode == "fork":
            pid = os.fork()
            if pid == 0:
                got = attention()
                os._exit(0 if all(torch.equal(a, b) for a, b in zip(got, expected)) else 3)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    sys.exit(f"child exit status {os.waitstatus_to_exitcode(status)}" if status else 0)
                time.sleep(0.05)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            sys.exit("the forked child hung")
        loader = DataLoader(Attention(), batch_size=None, num_workers=2, multiprocessing_context=mode,
                            timeout=240)
        results = list(loader)
        assert len(results) == 4
        for got in results:
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), "a worker computed other values"
        print("ok")
"""


@pytest.mark.parametrize("mode", ["fork", "dataloader-fork", "spawn", "forkserver"])
def test_kernels_run_in_forked_and_spawned_workers(tmp_path, seed, mode):
    """Before: after a kernel ran in a process, the same call in a fork()ed child (a DataLoader
    worker) hung forever. Now every start method computes bitwise what the parent computes:
    flash_attn_func's forward and backward and flash_attn_with_kvcache."""
    run = _run_isolated(_FORK_SCRIPT, tmp_path, mode.removeprefix("dataloader-"), env={"SEED": str(seed)})
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
