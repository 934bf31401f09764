"""Multi-process helpers for the data-parallel tests: `run_world` starts one process per rank
(spawned, `torch.distributed` over a file store, gloo on CPU or NCCL on GPUs), runs a worker
function defined here on every rank and returns each rank's result. A rank that fails sends
back its traceback; processes still alive after the timeout are killed and the test fails,
so a hang never outlives its test.

The workers train small models of detgemm Linears on a global batch that every rank builds
from the same seed; rank r takes its slice of it (see `rank_chunks`)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = 16  # tokens per chunk; global batches are lists of chunks


class _RankKilled(AssertionError):
    """A rank died from a signal without a Python error (e.g. gloo's C++ `terminate` when a
    peer connection drops on a loaded 2-core machine): the run itself never finished."""


@contextlib.contextmanager
def one_rank_gloo(directory):
    """A one-rank gloo process group in this process (its file store in `directory`);
    destroyed on exit, after collecting the wrappers and meshes that still hold it."""
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


def run_world(fn, world: int, *args, backend: str = "gloo", timeout: float = 240.0,
              pg_timeout: float = 60.0, may_exit: tuple = ()) -> list:
    """Run ``fn(rank, world, *args)`` on `world` fresh processes; returns their results.
    A rank in `may_exit` may end its process itself, as the test makes it: its result is
    what it saved (`save_result`) before, or None.

    A world in which a rank was killed by a signal before it reported anything is started
    once more from scratch (a new store, new processes); any Python error, hang, missing or
    wrong result fails at once."""
    try:
        return _run_world_once(fn, world, args, backend, timeout, pg_timeout, may_exit)
    except _RankKilled:
        return _run_world_once(fn, world, args, backend, timeout, pg_timeout, may_exit)


def _run_world_once(fn, world, args, backend, timeout, pg_timeout, may_exit) -> list:
    tmp = tempfile.mkdtemp(prefix="detgemm_dist_")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, tmp, args, backend, pg_timeout),
                         daemon=True) for rank in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        errors = []
        for r in range(world):
            err = os.path.join(tmp, f"rank{r}.err")
            if os.path.exists(err):
                with open(err) as f:
                    errors.append(f"--- rank {r}:\n{f.read()}")
        if hung or errors:
            head = f"ranks {hung} still running after {timeout:.0f} s\n" if hung else ""
            raise AssertionError(head + "\n".join(errors))
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.pt")
            killed = p.exitcode is not None and p.exitcode < 0
            if killed and not os.path.exists(path):
                raise _RankKilled(f"rank {r} killed by signal {-p.exitcode} with no result")
            # A result file is complete (written, then renamed into place). A rank that wrote
            # it and was then aborted by a signal while tearing down gloo ("terminate called
            # without an active exception", seen on a loaded 2-core machine) did its work:
            # its result counts. Any other nonzero exit, or no result, fails.
            if r in may_exit:
                results.append(torch.load(path, weights_only=False)
                               if os.path.exists(path) else None)
                continue
            if (p.exitcode != 0 and not killed) or not os.path.exists(path):
                raise AssertionError(f"rank {r} exited with code {p.exitcode} and no result")
            results.append(torch.load(path, weights_only=False))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_RESULT_PATH = [None]  # this worker process's result file


def save_result(result) -> None:
    """Write this rank's result (a rank that is about to end its own process saves first)."""
    path = _RESULT_PATH[0]
    torch.save(result, path + ".part")
    os.replace(path + ".part", path)  # the name appears only once the file is whole


def _entry(fn, rank, world, tmp, args, backend, pg_timeout):
    torch.set_num_threads(1)
    _RESULT_PATH[0] = os.path.join(tmp, f"rank{rank}.pt")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        save_result(result)
        if isinstance(result, dict) and result.get("leave"):
            os._exit(0)  # its process group is broken (a peer died): no teardown
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            gc.collect()  # wrappers (module <-> engine cycles) let their groups go here
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- models
class Mlp(torch.nn.Module):
    """Linears and element-wise ops only: every token's forward and dY are its own."""

    def __init__(self, d: int = 32, h: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.mid = torch.nn.Linear(h, h, bias=False)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        h = h + torch.nn.functional.silu(self.mid(h))
        return x + self.down(h)


class NormModel(torch.nn.Module):
    """Embedding, LayerNorm and RMSNorm around detgemm Linears: their gradients are summed in
    rank order, deterministic but not world-size invariant."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.rms = torch.nn.RMSNorm(2 * d)
        self.head = torch.nn.Linear(2 * d, vocab)

    def forward(self, ids):
        h = torch.nn.functional.gelu(self.fc(self.ln(self.emb(ids))))
        return self.head(self.rms(h))


def build(kind: str, seed: int, device="cpu", dtype=torch.bfloat16, **kw):
    import detgemm_cute as dg

    torch.manual_seed(seed)
    model = (Mlp(**kw) if kind == "mlp" else NormModel(**kw)).to(device=device, dtype=dtype)
    return dg.nn.convert(model, fp32_grad_accum=True)


def global_batch(kind: str, seed: int, step: int, chunks: int, device="cpu",
                 dtype=torch.bfloat16, d: int = 32, vocab: int = 64):
    """The step's global batch: `chunks` chunks of 16 tokens, (inputs, targets) each."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = chunks * TOKENS
    if kind == "mlp":
        x = torch.randn(n, d, generator=g).to(dtype)
        y = torch.randn(n, d, generator=g).to(dtype)
    else:
        x = torch.randint(0, vocab, (n,), generator=g)
        y = torch.randint(0, vocab, (n,), generator=g)
    return x.to(device), y.to(device)


def loss_sum(kind: str, out, y):
    """Sum over tokens of each token's own loss (the caller divides by the global count)."""
    if kind == "mlp":
        return (out.float() - y.float()).square().sum()
    return torch.nn.functional.cross_entropy(out.float(), y, reduction="sum")


def rank_chunks(rank: int, world: int, chunks: int, micro: int, order: str) -> list[list[int]]:
    """The chunk indices of each of this rank's micro-batches.

    "rank_major": rank r holds the consecutive chunks r*C/R .. (r+1)*C/R - 1, split in
    `micro` consecutive micro-batches (finalize flushes once per step).
    "interleaved": rank r's micro-batch j is global micro-batch j*R + r (flush after every
    micro-batch)."""
    per_rank = chunks // world
    per_micro = per_rank // micro
    assert per_rank * world == chunks and per_micro * micro == per_rank
    if order == "rank_major":
        base = rank * per_rank
        return [list(range(base + j * per_micro, base + (j + 1) * per_micro))
                for j in range(micro)]
    return [list(range((j * world + rank) * per_micro, (j * world + rank + 1) * per_micro))
            for j in range(micro)]


def _rows(chunk_ids, device):
    return torch.cat([torch.arange(c * TOKENS, (c + 1) * TOKENS) for c in chunk_ids]).to(device)


def train(rank, world, cfg, wrap=True):
    """AdamW steps with gradient accumulation; returns weights, this rank's last-step main
    grads and flush stats (and, for the norm model, a check of the rank-order sum).

    cfg: overlap (default True: the last micro-batch's backward, outside no_sync(), starts
    the pass), shard (sharded finish and optimizer), log (keep the posted operations)."""
    import detgemm_cute as dg
    from detgemm_cute.dist_shard import state_numel
    from detgemm_cute.distributed import InvariantDataParallel

    device = cfg.get("device", "cpu")
    # autocast: fp32 parameters (fp32 .grad), bf16 GEMMs inside torch.autocast
    dtype = torch.float32 if cfg.get("autocast") else cfg.get("dtype", torch.bfloat16)
    kind, seed, chunks = cfg["kind"], cfg["seed"], cfg["chunks"]
    shape = {"d": cfg["d"], "h": cfg["h"]} if "d" in cfg else {}
    model = build(kind, seed, device, dtype, **shape)
    net = model
    if wrap:
        net = InvariantDataParallel(model, pipeline_bytes=cfg.get("pipeline_bytes", 4 << 20),
                                    overlap=cfg.get("overlap", True),
                                    shard_optimizer=cfg.get("shard", False))
        if cfg.get("log"):
            net._engine.ch.log = []
        opt = net.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    total = chunks * TOKENS
    out = {"stats": [], "sum_order_ok": []}
    for step in range(cfg["steps"]):
        x, y = global_batch(kind, seed, step, chunks, device, dtype, d=cfg.get("d", 32))
        dg.nn.zero_main_grads(net)
        opt.zero_grad()
        micro = rank_chunks(rank, world, chunks, cfg["micro"], cfg["order"])
        for j, ids in enumerate(micro):
            rows = _rows(ids, device)
            last = j == len(micro) - 1 or cfg["order"] == "interleaved"
            with contextlib.ExitStack() as stack:
                if wrap and not last:
                    stack.enter_context(net.no_sync())
                stack.enter_context(torch.autocast(torch.device(device).type,
                                                   dtype=torch.bfloat16,
                                                   enabled=bool(cfg.get("autocast"))))
                out_ = net(x[rows])
                (loss_sum(kind, out_, y[rows]) / total).backward()
            if cfg["order"] == "interleaved" and wrap:
                net.flush()
        others = {}
        if wrap and kind == "norm":
            others = {n: _gather(p.grad, world) for n, p in model.named_parameters()
                      if n in net.other_parameter_names()}
        dg.nn.finalize_grads(model if cfg.get("finalize_inner") else net)
        if wrap:
            out["stats"].append(net.stats)
        for n, parts in others.items():
            p = dict(model.named_parameters())[n]
            acc = parts[0].float()
            for g in parts[1:]:
                acc = acc + g.float()
            grad = p.grad if not cfg.get("shard") else _gathered_grad(net, p, world)
            out["sum_order_ok"].append((n, torch.equal(grad, acc.to(p.dtype))))
        opt.step()
    out["weights"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    out["main_grads"] = {n: p.main_grad.cpu().clone() for n, p in model.named_parameters()
                         if hasattr(p, "main_grad")}
    out["flat_bytes"] = 4 * sum(p.numel() for layer in net._engine.layers
                                for p in layer.params) if wrap else 0
    out["state_numel"] = state_numel(opt)
    out["log"] = net._engine.ch.log if wrap else None
    return out


def _gathered_grad(net, p, world):
    """Sharded finish: the whole .grad of model parameter `p`, from the ranks' pieces."""
    eng = net._engine
    lo = eng.layout.offset[id(p)]
    full = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
    for r in range(world):
        for q, gi, a, b in eng.layout.shard_pieces(r):
            if q is p:
                part = torch.zeros(b - a, dtype=p.dtype, device=p.device)
                if r == eng.rank:
                    part.copy_(eng.pieces[id(p)][0].grad)
                dist.broadcast(part, src=r)
                full[a - lo:b - lo] = part
    return full.view(p.shape)


def _gather(t, world):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return parts


def train_worker(rank, world, cfg):
    out = train(rank, world, cfg)
    if cfg.get("plain_too") and rank == 0:
        out["plain"] = train(0, 1, dict(cfg, order="rank_major"), wrap=False)
    return out


def train_many(rank, world, cfgs: dict):
    """Several trainings in one world, one after another: {label: train_worker result}."""
    return {label: train_worker(rank, world, cfg) for label, cfg in cfgs.items()}


def posting_order_problems(logs: list) -> list[str]:
    """What would deadlock or mismatch on NCCL, where each communicator runs its
    operations in posting order: for every pair of neighbours, rank a's hop sends to b must
    be rank b's hop receives from a, in order and size; for the delivery group, the
    collectives must be the same on every rank and every point-to-point sequence
    must match its peer's, in order and size."""
    problems = []
    world = len(logs)

    def ops(r, kind, role, peer=None):
        return [(e[3], e[4]) for e in logs[r] if e[0] == kind and e[1] == role
                and (peer is None or e[2] == peer)]

    for a in range(world - 1):
        if ops(a, "send", "hop", a + 1) != ops(a + 1, "recv", "hop", a):
            problems.append(f"hops {a} -> {a + 1} do not match")
    for a in range(world):
        for b in range(world):
            if a != b and ops(a, "send", "deliver", b) != ops(b, "recv", "deliver", a):
                problems.append(f"deliveries {a} -> {b} do not match")
    coll = [[(e[0], e[3], e[4]) for e in log if e[0] in ("broadcast", "all_gather")]
            for log in logs]
    if any(c != coll[0] for c in coll):
        problems.append("collectives differ between ranks")
    return problems


# ------------------------------------------------------------------------------ faults
def fault_worker(rank, world, seed, device="cpu"):
    """Two faults in one world, each in the middle of the chain on rank 1 (its dW GEMM is
    replaced): first it raises once (every rank's error is kept; every rank then drops
    the step and trains one more, which must work), then rank 1's process exits at its
    next dW (it saves its result first; the others keep their errors and leave without
    tearing down the broken group)."""
    import detgemm_cute as dg
    from detgemm_cute import dist_records
    from detgemm_cute.distributed import InvariantDataParallel

    model = build("mlp", seed, device)
    net = InvariantDataParallel(model, pipeline_bytes=1024)
    opt = net.make_optimizer(torch.optim.AdamW, lr=1e-2)
    real = dist_records.weight_grad
    fault = [None]

    def faulty(*args, **kwargs):
        if fault[0] == "raise":
            fault[0] = None
            raise RuntimeError("injected fault in rank 1's dW")
        if fault[0] == "exit":
            save_result(out)
            os._exit(17)
        return real(*args, **kwargs)

    if rank == 1:
        dist_records.weight_grad = faulty

    def step(s):
        x, y = global_batch("mlp", seed, s, world, device)
        rows = _rows([rank], device)
        dg.nn.zero_main_grads(net)
        opt.zero_grad()
        (loss_sum("mlp", net(x[rows]), y[rows]) / (world * TOKENS)).backward()
        dg.nn.finalize_grads(net)
        opt.step()

    def timed(s):
        t0 = time.monotonic()
        error = _expect_error(lambda: step(s))
        return {"error": error, "seconds": time.monotonic() - t0}

    out = {}
    fault[0] = "raise"
    out["raise"] = timed(0)
    net.discard_pending()
    step(1)
    out["weights"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    fault[0] = "exit"
    out["exit"] = timed(2)
    out["leave"] = True
    return out


# ------------------------------------------------------------------------ bad setups
BAD_EXPECT = {  # check -> (exception types, any of these substrings)
    "model differs on rank 1": (("RuntimeError",), ["model on rank 1 differs from rank 0's"]),
    "values differ without the broadcast": (("RuntimeError",),
                                            ["model on rank 1 differs from rank 0's"]),
    "24 tokens": (("ValueError",), ["ran backward on 24 tokens", "multiple of 16 tokens"]),
    "optimizer.step without finalize": (("RuntimeError",), ["optimizer.step() ran after"]),
    "zero_main_grads without finalize": (("RuntimeError",), ["zero_main_grads() ran after"]),
    "flush on rank 0, finalize on rank 1": (("RuntimeError",), ["ranks disagree"]),
    "backward after the synchronizing one": (("RuntimeError",),
                                             ["a backward ran after this step's synchronizing"]),
    "input modified in place on rank 0": (("RuntimeError",), ["modified in place"]),
    "rank 1 not converted for fp32 accumulation": (("ValueError", "RuntimeError"),
                                                   ["fp32_grad_accum=True"]),
    "no detgemm Linear": (("ValueError",), ["no trainable detgemm Linear"]),
    "layer shares its weight": (("ValueError",), ["tied weights"]),
    "sparse embedding gradient": (("RuntimeError",), ["only dense gradients"]),
    "make_optimizer over a foreign tensor": (("ValueError",), ["not a trainable parameter"]),
    "make_optimizer of a non-optimizer": (("TypeError",), ["optimizer_class must be"]),
}


def _expect_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return type(e).__name__, str(e)
    return "no error", ""


def bad_setup_worker(rank, world, seed):
    import detgemm_cute as dg
    from detgemm_cute.distributed import InvariantDataParallel as IDP

    out = {}

    def step_on(net, tokens, finalize=True):
        x, y = global_batch("mlp", seed, 0, 1)
        x = torch.cat([x] * 2)[:tokens]
        y = torch.cat([y] * 2)[:tokens]
        (loss_sum("mlp", net(x), y) / (tokens * world)).backward()
        if finalize:
            dg.nn.finalize_grads(net)

    def differs():
        IDP(build("mlp", seed, h=64 if rank == 0 else 48))
    out["model differs on rank 1"] = _expect_error(differs)
    out["values differ without the broadcast"] = _expect_error(
        lambda: IDP(build("mlp", seed + rank), broadcast_parameters=False))
    out["24 tokens"] = _expect_error(lambda: step_on(IDP(build("mlp", seed)), 24))

    net = IDP(build("mlp", seed))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    step_on(net, 16, finalize=False)
    out["optimizer.step without finalize"] = _expect_error(opt.step)
    out["zero_main_grads without finalize"] = _expect_error(lambda: dg.nn.zero_main_grads(net))
    net.discard_pending()
    dg.nn.zero_main_grads(net)
    step_on(net, 16)  # a proper step works after the discard
    opt.step()

    net = IDP(build("mlp", seed))
    step_on(net, 16, finalize=False)
    out["flush on rank 0, finalize on rank 1"] = _expect_error(
        net.flush if rank == 0 else lambda: dg.nn.finalize_grads(net))

    net = IDP(build("mlp", seed))
    step_on(net, 16, finalize=False)
    out["backward after the synchronizing one"] = _expect_error(
        lambda: step_on(net, 16, finalize=False))
    net.discard_pending()  # waits for the first backward's pass, posted on both ranks

    net = IDP(build("mlp", seed))
    x, y = global_batch("mlp", seed, 1, 1)
    with net.no_sync():  # records kept until the pass
        (loss_sum("mlp", net(x), y) / 32).backward()
    if rank == 0:
        x.add_(1)
    out["input modified in place on rank 0"] = _expect_error(lambda: dg.nn.finalize_grads(net))

    def unconverted():
        m = build("mlp", seed)
        if rank == 1:
            dg.nn.convert(m, fp32_grad_accum=False)
        IDP(m)
    out["rank 1 not converted for fp32 accumulation"] = _expect_error(unconverted)
    out["no detgemm Linear"] = _expect_error(lambda: IDP(torch.nn.LayerNorm(8)))

    def tied():
        m = build("mlp", seed)
        m.extra = torch.nn.Module()
        m.extra.w = m.up.weight
        IDP(m)
    out["layer shares its weight"] = _expect_error(tied)

    def sparse():
        m = build("mlp", seed)
        m.emb = torch.nn.Embedding(8, 32, sparse=True).to(torch.bfloat16)
        net = IDP(m)
        (net(m.emb(torch.arange(16) % 8)).float().sum() / 32).backward()
        dg.nn.finalize_grads(net)
    out["sparse embedding gradient"] = _expect_error(sparse)

    net = IDP(build("mlp", seed), shard_optimizer=True)
    out["make_optimizer over a foreign tensor"] = _expect_error(
        lambda: net.make_optimizer(torch.optim.AdamW, [torch.nn.Parameter(torch.zeros(2))]))
    out["make_optimizer of a non-optimizer"] = _expect_error(
        lambda: net.make_optimizer(torch.nn.Linear))

    # a process group without this rank (rank 1); rank 0 wraps alone
    group = dist.new_group([0])
    non_member = _expect_error(lambda: IDP(build("mlp", seed), group))

    # the broadcast makes rank 0's parameters everyone's
    net = IDP(build("mlp", seed + rank))
    ref = build("mlp", seed)
    broadcast_ok = all(torch.equal(p, q) for p, q in zip(net.parameters(), ref.parameters()))
    return {"checks": out, "broadcast_ok": broadcast_ok, "non_member": non_member}
