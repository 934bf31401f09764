"""Timing check for the direct-store epilogue (branch wip/c-direct): q @ k^T at odd sequence
lengths and fwd with odd output widths, detgemm against torch.bmm / cuBLASLt no split-K."""
import torch, detgemm_cute as dg
from detgemm_cute.benchlib.timing import QUICK_PLAN, time_units
from detgemm_cute.benchlib.peers import LtNoSplit
cap = torch.cuda.Stream()
B = torch.bfloat16
for lb, s, d in [(288, 333, 64), (80, 1500, 64), (80, 1500, 256), (24, 2500, 128), (16, 3500, 128), (96, 777, 128)]:
    sets = [(torch.randn(lb, s, d, device="cuda", dtype=B), torch.randn(lb, s, d, device="cuda", dtype=B).transpose(1, 2)) for _ in range(3)]
    r = time_units({"torch": lambda st: torch.bmm(*st), "det": lambda st: dg.bmm(*st)}, sets, QUICK_PLAN, cap)
    ok = torch.equal(dg.bmm(*sets[0])[1].view(torch.int16), dg.mm(sets[0][0][1], sets[0][1][1]).view(torch.int16))
    print(f"qk L={lb} S={s} d={d}: torch {r['torch']['us']:.1f} det {r['det']['us']:.1f} -> {r['torch']['us']/r['det']['us']:.2f}x entry==mm {ok}", flush=True)
lt = LtNoSplit()
def ltf(st):
    with lt:
        return torch.mm(st[0], st[1].t())
for m, k, n in [(450, 768, 50257), (1, 4096, 32001), (2048, 4096, 151655), (700, 4096, 1001)]:
    sets = [(torch.randn(m, k, device="cuda", dtype=B), torch.randn(n, k, device="cuda", dtype=B)) for _ in range(2)]
    r = time_units({"torch": lambda st: torch.mm(st[0], st[1].t()), "lt": ltf, "det": lambda st: dg.mm(st[0], st[1].t())}, sets, QUICK_PLAN, cap)
    print(f"fwd {m}x{k}->{n}: torch {r['torch']['us']:.1f} lt {r['lt']['us']:.1f} det {r['det']['us']:.1f} -> {r['lt']['us']/r['det']['us']:.2f}x Lt", flush=True)
