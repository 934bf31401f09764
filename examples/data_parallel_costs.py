"""Communication cost of the rank-to-rank gradient pass against a ring all-reduce.

    python examples/data_parallel_costs.py --world 2          # CPU: spawns gloo processes
    torchrun --nproc-per-node 2 examples/data_parallel_costs.py --device cuda   # NCCL

`InvariantDataParallel` moves each step's fp32 gradients R-1 hops along the ranks (rank r
sends every slice once to rank r+1, all receives posted at the start, so the hops overlap
slice by slice) and broadcasts each slice from the last rank as it is done. This script
times exactly that code path (`detgemm_cute.dist_pass.Pass`) with the per-rank dW work left
out, next to `torch.distributed.all_reduce` of the same bytes (what DDP sends), for
several sizes. Compute is not included: on a GPU the dW GEMMs add their own time, run
while the slices travel, and in training the pass overlaps the backward.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def _now(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def make_engine(pipeline_bytes: int, device):
    """The library's engine over the whole world, with no model (collective)."""
    from detgemm_cute.dist_chain import Engine

    eng = Engine(torch.nn.Module(), dist.group.WORLD, pipeline_bytes, device=device,
                 backend=dist.get_backend())
    eng.ch.make_groups()
    return eng


def chain_pass(eng, buf):
    """One pass of `buf` through the library's pass (`detgemm_cute.dist_pass.Pass`): slices
    passed rank to rank, each broadcast from the last rank; no compute (the slices of a
    sum to which no rank adds a gradient)."""
    from detgemm_cute.dist_pass import Pass
    from detgemm_cute.dist_records import sum_units

    units = sum_units("buffer", torch.nn.Parameter(buf, requires_grad=False), buf, 0,
                      eng.pipeline_bytes)
    p = Pass(eng, [], overlapped=False)
    p.start()
    p.launch_others(units)
    p.drain()
    return p.st


def measure(sizes_mib, pipeline_bytes, device, reps):
    rows = []
    eng = make_engine(pipeline_bytes, device)
    for mib in sizes_mib:
        buf = torch.zeros(int(mib * (1 << 20)) // 4, device=device)
        chain_pass(eng, buf)  # warm-up
        dist.all_reduce(buf)
        times = {"pass": [], "all_reduce": []}
        for _ in range(reps):
            dist.barrier()
            t0 = _now(device)
            chain_pass(eng, buf)
            t1 = _now(device)
            dist.barrier()
            t2 = _now(device)
            dist.all_reduce(buf)
            t3 = _now(device)
            times["pass"].append(t1 - t0)
            times["all_reduce"].append(t3 - t2)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rows.append((mib, med["pass"], med["all_reduce"]))
    return rows


def run(rank, world, args, device):
    rows = measure(args.sizes, args.pipeline_bytes, device, args.reps)
    # every rank finishes the pass at the broadcast; report the slowest rank's median
    t = torch.tensor([[p, a] for _, p, a in rows], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"world {world}, {device.type}, backend {dist.get_backend()}, slices of "
              f"{args.pipeline_bytes / (1 << 20):g} MiB, median of {args.reps}")
        print(f"{'fp32 MiB':>9}  {'pass + broadcast ms':>20}  {'all_reduce ms':>14}  {'ratio':>6}")
        for (mib, _, _), (p, a) in zip(rows, t.tolist()):
            print(f"{mib:>9g}  {1e3 * p:>20.2f}  {1e3 * a:>14.2f}  {p / a:>6.2f}")
    return 0


def _spawned(rank, world, store, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        run(rank, world, args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    # Done: leave without interpreter finalization, where gloo's threads can abort the
    # process after the fact (as in train_data_parallel._leave).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes to spawn (no torchrun)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64],
                    help="gradient sizes in MiB of fp32")
    ap.add_argument("--pipeline-bytes", type=int, default=4 << 20)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = torch.device("cpu")
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            return run(rank, world, args, device)
        finally:
            dist.destroy_process_group()
    if args.device == "cuda":
        raise SystemExit("--device cuda: start with torchrun --nproc-per-node N")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(args.world, os.path.join(tmp, "store"), args),
                           nprocs=args.world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
