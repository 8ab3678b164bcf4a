"""GPU check of tvmflash: correctness, speed vs PyTorch SDPA, and one 512K-token head.

    python benchmarks/gpu_check.py --out-dir $OUT          # on a machine with one NVIDIA GPU
    python benchmarks/gpu_check.py --device cpu --quick    # the same code on CPU kernels
    python benchmarks/gpu_check.py --help                  # stages, rules, options

The code is the package ``benchmarks/gpucheck`` (its docstring describes the check).
"""

import sys

from gpucheck.orchestrate import main

if __name__ == "__main__":
    sys.exit(main())
