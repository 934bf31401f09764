"""`detgemm-cute demo`: the contract, proven live on this machine.

A short story first: what is promised, then each promise checked bit for bit here --
batch invariance (rows at several M against the same rows of one big call), chunked
prefill, and dW accumulated over micro-batches. With an SM90 GPU (H100/H200) or an SM80+
GPU the kernels run (with timings against cuBLAS); without one, the bit-exact CPU reference
of the same kernels runs on small shapes (a few seconds). `--audit` adds the full audit of
the dispatch tables and the explanation of two dispatch choices.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

import torch

PROMISE = """\
Promised: every output element is one fixed chain (fp32 accumulation over K in ascending
16-wide blocks, no split-K, one rounding), whatever tile computes it. So row i of
linear(x, w) depends only on row i of x and on w (any batch size, any chunking), and dW
accumulated over micro-batches of a multiple of 16 tokens equals one call on all of them."""


@dataclass(frozen=True)
class Setup:
    device: str
    k: int
    n: int
    full_m: int
    ms: tuple
    chunks: tuple  # row counts of a chunked prefill, summing to full_m
    timed: bool


CPU = Setup("cpu", 512, 256, 256, (1, 3, 16, 64, 200), (16, 112, 128), timed=False)
GPU = Setup("cuda", 4096, 4096, 4096, (1, 3, 16, 64, 128, 512, 2048), (777, 1271, 2048),
            timed=True)


def _gpu_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _yes(ok: bool, no: str = "NO") -> str:
    return "yes" if ok else no


def _time_us(fn, reps=21):
    from .benchlib.timing import eager_median_us

    return eager_median_us(fn, reps)


def _rows(s: Setup, x, w, arch) -> bool:
    """Rows of x[:M] @ w^T against the same rows of the full call, detgemm and torch."""
    import torch.nn.functional as F

    import detgemm_cute as dg
    from detgemm_cute import dispatch

    full_d, full_t = dg.linear(x, w), F.linear(x, w)
    print(f"\n1. Batch invariance: rows of x[:M] @ w^T vs the same rows at M={s.full_m} "
          f"(K={s.k}, N={s.n}, bf16)")
    head = f"{'M':>6}  {'detgemm same':>12}  {'torch same':>10}"
    print(head + (f"  {'bucket':32}  {'detgemm us':>10}  {'torch us':>8}" if s.timed else ""))
    ok = True
    for m in s.ms:
        xm = x[:m]
        same_d, same_t = _same(dg.linear(xm, w), full_d[:m]), _same(F.linear(xm, w), full_t[:m])
        ok &= same_d
        line = f"{m:6d}  {_yes(same_d):>12}  {_yes(same_t, 'no'):>10}"
        if s.timed:
            bucket = dispatch.lookup("fwd", "bf16", arch, m, s.n, s.k).name
            line += (f"  {bucket[:32]:32}  {_time_us(lambda: dg.linear(xm, w)):10.1f}  "
                     f"{_time_us(lambda: F.linear(xm, w)):8.1f}")
        print(line)
    return ok


def _chunked(s: Setup, x, w) -> bool:
    import detgemm_cute as dg

    parts, r = [], 0
    for c in s.chunks:
        parts.append(dg.linear(x[r:r + c], w))
        r += c
    ok = _same(torch.cat(parts), dg.linear(x, w))
    sizes = " + ".join(map(str, s.chunks))
    print(f"2. Chunked prefill: {s.full_m} rows as {sizes} vs one call: "
          f"{'bit-identical' if ok else 'DIFFERENT'}")
    return ok


def _micro_batches(s: Setup, g) -> bool:
    import detgemm_cute as dg

    tokens = s.full_m
    dy = torch.randn(tokens, s.n, device=s.device, generator=g).bfloat16()
    x = torch.randn(tokens, s.k, device=s.device, generator=g).bfloat16()
    whole = dg.weight_grad(dy, x)
    acc = torch.zeros(s.n, s.k, device=s.device)
    cut = [0, 16, tokens // 2, tokens]
    for a, b in zip(cut, cut[1:]):
        dg.weight_grad(dy[a:b], x[a:b], acc=acc)
    ok = torch.equal(acc.view(torch.int32), whole.view(torch.int32))
    sizes = " + ".join(str(b - a) for a, b in zip(cut, cut[1:]))
    print(f"3. dW += dY^T X over micro-batches of {sizes} tokens (fp32 buffer) vs one call: "
          f"{'bit-identical' if ok else 'DIFFERENT'}")
    return ok


def _more(s: Setup, g) -> bool:
    """bmm entries and fp32 rows: one line each."""
    import detgemm_cute as dg

    q = torch.randn(6, 16, 64, device=s.device, generator=g).bfloat16()
    k = torch.randn(6, 32, 64, device=s.device, generator=g).bfloat16()
    bmm_ok = _same(dg.bmm(q[2:3], k[2:3].transpose(1, 2)), dg.bmm(q, k.transpose(1, 2))[2:3])
    x = torch.randn(48, 512, device=s.device, generator=g)
    w = torch.randn(64, 512, device=s.device, generator=g)
    y = dg.linear(x, w)
    fp32_ok = torch.equal(dg.linear(x[5:6], w).view(torch.int32), y[5:6].view(torch.int32))
    print(f"4. bmm entry 2 alone vs in a batch of 6: {'bit-identical' if bmm_ok else 'DIFFERENT'}"
          f"; fp32 row 5 alone vs in a batch of 48: {'bit-identical' if fp32_ok else 'DIFFERENT'}")
    return bmm_ok and fp32_ok


def story(s: Setup, arch: str | None) -> bool:
    g = torch.Generator(device=s.device).manual_seed(0)
    x = torch.randn(s.full_m, s.k, device=s.device, generator=g).bfloat16()
    w = (torch.randn(s.n, s.k, device=s.device, generator=g) / s.k ** 0.5).bfloat16()
    ok = _rows(s, x, w, arch)
    print()
    ok &= _chunked(s, x, w)
    ok &= _micro_batches(s, g)
    ok &= _more(s, g)
    return ok


def _audit() -> int:
    from detgemm_cute import tables

    print("\n== audit of the dispatch tables")
    rc = tables.audit(None, (), print, _err)
    print("\n== which bucket serves a decode step and a prefill (sm90)")
    for m in (1, 4096):
        try:
            print(tables.explain("fwd", "bf16", "sm90", m, 4096, 4096))
        except tables.USER_ERRORS as e:
            _err(str(e))
            rc = 1
    return rc


def _tables_ok() -> bool:
    """Every kernel family's table loads (an installation without its tables fails here,
    before any promise is checked, even where only the CPU reference would run)."""
    from detgemm_cute import tables

    rc = tables.audit(None, (), lambda *_: None, _err)
    return rc == 0


def _err(msg: str) -> None:
    for line in msg.splitlines():
        print(f"detgemm-cute: {line}", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="detgemm-cute demo", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rows timed (GPU)")
    p.add_argument("--audit", action="store_true",
                   help="also print the full audit of the dispatch tables")
    args = p.parse_args(argv or [])
    if not _tables_ok():
        return 1
    print(PROMISE)
    if _gpu_ok():
        from detgemm_cute.gemm import arch_of

        arch = arch_of(torch.device("cuda"))
        print(f"\nHere: {torch.cuda.get_device_name()}, kernel family {arch}: the kernels run.")
        setup = replace(GPU, ms=(1, 16, 512)) if args.quick else GPU
    else:
        arch, setup = None, CPU
        print("\nHere: no SM90 or SM80+ GPU, so the bit-exact CPU reference of the kernels "
              "runs (small shapes;\nthe kernels need an H100/H200 or an A100-class GPU or newer).")
    ok = story(setup, arch)
    print("\nverdict: " + ("every promise held, bit for bit, on this machine" if ok else
                           "a promise FAILED here (a bug: please report it with this output)"))
    rc = _audit() if args.audit else 0
    if not args.audit:
        print("More: `detgemm-cute demo --audit` (every dispatch bucket), `detgemm-cute explain "
              "--op fwd 100 4096 4096`,\nREADME.md and docs/.")
    return 0 if ok and rc == 0 else 1
