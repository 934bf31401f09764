"""`detgemm-cute tune`: time candidate bucket configurations on this GPU and write a table.

  candidates    the candidate configurations for a problem (from the kernel family's limits,
                pruned with wave arithmetic)
  layer         candidates as an in-memory user layer, so `force_bucket` can run each one
  store         the resume file: one JSON line per measured (problem, op)
  table         per-problem winners -> non-overlapping buckets covering every (M, N, K) -> YAML
  measure       timing one problem's candidates and peers (GPU)
  command       the command line
"""
