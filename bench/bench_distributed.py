"""Data-parallel training steps: `InvariantDataParallel` against DDP, at 1, 2 and 4 GPUs.

    python bench/bench_distributed.py --out "$OUT"              # worlds 1, 2, 4 in turn
    python bench/bench_distributed.py --worlds 2 --models mlp   # one world, one model
    torchrun --nproc-per-node 2 bench/bench_distributed.py --worker --parts DIR  # one world

Without ``--worker`` the script first compiles every kernel the steps use, in parallel, into
the AOT cache (one step of each arm in this process notes the kernel keys), then launches
``torchrun --standalone --nproc-per-node W`` for each world size W in ``--worlds`` in turn
(each bounded by ``--world-timeout``, all by ``--total-timeout``), and writes
``distributed_<device>.md``, ``.json`` and (with matplotlib) ``.png`` under ``--out``
(default ``$OUT``, else bench/results).

Every world times a full training step (forward, backward, gradients, AdamW) of two models,
each rank on its own ``--tokens`` tokens (bf16):
- ``mlp``: 4 residual blocks 2048 -> 8192 -> 2048 with GELU (134M parameters);
- ``llama``: 4 decoder layers shaped like Llama-3.2-1B's (243M parameters; SDPA attention).
Arms: ``ddp_torch`` (torch Linear, fp32 parameters under bf16 autocast, DDP),
``ddp_dg`` (detgemm Linear, bf16 parameters, DDP), ``idp`` (InvariantDataParallel,
bf16 parameters with fp32 main_grad, the pass overlapped with the backward), ``idp_shard``
(the same with the sharded finish) at each ``--pipeline-mib``, and ``idp_at_flush`` (the
pass started at finalize_grads, as before the overlap).

Per arm: step time (median of ``--steps`` steps timed by CUDA events, the slowest rank's),
its ratio to each DDP arm, the phases of ``--profile-steps`` further steps (forward;
backward on the main stream; for IDP the chain's tail after it, the side stream's wait for
rank r-1's slices, finalize_grads; optimizer, with the sharded all-gather), peak memory,
the X/dY records held, and the fp32 bytes moved per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TARGET = 1.15  # the step-time ratio to DDP the invariant path aims for
ARMS = ("ddp_torch", "ddp_dg", "idp", "idp_shard", "idp_at_flush")


@dataclasses.dataclass
class Arm:
    label: str
    kind: str  # ddp_torch | ddp_dg | idp
    overlap: bool = True
    shard: bool = False
    pipeline_mib: int = 16


def arms_of(args) -> list[Arm]:
    out = []
    for name in args.arms:
        if name == "ddp_torch":
            out.append(Arm("DDP, torch Linear + autocast", "ddp_torch"))
        elif name == "ddp_dg":
            out.append(Arm("DDP, detgemm Linear", "ddp_dg"))
        elif name in ("idp", "idp_shard"):
            for mib in args.pipeline_mib:
                shard = name == "idp_shard"
                out.append(Arm(f"IDP{' sharded' if shard else ''}, {mib} MiB slices", "idp",
                               shard=shard, pipeline_mib=mib))
        elif name == "idp_at_flush":
            mib = args.pipeline_mib[0]
            out.append(Arm(f"IDP, pass at finalize, {mib} MiB", "idp", overlap=False,
                           pipeline_mib=mib))
    return out


# ------------------------------------------------------------------------------- worker
class _HostMark:
    """A CUDA event's interface on the host clock (the CPU check of the bench)."""

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def _event(device):
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else _HostMark()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark(marks, i):
    if marks is not None:
        marks[i].record()


def _ms(a, b) -> float:
    return a.elapsed_time(b)


def _median_dicts(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: statistics.median(d[k] for d in dicts if k in d) for k in sorted(keys)}


def build_arm(spec, arm: Arm, args, device, world: int):
    """(model, net, optimizer, step): one rank's model and training step for `arm`;
    ``step(marks)`` records marks[0..4] at its phase boundaries when given."""
    import detgemm_cute as dg
    from detgemm_cute.distributed import InvariantDataParallel

    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build()
    model = model.float() if arm.kind == "ddp_torch" else model.to(torch.bfloat16)
    if arm.kind != "ddp_torch":
        dg.nn.convert(model, fp32_grad_accum=arm.kind == "idp")
    x = spec.batch(args.tokens, device)
    idp = arm.kind == "idp"
    cuda = device.type == "cuda"
    if idp:
        net = InvariantDataParallel(model, pipeline_bytes=arm.pipeline_mib << 20,
                                    overlap=arm.overlap, shard_optimizer=arm.shard,
                                    phase_events=cuda)
        opt = net.make_optimizer(torch.optim.AdamW, lr=1e-5)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if cuda else None,
                  gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scale = 1.0 / (args.tokens * world)

    def step(marks=None):
        if idp:
            dg.nn.zero_main_grads(net)
        opt.zero_grad(set_to_none=True)
        _mark(marks, 0)
        with torch.autocast(device.type, torch.bfloat16, enabled=arm.kind == "ddp_torch"):
            out = net(x)
        loss = out.float().square().sum() * scale
        _mark(marks, 1)
        loss.backward()
        _mark(marks, 2)
        if idp:
            dg.nn.finalize_grads(net)
        _mark(marks, 3)
        opt.step()
        _mark(marks, 4)

    return model, net, opt, step


def run_arm(spec, arm: Arm, args, device, world: int) -> dict:
    import torch.distributed as dist

    model, net, opt, step = build_arm(spec, arm, args, device, world)
    idp, cuda = arm.kind == "idp", device.type == "cuda"
    for _ in range(args.warmup):
        step()
    _sync(device)
    if idp:
        net.phase_times()  # clear the warm-up's events
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ev = [_event(device) for _ in range(args.steps + 1)]
    ev[0].record()
    for i in range(args.steps):
        step()
        ev[i + 1].record()
    _sync(device)
    times = [_ms(ev[i], ev[i + 1]) for i in range(args.steps)]
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    row = {"step_ms": statistics.median(times), "steps_ms": times, "peak_bytes": peak}
    if idp:
        net.phase_times()
        st = net.stats
        row.update(held_bytes=st.held_bytes, sent_bytes=st.sent_bytes,
                   received_bytes=st.received_bytes,
                   final_bytes=st.broadcast_bytes + st.delivered_bytes)
    phases = []
    for _ in range(args.profile_steps):
        marks = [_event(device) for _ in range(5)]
        step(marks)
        _sync(device)
        ph = {"forward": _ms(marks[0], marks[1]), "backward": _ms(marks[1], marks[2]),
              "finish": _ms(marks[2], marks[3]), "optimizer": _ms(marks[3], marks[4]),
              "step": _ms(marks[0], marks[4])}
        if idp:
            pt = net.phase_times(since=marks[1])
            if "backward" in pt:
                ph["chain_tail"] = ph["backward"] - pt["backward"]
                ph["backward"] = pt["backward"]
            for key in ("chain_wait", "gather"):
                if key in pt:
                    ph[key] = pt[key]
        phases.append(ph)
    row["phases"] = _median_dicts(phases) if phases else {}
    row["describe"] = spec.describe(model)
    del net, opt, model, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def p2p_gbs(device) -> float | None:
    """Rank 0 -> rank 1 send of 64 MiB (NCCL), GB/s on rank 1; None elsewhere."""
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.empty(16 << 20, device=device)
    best = None
    for _ in range(4):
        dist.barrier()
        if rank > 1:
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        b.record()
        torch.cuda.synchronize(device)
        gbs = t.numel() * 4 / _ms(a, b) / 1e6
        best = gbs if best is None else max(best, gbs)
    dist.barrier()
    return best if rank == 1 else None


def worker(args) -> int:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from dist_models import Spec

    from detgemm_cute.benchlib.gpu import device_meta

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl",
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        bw = [None] * world
        dist.all_gather_object(bw, p2p_gbs(device) if world > 1 and not args.cpu else None)
        meta = _cpu_meta() if args.cpu else device_meta()
        result = {"world": world, "meta": meta, "p2p_gbs": bw[1] if world > 1 else None,
                  "tokens_per_rank": args.tokens, "models": {}}
        for name in args.models:
            spec = Spec(name, args.mlp_blocks if name == "mlp" else args.llama_layers, args.seq,
                        tiny=args.cpu)
            rows = {}
            for arm in arms_of(args):
                t0 = time.time()
                row = run_arm(spec, arm, args, device, world)
                per_rank = [None] * world
                dist.all_gather_object(per_rank, row)
                slowest = max(per_rank, key=lambda r: r["step_ms"])
                rows[arm.label] = {"kind": arm.kind, "overlap": arm.overlap,
                                   "shard": arm.shard, "pipeline_mib": arm.pipeline_mib,
                                   "step_ms": slowest["step_ms"], "ranks": per_rank}
                if rank == 0:
                    print(f"[bench] world {world} {name:5s} {arm.label:34s} "
                          f"{slowest['step_ms']:7.2f} ms/step ({time.time() - t0:.0f} s)",
                          flush=True)
            result["models"][name] = {"describe": row["describe"], "arms": rows}
        if rank == 0:
            Path(args.parts).mkdir(parents=True, exist_ok=True)
            with open(Path(args.parts) / f"world{world}.json", "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    return 0


def _cpu_meta() -> dict:
    return {"device": "cpu (gloo, tiny models: a check of the bench, not a measurement)",
            "torch": torch.__version__, "cuda": None,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


# ------------------------------------------------------------------------------- launcher
def _forwarded(args) -> list[str]:
    out = ["--models", *args.models, "--arms", *args.arms,
           "--pipeline-mib", *map(str, args.pipeline_mib)]
    for name in ("tokens", "seq", "mlp_blocks", "llama_layers", "warmup", "steps",
                 "profile_steps", "timeout"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out + (["--cpu"] if args.cpu else [])


def precompile(args) -> str:
    """Compile the kernels of every arm's step into the AOT cache in parallel processes, so
    that no world compiles on first use: one step of each arm runs here (a world of one)
    with `compile.get` noting each kernel key and returning a kernel that does nothing
    (dispatch reads shapes, strides and dtypes, never values); then the keys are built."""
    import torch.distributed as dist

    from detgemm_cute import aot_cache
    from detgemm_cute import compile as kcompile
    from detgemm_cute.parallel_compile import compile_all, default_jobs
    from dist_models import Spec

    directory = aot_cache.cache_dir()
    if directory is None:
        return "kernels compile on first use (the AOT cache is off)"
    t0 = time.time()
    keys, real = {}, kcompile.get
    kcompile.get = lambda key: keys.setdefault(key, _no_kernel)
    store = tempfile.mkdtemp(prefix="detgemm_dist_bench_pg_")
    dist.init_process_group("nccl", init_method=f"file://{store}/s", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    try:
        for name in args.models:
            spec = Spec(name, args.mlp_blocks if name == "mlp" else args.llama_layers, args.seq)
            for arm in arms_of(args):
                if arm.kind != "ddp_torch":
                    build_arm(spec, arm, args, device, 1)[3]()
    finally:
        kcompile.get = real
        gc.collect()
        dist.destroy_process_group()
        torch.cuda.empty_cache()
    failed = compile_all(list(keys), directory, default_jobs(), log=lambda m: None)
    return (f"{len(keys)} kernels compiled in parallel into the AOT cache in "
            f"{time.time() - t0:.0f} s" + (f" ({len(failed)} failed: compiled on first use)"
                                           if failed else ""))


def _no_kernel(*args, **kwargs):
    return None


def launch(args) -> int:
    gpus = max(args.worlds) if args.cpu else torch.cuda.device_count()
    parts = Path(tempfile.mkdtemp(prefix="detgemm_dist_bench_"))
    results, notes = [], []
    start = time.time()
    if not args.cpu and gpus and not args.no_precompile:
        try:
            notes.append(precompile(args))
        except Exception as exc:  # noqa: BLE001 - the worlds then compile on first use
            notes.append(f"precompile failed ({type(exc).__name__}: {exc}); kernels compile "
                         f"on first use")
        print(f"[bench] {notes[-1]}", flush=True)
    for w in args.worlds:
        if w > gpus:
            notes.append(f"world {w}: not run ({gpus} GPUs)")
            continue
        left = args.total_timeout - (time.time() - start)
        if left < 30:
            notes.append(f"world {w}: not run (--total-timeout {args.total_timeout} s spent)")
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={w}", str(Path(__file__).resolve()), "--worker",
               "--parts", str(parts), *_forwarded(args)]
        print(f"[bench] world {w}: {' '.join(cmd[2:5])} ...", flush=True)
        t0 = time.time()
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            code = proc.wait(timeout=min(args.world_timeout, left))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        spent = time.time() - t0
        part = parts / f"world{w}.json"
        if part.exists():
            with open(part) as f:
                results.append(json.load(f))
        if code != 0:
            why = "timed out" if code is None else f"exit code {code}"
            notes.append(f"world {w}: {why} after {spent:.0f} s")
        print(f"[bench] world {w} done in {spent:.0f} s", flush=True)
    if not results:
        print("[bench] no world produced results: " + "; ".join(notes), file=sys.stderr)
        return 1
    from bench_distributed_report import write_report

    for path in write_report(results, notes, Path(args.out), TARGET):
        print(f"[bench] wrote {path}")
    print(f"[bench] {time.time() - start:.0f} s in all", flush=True)
    return 0 if len(results) == len(args.worlds) else 1


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--models", nargs="+", default=["mlp", "llama"], choices=["mlp", "llama"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--pipeline-mib", type=int, nargs="+", default=[16, 64],
                    help="fp32 MiB per slice passed rank to rank (one IDP arm each)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    ap.add_argument("--seq", type=int, default=2048, help="llama: tokens per sequence")
    ap.add_argument("--mlp-blocks", type=int, default=4)
    ap.add_argument("--llama-layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=120, help="process-group timeout, s")
    ap.add_argument("--world-timeout", type=int, default=150,
                    help="seconds one world's torchrun may take")
    ap.add_argument("--total-timeout", type=int, default=360,
                    help="seconds for everything (a world that would start later is skipped)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"))
    ap.add_argument("--no-precompile", action="store_true",
                    help="let each world compile its kernels on first use")
    ap.add_argument("--cpu", action="store_true",
                    help="gloo processes on the CPU with tiny models: checks the bench runs "
                         "(no meaningful times)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker or "LOCAL_RANK" in os.environ:
        if not args.parts:
            args.parts = args.out
        return worker(args)
    sys.path.insert(0, str(HERE))
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
