"""Every SM90 tile shape the limits allow gives the same bits: row tiles (BM 8/16/32), the
odd WGMMA widths (BN 48, 80, 96, 112, 160, 224) and the odd multiples of 8 (88..200), forced
through a user layer onto problems whose M, N and K cut through their tiles, against the
built-in table's bits.

Row tiles load only BM rows of A per stage, the stages BM rows apart, and WGMMA's other
64 - BM rows of a stage are the next stages' rows (or the buffer's slack): a bug there (a
stored row that read another stage's rows, a row stored twice, a stage overwritten while
read) shows up as different bits or as NaN left in the poisoned output. The row-tile specs
run the most stages that fit (WGMMA's extra rows of the last stages are the buffer's slack)
but one, 32x32x128 on 2 stages, the shallowest ring (stage 0's extra rows are stage 1's).

A ragged last tile along M or N is moved back to end at the edge (its first rows are also
the previous tile's): `test_ragged_last_tiles_match_the_reference` checks those problems
against the CPU reference's bits, independently of the GPU's other tiles."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU (the sm90 family's tiles)", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import gemm, grads, reference, registry  # noqa: E402
from gpu_helpers import poison, rand, same_bits  # noqa: E402
from tile_specs import (ALL, DIRECT, FAR, MANY, bucket_lines, layer_text, name,  # noqa: E402
                        serves_bmm)


@pytest.fixture(scope="module")
def layer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiles") / "tiles.yaml"
    path.write_text(layer_text())
    return path


@pytest.fixture
def forced_layer(layer_file):
    registry.add_config(layer_file)  # conftest removes user layers after every test


def _run_forced(name, fn):
    with gemm.force_bucket(name):
        poison()
        return fn()


def _forced(op, spec, fn):
    return _run_forced(f"{op}_{name(*spec)}", fn)


@pytest.mark.parametrize("spec", ALL, ids=[name(*t) for t in ALL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_bits(forced_layer, spec, dtype):
    for m, n, k in [(1, 1000, 4104), (5, 264, 1000), (13, 3000, 520), (64, 776, 2048),
                    (100, 1032, 3000), (300, 520, 776)]:
        x, w, b = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype), rand(n, dtype=dtype)
        want = dg.linear(x, w, b)
        want32 = dg.linear(x, w, out_dtype=torch.float32)
        got = _forced("fwd", spec, lambda: dg.linear(x, w, b))
        got32 = _forced("fwd", spec, lambda: dg.linear(x, w, out_dtype=torch.float32))
        assert same_bits(got, want), (spec, m, n, k)
        assert same_bits(got32, want32), (spec, m, n, k)
        # A transposed view (M-major A): staged for row tiles, read in place otherwise.
        xt = rand(k, m, dtype=dtype).t()
        assert same_bits(_forced("fwd", spec, lambda: dg.mm(xt, w.t())), dg.mm(xt, w.t()))


@pytest.mark.parametrize("spec", ALL, ids=[name(*t) for t in ALL])
def test_backward_bits(forced_layer, spec):
    t, n, k = 48, 520, 264
    dy, w, x = rand(t, n), rand(n, k), rand(t, k)
    assert same_bits(_forced("dx", spec, lambda: grads.input_grad(dy, w)),
                     grads.input_grad(dy, w))
    acc0 = torch.randn(n, k, device="cuda")
    want = grads.weight_grad(dy, x, acc=acc0.clone())
    got = _forced("dw", spec, lambda: grads.weight_grad(dy, x, acc=acc0.clone()))
    assert same_bits(got, want)


def _ragged(tile, swap_ab):
    """(M, N) pairs whose last tile holds 1, 3 or BM-1 rows (the caller's M runs along the
    kernel's N when operands are swapped), one shorter than a tile, and whose N is ragged
    too."""
    rows, cols = (tile[1], tile[0]) if swap_ab else (tile[0], tile[1])
    return [(rows + 1, 3 * cols + 5), (2 * rows + 3, 2 * cols), (3 * rows - 1, cols + 1),
            (2 * rows, cols + 9), (max(rows - 3, 1), 2 * cols + 7)]


@pytest.mark.parametrize("spec", ALL, ids=[name(*t) for t in ALL])
def test_ragged_last_tiles_match_the_reference(forced_layer, spec):
    """fwd (with bias, bf16 and fp32 out, X as a transposed view) and dX on problems whose
    last tile along M, N or both is mostly empty, so it is moved back and overlaps the
    tile before it: bits equal the CPU reference's and no poisoned output is left."""
    k = 200
    for m, n in _ragged(spec[0], spec[5]):
        w, dy = _check_fwd_forms(spec, m, n, k)
        got = _forced("dx", spec, lambda: grads.input_grad(dy, w))
        assert same_bits(got.cpu(), reference.mm(dy.cpu(), w.cpu())), (m, n)


def _check_fwd_forms(spec, m, n, k):
    """fwd under `spec` on fresh [m, k] x [n, k] inputs with bias (bf16 and fp32 out) and
    with an M-major X: bits equal the CPU reference's. Returns (w, dy) for the dX checks."""
    x, w, b, dy = rand(m, k), rand(n, k), rand(n), rand(m, n)
    xc, wc, bc = x.cpu(), w.cpu(), b.cpu()
    got = _forced("fwd", spec, lambda: dg.linear(x, w, b))
    assert same_bits(got.cpu(), reference.linear(xc, wc, bc)), (m, n)
    got = _forced("fwd", spec, lambda: dg.linear(x, w, b, out_dtype=torch.float32))
    assert same_bits(got.cpu(), reference.linear(xc, wc, bc, torch.float32)), (m, n)
    xt = x.t().contiguous().t()  # M-major X
    got = _forced("fwd", spec, lambda: dg.mm(xt, w.t()))
    assert same_bits(got.cpu(), reference.mm(xc, wc.t())), (m, n)
    return w, dy




@pytest.mark.parametrize("spec", MANY, ids=[name(*t) for t in MANY])
def test_many_tiles_per_cta(forced_layer, spec):
    """Problems with several tiles per CTA, so both ping-pong consumer warpgroups run tiles
    and skip each other's stages (an odd and an even count per CTA, tails in M, N and K),
    swapped problems whose M is large, and clusters of four or eight with partial clusters
    at the edges: the bits of every op equal the built-in table's,
    and no poisoned output survives."""
    for m, n, k in [(2000, 3000, 1000), (4100, 1032, 520), (777, 5120, 4104)]:
        x, w, b = rand(m, k), rand(n, k), rand(n)
        assert same_bits(_forced("fwd", spec, lambda: dg.linear(x, w, b)),
                         dg.linear(x, w, b)), (m, n, k)
        dy = rand(m, n)
        assert same_bits(_forced("dx", spec, lambda: grads.input_grad(dy, w)),
                         grads.input_grad(dy, w)), (m, n, k)
        acc0 = torch.randn(n, k, device="cuda")
        want = grads.weight_grad(dy, x, acc=acc0.clone())
        got = _forced("dw", spec, lambda: grads.weight_grad(dy, x, acc=acc0.clone()))
        assert same_bits(got, want), (m, n, k)
    if not serves_bmm(spec):
        return
    # A batch: the tile index's L coordinate walks entries; every entry as if alone.
    a, bt = rand(6, 300, 520), rand(6, 520, 700)
    got = _forced("bmm", spec, lambda: dg.bmm(a, bt))
    assert same_bits(got, dg.bmm(a, bt))
    for i in range(6):
        assert same_bits(got[i], dg.mm(a[i], bt[i]))


def test_raster_n_gives_the_same_bits(tmp_path):
    """`raster_n` walks a persistent schedule's N tiles first: only the order in which tiles
    run changes, so every op (swapped, plain, ping-pong; several waves of tiles per problem)
    gives the table's bits."""
    specs = [((128, 208, 64), 5, True, (2, 1), False, True),
             ((128, 128, 64), 6, True, (1, 2), True, False),
             ((256, 128, 64), 4, True, (1, 1), False, False)]
    lines = ["arch: sm90", "buckets:"]
    for i, spec in enumerate(specs):
        for op in ("fwd", "dx", "dw"):
            lines += bucket_lines(f"{op}_raster{i}", op, FAR + 100 + i, spec, raster_n=True)
    path = tmp_path / "raster.yaml"
    path.write_text("\n".join(lines) + "\n")
    registry.add_config(path)
    for i in range(len(specs)):
        for m, n, k in [(300, 40000, 1000), (2100, 3000, 520)]:
            x, w, b = rand(m, k), rand(n, k), rand(n)
            assert same_bits(_run_forced(f"fwd_raster{i}", lambda: dg.linear(x, w, b)),
                             dg.linear(x, w, b)), (i, m, n, k)
            dy = rand(m, n)
            assert same_bits(_run_forced(f"dx_raster{i}", lambda: grads.input_grad(dy, w)),
                             grads.input_grad(dy, w)), (i, m, n, k)
            acc0 = torch.randn(n, k, device="cuda")
            want = grads.weight_grad(dy, x, acc=acc0.clone())
            got = _run_forced(f"dw_raster{i}",
                              lambda: grads.weight_grad(dy, x, acc=acc0.clone()))
            assert same_bits(got, want), (i, m, n, k)


def test_persistent_grids_fit_the_gpu_s_co_resident_clusters():
    """The persistent grid of a cluster shape is the driver's count of clusters of that size
    the GPU holds at once (a cluster stays inside one GPC), never more than SMs / size."""
    import cutlass.utils

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    info = cutlass.utils.HardwareInfo(0)
    for size in (4, 8):
        slots = gemm._cluster_slots(0, size)
        assert slots == min(info.get_max_active_clusters(size), sms // size) >= 1
    assert gemm._cluster_slots(0, 2) == sms // 2


@pytest.mark.parametrize("spec", DIRECT, ids=[name(*t) for t in DIRECT])
def test_unaligned_output_rows_match_the_reference(forced_layer, spec):
    """Outputs whose rows TMA cannot address (a width not a multiple of 8, or of 4 in fp32)
    are stored by the kernel's threads from staged sub-tiles, bounds-checked (ping-pong
    kernels: padded rows, copied out): fwd with bias (bf16 and fp32 out), an M-major X, dX
    of an odd input width, a batch (q @ k^T at an odd sequence length); bits equal the CPU
    reference's and no poisoned element is left."""
    k = 200
    for m, n in [(300, 333), (77, 1001), (1000, 77)]:
        _, dy = _check_fwd_forms(spec, m, n, k)
        w_odd = rand(n, 333)  # dX [m, 333]
        got = _forced("dx", spec, lambda: grads.input_grad(dy, w_odd))
        assert same_bits(got.cpu(), reference.mm(dy.cpu(), w_odd.cpu())), (m, n)
    if serves_bmm(spec):
        q, kt = rand(5, 333, 64), rand(5, 333, 64).transpose(1, 2)
        got = _forced("bmm", spec, lambda: dg.bmm(q, kt))
        for i in range(5):
            assert same_bits(got[i].cpu(), reference.mm(q[i].cpu(), kt[i].cpu())), i
