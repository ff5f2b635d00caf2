"""The integrations' examples (examples/) as users run them: two workers of a closed swarm on
127.0.0.1, a real DHT, a run secret; every outer step lands on both with the same θ_global hash."""

from __future__ import annotations

import re
import sys

import pytest

from opendiloco.swarm.membership import SECRET_FILE_ENV, new_secret_file
from opendiloco.testing.ports import free_port

from .conftest import ROOT

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
ROUND = re.compile(r"outer step (\d+): θ_global ([0-9a-f]+), group of (\d+)")


def rounds(log: str) -> dict[int, tuple[str, int]]:
    """Outer step -> (θ_global hash, group size), from the lines ``RoundLog`` writes (every process of a
    worker writes them: they must agree)."""
    found: dict[int, set] = {}
    for m in ROUND.finditer(log):
        found.setdefault(int(m[1]), set()).add((m[2], int(m[3])))
    assert all(len(said) == 1 for said in found.values()), found
    return {step: said.pop() for step, said in found.items()}


def run_example(swarm, tmp_path, script: str, *, launcher=None, outer_steps: int) -> str:
    """Runs ``examples/<script>`` as two workers of a closed swarm (each started by ``launcher()``'s command,
    default ``python``); asserts they agree at every outer step. Returns the first worker's log."""
    peers = swarm.bootstrap()
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    example = str(ROOT / "examples" / script)
    procs = [swarm.spawn([*(launcher() if launcher else [sys.executable]), example, str(tmp_path / name), *peers],
                         name, env={SECRET_FILE_ENV: str(secret)})
             for name in ("w0", "w1")]
    swarm.wait(procs, timeout=200)
    seen = {name: rounds(swarm.log(name, tail=10**7)) for name in ("w0", "w1")}
    for name in seen:
        assert sorted(seen[name]) == list(range(1, outer_steps + 1)), swarm.log(name)
    for step in range(1, outer_steps + 1):
        assert seen["w0"][step] == seen["w1"][step], f"outer step {step}: {seen['w0'][step]} != {seen['w1'][step]}"
        assert seen["w0"][step][1] == 2
    assert len({h for h, _ in seen["w0"].values()}) == outer_steps  # θ_global moved at every step
    return swarm.log("w0", tail=10**7)


def test_hugging_face_trainer(swarm, tmp_path):
    run_example(swarm, tmp_path, "hf_trainer.py", outer_steps=4)


def test_an_accelerate_launch_loop_of_two_processes_per_worker(swarm, tmp_path):
    def launch() -> list[str]:  # each worker's processes meet on a port of their own
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port())]

    log = run_example(swarm, tmp_path, "accelerate_loop.py", launcher=launch, outer_steps=4)
    assert log.count("outer step 4: θ_global") == 2  # said by both processes of the worker, alike


def test_a_lightning_trainer_with_the_callback(swarm, tmp_path):
    run_example(swarm, tmp_path, "lightning_trainer.py", outer_steps=4)


def test_a_lightning_fabric_loop(swarm, tmp_path):
    run_example(swarm, tmp_path, "lightning_fabric.py", outer_steps=4)


def test_the_readmes_own_loop_runs_as_written(swarm, tmp_path):
    """README.md's own-loop recipe, copied as it is: a closed run's worker alone, 4 outer steps."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("<!-- recipe: own-loop -->"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    (tmp_path / "loop.py").write_text(code)
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    swarm.cwd = tmp_path  # where the snippet keeps its identity (runs/me)
    proc = swarm.spawn([sys.executable, str(tmp_path / "loop.py")], "loop", env={SECRET_FILE_ENV: str(secret)})
    swarm.wait([proc], timeout=120)
    said = swarm.log("loop")
    assert "after 4 outer steps" in said, said
    assert (tmp_path / "runs" / "me" / "peer.key").is_file()
