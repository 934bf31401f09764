"""Host overhead at 64x64x64 bf16 (bmm: 8 x 64x64x64), broken down: host time per call of 3000 calls (median of
7 repetitions) for torch's ops, a bare `torch.empty`, the bare TVM-FFI kernel call, the
plan key, and detgemm's public functions and custom op. Needs a GPU.

    python bench/bench_overhead.py
"""
import time, statistics, torch
import detgemm_cute as dg
from detgemm_cute import gemm as G
x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
wt = w.t(); b = torch.randn(64, device="cuda", dtype=torch.bfloat16)
dg.linear(x, w); dg.mm(x, wt); dg.linear(x, w, b)
key = G._key(x, w, "nk", None, None, "fwd"); plan = G._plans[key]
c = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
def t(fn, n=3000, reps=7):
    for _ in range(n): fn()
    torch.cuda.synchronize()
    r = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n): fn()
        t1 = time.perf_counter(); torch.cuda.synchronize()
        r.append((t1 - t0) / n * 1e6)
    return statistics.median(r)
rows = {
 "torch.mm(x, w.t())": lambda: torch.mm(x, wt),
 "F.linear(x, w)": lambda: torch.nn.functional.linear(x, w),
 "torch.empty(64,64)": lambda: torch.empty((64, 64), dtype=torch.bfloat16, device=x.device),
 "kernel fn only (TVM-FFI)": lambda: plan.fn(x, w, c, None, plan.max_clusters),
 "G._key": lambda: G._key(x, w, "nk", None, None, "fwd"),
 "dg.mm(x, w.t())": lambda: dg.mm(x, wt),
 "dg.linear(x, w)": lambda: dg.linear(x, w),
 "dg.linear(x, w, b)": lambda: dg.linear(x, w, b),
 "torch.ops.detgemm.linear": lambda: torch.ops.detgemm.linear(x, w, None, None),
 "torch.bmm(a, b)": lambda: torch.bmm(a3, b3),
 "dg.bmm(a, b)": lambda: dg.bmm(a3, b3),
}
a3 = torch.randn(8, 64, 64, device="cuda", dtype=torch.bfloat16)
b3 = torch.randn(8, 64, 64, device="cuda", dtype=torch.bfloat16)
dg.bmm(a3, b3)
for name, fn in rows.items():
    print(f"{name:32s} {t(fn):7.2f} us/call (enqueue)", flush=True)
# The same calls through batch_invariant_mode's aten overrides (what a model pays per matmul)
with dg.batch_invariant_mode():
    for name, fn in {"mode: torch.mm(x, w.t())": lambda: torch.mm(x, wt),
                     "mode: F.linear(x, w)": lambda: torch.nn.functional.linear(x, w),
                     "mode: torch.bmm(a, b)": lambda: torch.bmm(a3, b3)}.items():
        print(f"{name:32s} {t(fn):7.2f} us/call (enqueue)", flush=True)
