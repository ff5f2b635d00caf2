"""The benchmark's arithmetic and report: analytic bytes, utilisation windows, generated section."""

from __future__ import annotations

import pytest

from benchmarks import analysis
from benchmarks.report import BEGIN, END, write_report


def test_bandwidth_optimal_allreduce():
    # 4 peers, 8 MB each: every peer sends 2*3/4 * 8 MB = 12 MB; at 100 Mbit/s that is 0.96 s.
    assert analysis.ring_allreduce_bytes(8e6, 4) == pytest.approx(12e6)
    assert analysis.bandwidth_optimal_s(8e6, 4, 100) == pytest.approx(0.96)
    assert analysis.ring_allreduce_bytes(8e6, 1) == 0
    # DiLoCo fp16 every 50 steps vs fp32 every step: 2 * 50 = 100x less.
    dp = analysis.analytic_bytes_per_step(1000, 4, bytes_per_value=4, every=1)
    diloco = analysis.analytic_bytes_per_step(1000, 4, bytes_per_value=2, every=50)
    assert dp / diloco == pytest.approx(100)


def _round(t, compute, step):
    return {"event": "outer_step", "ok": True, "time": t, "round_compute_s": compute, "outer_step": step}


def test_steady_utilisation_leaves_out_the_first_round():
    records = [_round(100.0, 40.0, 1),  # start-up skew lands in round 1: not counted
               _round(110.0, 9.0, 2), {"event": "outer_step", "ok": False, "time": 111.0, "round_compute_s": 0.5},
               _round(120.0, 8.0, 3)]
    assert analysis.steady_utilisation(records) == pytest.approx((9.0 + 8.0) / 20.0)
    assert analysis.steady_utilisation(records[:1]) is None


def _entry(method, loss, h=None, wire=None, analytic=0.0, workers=4):
    return {"method": method, "H": h, "workers": workers, "steps": 100, "network": "netns", "link_mbit": None,
            "wall_s": 60.0, "final_eval_loss": loss, "final_eval_losses": [loss], "eval_curve": [(50, loss + 1),
                                                                                                (100, loss)],
            "wire_bytes_per_step": [wire] * workers, "payload_bytes_per_step": None,
            "analytic_bytes_per_step": analytic, "utilisation_whole": [0.9], "utilisation_steady": [0.95] * workers,
            "hashes_agree": True, "group_sizes": [4], "transfer_s_median": 1.2, "sync_s_median": 1.5,
            "payload_bytes_per_round": 3e6, "round_compute_s_median": 20.0, "comm_s_per_step": 0.1}


def test_report_section_replaces_only_its_markers(tmp_path):
    results = {
        "plan": {"name": "test", "config": "configs/tiny.toml", "model": [], "steps": 100, "batch": 8,
                 "workers": 4, "eval_batches": 4, "util_batch": 2},
        "machine": {"cores": 2, "cpu": "cpu", "torch": "t", "hivemind": "h", "python": "3", "kernel": "k"},
        "netns": True, "parameters": 1_000_000, "minutes": 3.0, "command": "python -m benchmarks.suite",
        "convergence": {"single": _entry("single", 3.0, workers=1, wire=10.0),
                        "data-parallel": _entry("data-parallel", 2.0, wire=6e6, analytic=6e6),
                        "diloco-H50": _entry("diloco", 2.2, h=50, wire=8e4, analytic=6e4)},
        "utilisation": {"util-H50-100mbit": {**_entry("diloco", 2.2, h=50), "link_mbit": 100.0, "optimal_s": 0.3}},
    }
    report = tmp_path / "bench.md"
    report.write_text(f"# Title\n\nhand-written\n\n{BEGIN}\nold\n{END}\n\n## After\n")
    headline = write_report(results, report)
    text = report.read_text()
    assert text.startswith("# Title\n\nhand-written\n\n") and text.endswith("\n## After\n")
    assert "old" not in text and text.count(BEGIN) == 1
    assert headline["loss_ratio"]["diloco-H50"]["dp"] == pytest.approx(1.1)
    assert headline["comm_reduction"]["diloco-H50"]["wire"] == pytest.approx(75)
    assert headline["utilisation"]["util-H50-100mbit"] == pytest.approx(0.95)
    assert "| 1.100 |" in text and "75x" in text and "4.00x" in text  # 1.2 s transfer / 0.3 s optimal
    assert (tmp_path / "img" / "bench_test_convergence.png").stat().st_size > 1000
    assert (tmp_path / "img" / "bench_test_utilisation.png").stat().st_size > 1000
