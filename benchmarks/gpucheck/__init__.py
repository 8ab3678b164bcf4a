"""GPU check of tvmflash: correctness, speed vs PyTorch SDPA, and one 512K-token head.

Made to run in one call of at most 8 minutes on a machine with one NVIDIA GPU (an H200):

    python benchmarks/gpu_check.py --out-dir $OUT                # everything, --budget-s 450
    python benchmarks/gpu_check.py --quick --out-dir $OUT        # fewer cases, a few minutes less
    python benchmarks/gpu_check.py --cases "N=8192,D=128,dtype=bfloat16" --stages speed
    python benchmarks/gpu_check.py --device cpu --quick          # same code on CPU, tiny shapes (tests)
    python benchmarks/gpu_check.py --precompile-only --arch sm_90   # fill $TVMFLASH_CACHE_DIR, no GPU

Stages (each runs in its own child process, so a crash, a hang or a poisoned CUDA context in one
is reported and the next still runs; a stage that outlives its time is killed and what it had
written is kept):

0. compile: every kernel the run needs (CUDA: per dtype, head dim and mask; CPU kernels take the
   mask per call: per dtype and head dim), in parallel processes (--jobs), into the disk cache;
   the stages then load the kernels from it instead of compiling one by one.
1. correctness: forward and backward on random shapes (odd lengths, seqlen_q != seqlen_k, causal
   and not, GQA/MQA, rows that see no key) against float64 PyTorch, by the flash-attn rule:
       max|ours - f64| <= 2 * max|torch_same_dtype - f64| + ULPS * eps(dtype) * magnitude
   where torch_same_dtype is plain (materialized) attention in the input dtype, eps(fp16) =
   2^-10, eps(bf16) = 2^-7, ULPS = 4, and magnitude = max(1, max|f64|, the size of the terms
   summed or cancelled on the way: max|v| for out, max|dout| for dv, scale * max_ij sum_d
   |dout_id v_jd| * max|k| (|q|) for dq (dk)) -- the rule of tests/test_attention.py. lse (fp32)
   must be finite exactly where the reference is and pass the same rule with eps(fp32). The
   reference is ``tvmflash.reference.reference_attention``.
   --deterministic also passes deterministic=True and checks that two backwards agree bitwise.
2. speed: TFLOP/s of tvmflash vs scaled_dot_product_attention with the FLASH backend
   (FlashAttention-2 inside PyTorch) and the cuDNN backend (a backend that cannot run a case is
   skipped with its error), N = 1K..16K, D = 64/128, causal and not, bf16 and fp16; batch =
   16384 // N and heads = 2048 // D (flash-attn's benchmark convention: 16K tokens, 2048
   channels). Forward and forward+backward are timed separately by
   ``tvmflash.reference.median_times`` (after a warm-up, the implementations interleaved round by
   round, the median over rounds; on CUDA the clock stops after a synchronize, and a call shorter
   than a few ms is repeated inside one timing so that the synchronize does not count);
   backward = (fwd+bwd) - fwd. FLOPs (flash-attn's count): forward 4 * B * H * Nq * Nk * D,
   halved when causal; backward 2.5x forward. Ratios are ours/ref in TFLOP/s (> 1: tvmflash
   faster). Each case also compares our output with the first reference (max abs diff).
3. long: one head (B = H = 1, D = 128, bf16, not causal) of --long-n = 524288 tokens, forward
   and forward+backward with our op: times and torch.cuda.max_memory_allocated, a float64 check
   of a few sampled query rows, and what standard attention would need: it keeps P = softmax(S)
   (B * H * N^2 elements) for the backward, and S and P (or P and dP/dS) are alive together, so
       standard bytes >= B * H * N^2 * sizeof(dtype)  (P alone)   ~ 2x that at its peak.
   If the time estimated from the speed stage does not fit the remaining budget, a smaller
   power-of-two N is used and said so. SDPA FLASH runs the same case if time is left.

A compact markdown table is printed last; every measurement, the environment (GPU, driver,
torch/CUDA/cuDNN/TVM versions, git commit) and notes go to --out-dir: gpu_check.json (all),
gpu_check.md (the table), stage_<name>.json (each stage, written as it goes). --budget-s bounds
the whole run: stages skip their remaining cases, with a note, once their share is spent.

Modules: ``cli`` (arguments), ``cases`` (the grids, inputs, FLOPs), ``compiling``,
``correctness``, ``speed`` and ``long`` (one stage each), ``stage`` (what they share: budget,
per-case records, the child process), ``orchestrate`` (runs the stages, in this process or in
children; the compile stage's workers, the environment) and ``report`` (summary and markdown). Everything runs with TVM's runtime alone (the GPU machine has
no TVM compiler): tvmflash's ``reference``, ``torch_op`` and ``compile`` (loading prebuilt or
cached kernels) do, ``tvmflash.analysis`` does not.
"""
