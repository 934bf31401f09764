"""Compile kernels from fake tensors with TVM-FFI, and keep them.

A kernel is compiled once per `KernelKey` (the bucket's tile/cluster/stages plus the dtypes
and operand layouts of the call) with symbolic M, N, K, so one compiled object serves every
problem size of its bucket. Compilation needs no GPU (`--gpu-arch sm_90a` for the SM90
family, `sm_80` -- or the GPU's own, e.g. `sm_90` -- for the SM80 family; `key.arch` picks
the kernel module), which is how CI proves that every bucket builds.

Caches:
- in-process: a dict from `KernelKey` to the compiled callable (the op layer keeps its own
  dict from the call's layout tuple to the callable, so a warm call does one dict lookup);
- on disk: the DSL's own file cache (``CUTE_DSL_CACHE_DIR``, default under /tmp) keeps the
  compiled module keyed by a hash of the traced IR, so a second process skips the backend
  compile but still traces the kernel in Python. ``CUTE_DSL_NO_CACHE=1`` disables it.
- AOT libraries (`aot_cache`, on by default; ``DETGEMM_CUTE_AOT_DIR``): exported ``.so`` files that a
  later process loads without tracing or compiling (`detgemm-cute warmup` fills it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .env import env_flag

DTYPES = ("bf16", "fp16")
OUT_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class KernelKey:
    """Everything that selects distinct machine code."""

    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    stages: int
    persistent: bool
    dtype: str  # input dtype of A and B: bf16 | fp16 | tf32 (fp32 operands read as TF32)
    out_dtype: str  # bf16 | fp16 | fp32
    a_major: str  # "k": A[M, K] row-major; "m": A is a transposed view
    b_form: str  # "nk": B given as [N, K] (weight of linear); "kn": [K, N] (mm)
    b_contig: str  # which dim of B (as given) has stride 1: "last" | "first"
    has_bias: bool
    arch: str = "sm_90a"
    accumulate: bool = False  # start from the fp32 values in C (dW +=) instead of +0.0
    batched: bool = False  # A, B, C are [L, ., .] batches (bmm), one launch for all entries
    # The fp32 tier: A and B are fp32 operands split into 16-bit parts (`split`: fp16 for
    # fwd/dX, bf16 for dW; both [rows, K'] K-major); each k tile is a chunk summed from +0.0
    # and added to the fp32 accumulator. `dtype` is what the kernel reads; out fp32, no bias.
    split: bool = False
    pingpong: bool = False  # two consumer warpgroups on alternate tiles (sm90, persistent)
    # The call computes C^T = op(B)^T A^T (operands swapped): the kernel's C is an M-major
    # view of the caller's [M, N] output and its bias runs along the kernel's rows. The
    # kernel's A is then the caller's B (a_major/b_form/b_contig describe the kernel's view).
    swap_ab: bool = False
    # The persistent schedule walks the N tiles fastest: concurrent CTAs then share the tile
    # of A (e.g. a swapped weight tile) instead of B's. Order only; no tile's arithmetic.
    raster_n: bool = False
    # Row groups of A and C with their own B ([G, ., .]; grouped_mm's mixture-of-experts
    # form): the kernel takes the groups' int32 cumulative row ends instead of a bias.
    grouped: bool = False
    # Groups along K (grouped_mm's 2-D x 2-D form, a mixture-of-experts weight gradient):
    # A [M, T] and B [T, N] with their column / row groups given by int32 cumulative ends
    # along T, C [G, M, N]; each entry is the chain over its group alone.
    grouped_k: bool = False
    # The tile's threads store each staged sub-tile (bounds-checked) instead of a TMA box:
    # for C's rows that do not start on 16 bytes (N not a multiple of 8 at 16 bits; no padded
    # buffer, no copy back), and in bmm for rows TMA would store as half sectors (sm90,
    # BM >= 64; gemm.output_rows).
    c_direct: bool = False
    # With `c_direct`: 8 when C's start, row pitch and batch stride are multiples of 8 bytes,
    # so each thread stores 8 bytes at once (`gemm.direct_align`: fresh bmm and grouped-K
    # outputs); 0: one element at a time (any pitch).
    c_align: int = 0
    # A's rows are read by the producer warpgroup, not TMA (16-byte chunks into a raw ring,
    # shifted into the stage: kernels/sm90_a_rows.py): a K-major A of any row pitch and
    # 2-byte-aligned start (p @ v's softmax rows at an odd sequence length), with no copy
    # into padded rows (sm90, persistent, BM >= 64, BK = 64, 16-bit, no A multicast).
    a_loads: bool = False
    # Launched with programmatic dependent launch (sm90 family; `pdl`): the CTAs set up under
    # the previous kernel's tail and wait for it before their first global access.
    pdl: bool = False
    # Grouped kernels (`grouped`, `grouped_k`) check offs on the device and trap on a bad
    # entry; with `offs_report` they print the entry first (`report_offs`). That printf is a
    # function call, and a call anywhere in a kernel makes ptxas issue its WGMMAs one at a
    # time (warning C7510): 1.09x a tile's time on an H200, so the default build traps only.
    offs_report: bool = False

    @staticmethod
    def for_bucket(bucket, **call) -> "KernelKey":
        from . import pdl

        call.setdefault("pdl", pdl.enabled() and family_of(call.get("arch", "sm_90a")) == "sm90")
        if call.get("grouped") or call.get("grouped_k"):
            call.setdefault("offs_report", report_offs())
        call.setdefault("swap_ab", getattr(bucket, "swap_ab", False))
        call.setdefault("raster_n", getattr(bucket, "raster_n", False))
        return KernelKey(tile=tuple(bucket.tile), cluster=tuple(bucket.cluster),
                         stages=bucket.stages, persistent=bucket.persistent,
                         pingpong=getattr(bucket, "pingpong", False), **call)


REPORT_OFFS_ENV = "DETGEMM_CUTE_REPORT_OFFS"


def report_offs() -> bool:
    """Whether grouped kernels built from now on print a bad offs entry before they trap
    (``DETGEMM_CUTE_REPORT_OFFS=1``, read when a call's plan is made): for debugging, as
    the printing build runs its WGMMAs one at a time (`KernelKey.offs_report`)."""
    return env_flag(REPORT_OFFS_ENV, False)


_lock = threading.Lock()
_compiled: dict[KernelKey, object] = {}


def _cutlass_dtype(name: str):
    import cutlass

    # tf32: the tensors are fp32 (what the caller passes); the kernel reads them as TF32.
    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32,
            "tf32": cutlass.Float32}[name]


def _make_fakes(key: KernelKey):
    """The fake tensors `key`'s kernel is compiled against, each from its `tensor_needs`
    need: what the staging decisions check the launch's tensors against."""
    import cutlass.cute as cute

    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from .kernels import tensor_needs as needs

    in_t, out_t = _cutlass_dtype(key.dtype), _cutlass_dtype(key.out_dtype)
    # A and B get their own K: a staged (zero-padded) operand may be longer in K than the
    # other; the kernel counts k tiles from A and TMA zero-fills B past its end.
    m, n, k_a, k_b = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    batch = cute.sym_int() if key.batched or key.grouped or key.grouped_k else None

    def shaped(shape, batched):  # torch order [L, rows, cols] for a batch
        return (batch, *shape) if batched else shape

    if key.a_loads:  # K-major, any row (and batch) stride, any element-aligned start
        a = needs.fake(in_t, shaped((m, k_a), key.batched), needs.a_rows(key.batched))
    else:
        a = needs.fake(in_t, shaped((m, k_a), key.batched),
                       needs.tma_operand(key.a_major == "k", key.batched))
    b_shape = (n, k_b) if key.b_form == "nk" else (k_b, n)
    b_batched = key.batched or key.grouped
    b = needs.fake(in_t, shaped(b_shape, b_batched),
                   needs.tma_operand(key.b_contig == "last", b_batched))
    c_batched = key.batched or key.grouped_k
    if key.c_direct:  # any row stride, or one of c_align bytes
        c_need = needs.c_direct(key.swap_ab, c_batched, key.c_align)
    elif key.grouped_k:
        c_need = needs.tma_operand(True, True)
    else:  # swapped: an M-major view
        c_need = needs.tma_operand(not key.swap_ab, key.batched)
    c = needs.fake(out_t, shaped((m, n), c_batched), c_need)
    bias_len = m if key.swap_ab else n
    bias = needs.fake(in_t, (bias_len,), needs.BIAS) if key.has_bias else None
    if key.grouped or key.grouped_k:  # the groups' cumulative ends take the bias's place
        bias = needs.fake(cutlass.Int32, (batch,), needs.OFFS)
    return a, b, c, bias, make_fake_stream(use_tvm_ffi_env_stream=True)


def family_of(gpu_arch: str) -> str:
    """The kernel family (registry arch) a ``--gpu-arch`` string builds: "sm_90a" -> "sm90"
    (TMA + WGMMA, which need the arch-specific target); every other target, e.g. "sm_80",
    "sm_86", "sm_89" and plain "sm_90" -> "sm80" (cp.async + mma.sync: runs on any GPU from
    sm_80 up, so an H100 runs it when it is built for "sm_90")."""
    name = gpu_arch.strip().lower().replace("_", "")
    if name == "sm90a":
        return "sm90"
    digits = name[2:].rstrip("af")
    if name.startswith("sm") and digits.isdigit() and int(digits) >= 80:
        return "sm80"
    raise ValueError(f"unknown GPU arch {gpu_arch!r}; expected e.g. sm_90a or sm_80")


def gpu_arch_for(family: str, capability: tuple[int, int]) -> str:
    """The ``--gpu-arch`` to build `family`'s kernels for a GPU of this compute capability:
    sm90 -> "sm_90a" (WGMMA and TMA need the arch-specific target); sm80 -> "sm_80" on any
    8.x GPU (one binary for A100, A10, L4, ...), else the GPU's own, e.g. "sm_90" on H100."""
    major, minor = capability
    if family == "sm90":
        return "sm_90a"
    if family == "sm80":
        return "sm_80" if major == 8 else f"sm_{major}{minor}"
    raise ValueError(f"unknown kernel family {family!r}; known: sm90, sm80")


def kernel_module(gpu_arch: str):
    """The kernel module for a ``--gpu-arch`` string (see `family_of`)."""
    if family_of(gpu_arch) == "sm90":
        from .kernels import sm90

        return sm90
    from .kernels import sm80

    return sm80


def build(key: KernelKey, extra_options: str = ""):
    """Compile `key` (no caching). Returns the TVM-FFI callable ``f(a, b, c, bias, max_clusters)``
    (grouped, grouped_k: ``f(a, b, c, offs, max_clusters)``).

    `extra_options` passes DSL flags through, e.g. ``--keep-ptx --dump-dir=D`` for audits."""
    import cutlass.cute as cute

    import cutlass

    if (key.grouped or key.grouped_k) and family_of(key.arch) != "sm90":
        raise ValueError(f"grouped kernels are sm90 only, not {key.arch}")
    kernel_class = kernel_module(key.arch).kernel_class(key.persistent, key.pingpong,
                                                        key.grouped, key.grouped_k)
    gemm = kernel_class(key.tile, key.cluster, key.stages, b_is_kn=key.b_form == "kn",
                        has_bias=key.has_bias, accumulate=key.accumulate, **_kernel_options(key))
    a, b, c, bias, stream = _make_fakes(key)
    # max_clusters is a run-time argument: the persistent grid is sized to the GPU it runs on.
    return cute.compile(gemm, a, b, c, bias, cutlass.Int32(1), stream,
                        options=f"--enable-tvm-ffi --gpu-arch {key.arch} {extra_options}".strip())


def a_major_builds(arch: str, tile_m: int, a_major: str) -> bool:
    """Whether a kernel of this family and BM reads an A of this major: an sm90 row tile
    (BM < 64) loads BM-row boxes of a K-major A into stages BM rows apart, so the op layer
    stages an M-major A K-major first."""
    return not (family_of(arch) == "sm90" and tile_m < 64 and a_major != "k")


def _kernel_options(key: KernelKey) -> dict:
    """Constructor options only some kernel families take."""
    opts = {}
    if not a_major_builds(key.arch, key.tile[0], key.a_major):
        raise ValueError("sm90 row tiles (BM < 64) read a K-major A: their stages lie BM rows "
                         "apart (the op layer stages an M-major A K-major first)")
    if key.dtype == "tf32" and key.a_major != "k" and family_of(key.arch) != "sm90":
        raise ValueError(f"a TF32 kernel of {key.arch} reads A K-major only (sm90 kernels "
                         f"read an M-major A through registers)")
    if key.swap_ab and family_of(key.arch) != "sm90":
        raise ValueError(f"swapped operands have sm90 kernels only, not {key.arch}")
    if key.split:
        opts["chunked"] = True
    if key.swap_ab:
        opts["bias_on_rows"] = True
    if key.c_direct:
        if family_of(key.arch) != "sm90" or key.tile[0] < 64 or key.accumulate:
            raise ValueError("direct C stores are for sm90 tiles of BM >= 64 without "
                             "accumulate")
        opts["c_direct"] = True
    if key.c_align:
        el = 4 if key.out_dtype == "fp32" else 2
        if not key.c_direct or key.c_align != 8:
            raise ValueError(f"c_align={key.c_align}: 0, or 8 with direct C stores (c_direct): "
                             f"8-byte stores")
        opts["c_vector"] = key.c_align // el
    if key.a_loads:
        if (family_of(key.arch) != "sm90" or not key.persistent or key.tile[0] < 64
                or key.tile[2] != 64 or key.cluster[1] != 1 or key.dtype not in DTYPES
                or key.a_major != "k" or key.split or key.grouped or key.swap_ab):
            raise ValueError("A loaded by the producer warpgroup (a_loads) is for persistent "
                             "sm90 kernels of BM >= 64 and BK = 64 with a K-major 16-bit A, "
                             "no A multicast (cluster [CM, 1]), not split, grouped or "
                             "swapped")
        from .kernels import sm90_limits

        if sm90_limits.a_rows_slots(key.tile, key.stages) < sm90_limits.A_ROWS_SLOTS[0]:
            fits = sm90_limits.a_rows_stages(key.tile, key.stages)
            raise ValueError(f"a_loads: tile {list(key.tile)} at {key.stages} stages leaves "
                             f"the raw ring of A's rows less than its 2 slots of shared "
                             f"memory; " + (f"use {fits} stages (`batched.with_a_loads`)"
                                            if fits else "stage A in padded rows instead"))
        opts["a_loads"] = True
    if key.grouped_k and (family_of(key.arch) != "sm90" or not key.persistent or key.pingpong
                          or key.tile[0] % 64 or key.tile[1] % 64 or key.a_major != "m"
                          or (key.b_form, key.b_contig) != ("kn", "last") or key.split
                          or key.dtype not in DTYPES or key.accumulate or key.swap_ab):
        raise ValueError("the grouped-K kernel is persistent, cooperative sm90 with BM and BN "
                         "multiples of 64, a 16-bit A M-contiguous and B [K, N] N-contiguous "
                         "(not split, accumulating or swapped)")
    if key.raster_n:
        if family_of(key.arch) != "sm90":
            raise ValueError(f"raster_n orders a persistent schedule: sm90 kernels only, not "
                             f"{key.arch}")
        opts["raster_n"] = True
    if key.offs_report:
        if not (key.grouped or key.grouped_k):
            raise ValueError("offs_report prints a bad offs entry: grouped kernels only")
        opts["offs_report"] = True
    if key.pdl:
        if family_of(key.arch) != "sm90":
            raise ValueError(f"programmatic dependent launch (pdl) is for sm90 kernels, not "
                             f"{key.arch}")
        opts["pdl"] = True
    return opts


def get(key: KernelKey):
    """The compiled kernel for `key`, compiling on first use (thread-safe: one compile).

    With an AOT cache directory (`aot_cache.ENV_VAR`), a library exported by an earlier
    process is loaded instead of compiling, and a fresh compile is exported for the next."""
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                fn = _load_or_build(key)
                _compiled[key] = fn
    return fn


def _load_or_build(key: KernelKey, directory=None):
    from . import aot_cache

    directory = directory or aot_cache.cache_dir()
    if directory is None:
        return build(key)
    fn = aot_cache.load(key, directory)
    if fn is None:
        fn = build(key)
        aot_cache.store(key, fn, directory)
    return fn


def cached_keys() -> list[KernelKey]:
    return list(_compiled)
