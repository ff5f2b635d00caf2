"""The import rules of docs/architecture.md, checked on the source: dependencies point one way."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "opendiloco"
CORE = ["optimizer.py", "fragment.py", "optimizer_state.py", "outer.py", "pacing.py", "streaming.py", "staging.py",
        "state_check.py", "fingerprint.py", "errors.py", "comm/base.py", "comm/buffers.py", "comm/codec.py",
        "comm/compression.py", "comm/formats.py", "comm/subset.py", "comm/topk.py", "comm/local.py", "comm/ranks.py",
        "comm/aggregation.py", "timeouts.py"]


def imports(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved against the package)."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                found.add(".".join(base + ((node.module,) if node.module else ())))
            else:
                found.add(node.module)
    return found


def library_files():
    return [p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("name", CORE)
def test_core_imports_no_transport(name):
    bad = {m for m in imports(PACKAGE / name) if m.split(".")[0] in {"hivemind", "asyncio", "uvloop"}}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_only_swarm_imports_hivemind():
    offenders = {str(p.relative_to(PACKAGE)) for p in library_files()
                 if any(m.split(".")[0] == "hivemind" for m in imports(p))
                 and p.relative_to(PACKAGE).parts[0] != "swarm"}
    assert not offenders, offenders


def test_comm_never_imports_the_swarm_or_the_trainer():
    for p in (PACKAGE / "comm").glob("*.py"):
        bad = {m for m in imports(p) if m.startswith(("opendiloco.swarm", "opendiloco.train"))}
        assert not bad, f"{p.name} imports {sorted(bad)}"


def test_the_rounds_code_reads_time_only_through_its_event_loop():
    """Every module of ``comm/`` that runs on the round's event loop reads no clock of its own (``time``,
    ``datetime``): time reaches the round through the loop (``loop.time()``, ``asyncio.sleep``,
    ``asyncio.wait_for``), so that a loop under virtual time runs it in virtual time (``testing/sim.py``)."""
    on_the_loop = [p for p in (PACKAGE / "comm").glob("*.py") if "asyncio" in imports(p)]
    assert len(on_the_loop) >= 6
    for p in on_the_loop:
        clocks = imports(p) & {"time", "datetime"}
        assert not clocks, f"comm/{p.name} imports {sorted(clocks)}"


def test_the_library_never_imports_its_test_tools():
    offenders = {str(p.relative_to(PACKAGE)) for p in library_files()
                 if any(m.startswith("opendiloco.testing") for m in imports(p))}
    assert not offenders, offenders


# Every layer of docs/architecture.md and the layers it may import: arrows point one way.
CORE_MODULES = {"outer", "inner", "pacing", "streaming", "staging", "state_check", "fingerprint", "errors", "extras",
                "timeouts"}
OPTIMIZER_MODULES = {"optimizer", "fragment", "optimizer_state"}
MAY_IMPORT = {
    "core": {"core"},
    "comm": {"core", "comm"},
    "optimizer": {"core", "comm", "optimizer"},
    "swarm": {"core", "comm", "swarm"},
    "train": {"core", "comm", "optimizer", "swarm", "train", "package"},
    "package": {"core", "comm", "optimizer", "package"},
}
LOADED_ON_FIRST_USE = {("opendiloco/__init__.py", "opendiloco.train.worker")}
"""The package's ``connect`` is the trainer's worker setup, imported when it is first used (never by
``import opendiloco``: ``test_importing_the_package_loads_neither_the_swarm_nor_the_trainer``)."""
STANDARD_LIBRARY_ONLY = ["pacing.py", "errors.py", "extras.py", "timeouts.py", "swarm/partners.py", "swarm/quorum.py"]
"""Modules that import nothing but the standard library and each other."""


def layer(module: str) -> str | None:
    """The layer of an ``opendiloco`` module name (None for what is not ours)."""
    parts = module.split(".")
    if parts[0] != "opendiloco":
        return None
    if len(parts) == 1:
        return "package"
    head = parts[1]
    if head in CORE_MODULES:
        return "core"
    if head in OPTIMIZER_MODULES:
        return "optimizer"
    if head in {"comm", "swarm", "optimizer", "testing"}:
        return head
    if head in {"train", "cli", "__main__", "integrations"}:
        return "train"
    raise AssertionError(f"opendiloco.{head} is in no layer of docs/architecture.md: add it to the table")


def test_every_module_is_in_a_layer_and_imports_only_the_layers_below_it():
    for path in library_files():
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        own = layer(".".join(p for p in parts if p != "__init__"))
        for module in imports(path):
            if (str(path.relative_to(PACKAGE.parent)), module) in LOADED_ON_FIRST_USE:
                continue
            target = layer(module)
            assert target is None or target in MAY_IMPORT[own], \
                f"{path.relative_to(PACKAGE)} ({own}) imports {module} ({target})"


def test_importing_the_package_loads_neither_the_swarm_nor_the_trainer():
    import subprocess
    import sys

    code = ("import sys, opendiloco; loaded = [m for m in ('hivemind', 'opendiloco.train', 'opendiloco.swarm') "
            "if m in sys.modules]; assert not loaded, loaded; assert callable(opendiloco.connect); "
            "assert 'opendiloco.train.worker' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", STANDARD_LIBRARY_ONLY)
def test_pure_modules_import_nothing_but_the_standard_library(name):
    import sys

    pure = {"opendiloco." + other.removesuffix(".py").replace("/", ".") for other in STANDARD_LIBRARY_ONLY}
    outside = {m for m in imports(PACKAGE / name) if m.split(".")[0] not in sys.stdlib_module_names and m not in pure}
    assert not outside, f"{name} imports {sorted(outside)}"


def test_the_layer_rules_catch_a_wrong_arrow():
    """The rules above would refuse each arrow docs/architecture.md forbids."""
    for importer, module in [("core", "opendiloco.comm.base"), ("core", "opendiloco.train.trainer"),
                             ("optimizer", "opendiloco.swarm.records"), ("comm", "opendiloco.optimizer"),
                             ("swarm", "opendiloco.train.config"), ("swarm", "opendiloco.optimizer"),
                             ("train", "opendiloco.testing.proctree")]:
        assert layer(module) not in MAY_IMPORT[importer], (importer, module)


HIVEMIND_PRIVATES_MODULE = PACKAGE / "swarm" / "daemon" / "hivemind_privates.py"
OWN_NAMES = {"_peer_id", "_run", "_node"}
"""Private names of hivemind's ``DHT`` or ``P2P`` that this project's own classes also use, for themselves."""


def hivemind_private_names() -> set[str]:
    """The private attributes and methods of hivemind's ``DHT`` and ``P2P``, read from its source."""
    spec = importlib.util.find_spec("hivemind")  # finds the package without importing it
    root = Path(spec.submodule_search_locations[0])
    names = set()
    for source in (root / "dht" / "dht.py", root / "p2p" / "p2p_daemon.py"):
        for cls in (n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_only_the_adapter_touches_hivemind_privates():
    """hivemind's private attributes are reached in one module, pinned to one release (a new release is
    checked there): everywhere else an attribute of that name is an access to hivemind's internals."""
    names = hivemind_private_names()
    assert {"_client", "_outer_pipe", "_parent_pid", "_make_process_args"} <= names
    names -= OWN_NAMES
    offenders = [f"{path.relative_to(PACKAGE)}:{where}" for path in library_files() if path != HIVEMIND_PRIVATES_MODULE
                 for where in private_accesses(path.read_text(), names)]
    assert not offenders, "\n".join(offenders)


def private_accesses(source: str, names: set[str]) -> list[str]:
    """``line: expression`` of every attribute access to one of ``names`` in ``source``."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names]


def test_the_privates_check_catches_a_daemon_call():
    names = hivemind_private_names() - OWN_NAMES
    assert private_accesses("async def f(p2p, peer):\n    await p2p._client.disconnect(peer)\n", names) == [
        "2: p2p._client"]
    assert private_accesses("dht._outer_pipe.close()\nself._peer_id = 1\n", names) == ["1: dht._outer_pipe"]


# swarm/'s wings (docs/architecture.md): the round's core modules sit at the top of swarm/ and may import
# every wing; a wing imports the wings below it and, of the core, only what WING_REACHES_UP names.
WINGS = {"daemon", "connectivity", "state", "ops"}
WING_MAY_IMPORT = {
    "daemon": {"daemon"},
    "connectivity": {"daemon", "connectivity"},
    "state": {"daemon", "state"},
    "ops": {"daemon", "connectivity", "ops"},
}
WING_REACHES_UP = {
    ("daemon/node.py", "opendiloco.swarm.connectivity.relays"): "the daemon flags that make a node relay or reserve",
    ("daemon/node.py", "opendiloco.swarm.connectivity.reachability"): "every node serves the dial-back check",
    ("daemon/node.py", "opendiloco.swarm.signing"): "a node's identity and the DHT's validator of signed records",
    ("connectivity/watch.py", "opendiloco.swarm.presence"): "the watch hooks onto the heartbeat's news",
    ("connectivity/watch.py", "opendiloco.swarm.records"): "a peer's record says it moved",
    ("connectivity/watch.py", "opendiloco.swarm.run_snapshot"): "public workers to widen the relay slots on",
    ("connectivity/watch.py", "opendiloco.swarm.exclusion"): "a relay back: peers behind it are tried again",
    ("state/transfer.py", "opendiloco.swarm.streams"): "the p2p streams a state is served on",
    ("state/multi_donor.py", "opendiloco.swarm.streams"): "the p2p streams parts are fetched on",
    ("state/download.py", "opendiloco.swarm.streams"): "the p2p streams a download opens",
    ("state/download.py", "opendiloco.swarm.presence"): "the live workers that may donate",
    ("state/download.py", "opendiloco.swarm.quorum"): "which state the run confirms",
    ("state/download.py", "opendiloco.swarm.matchmaking"): "whether the run left this worker out of a round",
    ("ops/status.py", "opendiloco.swarm.records"): "the run's records, read for the operator",
    ("ops/status.py", "opendiloco.swarm.membership"): "the run secret that opens a closed run's records",
}


def imported_modules(path: Path) -> set[str]:
    """``imports(path)``, with ``from package import module`` resolved to the module."""
    found = imports(path)
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level] + ((node.module,) if node.module else ())) \
                if node.level else node.module
            for alias in node.names:
                target = PACKAGE.parent.joinpath(*f"{base}.{alias.name}".split("."))
                if target.with_suffix(".py").exists() or (target / "__init__.py").exists():
                    found.add(f"{base}.{alias.name}")
    return found


def is_package(module: str) -> bool:
    """Whether an ``opendiloco`` module name is a package (its modules imported by name are checked)."""
    return (PACKAGE.parent.joinpath(*module.split(".")) / "__init__.py").exists()


def swarm_part(module: str) -> str | None:
    """The wing of an ``opendiloco.swarm`` module, "core" for the modules at the top of swarm/, None
    for the package itself and for what is not in swarm/."""
    parts = module.split(".")
    if parts[:2] != ["opendiloco", "swarm"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in WINGS else "core"


def wing_arrows_refused(importer: str, module: str) -> bool:
    """Whether a wing's file (``importer``, relative to swarm/) may not import ``module``."""
    own, target = importer.split("/")[0], swarm_part(module)
    if own not in WINGS or target is None:
        return False
    if target in WINGS:
        refused = target not in WING_MAY_IMPORT[own]
    else:
        refused = True
    return refused and (importer, module) not in WING_REACHES_UP


def test_the_wings_import_only_the_wings_below_them_and_what_they_name_of_the_core():
    swarm = PACKAGE / "swarm"
    wrong = [f"{path.relative_to(swarm)} imports {module}" for path in swarm.rglob("*.py")
             for module in sorted(imported_modules(path))
             if not is_package(module) and wing_arrows_refused(str(path.relative_to(swarm)), module)]
    assert not wrong, "\n".join(wrong)


def test_every_named_arrow_up_is_still_there():
    """An exception for an import that is gone is dropped from WING_REACHES_UP."""
    swarm = PACKAGE / "swarm"
    for importer, module in WING_REACHES_UP:
        assert module in imported_modules(swarm / importer), (importer, module)


def test_the_wing_rules_catch_a_wrong_arrow():
    for importer, module in [("daemon/dht_calls.py", "opendiloco.swarm.connectivity.relays"),
                             ("daemon/node.py", "opendiloco.swarm.records"),
                             ("connectivity/relays.py", "opendiloco.swarm.presence"),
                             ("connectivity/frozen.py", "opendiloco.swarm.ops.doctor"),
                             ("state/layout.py", "opendiloco.swarm.connectivity.relays"),
                             ("ops/health.py", "opendiloco.swarm.state.transfer")]:
        assert wing_arrows_refused(importer, module), (importer, module)
    assert not wing_arrows_refused("connectivity/relays.py", "opendiloco.swarm.daemon.hivemind_privates")
    assert not wing_arrows_refused("ops/doctor.py", "opendiloco.swarm.connectivity.reachability")


def house_stats():
    """``scripts/house_stats.py``, loaded as a module."""
    spec = importlib.util.spec_from_file_location("house_stats", PACKAGE.parent / "scripts" / "house_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_over_650_lines_no_function_over_80_and_no_import_cycle():
    stats = house_stats()
    lines, long, graph = stats.measure(80)
    big = {str(f.relative_to(PACKAGE)): n for f, n in lines.items() if n > 650}
    assert not big and not long and not stats.cycles(graph), (big, long, stats.cycles(graph))


def test_the_cycle_finder_finds_a_cycle():
    stats = house_stats()
    assert stats.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert stats.cycles({"a": {"b"}, "b": set()}) == []
