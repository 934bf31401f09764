"""Cold start: the first call of new buckets in fresh processes, with the on-disk kernel
cache empty, filled by an earlier process, and turned off.

Each child process imports torch, initialises CUDA, imports detgemm_cute and times its first
`linear` call for M = 1, 200 and 2048 (three different buckets, 4096x4096 weights); it also
reports whether the DSL (`cutlass`) had to be imported. Needs a GPU.

    python bench/bench_coldstart.py
"""
import os, subprocess, sys, tempfile, time
CHILD = r'''
import time, os, sys
import torch
torch.empty(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
import detgemm_cute as dg
t2 = time.perf_counter()
res = []
for m in map(int, sys.argv[1].split(",")):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    y = dg.linear(x, w); torch.cuda.synchronize()
    res.append(f"M={m}: {time.perf_counter()-t3:.3f}s")
print(f"RESULT import={t2-t1:.3f}s first calls: {', '.join(res)} dsl-imported={'cutlass' in sys.modules}")
'''
def run(env, ms, label):
    e = dict(os.environ); e.update(env)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, ms], env=e, capture_output=True, text=True)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    print(f"{label:48s} {line[0] if line else p.stderr[-800:]}  (process {time.perf_counter()-t:.1f}s)", flush=True)

home = tempfile.mkdtemp()
base = {"XDG_CACHE_HOME": home}
base.pop("DETGEMM_CUTE_AOT_DIR", None)
os.environ.pop("DETGEMM_CUTE_AOT_DIR", None)
run({**base, "CUTE_DSL_CACHE_DIR": tempfile.mkdtemp()}, "1,200,2048", "default cache, empty: 3 new buckets")
run({**base, "CUTE_DSL_CACHE_DIR": tempfile.mkdtemp()}, "1,200,2048", "default cache, 2nd process")
run({**base, "CUTE_DSL_CACHE_DIR": tempfile.mkdtemp()}, "1,200,2048", "default cache, 3rd process")
run({"DETGEMM_CUTE_AOT_DIR": "off", "CUTE_DSL_CACHE_DIR": tempfile.mkdtemp()}, "1,200,2048", "cache off")
