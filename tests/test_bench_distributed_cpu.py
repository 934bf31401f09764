"""CPU checks of bench/bench_distributed.py: its command line (what the launcher forwards to
each torchrun world parses back the same), its arms, and the report rendered from results
shaped like a GPU run's. The bench itself runs on GPUs (`--cpu` checks it end to end with
gloo processes; not run here: minutes on a small CPU)."""

from __future__ import annotations

import json

import pytest
from bench_path import bench_on_path


@pytest.fixture(scope="module")
def bd():
    with bench_on_path():
        import bench_distributed
        import bench_distributed_report
        yield bench_distributed, bench_distributed_report


def test_forwarded_options_parse_back(bd):
    mod, _ = bd
    args = mod.parse(["--models", "mlp", "--tokens", "8192", "--pipeline-mib", "4", "32",
                      "--steps", "5", "--cpu"])
    again = mod.parse(["--worker", "--parts", "x", *mod._forwarded(args)])
    for name in ("models", "arms", "pipeline_mib", "tokens", "seq", "mlp_blocks",
                 "llama_layers", "warmup", "steps", "profile_steps", "timeout", "cpu"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.worker and again.parts == "x"


def test_arms(bd):
    mod, _ = bd
    arms = mod.arms_of(mod.parse([]))
    kinds = [(a.kind, a.overlap, a.shard, a.pipeline_mib) for a in arms]
    assert kinds == [("ddp_torch", True, False, 16), ("ddp_dg", True, False, 16),
                     ("idp", True, False, 16), ("idp", True, False, 64),
                     ("idp", True, True, 16), ("idp", True, True, 64),
                     ("idp", False, False, 16)]
    assert len({a.label for a in arms}) == len(arms)


def _rank(step, idp, shard=False):
    row = {"step_ms": step, "steps_ms": [step] * 3, "peak_bytes": 5 << 30,
           "phases": {"forward": 2.0, "backward": 6.0, "finish": 0.3, "optimizer": 1.0,
                      "step": step}}
    if idp:
        row.update(held_bytes=96 << 20, sent_bytes=512 << 20, received_bytes=512 << 20,
                   final_bytes=(128 if shard else 512) << 20)
        row["phases"].update(chain_tail=0.7, chain_wait=0.4)
        if shard:
            row["phases"]["gather"] = 0.5
    return row


def _world(world, idp_ms):
    arms = {"DDP, torch Linear + autocast": ("ddp_torch", 12.0, False),
            "DDP, detgemm Linear": ("ddp_dg", 10.0, False),
            "IDP, 16 MiB slices": ("idp", idp_ms, False),
            "IDP sharded, 16 MiB slices": ("idp", idp_ms + 1, True)}
    rows = {label: {"kind": kind, "overlap": True, "shard": shard, "pipeline_mib": 16,
                    "step_ms": ms,
                    "ranks": [_rank(ms, kind == "idp", shard) for _ in range(world)]}
            for label, (kind, ms, shard) in arms.items()}
    return {"world": world, "meta": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11",
                                     "cuda": "13.0", "date": "2026-11-26 12:00 UTC"},
            "p2p_gbs": 300.0 if world > 1 else None, "tokens_per_rank": 4096,
            "models": {"mlp": {"describe": "4 x (2048 -> 8192 -> 2048), GELU, 134M",
                               "arms": rows}}}


def test_report(bd, tmp_path):
    _, rep = bd
    results = [_world(1, 11.0), _world(2, 13.0), _world(4, 14.5)]
    paths = rep.write_report(results, ["world 8: not run (4 GPUs)"], tmp_path, 1.15)
    md = paths[0].read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "world 8: not run" in md
    target = md.split("## Target")[1].split("## mlp")[0]
    assert "| mlp | 2 | IDP, 16 MiB slices | 13.00 | 12.00 | 1.08x |" in target
    assert "| yes |" in target and "| no |" in target  # 13/12 meets 1.15, 14.5/12 does not
    table = md.split("## mlp")[1]
    assert table.count("\n| 4 |") == 4 and "| 0.70 |" in table and "| 512 |" in table
    data = json.loads(paths[1].read_text())
    assert data["target"] == 1.15 and [w["world"] for w in data["worlds"]] == [1, 2, 4]
