"""``LocalRanks``: a worker of two gloo processes under DDP, with ``DiLoCoOptimizer`` in a plain loop.

The leader's outcome must reach the other rank whatever it is: a good average, a failed round, a
"behind" that ends in a state download, a pacing decision that only the leader can take.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opendiloco import DiLoCoOptimizer
from opendiloco.comm import LocalRanks, SingleWorker
from opendiloco.errors import BehindError, RoundCounted
from opendiloco.pacing import Pace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

H = 3


class _Scripted(SingleWorker):
    """The leader's transport, with one scripted event of a real swarm: "behind" at one outer step
    (answered by a peer's state), or a peer that is already waiting (pacing)."""

    def __init__(self, scenario: str, peer_state: dict | None):
        # A lossy format where error feedback is tested: the residual is the leader's to hand over.
        super().__init__(compression={"streamed": "int4", "subset": "subset4+int4",
                                      "topk": "topk16+e2m1"}.get(scenario, "none"))
        self.scenario, self.peer_state = scenario, peer_state

    def start(self, flat, *, weight, key, out=None, error_out=None):
        if self.scenario == "behind" and key.outer_step == 1:
            raise BehindError("the group is at outer step 2", group_outer_step=2)
        if self.scenario == "counted" and key.outer_step == 1:
            raise RoundCounted("the group completed round 1 without us", group_outer_step=2, completed=True)
        return super().start(flat, weight=weight, key=key, out=out, error_out=error_out)

    def download_state(self, timeout, min_outer_step=None, max_bytes=None, majority_hash=None):
        return self.peer_state if self.scenario in ("behind", "counted") else None

    def peer_paces(self, outer_step):
        # A peer that waits for us: under pace="swarm" the round is due after one step.
        if self.scenario == "paced":
            return [Pace(work=100.0, rate=10.0, per_step=4.0, time=0.0, ready=True)]
        return []


def _model(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))


def _peer_state() -> dict:
    """The state of a peer two outer steps ahead, with other weights."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H)
    state = opt.shareable_state()
    state["outer_step"], state["inner_steps_total"] = 2, 2 * H
    return state


def _rank_main(rank: int, store: str, out: str, scenario: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        model = _model(256 if scenario in ("subset", "topk") else 16)  # subset: 13 blocks of 256 values, 4 a round
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        leader = _Scripted(scenario, _peer_state()) if rank == 0 else None
        comm = LocalRanks(leader)
        streamed = dict(fragments=2, overlap=1, error_feedback=True) if scenario == "streamed" else {}
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H + 1 if streamed else H, communicator=comm,
                              pace="swarm" if scenario == "paced" else "fixed", **streamed,
                              **({"error_feedback": True} if scenario in ("subset", "topk") else {}))
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
        reports = []
        for step in range(4 * H):
            x = torch.randn(4, 8, generator=gen)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            if scenario == "nan" and step == H:  # a poisoned step on the whole worker (DDP shares it)
                for p in model.parameters():
                    p.grad.fill_(float("nan"))
            opt.step()
            opt.zero_grad()
            if opt.last_sync is not None and (not reports or opt.last_sync is not reports[-1][0]):
                reports.append((opt.last_sync, opt.global_hash()))
        rows = [{"outer_step": r.outer_step, "ok": r.ok, "reason": r.reason, "steps": r.steps, "hash": h,
                 "peers": list(r.peers), "dropped": r.dropped_steps, "fragment": r.fragment} for r, h in reports]
        if opt.error_feedback:
            rows.append({"residuals": [float(opt.error_residual(f).abs().sum()) for f in range(opt.num_fragments)]})
        if scenario == "topk":  # values the last round did not send keep their local work, on every rank
            rows.append({"carried": sum(int((p != g).sum()) for p, g in zip(model.parameters(),
                                                                             opt.outer.global_params))})
        Path(out, f"rank{rank}.json").write_text(json.dumps({"peer_id": comm.peer_id, "reports": rows}))
        comm.close()
    finally:
        dist.barrier()  # neither rank tears its connections down while the other still uses them
        dist.destroy_process_group()


def _run(tmp_path: Path, scenario: str) -> list[dict]:
    # Ranks are forked from a server that imported torch and this package once (a fresh interpreter
    # per rank, as "spawn" starts, costs some 5 s of CPU each); the fork server is single-threaded.
    mp.set_forkserver_preload(["opendiloco.testing.forkserver_preload"])
    mp.start_processes(_rank_main, args=(str(tmp_path / "store"), str(tmp_path), scenario), nprocs=2,
                       start_method="forkserver", join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _same_on_both_ranks(results: list[dict]) -> list[dict]:
    leader, follower = results
    assert leader["reports"] == follower["reports"]
    assert leader["peer_id"] == follower["peer_id"] == "local"  # one identity for the worker
    return leader["reports"]


def test_ranks_apply_the_leaders_average_bit_for_bit(tmp_path):
    reports = _same_on_both_ranks(_run(tmp_path, "plain"))
    assert [r["outer_step"] for r in reports] == [1, 2, 3, 4] and all(r["ok"] for r in reports)
    assert len({r["hash"] for r in reports}) == 4  # θ_global moved at every outer step


def test_a_failed_round_fails_on_every_rank(tmp_path):
    reports = _same_on_both_ranks(_run(tmp_path, "nan"))
    # The NaN reached AdamW's moments too, so every later round fails as well: alike on both ranks.
    assert reports[0]["ok"] and not any(r["ok"] for r in reports[1:]), reports
    assert all("weight 0" in r["reason"] for r in reports[1:])
    assert reports[1]["dropped"] == H  # the poisoned work is dropped on both ranks alike
    assert {r["hash"] for r in reports} == {reports[0]["hash"]}  # θ_global kept


def test_a_state_download_reaches_every_rank(tmp_path):
    reports = _same_on_both_ranks(_run(tmp_path, "behind"))
    caught_up = [r for r in reports if "caught up" in r["reason"]]
    assert len(caught_up) == 1 and caught_up[0]["outer_step"] == 2, reports
    peer = DiLoCoOptimizer(_model().parameters(), local_steps=H)
    peer.load_shareable_state(_peer_state())
    assert caught_up[0]["hash"] == peer.global_hash()


def test_a_round_the_group_counted_is_adopted_on_every_rank(tmp_path):
    reports = _same_on_both_ranks(_run(tmp_path, "counted"))
    adopted = [r for r in reports if "completed round 1" in r["reason"]]
    assert len(adopted) == 1 and adopted[0]["outer_step"] == 2 and adopted[0]["dropped"] == 0, reports


def test_pacing_follows_the_leaders_decision(tmp_path):
    """Only the leader sees the swarm's paces: the other rank would wait for H steps, but takes the
    leader's decision and enters every round after one step with it."""
    reports = _same_on_both_ranks(_run(tmp_path, "paced"))
    assert len(reports) == 4 * H and all(r["ok"] and r["steps"] == 1 for r in reports), reports


def test_streamed_rounds_with_error_feedback_agree_on_every_rank(tmp_path):
    """Two fragments, rounds landing one step after they start, int4 with error feedback: each rank
    applies the same average and keeps the same residual (the leader hands it over)."""
    reports = _same_on_both_ranks(_run(tmp_path, "streamed"))
    rounds, residuals = reports[:-1], reports[-1]["residuals"]
    assert [r["fragment"] for r in rounds] == [i % 2 for i in range(len(rounds))] and all(r["ok"] for r in rounds)
    assert len(rounds) >= 5
    assert all(v > 0 for v in residuals)  # int4 loses something of every fragment


def test_a_top_k_round_carries_the_unsent_values_on_every_rank(tmp_path):
    """topk16+e2m1: the follower learns the leader's format when ``LocalRanks`` starts, so every rank
    keeps the local work of the values a round did not send, and ends as the leader does."""
    reports = _same_on_both_ranks(_run(tmp_path, "topk"))
    rounds, carried = reports[:-2], reports[-1]["carried"]
    assert [r["outer_step"] for r in rounds] == [1, 2, 3, 4] and all(r["ok"] for r in rounds)
    assert carried > 0


def test_a_subset_round_agrees_on_every_rank(tmp_path):
    """subset4+int4: every rank gathers the same quarter of the values (the follower learns the leader's
    format when ``LocalRanks`` starts) and applies the same average and residual."""
    reports = _same_on_both_ranks(_run(tmp_path, "subset"))
    rounds, residuals = reports[:-1], reports[-1]["residuals"]
    assert [r["outer_step"] for r in rounds] == [1, 2, 3, 4] and all(r["ok"] for r in rounds)
    assert len({r["hash"] for r in rounds}) == 4 and residuals[0] > 0
