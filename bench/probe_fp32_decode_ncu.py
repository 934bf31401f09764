"""fp32 "ieee" decode kernels against cuBLAS SGEMM under Nsight Compute, one launch each:

    ncu --profile-from-start off --clock-control none --section ... \
        python bench/probe_fp32_decode_ncu.py

Profiled (between cudaProfilerStart/Stop, after warm-up), per (M, K, N): `dg.linear` on
fp32 inputs (X's split kernel, then the fused decode kernel) and `F.linear` with TF32 off;
a shape written ``dx:MxKxN`` profiles dX instead (`dg.input_grad(dY [M, N], W [N, K])`, W's
columns read in place, against ``dY @ W``). Arguments: shapes instead of the default ones.
Records: bench/results/tune/fp32-decode-ncu_*.txt.
"""
import sys

import torch
import torch.nn.functional as F
from ncu_common import profiled

import detgemm_cute as dg

SHAPES = ["1x4096x4096", "1x18944x3584", "16x4096x4096", "64x4096x4096"]


def calls(spec: str):
    """The detgemm call and its cuBLAS peer for one ``[dx:]MxKxN`` problem."""
    op, _, dims = spec.rpartition(":")
    m, k, n = (int(v) for v in dims.split("x"))
    w = torch.randn(n, k, device="cuda") * k ** -0.5
    if op == "dx":
        dy = torch.randn(m, n, device="cuda")
        return (lambda: dg.input_grad(dy, w)), (lambda: dy @ w)
    x = torch.randn(m, k, device="cuda")
    return (lambda: dg.linear(x, w)), (lambda: F.linear(x, w))


torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
profiled([call for spec in (sys.argv[1:] or SHAPES) for call in calls(spec)])
