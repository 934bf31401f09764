"""`detgemm-cute demo`: the contract, shown on this machine.

With an SM80+ GPU (SM90 kernels on H100/H200, SM80 kernels on 8.x GPUs): GEMMs at several M, rows compared bitwise with the same rows computed at
M=4096, for detgemm and for cuBLAS (torch), with timings. Without one: the dispatch audit, an
explain, and real deterministic GEMMs through the bit-exact CPU reference.
"""

from __future__ import annotations

import argparse
import sys

import torch

M_LIST = [1, 3, 16, 64, 128, 512, 2048, 4096]


def _gpu_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def _same_rows(part, full):
    return torch.equal(part.view(torch.int16), full[: part.shape[0]].view(torch.int16))


def _time_us(fn, reps=21):
    from .benchlib.timing import eager_median_us

    return eager_median_us(fn, reps)


def _gpu_demo(quick: bool) -> int:
    import torch.nn.functional as F

    import detgemm_cute as dg
    from detgemm_cute import dispatch
    from detgemm_cute.gemm import arch_of

    arch = arch_of(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()}, kernel family {arch}")
    shapes = [(4096, 4096)] if quick else [(4096, 4096), (14336, 4096)]
    all_det, cublas_broke = True, False
    for k, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(4096, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        full_det, full_cub = dg.linear(x, w), F.linear(x, w)
        print(f"\nK={k} N={n}: rows of X[:M] @ W^T vs the same rows at M=4096 (bitwise)")
        print(f"{'M':>5} {'bucket':24} {'detgemm same':>12} {'cuBLAS same':>11} "
              f"{'detgemm us':>10} {'cuBLAS us':>9}")
        for m in M_LIST:
            xm = x[:m]
            same_d = _same_rows(dg.linear(xm, w), full_det)
            same_c = _same_rows(F.linear(xm, w), full_cub)
            all_det &= same_d
            cublas_broke |= not same_c
            bucket = dispatch.lookup("fwd", "bf16", arch, m, n, k).name
            td, tc = _time_us(lambda: dg.linear(xm, w)), _time_us(lambda: F.linear(xm, w))
            print(f"{m:5d} {bucket:24} {'yes' if same_d else 'NO':>12} "
                  f"{'yes' if same_c else 'no':>11} {td:10.1f} {tc:9.1f}")
    print("\nverdict: detgemm rows are " + ("bit-identical at every M" if all_det else
                                            "NOT identical (a bug: please report)")
          + "; cuBLAS rows " + ("changed with M" if cublas_broke else "did not change here"))
    return 0 if all_det else 1


def _cpu_demo() -> int:
    from detgemm_cute import reference, tables

    print("No SM90 or SM80+ GPU found: the detgemm kernels need an H100/H200 (SM90 family) or "
          "an A100-class GPU or newer (SM80 family). Running what works here:\n")
    print("== 1. audit of the dispatch tables")
    rc = tables.audit(None, (), print, _err)
    print("\n== 2. which bucket serves a decode step and a prefill")
    for m in (1, 4096):
        try:
            print(tables.explain("fwd", "bf16", "sm90", m, 4096, 4096))
        except tables.USER_ERRORS as e:
            _err(str(e))
            rc = 1
    print("\n== 3. deterministic GEMMs on the CPU (detgemm_cute.reference)")
    print("The reference reproduces the SM90 WGMMA chain bit for bit: fp32 accumulation over K "
          "in ascending 16-wide blocks, bias added in fp32, one rounding.")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g).bfloat16()
    w = (torch.randn(256, 512, generator=g) / 512 ** 0.5).bfloat16()
    full = reference.linear(x, w)
    part = reference.linear(x[:8], w)
    same = _same_rows(part, full)
    print(f"rows of X[:8] @ W^T vs the same rows of X[:64] @ W^T: "
          f"{'bit-identical' if same else 'DIFFERENT'}")
    same &= _cpu_grad_demo(g)
    same &= _cpu_bmm_demo(g)
    same &= _cpu_fp32_demo(g)
    return 0 if (same and rc == 0) else 1


def _err(msg: str) -> None:
    for line in msg.splitlines():
        print(f"detgemm-cute: {line}", file=sys.stderr)


def _cpu_grad_demo(g) -> bool:
    """dW += dY^T X continued in an fp32 buffer: micro-batches of 16 + 48 tokens give the
    bits of one 64-token call (CPU tensors run the same reference chain)."""
    import detgemm_cute as dg

    print("\n== 4. training gradients: dW accumulated over micro-batches (fp32 buffer)")
    dy = torch.randn(64, 128, generator=g).bfloat16()
    x = torch.randn(64, 256, generator=g).bfloat16()
    whole = dg.weight_grad(dy, x)
    acc = torch.zeros(128, 256)
    dg.weight_grad(dy[:16], x[:16], acc=acc)
    dg.weight_grad(dy[16:], x[16:], acc=acc)
    same = torch.equal(acc.view(torch.int32), whole.view(torch.int32))
    print(f"dW over 16 + 48 tokens, accumulated in fp32, vs one call on 64 tokens: "
          f"{'bit-identical' if same else 'DIFFERENT'}")
    return same


def _cpu_bmm_demo(g) -> bool:
    """bmm: an entry's bits do not depend on how many entries ride with it."""
    import detgemm_cute as dg

    print("\n== 5. batched GEMMs (attention's q @ k^T): one entry alone vs in a batch of 6")
    q = torch.randn(6, 16, 64, generator=g).bfloat16()
    k = torch.randn(6, 32, 64, generator=g).bfloat16()
    scores = dg.bmm(q, k.transpose(1, 2))
    alone = dg.bmm(q[2:3], k[2:3].transpose(1, 2))
    same = torch.equal(alone.view(torch.int16), scores[2:3].view(torch.int16))
    print(f"entry 2 of a batch of 6 vs entry 2 alone: {'bit-identical' if same else 'DIFFERENT'}")
    return same


def _cpu_fp32_demo(g) -> bool:
    """fp32 inputs: the split tier's rows are batch-invariant and its error is below an fp32
    FMA chain's (CPU tensors run the model of the H100's fp32 kernels)."""
    import detgemm_cute as dg

    print("\n== 6. fp32 inputs (full precision: fp16 parts, chunked fp32 chain)")
    x = torch.randn(48, 512, generator=g)
    w = torch.randn(64, 512, generator=g)
    y = dg.linear(x, w)
    alone = dg.linear(x[5:6], w)
    same = torch.equal(alone.view(torch.int32), y[5:6].view(torch.int32))
    ref = x.double() @ w.double().t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    print(f"row 5 alone vs in a batch of 48: {'bit-identical' if same else 'DIFFERENT'}; "
          f"relative error vs fp64 {err:.1e}")
    with dg.fp32_precision("tf32"):
        t = dg.linear(x, w)
    err_t = ((t.double() - ref).norm() / ref.norm()).item()
    print(f'precision "tf32" (inputs rounded to TF32, 8-wide chain): relative error {err_t:.1e}')
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="detgemm-cute demo", description=__doc__)
    p.add_argument("--quick", action="store_true", help="one shape only")
    args = p.parse_args(argv or [])
    return _gpu_demo(args.quick) if _gpu_ok() else _cpu_demo()
