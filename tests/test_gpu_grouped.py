"""The one-launch grouped GEMM (grouped_mm's mixture-of-experts form on SM90).

- every grouped bucket, forced: each group's rows have the bits of `dg.mm` on those rows
  and that group's weight alone (a 2-D GEMM from another table and tile), for groups empty,
  shorter than a tile, exactly a tile, a tile and a row, many tiles, and last tiles around
  half a tile (where a two-warpgroup tile runs its first half alone); rows past the last
  group are +0.0; weights with K or N contiguous or staged (K not a multiple of 8); odd N;
  fp32 output; outputs land in NaN-poisoned memory;
- the ping-pong grouped kernel (a user layer) likewise, with trailing empty groups;
- a token's row does not depend on how many tokens its group received;
- the call is one launch that a CUDA graph captures, and a replay after offs changed in
  place gives the new grouping's bits (offs is read on the device);
- a bad offs fails the launch (a device-side check), and names the wrong entry with
  DETGEMM_CUTE_REPORT_OFFS=1.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import gemm, registry  # noqa: E402
from gpu_helpers import (fails_on_the_device, group_ends, poison, rand,  # noqa: E402
                         same_bits)

if gemm.arch_of(torch.device("cuda")) != "sm90":
    pytest.skip("the grouped kernel is SM90's", allow_module_level=True)


def _buckets():
    return sorted(b.name for b in registry.get_registry("sm90").buckets if b.op == "grouped")


def _weights(experts, k, n, layout, dtype=torch.bfloat16):
    """[G, K, N] with N contiguous ("n"), K contiguous ("k": nn.Linear's storage)."""
    if layout == "n":
        return rand(experts, k, n, dtype=dtype)
    return rand(experts, n, k, dtype=dtype).transpose(1, 2)


def _assert_groups(y, x, w, sizes, out_dtype=None):
    start = 0
    for g, size in enumerate(sizes):
        if size:
            want = dg.mm(x[start:start + size], w[g], out_dtype=out_dtype)
            assert same_bits(y[start:start + size], want), (sizes, g)
        start += size
    assert not y[start:].isnan().any() and not y[start:].any(), "rows past the last group"


def _sizes(bm):
    """Group sizes that cut a BM-row tile every way: empty, short, exact, one over, many;
    and a last tile holding exactly half a tile, or one row more, of its group (a tile of
    two warpgroups runs the first half alone up to there, in place, else moves back)."""
    half = bm // 2
    return [0, 1, bm - 1, bm, bm + 1, 0, 3 * bm + 17, 5, 2 * bm, half, half + 1,
            bm + half, bm + half + 1, 2 * bm + half - 1]


@pytest.mark.parametrize("name", _buckets())
@pytest.mark.parametrize("layout", ["k", "n"])
def test_every_grouped_bucket_matches_mm(name, layout):
    bm = registry.get_registry("sm90").bucket(name).tile[0]
    sizes = _sizes(bm)
    k, n = 320, 392  # N: not a multiple of BN; the last tile moves back
    x = rand(sum(sizes) + 7, k)  # 7 rows past the last group
    w = _weights(len(sizes), k, n, layout)
    with dg.force_bucket(name):
        poison()
        y = dg.grouped_mm(x, w, group_ends(sizes))
        _assert_groups(y, x, w, sizes)
        poison()
        y32 = dg.grouped_mm(x, w, group_ends(sizes), out_dtype=torch.float32)
        _assert_groups(y32, x, w, sizes, out_dtype=torch.float32)


def _user_layer(tmp_path, tile, cluster, stages, pingpong):
    """A user layer with one grouped bucket, `user_grouped`, for every M (conftest removes
    user layers after every test)."""
    path = tmp_path / "grouped.yaml"
    path.write_text(f"arch: sm90\nbuckets:\n  - name: user_grouped\n    op: grouped\n"
                    f"    dtypes: [bf16, fp16]\n    m: [1, null]\n    tile: {list(tile)}\n"
                    f"    cluster: {list(cluster)}\n    stages: {stages}\n"
                    f"    persistent: true\n    pingpong: {str(pingpong).lower()}\n")
    registry.add_config(path)


# Ping-pong grouped kernels (two consumer warpgroups on alternate tiles) as a user layer: the
# table may or may not pick one, so the path is proven here either way.
PINGPONG = [((128, 192, 64), (1, 2), 5), ((128, 128, 64), (1, 1), 6), ((64, 256, 64), (1, 2), 5),
            ((128, 192, 64), (2, 1), 5), ((128, 128, 64), (2, 2), 6)]


@pytest.mark.parametrize("tile,cluster,stages", PINGPONG)
def test_pingpong_grouped_matches_mm(tmp_path, tile, cluster, stages):
    _user_layer(tmp_path, tile, cluster, stages, pingpong=True)
    sizes = _sizes(tile[0]) + [0, 0, 5 * tile[0] + 3]  # trailing empty groups: skipped tiles
    k, n = 320, 3 * tile[1] + 8
    x = rand(sum(sizes) + 7, k)
    for layout in ("k", "n"):
        w = _weights(len(sizes), k, n, layout)
        with dg.force_bucket("user_grouped"):
            poison()
            _assert_groups(dg.grouped_mm(x, w, group_ends(sizes)), x, w, sizes)


# Cooperative grouped tiles no built-in bucket uses, as a user layer: a 256-row tile (two
# warpgroups holding alternate 64-row blocks), a 64-row one, a 128-row one on one CTA; and
# clusters along M (the weight tile multicast; groups of an odd tile count get a padding
# tile that stores nothing), 2 or 4 CTAs along M, with and without 2 along N.
COOPERATIVE = [((256, 128, 64), (1, 2), 4), ((64, 128, 64), (1, 1), 6),
               ((128, 128, 64), (1, 1), 6), ((128, 256, 64), (2, 1), 4),
               ((128, 128, 64), (2, 2), 6), ((256, 128, 64), (2, 1), 4),
               ((64, 256, 64), (2, 1), 5), ((128, 192, 64), (4, 1), 4)]


@pytest.mark.parametrize("tile,cluster,stages", COOPERATIVE)
def test_user_layer_grouped_tiles_match_mm(tmp_path, tile, cluster, stages):
    _user_layer(tmp_path, tile, cluster, stages, pingpong=False)
    bm = tile[0]
    sizes = _sizes(bm) + [100, 300, 64, 200, 5, 256, 3 * bm // 4, bm // 4 + 1, bm // 4]
    k, n = 320, 2 * tile[1] + 8
    x = rand(sum(sizes) + 3, k)
    w = _weights(len(sizes), k, n, "k")
    with dg.force_bucket("user_grouped"):
        poison()
        _assert_groups(dg.grouped_mm(x, w, group_ends(sizes)), x, w, sizes)


@pytest.mark.parametrize("k,n", [(100, 300), (64, 8), (4096, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_layouts_and_sizes(k, n, dtype):
    """K not a multiple of 8 (weights and x staged), N with unaligned rows (padded output),
    a narrow N, a wide K; both 16-bit dtypes, both weight layouts."""
    sizes = [37, 0, 200, 129, 1, 64]
    x = rand(sum(sizes), k, dtype=dtype)
    for layout in ("k", "n"):
        w = _weights(len(sizes), k, n, layout, dtype)
        poison()
        _assert_groups(dg.grouped_mm(x, w, group_ends(sizes)), x, w, sizes)


def test_token_row_does_not_depend_on_its_group_size():
    experts, k, n = 8, 1024, 768
    w = _weights(experts, k, n, "k")
    x = rand(3000, k)
    probe = x[:1]
    want = [dg.mm(probe, w[g]) for g in range(experts)]
    for sizes in ([375] * 8, [1, 2999, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 3000],
                  [129, 64, 1000, 7, 800, 0, 1000, 0]):
        g0 = next(g for g, s in enumerate(sizes) if s)
        poison()
        y = dg.grouped_mm(x, w, group_ends(sizes))
        assert same_bits(y[:1], want[g0]), sizes


def test_grouped_is_captured_and_reads_offs_on_the_device():
    experts, k, n = 6, 512, 640
    w = _weights(experts, k, n, "k")
    x = rand(900, k)
    first, second = [100, 0, 300, 50, 250, 150], [1, 600, 0, 99, 0, 190]
    offs = group_ends(first)
    dg.grouped_mm(x, w, offs)  # compile outside the capture
    out = torch.empty(900, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(dg.grouped_mm(x, w, offs))
    for sizes in (first, second):
        offs.copy_(group_ends(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_groups(out, x, w, sizes)


def test_grouped_backward_in_one_launch_forms():
    """Autograd through the one-launch forward: dX is the grouped form against w^T (one
    launch too), dW per expert."""
    sizes = [10, 0, 130, 48]
    x = rand(188, 256).requires_grad_()
    w = _weights(4, 256, 192, "k").detach().requires_grad_()
    g = rand(188, 192)
    dg.grouped_mm(x, w, group_ends(sizes)).backward(g)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        if size:
            assert same_bits(x.grad[rows], dg.mm(g[rows], w[e].detach().t()))
            assert same_bits(w.grad[e], dg.mm(x.detach()[rows].t(), g[rows]))
        start += size


@pytest.mark.parametrize("offs,message", [([50, 20, 100], "offs[1] = 20 after 50"),
                                          ([50, 70, 101], "offs[2] = 101 after 70")])
def test_bad_offs_fail_on_the_device(offs, message):
    """offs is never read on the host: the kernel checks it and fails the launch (in a
    subprocess: a failed launch ends the CUDA context); the build that
    DETGEMM_CUTE_REPORT_OFFS=1 asks for also prints the entry that is wrong."""
    code = ("import torch, detgemm_cute as dg\n"
            "x = torch.randn(100, 64, device='cuda', dtype=torch.bfloat16)\n"
            "w = torch.randn(3, 64, 32, device='cuda', dtype=torch.bfloat16)\n"
            f"offs = torch.tensor({offs}, device='cuda', dtype=torch.int32)\n"
            "dg.grouped_mm(x, w, offs)\n"
            "torch.cuda.synchronize()\n")
    fails_on_the_device(code, message, env={"DETGEMM_CUTE_REPORT_OFFS": "1"})
    assert message not in fails_on_the_device(code, "CUDA error",
                                              env={"DETGEMM_CUTE_REPORT_OFFS": "0"})
