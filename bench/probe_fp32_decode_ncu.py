"""fp32 "ieee" decode kernels against cuBLAS SGEMM under Nsight Compute, one launch each:

    ncu --profile-from-start off --clock-control none --section ... \
        python bench/probe_fp32_decode_ncu.py

Profiled (between cudaProfilerStart/Stop, after warm-up), per (M, K, N): `dg.linear` on
fp32 inputs (X's split kernel, then the fused decode kernel) and `F.linear` with TF32 off.
Arguments: MxKxN shapes instead of the default ones. Record:
bench/results/tune/fp32-decode-ncu_*.txt.
"""
import sys

import torch
import torch.nn.functional as F
from ncu_common import profiled

import detgemm_cute as dg

SHAPES = [(1, 4096, 4096), (1, 18944, 3584), (16, 4096, 4096), (64, 4096, 4096)]
if len(sys.argv) > 1:
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]]
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
data = [(torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") * k ** -0.5)
        for m, k, n in SHAPES]
profiled([call for x, w in data
          for call in (lambda x=x, w=w: dg.linear(x, w), lambda x=x, w=w: F.linear(x, w))])
