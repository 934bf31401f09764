"""Buckets with alternatives: YAML schema, per-shape choice, explain, and the cost fitter."""

import math
import random

import pytest

from detgemm_cute import dispatch as D
from detgemm_cute import registry as R
from detgemm_cute import wave_cost
from detgemm_cute.tune import choice
from detgemm_cute.tune.table import Point

ALT_A = "{tile: [128, 256, 64], cluster: [1, 2], stages: 4, persistent: true, cost: [2.0, 0.6, 0.1, 1.0]}"
ALT_B = "{tile: [64, 64, 128], stages: 6, persistent: true, swap_ab: true, cost: [1.0, 0.15, 0.2, 0.5]}"


def _layer(tmp_path, alts=(ALT_A, ALT_B), head="    sms: 132\n", name="u.yaml"):
    p = tmp_path / name
    p.write_text("arch: sm90\nbuckets:\n  - name: mine\n    op: fwd\n    dtypes: [bf16]\n"
                 "    m: [100000, null]\n" + head + "    alternatives:\n" +
                 "".join(f"      - {a}\n" for a in alts))
    return p


def test_choice_follows_the_wave_arithmetic(tmp_path):
    R.add_config(_layer(tmp_path))
    names = {}
    for m, n, k in ((100000, 16384, 8192), (100000, 64, 64), (250000, 8192, 256)):
        b = D.lookup("fwd", "bf16", "sm90", m, n, k)
        alts = R.get_registry("sm90").alternatives(b)
        want = min(alts, key=lambda a: wave_cost.predict_us(a.cost, a.tile, a.cluster, a.swap_ab,
                                                             m, n, k, 132))
        assert b is want and b.group == "mine" and b.layer == 1
        names[(m, n, k)] = b.name
    assert set(names.values()) == {"mine.128x256x64_c1x2_s4_p", "mine.64x64x128_c1x1_s6_p_swap_ab"}
    ex = D.explain("fwd", "bf16", "sm90", 100000, 64, 64)
    assert "least predicted time of its 2 alternatives" in ex.reason
    assert str(ex).count("option:") == 2 and str(ex).count("<- runs") == 1
    assert D.bucket_by_name("sm90", "mine.128x256x64_c1x2_s4_p").cost == (2.0, 0.6, 0.1, 1.0, 0.0, 0.0)  # 4 numbers: no traffic or padding term


def test_features_by_hand():
    # 1000 x 5120 on 128x256 tiles: 8 * 20 = 160 tiles, 2 waves of 132, K 4096 / 64 = 64 blocks
    # operand traffic: 160 tiles x 64 k-blocks x (128 + 256) x 64 x 2 bytes, all SMs busy
    f = wave_cost.features((128, 256, 64), (1, 1), False, 1000, 5120, 4096, 132)
    assert f[:4] == (1.0, 128.0, 128.0, 2.0)
    assert f[4] == pytest.approx(160 * 64 * 384 * 64 * 2 / 1e6)
    # swapped: the tile's rows run along N
    f = wave_cost.features((128, 64, 64), (1, 1), True, 100, 1024, 640, 132)
    assert f[:4] == (1.0, 10.0, 10.0 * 16 / 132, 1.0)  # ceil(1024/128) * ceil(100/64) = 16 tiles
    assert f[4] == pytest.approx(16 * 10 * 192 * 64 * 2 / 1e6 * 16 / 132)
    # clusters are the unit: 896 x 8192 on 128x224, 1x2 -> 7 x ceil(37 / 2) = 133 clusters,
    # 66 at a time: 3 waves (259 single tiles would take 2)
    f = wave_cost.features((128, 224, 64), (1, 2), False, 896, 8192, 640, 132)
    assert f[:4] == (1.0, 30.0, 30.0 * 132 / 132, 3.0)
    # the B tile (224 wide) is multicast to both CTAs of a 1x2 cluster: counted once per pair
    assert f[4] == pytest.approx(7 * 37 * 10 * (128 / 2 + 224) * 64 * 2 / 1e6)
    assert wave_cost.features((128, 224, 64), (1, 1), False, 896, 8192, 640, 132)[3] == 2.0


def test_clusters_of_four_and_eight_fit_fewer_than_sms_over_size():
    """A cluster stays inside one GPC: a 132-SM H100 holds 30 clusters of 4 and 15 of 8 at
    once (the driver's count), so 128 tiles on 2 x 2 clusters (32 clusters) take two waves,
    and 120 tiles on 4 x 2 clusters (15) one; other GPUs fall back to SMs / size."""
    assert [wave_cost.cluster_slots(132, s) for s in (1, 2, 4, 8)] == [132, 66, 30, 15]
    assert wave_cost.cluster_slots(108, 4) == 27 and wave_cost.cluster_slots(1, 8) == 1
    # dx 960 x 2048 <- 3584 swapped onto 128x128 tiles, 2 x 2: 16 x 8 tiles, 32 clusters
    f = wave_cost.features((128, 128, 64), (2, 2), True, 960, 2048, 3584, 132)
    assert f[3] == 2.0 and f[2] == pytest.approx(2 * 56 * 120 / 132)
    # 1234 x 768 on 64x128 tiles, 4 x 2, swapped: 12 x 10 tiles in 3 x 5 = 15 clusters
    assert wave_cost.features((64, 128, 64), (4, 2), True, 1234, 768, 3072, 132)[3] == 1.0


def test_row_copy_staging_is_for_16_bit_cuda_rows_only():
    """The row-copy kernel takes 16-bit CUDA rows; anything else is left to PyTorch's copy
    (None), and the CPU path of stage_k_major pads with zeros."""
    import torch

    from detgemm_cute import gemm, staging

    x = torch.randn(5, 777).bfloat16()
    assert staging.rows(x, 784) is None and staging.rows(x.float(), 784) is None
    out = gemm.stage_k_major(x, True)
    assert out.shape == (5, 784) and torch.equal(out[:, :777], x) and not out[:, 777:].any()


def test_traffic_term_sees_the_weight_read_per_tile_over_m():
    # M = 176 on swapped tiles: one 192-wide tile over M reads the weight once, two 112-wide
    # ones read it twice; the wave terms alone favour the two (twice the SMs busy)
    one = wave_cost.features((64, 192, 64), (1, 1), True, 176, 3584, 3584, 132)
    two = wave_cost.features((64, 112, 64), (1, 1), True, 176, 3584, 3584, 132)
    assert two[1] == one[1] and two[2] > one[2]
    weight_mb = 3584 * 3584 * 2 / 1e6
    assert one[4] == pytest.approx((weight_mb + 56 * 56 * 192 * 64 * 2 / 1e6) * 56 / 132)
    assert two[4] == pytest.approx((2 * weight_mb + 56 * 2 * 56 * 112 * 64 * 2 / 1e6) * 112 / 132)


@pytest.mark.parametrize("head, alts, words", [
    ("", (ALT_A,), "sms (the SM count"),
    ("    sms: 132\n    tile: [64, 64, 64]\n", (ALT_A,), "gives its kernel fields in each"),
    ("    sms: 132\n", ("{tile: [128, 256, 64], stages: 4, cost: [1, 2]}",), "cost must be a list of 4 to 6"),
    ("    sms: 132\n", ("{tile: [128, 256, 64], stages: 4, cost: [1, 2, -3, 4]}",), "numbers >= 0"),
    ("    sms: 132\n", ("{tile: [128, 256, 64], stages: 4}",), "'cost': missing"),
    ("    sms: 132\n", ("{tile: [128, 256, 64], stages: 4, cots: [1, 1, 1, 1]}",), "did you mean 'cost'"),
    ("    sms: 132\n", ("{tile: [128, 250, 64], stages: 4, cost: [1, 1, 1, 1]}",), "tile"),
    ("    sms: 132\n", (ALT_A, ALT_A), "the same kernel as another alternative"),
])
def test_bad_alternatives_are_reported_with_line_and_field(tmp_path, head, alts, words):
    with pytest.raises(R.ConfigError) as e:
        R.load_config(_layer(tmp_path, alts, head))
    assert words in str(e.value) and "u.yaml:" in str(e.value)


def test_builtin_alternatives_are_complete_and_distinct():
    reg = R.get_registry("sm90")
    groups = {}
    for b in reg.buckets:
        if b.group:
            groups.setdefault(b.group, []).append(b)
    assert set(groups) >= {"fwd_prefill", "dx_prefill", "dw_prefill"}
    for name, alts in groups.items():
        assert len(alts) >= 2 and len({(a.tile, a.cluster, a.stages, a.persistent, a.pingpong,
                                        a.swap_ab, a.raster_n) for a in alts}) == len(alts)
        assert all(a.sms == 132 and len(a.cost) == wave_cost.N_COEFFS and min(a.cost) >= 0 for a in alts)
        assert len({(a.m, a.n, a.k, a.dtypes, a.op) for a in alts}) == 1


def test_fit_recovers_coefficients_and_keeps_floors():
    rnd = random.Random(0)
    true = (3.0, 0.5, 0.25, 1.5, 0.02, 0.3)
    samples = []
    for _ in range(60):
        # small and large grids alike, so `active` (min(tiles, SMs)) varies
        f = wave_cost.features((128, 128, 64), (1, 1), False, rnd.randint(100, 3000),
                               rnd.randint(100, 8000), rnd.randint(64, 16384), 132)
        samples.append((f, sum(c * x for c, x in zip(true, f))))
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(choice.fit_cost(samples), true))
    floor = (0.0, 0.9, 0.0, 0.0, 0.0, 0.0)
    got = choice.fit_cost(samples, floor)
    assert got[1] == pytest.approx(0.9) and min(g - f for g, f in zip(got, floor)) >= 0


def test_fitted_costs_are_the_ones_a_table_writes():
    """fit_all rounds each coefficient as `bucket_yaml` writes it (4 significant digits), so
    the picks selection and tune-fit's report score are the written table's: kernels whose
    fits sit on their floors predict proportional times, and unrounded ties broke another
    way than the written costs did (an H200 fwd_mid_narrow fit reported 0.959x Lt that its
    YAML ran at 0.932x)."""
    fields = {"a": {"tile": [128, 128, 64]}, "b": {"tile": [64, 64, 128]}}
    pts = [Point(m, n, k, {"a": 10.0 + m / 97, "b": 11.0 + k / 89})
           for m, n, k in [(512, 4096, 4096), (640, 2048, 8192), (800, 8192, 1024)] * 3]
    costs = choice.fit_all(pts, fields, 132, 8)
    for cost in costs.values():
        assert cost == tuple(float(f"{c:.4g}") for c in cost)
    lines = choice.bucket_yaml("x", "fwd", ["bf16"], ((512, 1535), (1, None), (1, None)), 132,
                               list(costs), costs, fields)
    assert all(str(list(costs[n])[1]) in "".join(lines) for n in costs)


def test_select_and_cross_validate_pick_the_faster_kernel():
    fields = {"big": {"tile": [128, 256, 64]}, "small": {"tile": [64, 64, 128]}}
    pts = []
    for m in (128, 256, 1024, 4096, 16384):
        for n, k in ((1024, 4096), (8192, 8192), (4096, 1024)):
            t = {c: wave_cost.predict_us(cost, tuple(fields[c]["tile"]), (1, 1), False, m, n, k,
                                         132)
                 for c, cost in (("big", (2, 0.8, 0.2, 1)), ("small", (1, 0.2, 0.1, 0.3)))}
            pts.append(Point(m, n, k, t, {"cublaslt": min(t.values())}))
    costs = choice.fit_all(pts, fields, 132, min_points=5)
    names = choice.select(pts, costs)
    assert set(names) <= {"big", "small"} and choice.reach(pts, names) == pytest.approx(1.0)
    res = choice.cross_validate(pts, fields, 132, "m", min_points=5)
    assert len(res) == len(pts)
    assert all(c is not None and p.times[c] == pytest.approx(p.best, rel=1e-6) for p, c in res)
    text = "\n".join(choice.bucket_yaml("x", "fwd", ["bf16"], ((129, None), (1, None), (1, None)),
                                        132, names, costs, fields))
    assert "alternatives:" in text and "sms: 132" in text and "cost: [" in text


def test_tune_alternatives_times_every_alternative(capsys):
    from detgemm_cute.tune import command

    rc = command.main(["--shapes", "4096x4096x4096", "--ops", "fwd", "--max-candidates", "1",
                       "--alternatives", "--dry-run"])
    assert rc == 0
    out = capsys.readouterr().out
    alts = [b for b in R.get_registry("sm90").buckets if b.group == "fwd_prefill"]
    assert f"+{len(alts) - 1}:" in out


def test_tune_fit_writes_a_layer_that_loads_and_serves(tmp_path, capsys):
    """Synthetic tune records (two kernels whose times follow known costs) -> tune-fit ->
    a layer the registry loads, whose lookups pick the faster kernel."""
    import gzip
    import json

    from detgemm_cute import cli

    true = {"128x256x64_c1x1_s4_p": ((128, 256, 64), (2, 0.8, 0.2, 1)),
            "64x64x128_c1x1_s6_p": ((64, 64, 128), (1, 0.2, 0.1, 0.3))}
    recs = []
    for m in (256, 512, 1024, 4096, 16384):
        for n, k in ((1024, 4096), (8192, 8192), (4096, 1024)):
            t = {c: wave_cost.predict_us(cost, tile, (1, 1), False, m, n, k, 132)
                 for c, (tile, cost) in true.items()}
            recs.append({"op": "fwd", "gemm": [m, n, k], "m": m, "n": n, "k": k, "cands": t,
                         "device": "GPU X", "arch": "sm90", "dtype": "bf16",
                         "peers": {"cublaslt": min(t.values())},
                         "fields": {c: {"tile": list(tile), "stages": 4 if tile[0] == 128 else 6,
                                        "persistent": True} for c, (tile, _) in true.items()}})
    src = tmp_path / "t.json.gz"
    with gzip.open(src, "wt") as f:
        json.dump({"records": recs}, f)
    out = tmp_path / "fit.yaml"
    assert cli.main(["tune-fit", str(src), "--ops", "fwd", "--m-min", "200", "--min-points", "5",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fwd: tune-fit on GPU X: 2 alternatives" in text and "left out" in text
    R.add_config(out)
    for m, n, k in ((300, 64, 64), (20000, 20000, 8192)):
        b = D.lookup("fwd", "bf16", "sm90", m, n, k)
        want = min(true, key=lambda c: wave_cost.predict_us(true[c][1], true[c][0], (1, 1),
                                                             False, m, n, k, 132))
        assert b.group == "fwd_alternatives" and b.tile == true[want][0]
    assert cli.main(["tune-fit", str(tmp_path / "none.json"), "--out", str(out)]) == 2
    # a bounded region: only the records inside are used, and the bucket serves that box
    box = tmp_path / "box.yaml"
    assert cli.main(["tune-fit", str(src), "--ops", "fwd", "--m-min", "200", "--m-max", "1024",
                     "--n-min", "2000", "--min-points", "2", "--name", "box", "--out",
                     str(box)]) == 0
    assert "costs from 6 problems (M 256..1024)" in capsys.readouterr().out  # 3 M x 2 N
    text = box.read_text()
    assert "m: [200, 1024]" in text and "n: [2000, null]" in text
    assert cli.main(["tune-fit", str(src), "--m-min", "600", "--m-max", "500",
                     "--out", str(box)]) == 2
    # a run joined to itself (--align-runs: every time already there) selects the same two
    assert cli.main(["tune-fit", str(src), str(src), "--align-runs", "--min-gain", "0",
                     "--ops", "fwd", "--m-min", "200", "--min-points", "5", "--out",
                     str(out)]) == 0
    assert "2 alternatives" in capsys.readouterr().out
    assert cli.main(["tune-fit", str(src), "--min-gain", "-0.1", "--out", str(out)]) == 2
    assert "--min-gain: expected a number >= 0.0, got -0.1" in capsys.readouterr().err


def test_tune_fit_also_offers_a_layers_kernels_to_the_selection(tmp_path, capsys):
    """A kernel close to the best on too few problems to be a contender is left out of the
    selection, unless `--also` names a layer holding it (a refit keeping a family kernel)."""
    import gzip
    import json

    from detgemm_cute import cli

    tiles = {"a": ((128, 256, 64), 4), "b": ((64, 64, 128), 6), "c": ((128, 128, 64), 6)}
    names = {k: f"{t[0]}x{t[1]}x{t[2]}_c1x1_s{st}_p" for k, (t, st) in tiles.items()}
    recs = []
    for i, m in enumerate((256, 512, 1024, 2048, 4096, 8192, 16384, 32768)):
        t = {names["a"]: 10.0 + i, names["b"]: 10.5 + i,
             names["c"]: (8.0 + i) if i in (2, 5) else 30.0}  # c: the best on two problems
        recs.append({"op": "fwd", "gemm": [m, 4096, 4096], "m": m, "n": 4096, "k": 4096,
                     "cands": t, "device": "GPU X", "arch": "sm90", "dtype": "bf16",
                     "peers": {"cublaslt": min(t.values())},
                     "fields": {names[k]: {"tile": list(tl), "stages": st, "persistent": True}
                                for k, (tl, st) in tiles.items()}})
    src = tmp_path / "t.json.gz"
    with gzip.open(src, "wt") as f:
        json.dump({"records": recs}, f)
    layer = tmp_path / "family.yaml"
    layer.write_text("arch: sm90\nbuckets:\n  - name: fam\n    op: fwd\n    dtypes: [bf16]\n"
                     "    m: [100000, null]\n    sms: 132\n    alternatives:\n"
                     "      - {tile: [128, 128, 64], stages: 6, persistent: true, "
                     "cost: [0, 1, 0, 0]}\n")
    out = tmp_path / "fit.yaml"
    base = ["tune-fit", str(src), "--ops", "fwd", "--min-points", "5", "--min-gain", "0",
            "--out", str(out)]
    assert cli.main(base) == 0
    assert "tile: [128, 128, 64]" not in out.read_text()
    assert cli.main(base + ["--also", str(layer)]) == 0
    assert "tile: [128, 128, 64]" in out.read_text()
    capsys.readouterr()
    # --also with --keep (which selects nothing) and a missing layer are errors, not no-ops
    assert cli.main(base + ["--also", str(layer), "--keep", str(layer)]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert cli.main(base + ["--also", str(tmp_path / "none.yaml")]) == 2
    assert "no such layer file" in capsys.readouterr().err


def test_read_records_merges_candidates_and_takes_each_peer_from_the_first_file(tmp_path):
    """A file of extra candidates without peers merges into the records that have them, in
    either order; a peer's time is the first file's that has it."""
    import gzip
    import json

    from detgemm_cute.tune.fit_command import read_records

    def rec(cands, peers):
        return {"op": "fwd", "gemm": [512, 4096, 4096], "m": 512, "n": 4096, "k": 4096,
                "device": "GPU X", "arch": "sm90", "dtype": "bf16", "cands": cands,
                "fields": {c: {"tile": [128, 128, 64]} for c in cands}, "peers": peers}

    base, extra, other = tmp_path / "base.json.gz", tmp_path / "extra.json.gz", tmp_path / "o.gz"
    for path, r in ((base, rec({"a": 10.0}, {"cublaslt": 9.0, "cublas": 9.5})),
                    (extra, rec({"b": 8.0}, {})),
                    (other, rec({"a": 11.0}, {"cublaslt": 7.0}))):
        with gzip.open(path, "wt") as f:
            json.dump({"records": [r]}, f)
    for order in ((base, extra), (extra, base)):
        (got,) = read_records(order)
        assert got["cands"] == {"a": 10.0, "b": 8.0}
        assert got["peers"] == {"cublaslt": 9.0, "cublas": 9.5}
        assert set(got["fields"]) == {"a", "b"}
    (got,) = read_records((base, other))  # a later file's candidate time replaces the first
    assert got["cands"] == {"a": 11.0} and got["peers"]["cublaslt"] == 9.0


def test_read_records_align_puts_a_later_run_on_the_first_runs_scale(tmp_path):
    """`--align-runs`: a later run's times of a problem are scaled by the candidates both runs
    timed on it (geomean of earlier / later), a candidate already timed keeps its first time,
    and a problem the runs share no candidate on joins unscaled."""
    import gzip
    import json

    from detgemm_cute.tune.fit_command import read_records

    def rec(m, cands):
        return {"op": "fwd", "gemm": [m, 4096, 4096], "m": m, "n": 4096, "k": 4096,
                "device": "GPU X", "arch": "sm90", "dtype": "bf16", "cands": cands,
                "fields": {c: {"tile": [128, 128, 64]} for c in cands}, "peers": {}}

    first, later = tmp_path / "first.json.gz", tmp_path / "later.json.gz"
    with gzip.open(first, "wt") as f:
        json.dump({"records": [rec(512, {"a": 10.0, "b": 20.0}), rec(640, {"a": 5.0})]}, f)
    with gzip.open(later, "wt") as f:  # 0.8x and 0.9x the first run on the shared a and b
        json.dump({"records": [rec(512, {"a": 8.0, "b": 18.0, "c": 6.0}),
                               rec(640, {"c": 4.0})]}, f)
    got = {r["m"]: r["cands"] for r in read_records((first, later), align=True)}
    scale = ((10.0 / 8.0) * (20.0 / 18.0)) ** 0.5
    assert got[512]["a"] == 10.0 and got[512]["b"] == 20.0
    assert got[512]["c"] == pytest.approx(6.0 * scale)
    assert got[640] == {"a": 5.0, "c": 4.0}
    plain = {r["m"]: r["cands"] for r in read_records((first, later))}
    assert plain[512] == {"a": 8.0, "b": 18.0, "c": 6.0}


@pytest.mark.parametrize("group, records, m_range, n_range, max_alternatives, terms, contend, "
                         "ops, fit", [
    # dX at 129..511 rows: the 60 kernels of bench/shapes/dx_pool.yaml (the dx_small, dx_mid
    # and dx_mid_narrow alternatives before, and fwd_cluster_pool.yaml's) timed on every other
    # problem of bench/shapes/fwd_small.txt and fwd_mid.txt after the cluster ragged-tail fix
    ("small", ("tune_dx_pool",), (129, 511), (1, {}), 16, 6, True, ("dx",), {}),
    # the forward at 129..511 rows: the 76 kernels of bench/shapes/fwd_small_deep_pool.yaml
    # and the 21 more of fwd_small_wave_pool.yaml (a second run, joined on the 4 kernels both
    # timed: --align-runs) timed on every problem of bench/shapes/fwd_small.txt and
    # fwd_small_m256.txt
    # (selected to 28 with --min-gain 0: with each weight left out 0.984x Lt, 0.976x at the
    # default 0.001's 23)
    ("small", ("tune_fwd_small_deep", "tune_fwd_small_wave"), (129, 511), (1, {}), 28, 6,
     True, ("fwd",), {"align": True, "min_gain": 0.0}),
    # the forward's wide outputs at M 512..767: the 34 kernels of bench/shapes/fwd_mid_pool.yaml
    # and the 15 more of fwd_cluster_pool.yaml timed on every problem of
    # bench/shapes/fwd_mid.txt, all 49 on fwd_mid_m512.txt
    ("mid_low", ("tune_fwd_mid", "tune_fwd_cluster", "tune_fwd_mid_m512"), (512, 767),
     (2305, {}), 12, 6, True, ("fwd",), {}),
    # fitted before the padding term and the contenders rule (a mid table reselected with
    # them ran 2-3% slower on the bench's mid rows: the small-mid A/B, bench/results/README.md)
    ("mid", ("tune_mid",), (512, 1535), (1, {}), 16, 5, False, ("fwd", "dx"), {}),
    # narrow outputs at mid M: the previous alternatives and kernels on 2-, 4- and 8-CTA
    # clusters, every one timed on every problem
    ("mid_narrow", ("tune_narrow8",), (512, 1535), (1, 2304), 16, 6, True, ("dx",), {}),
    # the forward's narrow outputs at mid M: the 34 kernels of bench/shapes/fwd_mid_pool.yaml
    # timed on every problem of bench/shapes/fwd_mid.txt
    ("mid_narrow", ("tune_fwd_mid",), (512, 1535), (1, 2304), 8, 6, True, ("fwd",), {}),
    # narrow outputs at prefill M: the 27 kernels of bench/shapes/fwd_prefill_narrow_pool.yaml
    # timed on every problem of bench/shapes/fwd_prefill_narrow.txt
    ("prefill_narrow", ("tune_fwd_prefill_narrow",), (1536, 10**9), (1, 2560), 6, 6, True,
     ("fwd",), {}),
    # dW with few output tiles: the 18 kernels of bench/shapes/dw_small_pool.yaml timed on
    # every problem of bench/shapes/dw_small.txt
    ("small", ("tune_dw_small",), (1, 767), (17, {}), 8, 6, True, ("dw",), {}),
    # the forward at 65..128 rows: the 71 kernels of bench/shapes/fwd_m65_128_odd8_pool.yaml
    # timed on every problem of bench/shapes/fwd_m65_128.txt and fwd_m65_128_heldout.txt
    ("m65_128", ("tune_fwd_m65_128_odd8",), (65, 128), (1, {}), 12, 6, True, ("fwd",), {}),
])
def test_builtin_buckets_follow_from_the_committed_records(group, records, m_range, n_range,
                                                           max_alternatives, terms, contend,
                                                           ops, fit):
    """The built-in small, mid, mid-low, mid-narrow, prefill-narrow and M 65..128 buckets (and dW's
    small one) are what `choice` selects and fits from the tune records committed next to
    them (bench/results/tune/): configs are data, derived. `fit`: the bucket's tune-fit options
    beyond the defaults (`align`: --align-runs, `min_gain`: --min-gain)."""
    from pathlib import Path

    from detgemm_cute.tune.candidates import Candidate
    from detgemm_cute.tune.fit_command import read_records
    from detgemm_cute.tune.summary import all_fields, points_of

    root = Path(__file__).resolve().parents[1] / "bench" / "results" / "tune"
    paths = sorted(p for r in records for p in root.glob(f"{r}_nvidia-*.json.xz"))
    assert len(paths) == len(records), paths
    recs = read_records(paths, align=fit.get("align", False))
    fields = all_fields(recs)
    reg = R.get_registry("sm90")
    for op in ops:
        pts = [p for p in points_of(recs, op) if m_range[0] <= p.m <= m_range[1]
               and n_range[0] <= p.n <= (n_range[1] or p.n)]
        costs = choice.fit_all(pts, fields, 132, 8, terms=terms,
                               only=choice.contenders(pts) if contend else None)
        names = choice.select(pts, costs, max_alternatives, fit.get("min_gain", 0.001))
        pad = (0.0,) * (wave_cost.N_COEFFS - terms)
        want = _as_written(costs, names, pad)
        got = {Candidate.from_bucket(b).name: b.cost for b in reg.buckets
               if b.group == f"{op}_{group}"}
        assert got == want, f"{op}_{group}"


def _as_written(costs, names, pad=()):
    """{name: cost} as a table writes the fitted costs (4 significant digits), `pad` appended
    (zeros for the terms a fit with fewer terms leaves out)."""
    return {n: tuple(float(f"{c:.4g}") for c in costs[n]) + tuple(pad) for n in names}


def _h200_buckets(monkeypatch, group):
    """{candidate name: cost} of the H200 device table's `group` alternatives."""
    from detgemm_cute import device_tables
    from detgemm_cute.tune.candidates import Candidate

    with monkeypatch.context() as mp:
        mp.setenv(device_tables.ENV_VAR, "nvidia-h200")
        R.invalidate()
        try:
            return {Candidate.from_bucket(b).name: b.cost
                    for b in R.get_registry("sm90").buckets if b.group == group}
        finally:
            R.invalidate()


def _h200_points(record, m_range, n_range, op="fwd"):
    from pathlib import Path

    from detgemm_cute.tune.fit_command import read_records
    from detgemm_cute.tune.summary import all_fields, points_of

    root = Path(__file__).resolve().parents[1] / "bench" / "results" / "tune"
    recs = read_records([root / f"{record}_nvidia-h200.json.xz"])
    pts = [p for p in points_of(recs, op) if m_range[0] <= p.m <= m_range[1]
           and n_range[0] <= p.n <= n_range[1]]
    return pts, all_fields(recs)


def test_h200_prefill_narrow_follows_from_the_committed_record(monkeypatch):
    """The H200 device table's fwd_prefill_narrow is `tune-fit --m-min 1536 --n-max 2560
    --max-alternatives 12 --also <the family's fwd_prefill_narrow>` on
    bench/results/tune/tune_fwd_narrow_wide_nvidia-h200.json.xz (the 82 kernels of
    bench/shapes/fwd_narrow_wide_pool.yaml timed on every problem)."""
    from detgemm_cute.tune.candidates import Candidate

    family = {Candidate.from_bucket(b).name for b in R.get_registry("sm90").buckets
              if b.group == "fwd_prefill_narrow"}
    pts, fields = _h200_points("tune_fwd_narrow_wide", (1536, 10**9), (1, 2560))
    costs = choice.fit_all(pts, fields, 132, 8, only=choice.contenders(pts) | family)
    names = choice.select(pts, costs, 12, 0.001)
    want = _as_written(costs, names)
    assert _h200_buckets(monkeypatch, "fwd_prefill_narrow") == want


def test_h200_dw_small_follows_from_the_committed_record(monkeypatch):
    """The H200 device table's dw_small is `tune-fit --m-max 767 --n-min 17
    --max-alternatives 8` on bench/results/tune/tune_dw_small_wide_nvidia-h200.json.xz (the 54
    kernels of bench/shapes/dw_small_wide_pool.yaml, the family's among them, timed on all 93
    problems), and every kernel it names returned the table's bits there."""
    pts, fields = _h200_points("tune_dw_small_wide", (1, 767), (17, 10**9), op="dw")
    assert len(pts) == 93 and all(len(p.times) == 54 for p in pts)
    costs = choice.fit_all(pts, fields, 132, 8, only=choice.contenders(pts))
    names = choice.select(pts, costs, 8, 0.001)
    want = _as_written(costs, names)
    got = _h200_buckets(monkeypatch, "dw_small")
    assert got == want
    # points_of drops a kernel's time where its bits differed from the table's
    assert all(name in p.times for p in pts for name in got)


def test_h200_mid_keeps_the_family_kernels_with_refitted_costs(monkeypatch):
    """The H200 device table's fwd_mid runs the family's alternatives with costs refitted on
    bench/results/tune/tune_fwd_mid_wide_nvidia-h200.json.xz (`tune-fit --keep`)."""
    from detgemm_cute.tune.candidates import Candidate

    family = [Candidate.from_bucket(b).name for b in R.get_registry("sm90").buckets
              if b.group == "fwd_mid"]
    got = _h200_buckets(monkeypatch, "fwd_mid")
    assert sorted(got) == sorted(family)
    pts, fields = _h200_points("tune_fwd_mid_wide", (768, 1535), (2305, 10**9))
    costs = choice.fit_all(pts, fields, 132, 8, only=set(got))
    assert got == _as_written(costs, got)


def test_builtin_dw_prefill_costs_follow_from_the_committed_records():
    """dw_prefill's alternatives were selected from an earlier 20-candidate pool; their costs
    are `tune-fit --keep`'s six-term refit on bench/results/tune/tune_alternatives_*.json.xz
    (every alternative timed on all 249 dW problems, GEMM M >= 768, N >= 17)."""
    from pathlib import Path

    from detgemm_cute.tune.candidates import Candidate
    from detgemm_cute.tune.fit_command import read_records
    from detgemm_cute.tune.summary import all_fields, points_of

    root = Path(__file__).resolve().parents[1] / "bench" / "results" / "tune"
    paths = sorted(root.glob("tune_alternatives_nvidia-*.json.xz"))
    assert len(paths) == 1, paths
    recs = read_records(paths)
    pts = [p for p in points_of(recs, "dw") if p.m >= 768 and p.n >= 17]
    assert len(pts) == 249
    got = {Candidate.from_bucket(b).name: b.cost for b in R.get_registry("sm90").buckets
           if b.group == "dw_prefill"}
    costs = choice.fit_all(pts, all_fields(recs), 132, 8, only=set(got))
    assert got == _as_written(costs, got)


def test_builtin_tf32_buckets_follow_from_the_committed_records():
    """The fwd tf32 buckets are `tune-fit`'s selection from
    bench/results/tune/tune_tf32_*.json.xz, whose records hold fwd and dx GEMMs alike as
    GEMM-dims problems (op fwd, `orig_op` kept); the dx ones are that selection's kernels
    that read A through registers well (`sm90_limits.reads_a_in_registers`), all swapped (dx
    reads its weight through registers: the kernel's A), with the same costs."""
    from pathlib import Path

    from detgemm_cute.kernels.sm90_limits import reads_a_in_registers
    from detgemm_cute.tune.candidates import Candidate
    from detgemm_cute.tune.fit_command import read_records
    from detgemm_cute.tune.summary import all_fields, points_of

    root = Path(__file__).resolve().parents[1] / "bench" / "results" / "tune"
    paths = sorted(root.glob("tune_tf32_nvidia-*.json.xz"))
    assert len(paths) == 1, paths
    recs = read_records(paths)
    assert {r["orig_op"] for r in recs} == {"fwd", "dx"}
    fields = all_fields(recs)
    reg = R.get_registry("sm90")
    for group, (lo, hi) in (("tf32_decode", (1, 127)), ("tf32", (128, None))):
        pts = [p for p in points_of(recs, "fwd") if lo <= p.m and (hi is None or p.m <= hi)]
        # fitted before the padding term existed: five coefficients, the sixth 0
        costs = choice.fit_all(pts, fields, 132, 8, terms=5)
        names = choice.select(pts, costs, 12)
        want = _as_written(costs, names, (0.0,))
        swapped = {Candidate.from_fields({**fields[n], "swap_ab": True}).name: c
                   for n, c in want.items()
                   if reads_a_in_registers(fields[n]["tile"][0],
                                           fields[n].get("pingpong", False))}
        for op, op_want in (("fwd", want), ("dx", swapped)):
            got = {Candidate.from_bucket(b).name: b.cost for b in reg.buckets
                   if b.group == f"{op}_{group}"}
            assert got == op_want, f"{op}_{group}"


def test_contenders_need_coverage_and_closeness():
    """A candidate is fitted only if timed on nearly every problem and within 3% of the
    fastest on at least 3 of them."""
    from detgemm_cute.tune.table import Point

    pts = [Point(200 + i, 4096, 4096, {"a": 10.0, "b": 10.2 if i < 3 else 20.0, "c": 30.0,
                                       **({"d": 5.0} if i == 0 else {})}, {}, "")
           for i in range(10)]
    assert choice.contenders(pts) == {"a", "b"}  # c never close, d timed once
    assert choice.contenders(pts, min_near=4) == {"a"}
    # a problem that only an occasional candidate ran counts for nothing (no error)
    lone = Point(999, 4096, 4096, {"d": 5.0}, {}, "")
    assert choice.contenders(pts + [lone], coverage=0.9) == {"a", "b"}


def test_padding_term_charges_a_mostly_empty_last_tile():
    """c5 multiplies work x the fraction of the tiles' extent along M past M: a swapped
    64x160 tile over M = 161 pads 159 of 320 rows, over M = 320 none."""
    f161 = wave_cost.features((64, 160, 64), (1, 1), True, 161, 28672, 8192, 132)
    f320 = wave_cost.features((64, 160, 64), (1, 1), True, 320, 28672, 8192, 132)
    assert f161[:5] == f320[:5]
    assert f161[5] == pytest.approx(f161[1] * 159 / 320) and f320[5] == 0.0
    plain = wave_cost.features((128, 128, 64), (1, 2), False, 272, 4096, 4096, 132)
    assert plain[5] == pytest.approx(plain[1] * (1 - 272 / 384))
