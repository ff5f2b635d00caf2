"""How the trainer's worker starts, before its first inner step, and what it says when that fails.

In order (``Trainer.run``): the worker's processes meet (``join_worker_processes``), rank 0 takes the
run dir (``worker_run_dir``), a checkpoint to resume is read and checked (``read_checkpoint``), the
Prometheus exporter starts (``start_exporter``), the worker makes its communicator
(``worker_communicator``: a swarm, or training alone) and its metrics (``open_metrics``), then adopts
a live peer's state if the run is ahead of it (``join_at_peers_state``). Every problem a user can
fix is a ``TrainError`` of one line; a process of the worker that died is one too
(``worker_failure``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from opendiloco import Communicator, DiLoCoOptimizer
from opendiloco.comm import LocalRanks, SingleWorker
from opendiloco.errors import Interrupted, LocalRankFailure, TrainError
from opendiloco.inner import inner_optimizer
from opendiloco.streaming import block_fragments

from .checkpoint import CheckpointError, CheckpointManager
from .checkpoint_format import CheckpointMismatch, check_model_fits, load_checkpoint
from .config import Config, SwarmConfig, config_fingerprint, fingerprint_covers
from .metrics import MetricsWriter
from .prometheus import PrometheusSink
from .prometheus import start_exporter as start_prometheus_exporter
from .ranks import WorkerRanks
from .sinks import make_sinks
from .worker import check_membership as check_swarm_membership
from .worker import join_swarm

log = logging.getLogger(__name__)


def check_membership(cfg: Config, *, warn: bool = True) -> bool:
    """Whether this worker's run is closed; ``SwarmError`` if it is neither closed nor open by choice
    (``opendiloco.train.worker.check_membership``, the rule ``connect`` follows too)."""
    return check_swarm_membership(cfg.swarm, warn=warn)


def join_worker_processes(ranks: WorkerRanks, device: torch.device) -> None:
    """The process group of a worker of several processes (torchrun); nothing in one process."""
    try:
        ranks.init(device)
    except (RuntimeError, ValueError) as e:
        raise TrainError(f"could not join the worker's other processes: {e}") from e


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Two workers sharing a run dir would overwrite each other's checkpoints: refuse the second."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            raise TrainError(f"run dir {run_dir} is in use by another worker (pid {holder}); "
                             "give each worker its own --run.worker NAME") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def worker_run_dir(ranks: WorkerRanks, run_dir: Path) -> Iterator[None]:
    """One run dir per worker: rank 0 holds its lock (and writes its config, checkpoints and metrics);
    the other ranks touch the directory only once rank 0 has it, and refuse when rank 0 does."""
    with contextlib.ExitStack() as stack:
        problem = None
        if ranks.leader:
            try:
                stack.enter_context(run_dir_lock(run_dir))
            except TrainError as e:
                problem = str(e)
        problem = ranks.from_leader(problem)
        if problem:
            raise TrainError(problem)
        yield


def worker_failure(e: RuntimeError, ranks: WorkerRanks) -> TrainError | None:
    """The ``TrainError`` to raise when ``e`` says another process of this worker died (our hand-off
    failed, or DDP's own collective did; torchrun ends the rest); None for any other error."""
    lost = isinstance(e, LocalRankFailure) or (ranks.multi and not isinstance(e, TrainError) and _lost_a_process(e))
    if not lost:
        return None
    return TrainError(f"a process of this worker failed, so the worker leaves the swarm: "
                      f"{str(e).strip().splitlines()[0][:300]}")


def _lost_a_process(e: RuntimeError) -> bool:
    """Whether a collective failed because a peer process of this worker is gone (gloo, NCCL)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "Connection reset",
                                                                    "Connection closed"))


def check_fresh_start(run_dir: Path, *, resume: bool, leader: bool) -> None:
    """A fresh start never overwrites a run: refused where checkpoints exist (without ``resume``); rank 0
    removes what an interrupted checkpoint write left behind."""
    if not resume and CheckpointManager(run_dir).latest() is not None:
        raise TrainError(f"{run_dir} already holds checkpoints: pass --resume to continue that run, "
                         "or choose another --run.name or --run.dir")
    if leader:
        CheckpointManager(run_dir).remove_stale_temp_files()


def checkpoint_to_resume(run_dir: Path, ranks: WorkerRanks, model: torch.nn.Module,
                    cfg: Config) -> tuple[Path, dict] | None:
    """The newest intact checkpoint of the run dir, checked against this config's model (before
    anything is joined or written: a checkpoint that cannot be used changes nothing)."""
    # Rank 0 picks the checkpoint (and sets damaged ones aside); the worker's other processes load that file.
    choice = None
    if ranks.leader:
        try:
            found = CheckpointManager(run_dir).load_intact()
            choice = {"path": str(found[0]) if found is not None else None}
        except CheckpointError as e:
            choice = {"error": f"{e}; nothing was changed"}
    choice = ranks.from_leader(choice)
    if "error" in choice:
        raise TrainError(choice["error"])
    if not ranks.leader:
        found = None
        if choice["path"] is not None:
            path = Path(choice["path"])
            found = (path, torch.load(path, map_location="cpu", weights_only=True))
    if found is not None:
        try:
            check_model_fits(found[1], model, cfg, found[0])
        except CheckpointMismatch as e:
            raise TrainError(str(e)) from None
    return found


def resume_from(found: tuple[Path, dict] | None, checkpoints_dir: Path, **parts) -> bool:
    """Loads the checkpoint ``checkpoint_to_resume`` found into the trainer's ``parts`` (``model``,
    ``opt``, ``scheduler``, ``stream``, ``scaler``); False when there was none."""
    if found is None:
        log.info("no checkpoint in %s; starting fresh", checkpoints_dir)
        return False
    path, ckpt = found
    try:
        load_checkpoint(ckpt, path=path, **parts)
    except CheckpointMismatch as e:
        raise TrainError(str(e)) from None
    opt = parts["opt"]
    log.info("resumed from %s (inner step %d, outer step %d)", path, opt.inner_steps_total, opt.outer_step)
    return True


def start_exporter(cfg: Config, ranks: WorkerRanks) -> PrometheusSink | None:
    """The Prometheus exporter ``[run] metrics_port`` asks for (rank 0 only), or None; started before the
    worker joins a swarm, so that a port in use is told at once."""
    run = cfg.run
    if run.metrics_port is None or not ranks.leader:
        return None
    try:
        exporter = start_prometheus_exporter(run.metrics_port, run.metrics_host)
    except OSError as e:
        raise TrainError(str(e)) from None
    log.info("metrics for Prometheus at %s", exporter.url)
    return exporter


def trains_alone(cfg: Config, comm: Communicator) -> bool:
    """True for a worker without a swarm (``make_communicator``'s ``SingleWorker``, or the ranks of one
    multi-process worker around it): its outer step is ``[optim] solo_outer_lr`` and
    ``solo_outer_momentum``. A group handed in by a caller (``InProcessGroup``) averages, so it is not."""
    return not cfg.swarm.enabled and isinstance(comm, (SingleWorker, LocalRanks))


def diloco_optimizer(cfg: Config, model: torch.nn.Module, comm: Communicator) -> DiLoCoOptimizer:
    """The DiLoCo optimizer ``[optim]`` and ``[swarm]`` describe, over ``model``, averaging through ``comm``
    (a worker that trains alone takes the solo outer step: ``trains_alone``)."""
    o = cfg.optim
    outer_lr, outer_momentum = (o.solo_outer_lr, o.solo_outer_momentum) if trains_alone(cfg, comm) \
        else (o.outer_lr, o.outer_momentum)
    return DiLoCoOptimizer(
        model.parameters(),
        local_steps=o.local_steps,
        inner_optimizer=inner_optimizer(o.inner, model, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                        weight_decay=o.weight_decay, muon_momentum=o.muon_momentum),
        outer_optimizer=functools.partial(torch.optim.SGD, lr=outer_lr, momentum=outer_momentum,
                                          nesterov=o.outer_nesterov and outer_momentum > 0),
        communicator=comm,
        module=model,  # its persistent floating buffers (none in a Llama: rotary frequencies are not)
        weight_by_samples=cfg.swarm.weight_by_samples,
        pace=o.pace,
        fragments=block_fragments(model, o.fragments),
        overlap=o.overlap,
        mix=o.mix,
        error_feedback=cfg.swarm.uses_error_feedback,
        warm_start=o.warm_start,
        error_decay=cfg.swarm.error_decay,
    )


def make_communicator(cfg: Config, run_dir: Path) -> Communicator:
    """The one place that decides how this worker averages with others."""
    if not cfg.swarm.enabled:
        return SingleWorker(compression=cfg.swarm.compression)  # a lone worker's average is its own
    # Its peer identity in its run dir; the swarm names the fingerprint, its keys are the trainer's to name.
    return join_swarm(cfg.swarm, identity_dir=run_dir, fingerprint=config_fingerprint(cfg),
                      covers=fingerprint_covers(), advice=" (compare their --print-config)")


def worker_communicator(cfg: Config, run_dir: Path, ranks: WorkerRanks) -> Communicator:
    """This process's communicator: ``make_communicator``'s, or in a worker of several processes
    ``LocalRanks`` (rank 0 alone joins the swarm; the other ranks hear its outcome)."""
    if not ranks.multi:
        return make_communicator(cfg, run_dir)
    leader = functools.partial(make_communicator, cfg, run_dir) if ranks.leader else None
    return LocalRanks(leader, timeout=hand_off_timeout(cfg.swarm))


def hand_off_timeout(swarm: SwarmConfig) -> float:
    """How long the worker's other processes wait for rank 0: its longest wait on the swarm (joining,
    a round with its matchmaking, a catch-up download), with a margin."""
    longest = max(swarm.join_timeout, swarm.matchmaking_timeout + swarm.max_wait + swarm.allreduce_timeout + 60.0)
    return min(longest + 300.0, 24 * 3600.0)


def open_metrics(cfg: Config, ranks: WorkerRanks, exporter: PrometheusSink | None) -> MetricsWriter:
    """Rank 0's ``metrics.jsonl``, forwarded to the sinks ``[run] log_to`` names and ``exporter``; the
    other ranks keep their own records (their θ_global hash at each outer step), without sinks."""
    if not ranks.leader:
        return MetricsWriter(cfg.run_dir / f"metrics.rank{ranks.rank}.jsonl")
    started = [exporter] if exporter is not None else []
    return MetricsWriter(cfg.run_dir / "metrics.jsonl", forward=make_sinks(cfg, cfg.run_dir, started))


def join_at_peers_state(comm: Communicator, opt: DiLoCoOptimizer, swarm: SwarmConfig, *, resumed: bool,
                        adopt: Callable[[dict], None]) -> bool:
    """Downloads θ_global and the step counters of a live peer, if there is one, and hands them to
    ``adopt`` (docs/invariants.md, 9); a worker that ``resumed`` from a checkpoint keeps it unless the
    peers are ahead of it. Returns whether a state was adopted. A download or a state that fails ends
    the start (``on_join_failure = "exit"``) or is told and passed over."""
    try:
        state = comm.download_state(timeout=swarm.join_timeout, max_bytes=opt.shareable_state_bound())
    except LocalRankFailure:
        raise
    except Interrupted:  # a stop was asked for: the loop ends at once, the checkpoint stays as it was
        log.warning("state download interrupted")
        return False
    except Exception as e:  # the transport's own errors: policy decides
        if swarm.on_join_failure == "exit":
            raise TrainError(f"could not download state from the swarm: {e}") from e
        log.warning("could not download state from the swarm (%s); starting from our own state", e)
        return False
    if state is None:
        return False
    if resumed and int(state.get("outer_step", -1)) <= opt.outer_step:
        log.info("peers are at outer step %s, not ahead of our checkpoint; keeping it", state.get("outer_step"))
        return False
    try:
        adopt(state)
    except ValueError as e:  # not the state the run confirmed, or not this model's: nothing was changed
        if swarm.on_join_failure == "exit":
            raise TrainError(f"refused the state downloaded from the swarm: {e}") from None
        log.warning("refused the state downloaded from the swarm (%s); starting from our own state", e)
        return False
    log.info("joined the swarm at outer step %d (inner step %d)%s", opt.outer_step, opt.inner_steps_total,
             ", inner optimizer warm-started" if opt.warm_started else "")
    return True
