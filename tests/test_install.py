"""What a user installs: the distribution's name, its dependencies and extras, and every install line
of the README and docs/ naming this project (never the package index's other ``opendiloco``)."""

from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

import pytest

from opendiloco import cli
from opendiloco.extras import DISTRIBUTION, MissingExtra

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
THIRD_PARTY_TOOLS = {"podman-compose"}
"""Tools the docs tell a user to install beside the project (not its dependencies)."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_install_commands() -> list[tuple[str, list[str]]]:
    """Every ``pip install ...`` in the README and docs/: (where, its arguments)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for chunk in re.findall(r"`([^`]*pip3? install[^`]*)`", line) or (
                    [line.strip()] if re.match(r"\s*(\S*/)?(pip3?|python3? -m pip) install ", line) else []):
                args = shlex.split(chunk.split("pip install", 1)[-1].split("pip3 install", 1)[-1])
                found.append((f"{path.relative_to(ROOT)}:{n}", args))
    return found


def test_the_distribution_is_named_for_this_project_and_not_the_package_index_other_opendiloco():
    assert PROJECT["name"] == DISTRIBUTION == "opendiloco-swarm"
    dist = metadata.distribution(DISTRIBUTION)  # installed from this checkout
    assert "opendiloco" in (dist.read_text("top_level.txt") or "opendiloco").split()
    assert Path(cli.__file__).resolve().is_relative_to(ROOT), "the opendiloco imported is not this checkout's"


def test_dependencies_pin_what_the_code_relies_on():
    deps = {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]): d for d in PROJECT["dependencies"]}
    assert deps["hivemind"] == "hivemind==1.1.12"  # its internals are used: exactly this release
    assert deps["torch"].startswith("torch>=2.6")  # torch.load of a peer's state: no older torch
    for imported in ("cryptography", "protobuf", "numpy", "msgpack", "pydantic", "blake3", "prometheus-client"):
        assert imported in deps, f"{imported} is imported by the code but not declared"
    assert "transformers" not in deps and "matplotlib" not in deps  # extras, not every worker's burden
    extras = PROJECT["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["hf"])
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    dev = " ".join(extras["dev"])
    assert all(x in dev for x in ("hf", "plot", "pytest")), "the tests' extras must be in dev"
    import hivemind
    import torch

    assert hivemind.__version__ == "1.1.12"
    assert tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def test_every_pip_install_line_of_the_docs_installs_this_project():
    commands = _pip_install_commands()
    assert commands, "the README says how to install extras"
    extras = set(PROJECT["optional-dependencies"])
    wrong = []
    for where, args in commands:
        targets = [a for a in args if not a.startswith("-")]
        if not targets:
            continue  # `pip install` named in prose
        for target in targets:
            m = re.fullmatch(r"(\.|[\w.-]+)(\[([\w,-]+)\])?([<>=!~].*)?", target)
            name = m and m.group(1)
            named = set((m.group(3) or "").split(",")) - {""} if m else set()
            if m is None or not (name == "." or _norm(name) == DISTRIBUTION or _norm(name) in THIRD_PARTY_TOOLS):
                wrong.append(f"{where}: {target}")
            elif named - extras:
                wrong.append(f"{where}: {target} names extras this project does not have: {named - extras}")
    assert not wrong, "install lines that do not install this project:\n" + "\n".join(wrong)


def test_plot_without_matplotlib_names_the_extra_in_one_line(monkeypatch, capsys, tmp_path):
    run = tmp_path / "worker-0"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "train", "inner_step": 1, "loss": 5.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install '{DISTRIBUTION}[plot]'" in err, err
    assert not (tmp_path / "loss.png").exists()


def test_a_hugging_face_tokenizer_without_transformers_names_the_extra(monkeypatch):
    from opendiloco.train.tokenizer import make_tokenizer

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtra, match=re.escape(f"pip install '{DISTRIBUTION}[hf]'")) as e:
        make_tokenizer("gpt2")
    assert "\n" not in str(e.value)
    assert make_tokenizer("bytes").vocab_size == 259  # the default needs no extra


def _extra_installed(extra: str) -> bool:
    from packaging.requirements import Requirement

    for req in PROJECT["optional-dependencies"][extra]:
        name = Requirement(req).name
        if _norm(name) == DISTRIBUTION:
            continue  # dev names the other extras through this project
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return False
    return True


@pytest.mark.slow
def test_every_pip_install_line_of_the_docs_resolves_as_written():
    """Each install line of this project, as written, resolved by pip against this environment with
    nothing downloaded (--dry-run --no-index): the name and extras exist and nothing conflicts. Lines
    whose extras are not installed here are checked by name above, not resolved."""
    import subprocess

    ran = 0
    for where, args in _pip_install_commands():
        targets = [a for a in args if not a.startswith("-")]
        if not targets or any(_norm(re.split(r"[\[<>=!~]", t)[0]) in THIRD_PARTY_TOOLS for t in targets):
            continue
        extras = {e for t in targets for e in re.findall(r"\[([\w,-]+)\]", t) for e in e.split(",")}
        if not all(_extra_installed(e) for e in extras):
            continue
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                               "--no-build-isolation", "--disable-pip-version-check", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        said = proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, f"{where}: pip install {' '.join(args)}\n{said}"
        ran += 1
    assert ran >= 2, "the README's install lines were resolved"
