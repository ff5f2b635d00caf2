"""Workers of different speed in one swarm: everyone's work enters every average (``pace="swarm"``)."""

import signal
import statistics

import pytest

from .test_resilience import assert_hashes_agree, ok_syncs

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def test_a_4x_slower_worker_contributes_to_every_round_and_nothing_is_dropped(swarm):
    swarm.bootstrap()
    # No quorum is asked for (min_group_size 1) and the grace for stragglers is short: only pacing by
    # the swarm and waits derived from what peers publish keep the slow worker in every round.
    opts = dict(run_until_stopped=True, local_steps=8, pace="swarm", min_group_size=1, straggler_wait=1.5,
                allreduce_timeout=8)
    delays = {"fast0": 0.04, "fast1": 0.04, "slow": 0.16}
    procs = [swarm.worker(name, seed=i + 1, step_delay=delay, **opts) for i, (name, delay) in enumerate(delays.items())]
    names = list(delays)

    def together() -> list[int]:
        """Outer steps in which all three averaged together."""
        return [k for k, r in ok_syncs(swarm, "slow").items() if r["group_size"] == 3]

    swarm.wait_for(lambda: len(together()) >= 6, 200, "six rounds with all three workers", show=names)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(procs, timeout=60)

    # From the first round all three were in (they start at different moments), every round of
    # every worker had all three, none failed, and the replicas agree bit for bit.
    first = min(together())
    for name in names:
        later = [r for r in swarm.records(name) if r["outer_step"] > first]
        assert later and all(r["ok"] and r["group_size"] == 3 for r in later), (name, later)
    steps = sorted(k for k in ok_syncs(swarm, "slow") if k > first)
    assert_hashes_agree(swarm, names, steps)

    # The round is paced by the group's work: the fast workers took more inner steps than H, the slow
    # one fewer, and each contribution was weighted by the steps behind it.
    mean_steps = {n: statistics.mean(ok_syncs(swarm, n)[k]["steps"] for k in steps) for n in names}
    assert mean_steps["slow"] < 8 < min(mean_steps["fast0"], mean_steps["fast1"]), mean_steps
    for n in names:
        assert all(ok_syncs(swarm, n)[k]["weight"] == ok_syncs(swarm, n)[k]["steps"] for k in steps)

    # Nothing was thrown away from the first round with all three on: every inner step a worker took
    # since entered an average, or is the unfinished round it was stopped in. (Before it, the start is
    # a race the test does not pace: a worker that saw no other live one may have averaged alone, and
    # gone back to the state two peers that had just joined held, as any smaller side heals.)
    for n in names:
        records, end = swarm.records(n), swarm.records(n, "end")[0]
        cut = next(i for i, r in enumerate(records) if r["ok"] and r["outer_step"] == first)
        assert end["dropped"] == sum(r["dropped"] for r in records[:cut + 1]), (n, end, records)
        since = records[cut + 1:]
        assert sum(r["steps"] for r in since) == records[-1]["inner_steps_total"] - records[cut]["inner_steps_total"]
    for n in names:  # and in a start that had no race, nothing was dropped at all
        end = swarm.records(n, "end")[0]
        unfinished = end["inner_steps_total"] - max(r["inner_steps_total"] for r in ok_syncs(swarm, n).values())
        if not any(r["dropped"] or not r["ok"] for r in swarm.records(n)):
            assert end["dropped"] == 0, (n, end)
            assert end["contributed"] + unfinished == end["inner_steps_total"] - _adopted(swarm, n), (n, end)


def _adopted(swarm, name) -> int:
    """Inner steps a worker took over from a peer when it joined (counted, but not its own)."""
    start = swarm.records(name, "start")[0]
    return start.get("inner_steps_total", 0) if start["downloaded"] else 0


def test_a_worker_left_out_under_swarm_pace_carries_its_work_into_the_next_round(swarm):
    swarm.bootstrap()
    opts = dict(run_until_stopped=True, local_steps=5, step_delay=0.1, min_group_size=2, pace="swarm",
                straggler_wait=3, allreduce_timeout=8)
    survivors = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    victim = swarm.worker("victim", seed=9, stall_in_allreduce=(2, 30), **opts)
    marker = swarm.out("victim").with_name("victim.jsonl.inround")
    swarm.wait_for(marker.exists, 120, "the victim to enter an all-reduce at or after outer step 2",
                   show=["victim", "w0"])
    victim.send_signal(signal.SIGSTOP)
    # The round it stalls in: outer step 2, or a later one if the others ran ahead while it started.
    stalled = int(marker.read_text().split()[0])
    swarm.wait_for(lambda: all(stalled + 1 in ok_syncs(swarm, f"w{i}") for i in range(2)), 60,
                   "the others to go on", show=["w0", "w1"])
    victim.send_signal(signal.SIGCONT)

    def back_in_the_group() -> int:
        records = swarm.records("victim")
        carried = [i for i, r in enumerate(records) if "carried" in r["reason"]]
        return carried and sum(r["ok"] and r["group_size"] == 3 for r in records[carried[0]:]) >= 2

    swarm.wait_for(back_in_the_group, 180, "the victim to come back, carrying its work, and average again",
                   show=["victim", "w0"])
    for proc in survivors + [victim]:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(survivors + [victim], timeout=60)

    records = swarm.records("victim")
    back = next(i for i, r in enumerate(records) if "carried" in r["reason"])
    assert records[back]["dropped"] == 0
    # Its next successful round contributed the carried steps too: more than it took in that round.
    after = next(r for r in records[back + 1:] if r["ok"])
    assert after["contributed"] > after["steps"], after
    assert swarm.records("victim", "end")[0]["dropped"] == 0
    assert_hashes_agree(swarm, ["w0", "w1", "victim"], sorted(ok_syncs(swarm, "victim")))
