"""Train one small model on 1, 2 and 4 data-parallel ranks and check the weights are
identical, bit for bit, to one device's.

    python examples/train_data_parallel.py                   # CPU: spawns 4 gloo processes
    python examples/train_data_parallel.py --world 2 --steps 2
    torchrun --nproc-per-node 2 examples/train_data_parallel.py --device cuda   # NCCL

One launch of W processes trains the model at every world size s in 1, 2, 4, ... up to W
(ranks 0..s-1, through `torch.distributed.new_group`), and rank 0 also trains it alone
without the wrapper: the reference, one device stepping through the global batch in order.
Every step's global batch is `--tokens` tokens; at world size s, rank r takes the r-th
consecutive slice of it (rank 0 first) and splits it into `--micro` micro-batches, each a
multiple of 16 tokens.

What makes the weights world-size invariant:
- every Linear is a detgemm Linear with fp32 gradient accumulation, wrapped in
  `InvariantDataParallel`, so each weight's gradient is one fp32 chain over the global
  batch in order, whoever computed which tokens (the micro-batches but the last run under
  `no_sync()`; the last one's backward starts the rank-to-rank pass);
- every other op works per token (GELU, residual adds, an RMSNorm without weights, the
  loss), so a token's activations and dY do not depend on which rank holds it;
- the loss is a sum over tokens divided by the *global* token count (nothing is divided by
  the world size), so each token's dY is the same at every world size;
- AdamW is element-wise and sees identical gradients on every rank.
A model with norm weights or embeddings trains deterministically too, but those gradients
are summed across ranks in rank order and change with the world size.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

TOKEN_BLOCK = 16


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        h = F.rms_norm(x.float(), (x.shape[-1],)).to(x.dtype)  # per token, no weights
        return x + self.down(F.gelu(self.up(h)))


class Net(torch.nn.Module):
    def __init__(self, d_in: int, d: int, layers: int, classes: int):
        super().__init__()
        self.inp = torch.nn.Linear(d_in, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, classes, bias=False)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def build(args, device):
    import detgemm_cute as dg

    torch.manual_seed(args.seed)
    net = Net(args.d_in, args.d_model, args.layers, args.classes)
    return dg.nn.convert(net.to(device=device, dtype=torch.bfloat16), fp32_grad_accum=True)


def batch(args, step, device):
    """The step's global batch: inputs and class labels from a fixed random teacher."""
    g = torch.Generator().manual_seed(args.seed * 7919 + step)
    x = torch.randn(args.tokens, args.d_in, generator=g)
    teacher = torch.randn(args.d_in, args.classes, generator=torch.Generator().manual_seed(1))
    y = (x @ teacher).argmax(-1)
    return x.to(device=device, dtype=torch.bfloat16), y.to(device)


def train(args, device, group=None, wrap=True):
    """Train; returns (sha256 of every weight's bits, last loss, costs)."""
    import detgemm_cute as dg
    from detgemm_cute.distributed import InvariantDataParallel

    model = build(args, device)
    world = dist.get_world_size(group) if wrap else 1
    rank = dist.get_rank(group) if wrap else 0
    if wrap:
        net = InvariantDataParallel(model, group, pipeline_bytes=args.pipeline_bytes,
                                    overlap=not args.no_overlap, shard_optimizer=args.shard)
        opt = net.make_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    else:
        net = model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    per_rank = args.tokens // world
    micro = per_rank // args.micro
    costs = {"finalize_s": [], "step_s": []}
    loss_total = torch.zeros((), device=device)
    for step in range(args.steps):
        t0 = _now(device)
        x, y = batch(args, step, device)
        dg.nn.zero_main_grads(net)
        opt.zero_grad()
        loss_total.zero_()
        for j in range(args.micro):
            rows = slice(rank * per_rank + j * micro, rank * per_rank + (j + 1) * micro)
            # the last micro-batch's backward starts the rank-to-rank pass, overlapped
            sync = j == args.micro - 1 or not wrap
            with contextlib.nullcontext() if sync else net.no_sync():
                loss = F.cross_entropy(net(x[rows]).float(), y[rows],
                                       reduction="sum") / args.tokens
                loss.backward()
            loss_total += loss.detach()
        if wrap and world > 1:
            dist.barrier(group)  # for the timing only: every rank starts finalize together
        t1 = _now(device)
        dg.nn.finalize_grads(net)
        t2 = _now(device)
        opt.step()
        if step > 0 or args.steps == 1:  # the first step also pays first-use costs
            costs["finalize_s"].append(t2 - t1)
            costs["step_s"].append(_now(device) - t0)
    if wrap:
        st = net.stats
        costs.update(held=st.held_bytes, sent=st.sent_bytes, received=st.received_bytes,
                     broadcast=st.broadcast_bytes, delivered=st.delivered_bytes,
                     wait_s=st.wait_seconds,
                     broadcast_s=st.broadcast_seconds,
                     grad_bytes=sum(p.numel() * 4 for p in model.parameters()))
        if world > 1:
            dist.all_reduce(loss_total, group=group)  # the loss printout only
    digest = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16], loss_total.item(), costs


def _ms(seconds: list) -> str:
    """Median over the timed steps, in ms."""
    return f"{1e3 * sorted(seconds)[len(seconds) // 2]:.1f} ms"


def _now(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def allreduce_seconds(nbytes: int, device, reps: int = 5) -> float:
    """A ring all-reduce of the same fp32 bytes on the whole world: what DDP would send."""
    t = torch.ones(max(1, nbytes // 4), device=device)
    dist.all_reduce(t)
    t0 = _now(device)
    for _ in range(reps):
        dist.all_reduce(t)
    return (_now(device) - t0) / reps


def world_sizes(world: int) -> list[int]:
    sizes, s = [], 1
    while s < world:
        if world % s == 0:
            sizes.append(s)
        s *= 2
    return sizes + [world]


def run(rank: int, world: int, args, device) -> int:
    """Every rank: train at each world size it takes part in; rank 0 reports."""
    results = {}
    for s in world_sizes(world):
        group = dist.group.WORLD if s == world else dist.new_group(list(range(s)))
        if rank < s:
            results[s] = train(args, device, group)
        dist.barrier()
    if rank == 0:
        results["one device"] = train(args, device, wrap=False)
    ar = allreduce_seconds(results[world][2]["grad_bytes"], device) if world > 1 else 0.0
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: (v[0], v[2]) for k, v in results.items()})
    if rank != 0:
        return 0
    ref = results["one device"][0]
    same = True
    print(f"{args.steps} AdamW steps, {args.tokens} tokens per step, {args.micro} micro-batches "
          f"per rank, {device.type}")
    print(f"{'run':>12}  {'weights sha256':>16}  {'last loss':>10}  {'all ranks':>9}  "
          f"{'= one device':>12}")
    for key, (h, loss, _) in results.items():
        members = [g[key][0] for g in gathered if key in g]
        agree = all(m == h for m in members)
        ok = h == ref
        same &= ok and agree
        label = key if isinstance(key, str) else f"{key} rank{'s' if key > 1 else ''}"
        print(f"{label:>12}  {h:>16}  {loss:10.6f}  {'same' if agree else 'DIFFER':>9}  "
              f"{'yes' if ok else 'NO':>12}")
    print("weights identical at every world size: " + ("yes" if same else "NO"))
    print("\ncosts per step on rank 0 (X and dY held at most; fp32 gradients passed rank to "
          "rank from the last micro-batch's backward on, then broadcast from the last rank, "
          "or with --shard sent to the ranks that own them; times: median over steps 2..)")
    print(f"  one device, no wrapper: step {_ms(results['one device'][2]['step_s'])}")
    for s in world_sizes(world):
        c, last = results[s][2], gathered[s - 1][s][1]
        wait = (f" (last step: rank {s - 1} waited {1e3 * last['wait_s']:.1f} ms for rank "
                f"{s - 2})" if s > 1 else "")
        print(f"  world {s}: held {c['held'] / 1024:.1f} KiB per rank, sent {c['sent'] / 1024:.1f}"
              f" KiB by rank 0, broadcast {c['broadcast'] / 1024:.1f} KiB, delivered "
              f"{c['delivered'] / 1024:.1f} KiB; finalize "
              f"{_ms(c['finalize_s'])}{wait}, step {_ms(c['step_s'])}")
    if world > 1:
        print(f"  ring all-reduce of the same {results[world][2]['grad_bytes'] / 1024:.1f} KiB on "
              f"{world} ranks (what DDP sends): {1e3 * ar:.2f} ms")
    return 0 if same else 1


def _spawned(rank, world, store, args, out):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    code = run_and_close(rank, world, args, torch.device("cpu"))
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(code))
    _leave()


def _leave() -> None:
    """End a spawned worker whose work is done and whose groups are destroyed without
    interpreter finalization: gloo's threads torn down while the interpreter shuts down can
    abort the process ("terminate called without an active exception"), a failure after
    the fact that would hide the result."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_and_close(rank, world, args, device) -> int:
    """`run`, then a barrier, so that no rank tears the process groups down while another
    still uses them (gloo can abort the process otherwise), then destroy them. The wrappers
    (each a module <-> engine cycle holding its group) are collected first, so the groups
    go inside `destroy_process_group`, not at interpreter exit."""
    try:
        code = run(rank, world, args, device)
        dist.barrier()
        return code
    finally:
        gc.collect()
        dist.destroy_process_group()


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4,
                    help="processes to spawn when not started by torchrun (default 4)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU per rank with NCCL (start with torchrun)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="global tokens per step")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per rank")
    ap.add_argument("--d-in", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipeline-bytes", type=int, default=4 << 20,
                    help="fp32 bytes per slice of output features passed rank to rank")
    ap.add_argument("--shard", action="store_true",
                    help="sharded finish: each rank steps the optimizer on its 1/R")
    ap.add_argument("--no-overlap", action="store_true",
                    help="start the rank-to-rank pass at finalize_grads, not in the backward")
    ap.add_argument("--timeout", type=float, default=300, help="process-group timeout, seconds")
    args = ap.parse_args(argv)
    return args


def check_sizes(args, world: int) -> None:
    for s in world_sizes(world):
        micro, rem = divmod(args.tokens, s * args.micro)
        if rem or micro % TOKEN_BLOCK or micro == 0:
            raise SystemExit(f"--tokens {args.tokens} must split into {s} ranks x {args.micro} "
                             f"micro-batches of a multiple of {TOKEN_BLOCK} tokens")


def main(argv=None) -> int:
    args = parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        check_sizes(args, world)
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout))
        return run_and_close(rank, world, args, device)
    if args.device == "cuda":
        raise SystemExit("--device cuda: start with torchrun --nproc-per-node N")
    check_sizes(args, args.world)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_spawned, args=(args.world, os.path.join(tmp, "store"), args, out),
                           nprocs=args.world, start_method="spawn")
        with open(out) as f:
            return int(f.read())


if __name__ == "__main__":
    sys.exit(main())
