"""Every built-in bucket of both families cross-compiles on a CPU-only machine (sm_90a,
sm_80); PTX audit."""

import re
from types import SimpleNamespace

import pytest

from detgemm_cute import aot, cli, registry
from detgemm_cute import compile as kcompile


@pytest.mark.slow
@pytest.mark.parametrize("gpu_arch, family", [("sm_90a", "sm90"), ("sm_80", "sm80")])
def test_every_bucket_compiles_and_passes_the_ptx_audit(gpu_arch, family):
    """Each family's built-in buckets, for its CI target (the SM80 audit requires mma.sync
    m16n8k16, cp.async and ldmatrix; the SM90 one WGMMA and bulk tensor copies). Two
    compile processes (the CI machine's cores): the longest tests of the suite."""
    lines = []
    rc = aot.compile_buckets(gpu_arch, variants="core", out=lines.append, jobs=2)
    assert rc == 0, "\n".join(lines)
    text = "\n".join(lines)
    for b in registry.get_registry(family).buckets:
        assert b.name in text  # fwd, dx and dw buckets alike
    assert "FAIL" not in text
    assert f"built and audited for {gpu_arch}" in lines[-1] and "variants=core" in lines[-1]
    assert "2 processes" in lines[-1]


def test_audit_flags_atomics_and_missing_wgmma():
    good = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\ncp.async.bulk.tensor.2d"
    assert aot.audit_ptx(good) == []
    assert any("atom" in p for p in aot.audit_ptx(good + "\n\t@%p3 atom.global.add.f32 [%rd1], %f1;"))
    assert any("red" in p for p in aot.audit_ptx(good + "\n\tred.global.add.f32 [%rd1], %f1;"))
    assert any("wgmma" in p for p in aot.audit_ptx("cp.async.bulk.tensor.2d"))


def test_cli_compile_one_bucket(capsys):
    name = next(b.name for b in registry.get_registry("sm90").buckets if b.op == "fwd")
    assert cli.main(["compile", "--arch", "sm_90a", "--bucket", name]) == 0
    assert name in capsys.readouterr().out
    assert cli.main(["compile", "--arch", "sm_90a", "--bucket", "no_such_bucket"]) == 1
    assert "no bucket 'no_such_bucket' in the sm90 table" in capsys.readouterr().err
    assert aot.compile_buckets("sm_90a", [name], out=lambda s: None, variants="bogus") == 1
    lines = []  # the library call takes base names and refuses unknown ones the same way
    assert aot.compile_buckets("sm_90a", ["fwd_prefil"], out=lines.append) == 1
    assert "did you mean fwd_prefill" in lines[0] and len(lines[0]) < 300


def test_first_use_compile_is_thread_safe(monkeypatch):
    """Threads hitting a cold kernel cache at once compile the key once and all get it."""
    import threading
    import time

    from detgemm_cute import compile as kcompile

    built = []

    def slow_build(key, extra_options=""):
        built.append(key)
        time.sleep(0.2)
        return object()

    monkeypatch.setattr(kcompile, "build", slow_build)
    key = kcompile.KernelKey(tile=(64, 64, 64), cluster=(1, 1), stages=3, persistent=False,
                             dtype="bf16", out_dtype="bf16", a_major="k", b_form="nk",
                             b_contig="last", has_bias=False, arch="test_only")
    got = []
    threads = [threading.Thread(target=lambda: got.append(kcompile.get(key))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kcompile._compiled.pop(key, None)
    assert len(built) == 1 and len(got) == 8 and all(g is got[0] for g in got)


def _audited_ptx(key, tmp_path) -> str:
    """`key`'s PTX (compiled here), after the PTX audit."""
    from detgemm_cute import compile as kcompile

    ptx = kcompile.build(key, f"--keep-ptx --dump-dir={tmp_path}").__ptx__ or ""
    assert aot.audit_ptx(ptx) == []
    return ptx


def _ptxas_report(ptx: str, tmp_path) -> str:
    """With ptxas at hand: the PTX assembles for sm_90a; returns ptxas's report ("" without
    ptxas)."""
    import shutil
    import subprocess

    if not shutil.which("ptxas"):
        return ""
    (tmp_path / "k.ptx").write_text(ptx)
    info = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                           str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr[-500:]
    return info.stderr


def _c_elements_loaded(ptx: str) -> int:
    """fp32 elements the PTX loads from global memory with 32-bit loads (scalar, .v2, .v4):
    a `dW +=` kernel's loads of C."""
    return sum(int(v or 1) for v in re.findall(r"ld\.global(?:\.v(\d))?\.b32\s", ptx))


def _assert_no_spills(ptx: str, tmp_path) -> str:
    """With ptxas at hand: the PTX assembles for sm_90a with no spill stores; returns
    ptxas's report ("" without ptxas)."""
    report = _ptxas_report(ptx, tmp_path)
    assert not report or re.search(r"\b0 bytes spill stores", report), report[-500:]
    return report


@pytest.mark.parametrize("tile, cluster, persistent, pingpong, batched, swap", [
    ((128, 128, 64), (1, 1), False, False, False, False),
    ((128, 192, 64), (2, 1), True, False, True, False),
    ((128, 256, 64), (1, 2), True, False, False, False),
    ((64, 128, 64), (1, 1), False, False, False, True)])
def test_direct_store_kernels_compile_without_a_tma_store(tmp_path, tile, cluster, persistent,
                                                          pingpong, batched, swap):
    """Outputs whose rows TMA cannot address (`c_direct`): the kernel still loads with TMA
    and multiplies with WGMMA, but its threads store C (st.global), with no bulk tensor
    store; with ptxas at hand, nothing spills; keys the direct store cannot serve (BM < 64,
    accumulate) are refused before compiling."""
    from detgemm_cute import compile as kcompile

    key = kcompile.KernelKey(tile=tile, cluster=cluster, stages=4, persistent=persistent,
                             pingpong=pingpong, dtype="bf16", out_dtype="bf16", a_major="k",
                             b_form="nk", b_contig="last", has_bias=False, arch="sm_90a",
                             batched=batched, swap_ab=swap, c_direct=True)
    ptx = _audited_ptx(key, tmp_path)
    assert re.search(r"st\.global", ptx)
    assert not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)
    _assert_no_spills(ptx, tmp_path)
    for refused in ({"tile": (32, 128, 64)}, {"accumulate": True}):
        with pytest.raises(ValueError, match="direct C stores"):
            kcompile.build(kcompile.KernelKey(**{**key.__dict__, **refused}))


@pytest.mark.slow
@pytest.mark.parametrize("tile, stages, persistent", [
    ((64, 64, 64), 4, True), ((64, 128, 64), 4, False), ((128, 128, 64), 4, True),
    ((128, 256, 64), 3, False)])
def test_a_loads_kernels_read_a_with_the_threads(tmp_path, tile, stages, persistent):
    """bmm's A of unaligned rows read by the producer warpgroup (`a_loads`, the p @ v
    tiles): A by 16-byte cp.async into the raw ring, realigned with 16-byte shared loads and
    stores; TMA for B only (no tensor map for A); on the persistent kernel with at most 3
    stages whatever the bucket says; the raw ring fits beside the stages; nothing spills;
    keys it cannot serve are refused."""
    from detgemm_cute import batched
    from detgemm_cute import compile as kcompile
    from detgemm_cute.kernels.sm90_a_rows import raw_stages

    bucket = SimpleNamespace(tile=tile, cluster=(1, 1), stages=stages, persistent=persistent,
                             pingpong=False)
    assert batched.reads_a_rows("sm90", bucket)
    key = batched.with_a_loads(kcompile.KernelKey.for_bucket(
        bucket, dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn", b_contig="last",
        has_bias=False, arch="sm_90a", batched=True))
    assert key.a_loads and key.persistent and key.tile == tile and key.stages == 3
    assert 2 <= raw_stages(tile, key.stages) <= 8
    ptx = _audited_ptx(key, tmp_path)
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 16", ptx)
    assert re.search(r"ld\.shared\.v4\.b32", ptx) and re.search(r"st\.shared\.v4\.b32", ptx)
    # Tensor maps (64-byte-aligned kernel parameters): B's and C's, none for A.
    assert len(re.findall(r"\.param \.align 64 \.b8", ptx)) == 2
    _assert_no_spills(ptx, tmp_path)
    for refused in ({"tile": (32, 128, 64)}, {"tile": (64, 64, 128)}, {"persistent": False},
                    {"cluster": (1, 2)}, {"a_major": "m"}, {"dtype": "tf32"}):
        with pytest.raises(ValueError, match="a_loads"):
            kcompile.build(kcompile.KernelKey(**{**key.__dict__, **refused}))
    assert not batched.reads_a_rows("sm90", SimpleNamespace(tile=(32, 128, 64)))
    assert not batched.reads_a_rows("sm90", SimpleNamespace(tile=(64, 64, 128)))
    assert not batched.reads_a_rows("sm80", bucket)
    assert not batched.reads_a_rows("sm90", bucket, batched.A_ROWS_MIN_K - 1)


def test_a_loads_kernels_fit_their_raw_ring_in_shared_memory():
    """Every tile `reads_a_rows` accepts gets, through `with_a_loads`, a stage count whose
    shared memory (the stages, the epilogue and the raw ring's slots of A's rows, as
    `sm90_a_rows` allocates them) fits the SM's 227 KiB: a 256 x 128 tile at 3 stages asked
    for 249 KiB and its launch failed (H200, 2026-11-28); at 2 it fits. A key that does not
    fit is refused before any launch, naming a stage count that does."""
    from detgemm_cute import batched
    from detgemm_cute import compile as kcompile
    from detgemm_cute.kernels import sm90_limits as L

    seen = 0
    for bm in (64, 128, 256):
        for bn in L.TILE_N:
            for stages in range(2, 9):
                tile = (bm, bn, 64)
                if L.check_config(tile, (1, 1), stages, True):
                    continue
                bucket = SimpleNamespace(tile=tile, cluster=(1, 1), stages=stages,
                                         persistent=True, pingpong=False)
                if not batched.reads_a_rows("sm90", bucket):
                    assert L.a_rows_stages(tile, stages) == 0
                    continue
                key = batched.with_a_loads(kcompile.KernelKey.for_bucket(
                    bucket, dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn",
                    b_contig="last", has_bias=False, arch="sm_90a", batched=True))
                slots = L.a_rows_slots(tile, key.stages)
                ring = slots * bm * (64 * 2 // 16 + 1) * 16
                assert 2 <= key.stages <= min(stages, 3) and slots >= 2, (tile, stages)
                assert L.smem_bytes(tile, key.stages) + ring + 2048 <= L.SMEM_BYTES, tile
                kcompile._kernel_options(key)  # accepted
                seen += 1
    assert seen > 100
    wide = SimpleNamespace(tile=(256, 128, 64), cluster=(1, 1), stages=3, persistent=True,
                           pingpong=False)
    key = batched.with_a_loads(kcompile.KernelKey.for_bucket(
        wide, dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn", b_contig="last",
        has_bias=False, arch="sm_90a", batched=True))
    assert key.stages == 2
    with pytest.raises(ValueError, match=r"a_loads: tile \[256, 128, 64\] at 3 stages .*use 2"):
        kcompile._kernel_options(kcompile.KernelKey(**{**key.__dict__, "stages": 3}))


def test_direct_store_policy():
    """Which kernels store unaligned output rows directly: SM90 tiles of BM >= 64 with plain
    operands, not ping-pong or swapped 128-row tiles (their registers are full); the plans
    ask only when the rows need padding at all (`padded_width`)."""
    import torch

    from detgemm_cute.gemm import half_sector_rows, output_rows, padded_width, stores_direct

    def bucket(tile_m, pingpong=False, swap_ab=False):
        return SimpleNamespace(tile=(tile_m, 128, 64), pingpong=pingpong, swap_ab=swap_ab)

    assert stores_direct("sm90", bucket(128), True)
    assert stores_direct("sm90", bucket(64, swap_ab=True), True)
    assert not stores_direct("sm80", bucket(128), True)
    assert not stores_direct("sm90", bucket(32), True)
    assert not stores_direct("sm90", bucket(128), False)  # split parts, TF32, acc
    assert not stores_direct("sm90", bucket(128, pingpong=True), True)
    assert not stores_direct("sm90", bucket(128, swap_ab=True), True)
    assert padded_width(4096, torch.bfloat16) == 0 and padded_width(333, torch.bfloat16) == 336
    assert padded_width(333, torch.float32) == 336 and padded_width(334, torch.float32) == 336
    # bmm also stores rows of a 16-mod-32-byte pitch directly (TMA writes half sectors there)
    assert half_sector_rows(1000, torch.bfloat16) and half_sector_rows(1004, torch.float32)
    assert not half_sector_rows(1008, torch.bfloat16) and not half_sector_rows(1000, torch.float32)
    assert not half_sector_rows(4096, torch.bfloat16)
    # the plans' decision: (c_direct, padded width); half sectors only where asked (bmm)
    bf = torch.bfloat16
    assert output_rows("sm90", bucket(128), 333, bf, True) == (True, 0)
    assert output_rows("sm90", bucket(128, pingpong=True), 333, bf, True) == (False, 336)
    assert output_rows("sm90", bucket(128), 1000, bf, True) == (False, 0)
    assert output_rows("sm90", bucket(128), 1000, bf, True, half_sectors=True) == (True, 0)
    assert output_rows("sm90", bucket(32), 1000, bf, True, half_sectors=True) == (False, 0)
    assert output_rows("sm90", bucket(128), 4096, bf, True, half_sectors=True) == (False, 0)


@pytest.mark.parametrize("tile, out_dtype", [((64, 256, 64), "bf16"), ((128, 128, 64), "bf16"),
                                             ((64, 256, 64), "fp32")])
def test_8_byte_direct_stores_compile_to_vector_stores(tmp_path, tile, out_dtype):
    """`c_align` 8 (a fresh bmm output whose row pitch is a multiple of 8 bytes): the
    threads read the staged sub-tile and store C 8 bytes at a time (st.global.v2.b32; the
    element stores stay for a line's partial end), with no spills; the key is refused
    without `c_direct` or at another alignment."""
    from detgemm_cute import compile as kcompile

    key = kcompile.KernelKey(tile=tile, cluster=(1, 1), stages=4, persistent=True,
                             dtype="bf16", out_dtype=out_dtype, a_major="k", b_form="kn",
                             b_contig="first", has_bias=False, arch="sm_90a", batched=True,
                             c_direct=True, c_align=8)
    ptx = _audited_ptx(key, tmp_path)
    assert re.search(r"st\.global\.v2\.b32", ptx) and re.search(r"ld\.shared\.v2\.b32", ptx)
    _assert_no_spills(ptx, tmp_path)
    for refused in ({"c_direct": False}, {"c_align": 16}):
        with pytest.raises(ValueError, match="c_align"):
            kcompile.build(kcompile.KernelKey(**{**key.__dict__, **refused}))


def test_bmm_plans_store_direct_rows_without_a_cluster():
    """bmm's direct-store outputs run on the bucket's tile without its multicast cluster
    (their slower epilogue held the cluster's peer CTA); TMA-stored outputs keep it."""
    from detgemm_cute import batched
    from detgemm_cute import compile as kcompile

    key = kcompile.KernelKey(tile=(128, 128, 64), cluster=(2, 1), stages=4, persistent=True,
                             dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn",
                             b_contig="first", has_bias=False, batched=True)
    assert batched.plan_key(key) is key
    direct = kcompile.KernelKey(**{**key.__dict__, "c_direct": True})
    assert batched.plan_key(direct) == kcompile.KernelKey(**{**direct.__dict__,
                                                             "cluster": (1, 1)})


def test_warmup_all_includes_the_direct_store_twins():
    """`--variants all` builds, next to each key a direct store can serve, its c_direct twin
    (so a warmed AOT cache covers unaligned output widths); never for ping-pong, sm80, split
    parts or accumulate; "core" stays one key per layout."""
    from detgemm_cute.gemm import stores_direct

    keys = aot.warmup_keys("sm_90a", variants="all")
    direct = {k for _, k in keys if k.c_direct}
    assert direct
    assert all(not (k.pingpong or k.split or k.accumulate or k.tile[0] < 64) for k in direct)
    for b in registry.get_registry("sm90").buckets:
        twins = [call for call, k in aot._bucket_keys(b, "sm_90a", "all") if k.c_direct]
        assert bool(twins) == (b.op in ("fwd", "dx", "dw", "bmm", "grouped_k")
                               and "fp32" not in b.dtypes
                               and "tf32" not in b.dtypes
                               and stores_direct("sm90", b, True)), b.name
    # bmm plans run direct-store outputs without a multicast cluster (batched.plan_key), and
    # the warmed twins are those keys
    assert all(k.cluster == (1, 1) for k in direct if k.batched)
    assert any(k.cluster != (1, 1) for _, k in keys if k.batched and not k.c_direct)
    assert not any(k.c_direct for _, k in aot.warmup_keys("sm_90a", variants="core"))
    assert not any(k.c_direct for _, k in aot.warmup_keys("sm_80", variants="all"))


def test_sm90_row_tiles_read_a_k_major_a_only():
    """Row tiles' A stages lie BM rows apart, which only a K-major A fills: building an
    M-major one is refused before the DSL runs, and `--variants all` never asks for it (the
    op layer stages such an A K-major); other tiles and sm80 take both."""
    assert not kcompile.a_major_builds("sm_90a", 16, "m")
    assert kcompile.a_major_builds("sm_90a", 16, "k")
    assert kcompile.a_major_builds("sm_90a", 64, "m")
    assert kcompile.a_major_builds("sm_80", 16, "m")
    key = kcompile.KernelKey(tile=(16, 32, 128), cluster=(1, 1), stages=4, persistent=True,
                             dtype="bf16", out_dtype="bf16", a_major="m", b_form="nk",
                             b_contig="last", has_bias=False)
    with pytest.raises(ValueError, match="row tiles"):
        kcompile.build(key)
    keys = [k for _, k in aot.warmup_keys("sm_90a", variants="all")]
    assert any(k.tile[0] < 64 for k in keys)
    assert all(k.a_major == "k" for k in keys if k.tile[0] < 64)


def test_operands_contiguous_in_m_or_n_are_staged_in_their_own_layout():
    """16-bit operands TMA cannot read whose contiguous dim is M or N keep that dim
    contiguous, padded to a multiple of 8 (one pass of the row-copy kernel), rather than
    being transposed K-major; the copy is the same matrix and TMA reads it in place."""
    import torch

    from detgemm_cute.gemm import padded_staging, stage_padded
    from detgemm_cute.kernels.tensor_needs import tma_unit_dim

    bf = torch.bfloat16
    dy_t = torch.randn(100, 333).to(bf).t()  # dW's A: [N=333, tokens], N contiguous
    b_kn = torch.randn(64, 333).to(bf)  # mm's B [K, N=333]
    w_nk = torch.randn(64, 333).to(bf).t()  # linear's weight [N=333, K], N contiguous
    for t, k_dim, unit in ((dy_t, 1, "first"), (b_kn, 0, "last"), (w_nk, 1, "first")):
        assert tma_unit_dim(t) is None
        assert padded_staging(t, k_dim) == unit
        s = stage_padded(t)
        assert tma_unit_dim(s) == unit and torch.equal(s, t)
        assert max(s.stride()) == 336
    assert padded_staging(dy_t, 1, first_ok=False) is None  # row tiles below 64: K-major
    assert padded_staging(torch.randn(333, 100).to(bf)[:, :99], 1) is None  # odd K: K-major
    assert padded_staging(dy_t.float(), 1) is None  # fp32 (split parts, TF32): K-major
    assert padded_staging(torch.randn(1, 333).to(bf).t(), 1) is None  # one column
    overlapping = torch.randn(400).to(bf).as_strided((333, 4), (1, 2))
    assert padded_staging(overlapping, 1) is None


@pytest.mark.parametrize("tile, cluster, swap, out_dtype", [
    ((64, 104, 128), (1, 2), True, "bf16"), ((128, 152, 64), (2, 1), False, "bf16"),
    ((64, 88, 128), (1, 1), False, "fp32")])
def test_odd_multiple_of_8_widths_store_8_column_sub_tiles(tmp_path, tile, cluster, swap,
                                                          out_dtype):
    """A width that is an odd multiple of 8 builds (its stages sliced from the outer layout)
    and stages its epilogue in 8-column sub-tiles: stmatrix .x2 for 16-bit outputs (an .x4
    copy would span two sub-tiles), none for fp32; a multiple of 16 keeps .x4."""
    from detgemm_cute import compile as kcompile
    from detgemm_cute.kernels import sm90_limits

    assert sm90_limits.epilogue_tile(tile[0], tile[1])[1] == 8
    assert sm90_limits.epilogue_tile(tile[0], tile[1] + 8)[1] in (16, 32)
    key = kcompile.KernelKey(tile=tile, cluster=cluster, stages=4, persistent=True,
                             pingpong=False, dtype="bf16", out_dtype=out_dtype, a_major="k",
                             b_form="nk", b_contig="last", has_bias=True, arch="sm_90a",
                             swap_ab=swap)
    ptx = _audited_ptx(key, tmp_path)
    got = set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.(x\d)", ptx))
    assert got == ({"x2"} if out_dtype == "bf16" else set()), got
    wide = kcompile.KernelKey(**{**key.__dict__, "tile": (tile[0], tile[1] + 8, tile[2]),
                                 "out_dtype": "bf16"})
    assert set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.(x\d)",
                          _audited_ptx(wide, tmp_path))) == {"x4"}


@pytest.mark.slow
@pytest.mark.parametrize("tile, cluster, stages, pingpong, swap", [
    ((128, 192, 64), (1, 2), 5, True, False), ((128, 192, 64), (2, 1), 5, True, False),
    ((128, 192, 64), (1, 1), 4, True, True), ((128, 256, 64), (1, 2), 4, False, False)])
def test_accumulating_dw_kernels_load_c_without_per_element_guards(tmp_path, tile, cluster,
                                                                    stages, pingpong, swap):
    """`dW +=` starts each tile's chain from C (`_init_acc`). A tile inside C loads it with
    no guard (fp32 pairs where C's rows are contiguous: half as many 8-byte loads as the
    thread's accumulators); a guard on every element made ptxas spill and serialize the
    WGMMAs (C7511) of the 128x192 ping-pong kernels. With ptxas at hand: no spills and no
    performance warning, on the dW tables' ping-pong kernels and a cooperative one."""
    from detgemm_cute import compile as kcompile

    key = kcompile.KernelKey(tile=tile, cluster=cluster, stages=stages, persistent=True,
                             pingpong=pingpong, dtype="bf16", out_dtype="fp32", a_major="m",
                             b_form="kn", b_contig="last", has_bias=False, arch="sm_90a",
                             swap_ab=swap, accumulate=True)
    ptx = _audited_ptx(key, tmp_path)
    per_thread = tile[0] * tile[1] // (128 if pingpong else 256)
    if not swap:
        pairs = re.findall(r"^\s*ld\.global(?:\.\w+)*\.v2\.[bf]32\s", ptx, re.M)
        assert len(pairs) >= per_thread // 2
    assert not re.search(r"C75\d\d", _assert_no_spills(ptx, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("tile, cluster, stages, may_spill", [
    ((128, 192, 64), (1, 2), 5, True), ((128, 128, 64), (1, 2), 6, False)])
def test_grouped_pingpong_kernels_keep_their_wgmmas_pipelined(tmp_path, tile, cluster, stages,
                                                              may_spill):
    """A ping-pong grouped consumer waits for its tile's WGMMAs whether or not the tile read
    anything: a wait on that data-dependent path made ptxas insert its own and serialize every
    WGMMA (C7518), and these kernels took 1.07-1.60x their present time on an H200
    (bench/results/tune/grouped_fit_pingpong_nvidia-h200.md). Needs ptxas. The 128x192 tile
    spills around its epilogue's row-by-row stores (the register path of a group shorter than
    the tile), not in the k-tile loop."""
    import shutil

    from detgemm_cute import compile as kcompile

    if not shutil.which("ptxas"):
        pytest.skip("ptxas (CUDA toolkit) is not on PATH")
    key = kcompile.KernelKey(**{**_GROUPED_KEY, "tile": tile, "cluster": cluster,
                                "stages": stages, "pingpong": True})
    ptx = _audited_ptx(key, tmp_path)
    if may_spill:
        report = _ptxas_report(ptx, tmp_path)
    else:
        report = _assert_no_spills(ptx, tmp_path)
    assert not re.search(r"C75\d\d", report), report[-500:]


@pytest.mark.slow
@pytest.mark.parametrize("tile, cluster, stages, persistent, b_form, dtype, accumulate", [
    ((64, 128, 96), (1, 1), 5, True, "nk", "fp16", False),
    ((128, 128, 96), (1, 1), 4, False, "kn", "fp16", False),
    ((64, 64, 96), (2, 1), 6, False, "nk", "fp16", False),
    ((64, 128, 96), (1, 1), 5, False, "nk", "bf16", True)])
def test_chunked_kernels_overlap_their_chunks(tmp_path, tile, cluster, stages, persistent,
                                              b_form, dtype, accumulate):
    """The fp32 tier's chunked chain (`sm90_chunked`): within a group of CHUNK_GROUP chunks,
    each chunk is issued before the one before it is added (a wait that leaves one WGMMA
    group in flight), and each group ends with all of them retired. With ptxas at hand: no
    spills (three fragments beside the mainloop) and no performance warning: a WGMMA left in
    flight across the loop's back edge onto a fragment the loop adds made ptxas serialize
    them all (C7514)."""
    from detgemm_cute import compile as kcompile
    from detgemm_cute.kernels.sm90_chunked import CHUNK_GROUP

    key = kcompile.KernelKey(tile=tile, cluster=cluster, stages=stages, persistent=persistent,
                             dtype=dtype, out_dtype="fp32", a_major="k", b_form=b_form,
                             b_contig="last", has_bias=False, arch="sm_90a", split=True,
                             accumulate=accumulate)
    ptx = _audited_ptx(key, tmp_path)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    # A group: CHUNK_GROUP - 1 overlapped waits and one drain; a chunk left over: one drain.
    assert waits.count("1") == CHUNK_GROUP - 1 and waits.count("0") == 2, waits
    # Each overlapped wait follows the commit of the next chunk's WGMMAs, and after every
    # wait the chunk it retires is added (a fragment's fp32 adds) before the next WGMMA
    # instruction: issue, wait, add.
    lines = [ln.strip() for ln in ptx.splitlines()]
    per_thread = tile[0] * tile[1] // (128 * (2 if tile[0] > 64 else 1))
    for i, ln in enumerate(lines):
        wait = re.match(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ln)
        if not wait:
            continue
        prev = next(j for j in range(i - 1, -1, -1) if lines[j].startswith("wgmma."))
        if wait.group(1) == "1":  # a drain (0) may follow the group's last overlapped wait
            assert lines[prev].startswith("wgmma.commit_group"), lines[prev]
        nxt = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("wgmma.")),
                   len(lines))
        adds = sum(bool(re.match(r"add(\.rn)?\.f32\s", x)) for x in lines[i + 1:nxt])
        assert adds >= per_thread, (adds, per_thread)
    if accumulate:  # dW +=: the chain continues from C's fp32 values (a tile inside C and
        # an edge tile load them on paths of their own)
        assert _c_elements_loaded(ptx) >= 2 * per_thread, (_c_elements_loaded(ptx), per_thread)
    assert not re.search(r"C75\d\d", _assert_no_spills(ptx, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("tile, cluster, stages, pingpong, swap_ab, accumulate", [
    ((128, 192, 64), (1, 2), 5, True, False, False),
    ((128, 128, 64), (2, 1), 6, False, False, False),
    ((128, 192, 64), (1, 1), 4, True, True, False),
    ((128, 192, 64), (1, 2), 5, True, False, True)])
def test_dense_kernels_pin_their_accumulator_start(tmp_path, tile, cluster, stages, pingpong,
                                                   swap_ab, accumulate):
    """A non-chunked SM90 kernel's chain starts from zeros written by volatile movs
    (`wgmma_registers`), each before the WGMMA fence of the tile's first k tile, or (dW +=) from C's
    values, each register pinned by an empty asm after the loads, before the fence. When the
    compiler sank a copied zero fill past the fence, ptxas drained the pipe after each tile's first
    WGMMA (info C7517, in 164 table kernels) and the 128x192 ping-pong kernel spilled; with ptxas at
    hand neither may remain."""
    from detgemm_cute import compile as kcompile

    key = kcompile.KernelKey(tile=tile, cluster=cluster, stages=stages, persistent=True,
                             dtype="bf16", out_dtype="fp32" if accumulate else "bf16",
                             a_major="m" if accumulate else "k", b_form="kn" if accumulate
                             else "nk", b_contig="last", has_bias=not accumulate,
                             arch="sm_90a", pingpong=pingpong, swap_ab=swap_ab,
                             accumulate=accumulate)
    ptx = _audited_ptx(key, tmp_path)
    lines = [ln.strip() for ln in ptx.splitlines()]
    zeros = [i for i, ln in enumerate(lines) if re.match(r"mov\.b32\s+%r\d+, 0f00000000;", ln)]
    per_thread = tile[0] * tile[1] // (128 * (1 if pingpong else 2))
    fence = next(i for i, x in enumerate(lines) if x.startswith("wgmma.fence"))
    if accumulate:
        # C's values (inside and edge tiles, `_c_elements_loaded`), then one empty asm per
        # accumulator register (`fence_operands`) after the last load, before the fence.
        assert _c_elements_loaded(ptx) >= 2 * per_thread, (_c_elements_loaded(ptx), per_thread)
        last = max(i for i, x in enumerate(lines[:fence]) if re.match(r"ld\.global", x))
        pins = sum(a.startswith("// begin inline asm") and b.startswith("// end inline asm")
                   for a, b in zip(lines[last:fence], lines[last + 1:fence]))
        assert pins >= per_thread, (pins, per_thread)
    else:
        assert zeros and zeros[0] < fence and len(zeros) % per_thread == 0, \
            (len(zeros), per_thread)
        for i in zeros:  # the next WGMMA instruction after each zero is the fence
            nxt = next(x for x in lines[i + 1:] if x.startswith("wgmma."))
            assert nxt.startswith("wgmma.fence"), nxt
    report = _assert_no_spills(ptx, tmp_path)
    assert not re.search(r"C75\d\d", report), report[-500:]


# A grouped kernel's key (128x256 tiles on a 1x2 cluster, bf16, B [K, N]) for the offs tests.
_GROUPED_KEY = dict(tile=(128, 256, 64), cluster=(1, 2), stages=4, persistent=True,
                    dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn", b_contig="last",
                    has_bias=False, arch="sm_90a", grouped=True)


def test_grouped_kernels_call_no_function_unless_asked_to_report_offs(tmp_path, monkeypatch):
    """A function call anywhere in a kernel makes ptxas issue its WGMMAs one at a time
    (C7510). The grouped kernels check offs with a trap alone, so their PTX calls nothing
    and passes the audit; the build that prints a bad entry (`offs_report`, from
    DETGEMM_CUTE_REPORT_OFFS when a plan is made) calls printf, which the audit reports."""
    from detgemm_cute import compile as kcompile

    base = dict(_GROUPED_KEY, grouped=False)
    for kind in ({"grouped": True}, {"grouped_k": True, "a_major": "m"}):
        key = kcompile.KernelKey(**{**base, **kind})
        assert "C7510" not in _assert_no_spills(_audited_ptx(key, tmp_path), tmp_path)
        report = kcompile.KernelKey(**{**base, **kind, "offs_report": True})
        ptx = kcompile.build(report, f"--keep-ptx --dump-dir={tmp_path}").__ptx__ or ""
        assert aot.audit_ptx(ptx) == ["a function call: ptxas then serializes every WGMMA "
                                      "(C7510)"]
        assert aot.audit_ptx(ptx, offs_report=True) == []  # what the debugging build is
        assert "vprintf" in ptx
    bucket = SimpleNamespace(tile=(128, 256, 64), cluster=(1, 2), stages=4, persistent=True)
    call = dict(dtype="bf16", out_dtype="bf16", a_major="k", b_form="kn", b_contig="last",
                has_bias=False)
    monkeypatch.delenv(kcompile.REPORT_OFFS_ENV, raising=False)
    assert not kcompile.KernelKey.for_bucket(bucket, grouped=True, **call).offs_report
    for value, on in (("0", False), ("off", False), ("", False), ("true", True), (" ON ", True)):
        monkeypatch.setenv(kcompile.REPORT_OFFS_ENV, value)
        assert kcompile.KernelKey.for_bucket(bucket, grouped=True, **call).offs_report is on
    monkeypatch.setenv(kcompile.REPORT_OFFS_ENV, "1")
    assert kcompile.KernelKey.for_bucket(bucket, grouped=True, **call).offs_report
    assert kcompile.KernelKey.for_bucket(bucket, grouped_k=True, **call).offs_report
    assert not kcompile.KernelKey.for_bucket(bucket, **call).offs_report  # dense: no offs
    with pytest.raises(ValueError, match="grouped kernels only"):
        kcompile.build(kcompile.KernelKey(**base, offs_report=True))


def test_ptxas_notes_name_what_costs_speed(tmp_path, monkeypatch):
    """`detgemm-cute compile --ptxas`: ptxas -v's performance warnings and spills per kernel
    (the grouped kernel that prints a bad offs entry: WGMMAs serialized at its printf call,
    C7510; the default build: nothing). Without ptxas on PATH the option is refused."""
    import shutil

    from detgemm_cute import compile as kcompile

    if shutil.which("ptxas"):
        notes = {report: aot.ptxas_notes(kcompile.build(
            kcompile.KernelKey(**_GROUPED_KEY, offs_report=report),
            f"--keep-ptx --dump-dir={tmp_path}").__ptx__ or "", "sm_90a")
            for report in (False, True)}
        assert notes[False] == []
        assert [n for n in notes[True] if n.startswith("C7510: wgmma.mma_async instructions "
                                                       "are serialized")], notes[True]
        # The command's lines: the debugging build (DETGEMM_CUTE_REPORT_OFFS=1) passes the
        # audit as what it is, and its notes name the serialized WGMMAs.
        monkeypatch.setenv(kcompile.REPORT_OFFS_ENV, "1")
        lines = []
        assert aot.compile_buckets("sm_90a", ["grouped_m1_41"], out=lines.append,
                                   ptxas=True) == 0
        assert all("| ptxas: C7510" in ln for ln in lines[:-2]), lines
        assert lines[-2].startswith("compile: ptxas notes on 4 of 4 distinct kernels")
        monkeypatch.delenv(kcompile.REPORT_OFFS_ENV)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    lines = []
    assert aot.compile_buckets("sm_90a", ["fwd_prefill"], out=lines.append, ptxas=True) == 1
    assert "--ptxas needs ptxas on PATH" in lines[0]
    with pytest.raises(RuntimeError, match="ptxas is not on PATH"):
        aot.ptxas_notes("", "sm_90a")
