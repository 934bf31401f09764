"""The SM90 tile specs `test_gpu_tile_shapes.py` forces through a user layer, and that layer's
YAML: data only, importable without a GPU, so a CPU test checks that the registry accepts the
layer the GPU tests load."""

# (tile, stages, persistent, cluster, pingpong, swap_ab)
TILES = [
    ((16, 16, 128), 16, True, (1, 1), False, False),
    ((8, 64, 128), 10, True, (1, 1), False, False),
    ((8, 32, 128), 16, True, (1, 2), False, False),
    ((16, 32, 128), 16, False, (1, 1), False, False),
    ((16, 48, 128), 12, True, (1, 1), False, False),
    ((32, 64, 64), 16, True, (1, 1), False, False),
    ((32, 80, 128), 7, False, (1, 1), False, False),
    ((64, 96, 64), 8, True, (1, 1), False, False),
    ((64, 112, 64), 8, False, (1, 1), False, False),
    ((128, 160, 64), 4, True, (1, 1), False, False),
    ((128, 224, 64), 3, True, (1, 1), False, False),
    ((128, 96, 64), 6, False, (2, 1), False, False),
    ((16, 128, 128), 5, True, (1, 1), False, False),
    ((32, 32, 128), 2, True, (1, 1), False, False),
]
# Ping-pong: two consumer warpgroups on alternate tiles of a CTA, one warpgroup per tile.
PINGPONG = [
    ((128, 192, 64), 5, True, (1, 1), True, False),
    ((128, 160, 64), 5, True, (2, 1), True, False),
    ((128, 128, 64), 6, True, (1, 2), True, False),
    ((64, 256, 64), 5, True, (1, 1), True, False),
    ((64, 128, 128), 4, True, (2, 1), True, False),
]
# Swapped operands: the kernel computes C^T = op(B)^T A^T into a transposed view of the
# output (M-major C, bias along the kernel's rows); plain, persistent and ping-pong kernels.
SWAPPED = [
    ((128, 256, 64), 4, True, (1, 2), False, True),
    ((128, 160, 64), 5, True, (2, 1), True, True),
    ((64, 112, 128), 4, False, (1, 1), False, True),
    ((128, 128, 64), 6, False, (2, 1), False, True),
    ((64, 256, 64), 5, True, (1, 1), True, True),
]
# 256-row tiles (two consumer warpgroups of 128 rows) and clusters of four CTAs (the shared
# operand multicast to 2 x 2, 4 x 1 or 1 x 4 CTAs), plain, persistent, ping-pong, swapped.
WIDE = [
    ((256, 128, 64), 4, True, (1, 1), False, False),
    ((256, 192, 64), 3, False, (1, 2), False, False),
    ((256, 144, 64), 4, True, (2, 1), False, True),
    ((256, 160, 64), 3, True, (1, 4), False, False),
    ((128, 128, 64), 6, True, (2, 2), False, False),
    ((128, 96, 64), 7, False, (1, 4), False, False),
    ((64, 208, 64), 6, True, (4, 1), False, True),
    ((128, 160, 64), 5, True, (2, 2), True, False),
    ((128, 224, 64), 4, False, (4, 1), False, True),
]
# Clusters of eight CTAs (4 x 2, 2 x 4: A multicast to two CTAs and B to four, or the other
# way round), deep stage rings, swapped or not, persistent or one tile per CTA.
CLUSTER8 = [
    ((64, 128, 64), 8, True, (4, 2), False, True),
    ((64, 128, 64), 8, True, (4, 2), False, False),
    ((64, 64, 64), 12, True, (2, 4), False, False),
    ((64, 64, 64), 12, True, (4, 2), False, True),
    ((128, 64, 64), 8, False, (2, 4), False, False),
]
# Widths that are odd multiples of 8 (an 8-column epilogue sub-tile, stored with stmatrix
# .x2): swapped or not, one or two warpgroups, ping-pong, 256 rows, clusters.
ODD8 = [
    ((64, 104, 128), 5, True, (1, 2), False, True),
    ((128, 152, 64), 6, True, (2, 1), False, False),
    ((64, 88, 128), 5, True, (1, 1), False, False),
    ((128, 120, 64), 7, False, (1, 1), False, True),
    ((256, 136, 64), 4, True, (1, 1), False, True),
    ((128, 120, 64), 6, True, (1, 1), True, False),
    ((64, 200, 64), 6, True, (1, 2), False, True),
]
ALL = TILES + PINGPONG + SWAPPED + WIDE + CLUSTER8 + ODD8
FAR = 10**12  # an M no call reaches: the buckets are used only when forced


def name(tile, stages, persistent, cluster, pingpong, swap_ab):
    return (f"shape_{'x'.join(map(str, tile))}_s{stages}{'_p' if persistent else ''}"
            f"{'p' if pingpong else ''}_c{cluster[0]}x{cluster[1]}{'_sw' if swap_ab else ''}")


def serves_bmm(spec) -> bool:
    """Specs the layer also declares as bmm buckets: ping-pong, 256-row and cluster tiles that
    do not swap operands (swapped buckets do not serve bmm) and whose width is a multiple of
    16 (bmm kernels take no odd multiple of 8: `sm90_limits.ODD_WIDTH_OPS`)."""
    return ((spec[4] or spec in WIDE or spec in CLUSTER8) and not spec[5]
            and spec[0][1] % 16 == 0)


def bucket_lines(name, op, m, spec, **extra) -> list[str]:
    """YAML lines of one bucket serving only M = m with the kernel of `spec`."""
    tile, stages, persistent, cluster, pingpong, swap_ab = spec
    fields = dict(tile=list(tile), cluster=list(cluster), stages=stages,
                  persistent=persistent, pingpong=pingpong, swap_ab=swap_ab, **extra)
    return ([f"  - name: {name}", f"    op: {op}", "    dtypes: [bf16, fp16]",
             f"    m: [{m}, {m}]"]
            + [f"    {k}: {str(v).lower() if isinstance(v, bool) else v}"
               for k, v in fields.items()])


MANY = PINGPONG + SWAPPED + WIDE + CLUSTER8 + ODD8

# One spec per kernel class with BM >= 64: one tile per CTA, persistent, swapped, 256 rows,
# clusters of four and eight, odd multiples of 8 wide; ping-pong (plain and swapped), which
# keeps the padded rows.
DIRECT = [TILES[8], TILES[11], PINGPONG[0], SWAPPED[1], SWAPPED[2], WIDE[0], WIDE[4],
          CLUSTER8[0], CLUSTER8[4], ODD8[0], ODD8[1]]


def layer_text() -> str:
    """The user layer of every spec in ALL: fwd, dX and dW buckets (and bmm where the spec
    serves it), each serving one M no call reaches, so they run only when forced."""
    lines = ["arch: sm90", "buckets:"]
    for i, spec in enumerate(ALL):
        for op in ("fwd", "dx", "dw") + (("bmm",) if serves_bmm(spec) else ()):
            lines += bucket_lines(f"{op}_{name(*spec)}", op, FAR + i, spec)
    return "\n".join(lines) + "\n"
