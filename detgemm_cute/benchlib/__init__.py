"""Benchmark library shared by `bench/bench_gemm.py` and `detgemm-cute tune`.

Pure parts (importable anywhere, no CUDA state touched, tested on CPU):
  stats    geometric means, speed ratios, throughput, summaries by M band
  fmt      number / bucket formatting, file-safe device names, strict JSON
  shapes   `Problem` (op, M, K, N), shape parsing, shape files, dedup and subsampling
  models   public model dimensions and the weight shapes of their layers per TP degree
  suites   named suites of problems (core, quick, decode, decode-models, prefill-models)
  report   markdown tables, JSON, matplotlib plot

GPU parts (import torch only; CUDA is touched when their functions run):
  gpu      device checks, device metadata, logging
  checks   relative error, finiteness, bitwise row comparison
  timing   CUDA-graph timing: R back-to-back calls per graph, rotated input sets, interleaved
           replays, medians
  peers    the calls being compared: detgemm, cuBLAS default, cuBLAS PEDANTIC, cuBLASLt with
           split-K off, per op (fwd, dx, dw)
  pedantic cublasGemmEx on a handle of our own in CUBLAS_PEDANTIC_MATH (ctypes or CuPy)
  runner   one benchmark row: inputs, correctness, same-bits, timing
  probe    batch-invariance probe and host overhead
"""
