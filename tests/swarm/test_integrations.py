"""The integrations' examples (examples/) as users run them: two workers of a closed swarm on
127.0.0.1, a real DHT, a run secret; every outer step lands on both with the same θ_global hash."""

from __future__ import annotations

import re
import sys

import pytest

from opendiloco.swarm.membership import SECRET_FILE_ENV, new_secret_file

from .conftest import ROOT

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
ROUND = re.compile(r"outer step (\d+): θ_global ([0-9a-f]+), group of (\d+)")


def rounds(log: str) -> dict[int, tuple[str, int]]:
    """Outer step -> (θ_global hash, group size), from the lines ``RoundLog`` writes."""
    return {int(m[1]): (m[2], int(m[3])) for m in ROUND.finditer(log)}


def run_example(swarm, tmp_path, script: str, *, launcher=(), outer_steps: int) -> None:
    """Runs ``examples/<script>`` as two workers of a closed swarm; asserts they agree at every outer step."""
    peers = swarm.bootstrap()
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    procs = [swarm.spawn([*(launcher or [sys.executable]), str(ROOT / "examples" / script), str(tmp_path / name),
                          *peers], name, env={SECRET_FILE_ENV: str(secret)})
             for name in ("w0", "w1")]
    swarm.wait(procs, timeout=200)
    seen = {name: rounds(swarm.log(name, tail=10**7)) for name in ("w0", "w1")}
    for name in seen:
        assert sorted(seen[name]) == list(range(1, outer_steps + 1)), swarm.log(name)
    for step in range(1, outer_steps + 1):
        assert seen["w0"][step] == seen["w1"][step], f"outer step {step}: {seen['w0'][step]} != {seen['w1'][step]}"
        assert seen["w0"][step][1] == 2
    assert len({h for h, _ in seen["w0"].values()}) == outer_steps  # θ_global moved at every step


def test_hugging_face_trainer(swarm, tmp_path):
    run_example(swarm, tmp_path, "hf_trainer.py", outer_steps=4)


def test_the_readmes_own_loop_runs_as_written(swarm, tmp_path):
    """README.md's "Use it in your own loop", copied as it is: a closed run's worker alone, 4 outer steps."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it in your own loop"):]
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
