"""tests/sanitize.py's plan, checked without a GPU: the deduplicated quick plan (what the
short sanitizer runs take) still reaches every kernel path, and its launch bookkeeping is
right. The runs themselves need compute-sanitizer on a GPU (commands in sanitize.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sanitize  # noqa: E402
import sanitize_cases as sc  # noqa: E402

from detgemm_cute import registry  # noqa: E402
from detgemm_cute.compile import KernelKey  # noqa: E402

PATHS = {"row-tile", "bm64", "bm128", "pingpong", "swap", "persistent", "raster_n",
         "cluster2", "cluster4", "cluster8", "direct-store", "row-copy", "m-major-a", "fwd",
         "dx", "dw", "bmm", "a-rows", "grouped", "empty-group", "short-group", "long-group",
         "all-empty", "trailing-rows", "split", "fp16-split", "exact-split", "tf32",
         "a-registers"}


def test_the_short_plan_reaches_every_kernel_path():
    for families in (["sm90"], ["sm80"]):
        plan = sc.items(families, quick=True, dedupe=True)
        tags = set().union(*(it.tags for it in plan))
        want = PATHS if families == ["sm90"] else {
            "row-copy", "fwd", "dx", "dw", "bmm", "split", "fp16-split", "exact-split", "tf32",
            "transpose", "bm64", "bm128"}
        assert want <= tags, sorted(want - tags)
        sigs = [(it.family, sc.signature(it.bucket)) for it in plan]
        assert len(sigs) == len(set(sigs))
    full = sc.items(["sm90", "sm80"])
    assert {(it.family, it.bucket.name) for it in full} == {
        (f, b.name) for f in ("sm90", "sm80") for b in registry.get_registry(f).buckets}


def test_edges_and_expected_launches():
    plan = sc.items(["sm90"], sections=("gemm",), only=("fwd_decode_m33_64_n1_1536",), quick=False)
    item = next(it for it in plan if it.bucket.name == "fwd_decode_m33_64_n1_1536")
    bm, bn, bk = item.bucket.tile
    dims = [dict(c.dims) for c in item.calls if c.kind == "linear"]
    assert {(d["M"], d["N"], d["K"]) for d in dims} == {
        (1, 1, 1), (bm - 1, bn - 1, bk - 1), (bm, bn, bk), (bm + 1, bn + 1, bk + 1),
        (2 * bm + 3, 3 * bn + 7, 2 * bk + 5), (0, bn, bk)}
    assert sum(c.launches() for c in item.calls) == len(item.calls) - 1  # M = 0: none
    g = sc.Call("grouped", (("N", 8), ("K", 8)), (("groups", (0, 0)), ("tail", 0)))
    assert g.launches() == 0


def test_swapped_buckets_get_edges_along_the_kernel_rows():
    plan = sc.items(["sm90"], sections=("gemm",), dedupe=True)
    item = next(it for it in plan if it.bucket.swap_ab and it.bucket.op == "fwd")
    bm, bn, _ = item.bucket.tile
    assert (bn + 1, bm + 1) in {(c.dim("M"), c.dim("N")) for c in item.calls}


def test_launch_kinds_name_the_kernel_path():
    key = KernelKey(tile=(64, 128, 64), cluster=(2, 4), stages=4, persistent=True,
                    dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn", b_contig="last",
                    has_bias=False, batched=True, a_loads=True, c_direct=True)
    assert set(sanitize.gemm_kind(key)) == {"sm90", "persistent", "bmm", "a-rows",
                                            "direct-store", "cluster8"}
    row = KernelKey(tile=(16, 64, 64), cluster=(1, 1), stages=4, persistent=False,
                    dtype="tf32", out_dtype="fp32", a_major="m", b_form="nk",
                    b_contig="last", has_bias=True, arch="sm_80")
    assert set(sanitize.gemm_kind(row)) == {"sm80", "row-tile", "tf32", "m-major-a"}


def test_list_needs_no_gpu(capsys):
    assert sanitize.main(["--list", "--dedupe", "--quick", "--families", "sm90",
                          "--only", "grouped"]) == 0
    out = capsys.readouterr().out
    items = sc.items(("sm90",), only=("grouped",), quick=True, dedupe=True)
    grouped = [b for b in registry.get_registry("sm90").buckets if "grouped" in b.name]
    assert len(items) == len({sc.signature(b) for b in grouped}) > 0  # one per signature
    assert f"plan: {len(items)} items" in out and "GEMM launches expected" in out


def test_every_planned_call_passes_the_public_argument_checks():
    """Each call of the full plan, on meta tensors: the API's own checks accept it (a shape
    the API refuses, such as N = 0, would stop the sanitizer run at that call)."""
    refused = []
    for item in sc.items(("sm90", "sm80"), dedupe=False):
        dtype = "fp32" if item.dtype == "tf32" else item.dtype
        for call in item.calls:
            try:
                sc.run_call(call, dtype, device="meta")
            except (ValueError, TypeError, RuntimeError) as e:
                refused.append((item.bucket.name, call.kind, call.dims, str(e)[:120]))
    assert not refused, refused[:5]
