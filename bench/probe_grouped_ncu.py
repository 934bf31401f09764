"""The grouped kernel against the dense one and cuBLAS at Mixtral 8x7B's up projection
(8 experts x ~1024 rows, K = 4096, N = 14336), one launch each, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --metrics M python bench/probe_grouped_ncu.py

Profiled (between cudaProfilerStart/Stop, after warm-up): `dg.grouped_mm` on the 8 groups,
`dg.mm` on 4096 and on 1024 rows with one expert's weight, `torch.mm` on 1024 rows (cuBLAS,
one GEMM of the per-expert loop). Record: bench/results/tune/grouped-mixtral-ncu_*.txt.
"""
import torch
import detgemm_cute as dg
torch.manual_seed(0)
E, T, K, N = 8, 8192, 4096, 14336
x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) * K ** -0.5
sizes = torch.full((E,), T // E, dtype=torch.int64)
sizes[0] += 37; sizes[1] -= 37
offs = sizes.cumsum(0).to(torch.int32).cuda()
wd = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    dg.grouped_mm(x, w, offs); dg.mm(x[:4096], wd); dg.mm(x[:1024], wd); torch.mm(x[:1024], wd)
torch.cuda.synchronize()
torch.cuda.profiler.start()
dg.grouped_mm(x, w, offs)   # grouped, 8 x ~1024 rows
dg.mm(x[:4096], wd)         # dense, 4096 rows
dg.mm(x[:1024], wd)         # dense, 1024 rows
torch.mm(x[:1024], wd)      # cuBLAS, 1024 rows (one expert of the loop)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
