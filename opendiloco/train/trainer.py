"""The reference training loop: a plain PyTorch loop that uses ``DiLoCoOptimizer`` like any user would."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from opendiloco import Communicator, DiLoCoOptimizer
from opendiloco.comm import LocalRanks, SingleWorker
from opendiloco.errors import Interrupted, LocalRankFailure
from opendiloco.inner import inner_optimizer
from opendiloco.streaming import block_fragments

from .allocator import release_freed_tensors
from .checkpoint import CheckpointError, CheckpointManager, atomic_write
from .checkpoint_format import CheckpointMismatch, check_model_fits, load_checkpoint, make_checkpoint
from .config import Config, config_fingerprint, fingerprint_covers, to_toml
from .data import make_streams
from .device import place
from .hf_model import ModelError
from .metrics import MetricsWriter
from .model import build_model, count_parameters, seed_generators
from .prometheus import PrometheusSink, start_exporter
from .ranks import RanksError, WorkerRanks
from .sinks import make_sinks, missing_package
from .tokenizer import make_tokenizer
from .worker import check_membership as check_swarm_membership
from .worker import join_swarm

log = logging.getLogger(__name__)


class TrainError(RuntimeError):
    """A problem the user can fix (printed as one line by the CLI)."""


def check_membership(cfg: Config, *, warn: bool = True) -> bool:
    """Whether this worker's run is closed; ``SwarmError`` if it is neither closed nor open by choice
    (``opendiloco.train.worker.check_membership``, the rule ``connect`` follows too)."""
    return check_swarm_membership(cfg.swarm, warn=warn)


def trains_alone(cfg: Config, comm: Communicator) -> bool:
    """True for a worker without a swarm (``make_communicator``'s ``SingleWorker``, or the ranks of one
    multi-process worker around it): its outer step is ``[optim] solo_outer_lr`` and
    ``solo_outer_momentum``. A group handed in by a caller (``InProcessGroup``) averages, so it is not."""
    return not cfg.swarm.enabled and isinstance(comm, (SingleWorker, LocalRanks))


def make_communicator(cfg: Config, run_dir: Path) -> Communicator:
    """The one place that decides how this worker averages with others."""
    if not cfg.swarm.enabled:
        return SingleWorker(compression=cfg.swarm.compression)  # a lone worker's average is its own
    # Its peer identity in its run dir; the swarm names the fingerprint, its keys are the trainer's to name.
    return join_swarm(cfg.swarm, identity_dir=run_dir, fingerprint=config_fingerprint(cfg),
                      covers=fingerprint_covers(), advice=" (compare their --print-config)")


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine decay to ``min_ratio`` of it at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_schedule_position(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Puts the scheduler at ``step`` (used after adopting a peer's state, whose step count we take)."""
    scheduler.last_epoch = step
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    """Training loss of every inner step this process took, in order."""
    eval_loss: float | None = None
    tokens_per_s: float = 0.0
    inner_steps: int = 0
    outer_steps: int = 0
    stopped: bool = False


class StopRequest:
    """SIGINT/SIGTERM ask the loop to finish its step, checkpoint and exit; a second SIGINT aborts."""

    def __init__(self, on_stop=None):
        self.requested = False
        self.on_stop = on_stop
        """Called in the handler: e.g. lets an outer step that waits for peers give up."""
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if self.on_stop is not None:
            self.on_stop()
        log.warning("%s received: finishing this step, then checkpointing and exiting",
                    signal.Signals(signum).name)

    def __enter__(self):
        if _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def run_dir_lock(run_dir: Path):
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


def _lost_a_process(e: RuntimeError) -> bool:
    """Whether a collective failed because a peer process of this worker is gone (gloo, NCCL)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "Connection reset",
                                                                    "Connection closed"))


class Trainer:
    """Builds everything from a config, then runs the loop. One instance per run.

    ``run`` is the whole loop. Scripts, benchmarks and loops of one's own use its parts, the same code::

        trainer = Trainer(cfg)
        trainer.build(SingleWorker())  # or build_model_and_data(), then build_optimizer(comm)
        loss, grad_norm = trainer.train_step()
        eval_loss = trainer.evaluate()
        with trainer.autocast():  # the forward pass in the trainer's precision
            ...

    ``device`` and ``precision`` are known from the start; ``build_model_and_data`` sets ``tokenizer``,
    ``stream``, ``eval_set``, ``model`` and ``forward`` (the model as it trains: DDP, compiled);
    ``build_optimizer`` sets ``comm``, ``opt``, ``scheduler``, ``scaler`` and ``checkpoints``.
    """

    def __init__(self, cfg: Config, *, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.run_dir = cfg.run_dir
        try:
            self.ranks = WorkerRanks.from_env()
            self.rows = self.ranks.rows(cfg.train.batch_size)
        except RanksError as e:
            raise TrainError(str(e)) from None
        # Closed, or open by choice, before anything else (every process of the worker refuses the same way;
        # rank 0, the one that joins the swarm, says that the run is open).
        check_membership(cfg, warn=self.ranks.leader)
        # The processes of one worker share the machine's cores.
        threads = cfg.train.threads or max(1, len(os.sched_getaffinity(0)) // self.ranks.local_size)
        torch.set_num_threads(threads)
        release_freed_tensors()
        self.placement = place(cfg.train.device, cfg.train.precision, self.ranks)
        self.device, self.precision = self.placement.device, self.placement.precision
        self.on_step: Callable[[float], None] | None = None
        """Called by ``run`` after every inner step with the seconds ``train_step`` took (benchmarks, probes)."""

    # -- setup --------------------------------------------------------------------------------
    def build(self, comm: Communicator) -> None:
        """Model, data and optimizer, averaging through ``comm``: what a loop of one's own needs."""
        self.build_model_and_data()
        self.build_optimizer(comm)

    def build_model_and_data(self) -> None:
        """Seeds the generators, then builds the tokenizer, the training stream, the held-out batches and
        the model (on ``device``, wrapped in DDP in a worker of several processes); raises ``TrainError``
        for a data problem."""
        cfg = self.cfg
        seed_generators(cfg.train.seed)
        try:
            self.tokenizer = make_tokenizer(cfg.data.tokenizer)
            self.stream, self.eval_set = make_streams(cfg.data, self.tokenizer, order_key=cfg.shard_key,
                                                      batch_size=cfg.train.batch_size,
                                                      eval_count=cfg.train.eval_batches)
        except (RuntimeError, OSError, ValueError) as e:  # missing files, bad lines, no datasets package...
            raise TrainError(f"data: {e}") from e
        try:
            self.model = build_model(cfg.model, self.tokenizer.vocab_size, cfg.data.seq_len,
                                     self.tokenizer).to(self.device)
        except ModelError as e:
            raise TrainError(str(e)) from None
        # DDP (several processes) starts every rank from rank 0's weights; the optimizer is built after.
        self.ddp = self.ranks.wrap(self.model, self.device)
        self.forward = torch.compile(self.ddp) if cfg.train.compile else self.ddp
        # Evaluation runs on rank 0 alone: never through DDP, whose backward the other ranks would await.
        self.eval_forward = self.forward if not self.ranks.multi else self.model

    def build_optimizer(self, comm: Communicator) -> None:
        """The DiLoCo optimizer over ``model`` averaging through ``comm``, the lr schedule, the fp16 loss
        scaler and the checkpoint manager. After ``build_model_and_data``."""
        self.comm = comm
        cfg, o = self.cfg, self.cfg.optim
        outer_lr, outer_momentum = (o.solo_outer_lr, o.solo_outer_momentum) if trains_alone(cfg, comm) \
            else (o.outer_lr, o.outer_momentum)
        self.opt = DiLoCoOptimizer(
            self.model.parameters(),
            local_steps=o.local_steps,
            inner_optimizer=inner_optimizer(o.inner, self.model, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                            weight_decay=o.weight_decay, muon_momentum=o.muon_momentum),
            outer_optimizer=functools.partial(torch.optim.SGD, lr=outer_lr, momentum=outer_momentum,
                                              nesterov=o.outer_nesterov and outer_momentum > 0),
            communicator=self.comm,
            module=self.model,  # its persistent floating buffers (none in a Llama: rotary frequencies are not)
            weight_by_samples=cfg.swarm.weight_by_samples,
            pace=o.pace,
            fragments=block_fragments(self.model, o.fragments),
            overlap=o.overlap,
            mix=o.mix,
            error_feedback=cfg.swarm.uses_error_feedback,
            warm_start=o.warm_start,
            error_decay=cfg.swarm.error_decay,
        )
        schedule = functools.partial(lr_lambda, warmup=o.warmup_steps, total=cfg.train.total_steps,
                                     min_ratio=o.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.scaler = self.placement.grad_scaler()
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.checkpoint.keep)

    def _read_checkpoint(self) -> tuple[Path, dict] | None:
        """The newest intact checkpoint of the run dir, checked against this config's model (before
        anything is joined or written: a checkpoint that cannot be used changes nothing)."""
        # Rank 0 picks the checkpoint (and sets damaged ones aside); the worker's other processes load that file.
        choice = None
        if self.ranks.leader:
            try:
                found = CheckpointManager(self.run_dir).load_intact()
                choice = {"path": str(found[0]) if found is not None else None}
            except CheckpointError as e:
                choice = {"error": f"{e}; nothing was changed"}
        choice = self.ranks.from_leader(choice)
        if "error" in choice:
            raise TrainError(choice["error"])
        if not self.ranks.leader:
            found = None
            if choice["path"] is not None:
                path = Path(choice["path"])
                found = (path, torch.load(path, map_location="cpu", weights_only=True))
        if found is not None:
            try:
                check_model_fits(found[1], self.model, self.cfg, found[0])
            except CheckpointMismatch as e:
                raise TrainError(str(e)) from None
        return found

    def _restore(self) -> int | None:
        """Loads the checkpoint read by ``_read_checkpoint``; returns its inner step, or None."""
        if self._checkpoint is None:
            log.info("no checkpoint in %s; starting fresh", self.checkpoints.dir)
            return None
        path, ckpt = self._checkpoint
        self._checkpoint = None
        try:
            load_checkpoint(ckpt, model=self.model, opt=self.opt, scheduler=self.scheduler, stream=self.stream,
                            scaler=self.scaler, path=path)
        except CheckpointMismatch as e:
            raise TrainError(str(e)) from None
        log.info("resumed from %s (inner step %d, outer step %d)", path, self.opt.inner_steps_total,
                 self.opt.outer_step)
        return self.opt.inner_steps_total

    def _join(self, resumed: bool) -> None:
        """Adopts θ_global and the step counters of a live peer, if there is one (docs/invariants.md, 9)."""
        swarm = self.cfg.swarm
        try:
            state = self.comm.download_state(timeout=swarm.join_timeout, max_bytes=self.opt.shareable_state_bound())
        except LocalRankFailure:
            raise
        except Interrupted:  # a stop was asked for: the loop ends at once, the checkpoint stays as it was
            log.warning("state download interrupted")
            return
        except Exception as e:  # the transport's own errors: policy decides
            if swarm.on_join_failure == "exit":
                raise TrainError(f"could not download state from the swarm: {e}") from e
            log.warning("could not download state from the swarm (%s); starting from our own state", e)
            return
        if state is None:
            return
        if resumed and int(state.get("outer_step", -1)) <= self.opt.outer_step:
            log.info("peers are at outer step %s, not ahead of our checkpoint; keeping it", state.get("outer_step"))
            return
        try:
            self.adopt_state(state)
        except ValueError as e:  # not the state the run confirmed, or not this model's: nothing was changed
            if swarm.on_join_failure == "exit":
                raise TrainError(f"refused the state downloaded from the swarm: {e}") from None
            log.warning("refused the state downloaded from the swarm (%s); starting from our own state", e)
            return
        log.info("joined the swarm at outer step %d (inner step %d)%s", self.opt.outer_step,
                 self.opt.inner_steps_total, ", inner optimizer warm-started" if self.opt.warm_started else "")

    def adopt_state(self, state: dict) -> None:
        """Joins at a peer's state (``DiLoCoOptimizer.shareable_state``): θ_global, the counters, the lr
        schedule's position and the data stream's; raises ``ValueError`` (nothing changed) for a state
        this worker refuses."""
        before = self.opt.inner_steps_total
        self.opt.load_shareable_state(state)
        set_schedule_position(self.scheduler, self.opt.schedule_step)
        ahead = self.opt.inner_steps_total - before
        if ahead > 0:
            self.stream.skip(ahead * self.cfg.train.batch_size * self.cfg.train.grad_accum)

    # -- pieces of the loop --------------------------------------------------------------------
    def autocast(self):
        """The context the forward pass runs in: autocast to the trainer's precision (nothing in fp32)."""
        return self.placement.autocast()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The mean loss on the held-out batches (None without any), computed by this process alone."""
        if not self.eval_set:
            return None
        self.model.eval()
        total = 0.0
        for batch in self.eval_set:
            # Rank 0 evaluates for the whole worker, in chunks no larger than what each process trains on.
            chunks = batch.split(self.rows) if self.ranks.multi else [batch]
            for chunk in chunks:
                chunk = chunk.to(self.device)
                with self.autocast():
                    total += float(self.eval_forward(input_ids=chunk, labels=chunk).loss) / len(chunks)
        self.model.train()
        return total / len(self.eval_set)

    def checkpoint_state(self) -> dict:
        """What resume needs, once (the format: ``checkpoint_format.py``)."""
        return make_checkpoint(model=self.model, opt=self.opt, scheduler=self.scheduler, stream=self.stream,
                               scaler=self.scaler, cfg=self.cfg)

    def save_checkpoint(self, background: bool = False) -> Path | None:
        """Writes a checkpoint; in the background, the loop waits only for a snapshot in host memory.
        Once per worker: rank 0 writes it, its other processes hold the same state."""
        if not self.ranks.leader:
            return None
        if background:
            began = time.perf_counter()
            previous = self.checkpoints.last_write
            self.checkpoints.save_in_background(self.checkpoint_state(), self.opt.inner_steps_total)
            self.metrics.write("checkpoint", inner_step=self.opt.inner_steps_total, outer_step=self.opt.outer_step,
                               blocked_s=time.perf_counter() - began, background=True,
                               previous_bytes=previous and previous["bytes"],
                               previous_write_s=previous and previous["write_s"])
            return None
        began = time.perf_counter()
        self.checkpoints.wait()
        path = self.checkpoints.save(self.checkpoint_state(), self.opt.inner_steps_total)
        self.metrics.write("checkpoint", inner_step=self.opt.inner_steps_total, outer_step=self.opt.outer_step,
                           blocked_s=time.perf_counter() - began, background=False, bytes=path.stat().st_size)
        return path

    def train_step(self) -> tuple[float, float | None]:
        """One inner step (with gradient accumulation; an outer step too when one is due); returns this
        process's loss and the gradient norm (None without clipping)."""
        cfg = self.cfg.train
        loss_sum = 0.0
        for i in range(cfg.grad_accum):
            batch = self.ranks.my_rows(self.stream.next_batch(cfg.batch_size)).to(self.device, non_blocking=True)
            # DDP averages the ranks' gradients once per inner step, at its last micro-batch.
            sync = self.ddp.no_sync() if self.ranks.multi and i < cfg.grad_accum - 1 else contextlib.nullcontext()
            with sync:
                with self.autocast():
                    loss = self.forward(input_ids=batch, labels=batch).loss / cfg.grad_accum
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += float(loss.detach())
        if cfg.throttle:
            time.sleep(cfg.throttle)
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        grad_norm = None
        if self.cfg.optim.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip))
        self.opt.count_samples(cfg.batch_size * cfg.grad_accum)
        before = self.opt.schedule_step
        if self.scaler is not None:
            self.scaler.step(self.opt)  # skips the step on inf/NaN gradients; then it does not count
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.opt.schedule_step != before:  # a step, an outer step, or state adopted from a peer
            set_schedule_position(self.scheduler, self.opt.schedule_step)
        return loss_sum, grad_norm

    # -- the loop -----------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> TrainResult:
        """Trains to ``train.total_steps`` (or ``stop_after`` more inner steps, or a signal)."""
        missing = missing_package(self.cfg.run.log_to)
        if missing:
            raise TrainError(missing)
        try:
            self.ranks.init(self.device)
        except (RuntimeError, ValueError) as e:
            raise TrainError(f"could not join the worker's other processes: {e}") from e
        try:
            with contextlib.ExitStack() as stack:
                # One run dir per worker: rank 0 holds its lock (and writes its config, checkpoints and
                # metrics); the other ranks touch the directory only once rank 0 has it.
                problem = None
                if self.ranks.leader:
                    try:
                        stack.enter_context(run_dir_lock(self.run_dir))
                    except TrainError as e:
                        problem = str(e)
                problem = self.ranks.from_leader(problem)
                if problem:
                    raise TrainError(problem)
                result = self._run_locked(stop_after)
            self.ranks.barrier()  # no process tears down its connections while another still uses them
            return result
        except RuntimeError as e:
            # Our hand-off, or DDP's own collective, failed: another process of this worker died
            # (torchrun ends the rest).
            lost = isinstance(e, LocalRankFailure) or (
                self.ranks.multi and not isinstance(e, TrainError) and _lost_a_process(e))
            if not lost:
                raise
            log.debug("collective failed", exc_info=True)
            raise TrainError(f"a process of this worker failed, so the worker leaves the swarm: "
                             f"{str(e).strip().splitlines()[0][:300]}") from e
        finally:
            self.ranks.close()

    def _run_locked(self, stop_after: int | None) -> TrainResult:
        if not self.resume and CheckpointManager(self.run_dir).latest() is not None:
            raise TrainError(f"{self.run_dir} already holds checkpoints: pass --resume to continue that run, "
                             "or choose another --run.name or --run.dir")
        if self.ranks.leader:
            CheckpointManager(self.run_dir).remove_stale_temp_files()
        self.build_model_and_data()  # before joining a swarm: a data problem fails fast
        self._checkpoint = self._read_checkpoint() if self.resume else None  # a bad one too
        exporter = self._start_exporter()  # before joining a swarm: a port in use is told at once
        try:
            if self.ranks.multi:  # a worker of several processes joins the swarm from its rank 0 only
                self.comm = LocalRanks(functools.partial(make_communicator, self.cfg, self.run_dir)
                                       if self.ranks.leader else None, timeout=self._hand_off_timeout())
            else:
                self.comm = make_communicator(self.cfg, self.run_dir)
        except BaseException:
            if exporter is not None:
                exporter.close()
            raise
        try:
            if self.ranks.leader:
                started = [exporter] if exporter is not None else []
                self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl",
                                             forward=make_sinks(self.cfg, self.run_dir, started))
            else:  # the other ranks keep their own records (their θ_global hash at each outer step), no sinks
                self.metrics = MetricsWriter(self.run_dir / f"metrics.rank{self.ranks.rank}.jsonl")
        except BaseException:
            self.comm.close()
            if exporter is not None:
                exporter.close()
            raise
        try:
            self.build_optimizer(self.comm)
            with StopRequest(on_stop=self.comm.interrupt) as stop, logging_redirect_tqdm():
                return self._loop(stop, stop_after)
        finally:
            try:
                if hasattr(self, "checkpoints"):
                    self.checkpoints.close()  # a write still in progress finishes first
            finally:
                self.metrics.close()
                self.comm.close()

    def _start_exporter(self) -> PrometheusSink | None:
        """The Prometheus exporter ``[run] metrics_port`` asks for (rank 0 only), or None."""
        run = self.cfg.run
        self.metrics_url = None
        if run.metrics_port is None or not self.ranks.leader:
            return None
        try:
            exporter = start_exporter(run.metrics_port, run.metrics_host)
        except OSError as e:
            raise TrainError(str(e)) from None
        self.metrics_url = exporter.url
        log.info("metrics for Prometheus at %s", exporter.url)
        return exporter

    def _hand_off_timeout(self) -> float:
        """How long the worker's other processes wait for rank 0: its longest wait on the swarm (joining,
        a round with its matchmaking, a catch-up download), with a margin."""
        sw = self.cfg.swarm
        longest = max(sw.join_timeout, sw.matchmaking_timeout + sw.max_wait + sw.allreduce_timeout + 60.0)
        return min(longest + 300.0, 24 * 3600.0)

    def _loop(self, stop: StopRequest, stop_after: int | None) -> TrainResult:
        cfg = self.cfg
        resumed = self.resume and self._restore() is not None
        self._join(resumed)
        if self.ranks.leader:
            atomic_write(self.run_dir / "config.toml", lambda f: f.write(to_toml(self.cfg).encode()))
        result = TrainResult(self.run_dir)
        self.metrics.write("start", worker=cfg.worker, peer_id=self.comm.peer_id, device=str(self.device),
                           precision=self.precision, parameters=count_parameters(self.model),
                           inner_step=self.opt.inner_steps_total, outer_step=self.opt.outer_step,
                           resumed=resumed, metrics_url=self.metrics_url, config=cfg.model_dump())
        log.info("worker %s on %s (%s): %.2fM parameters, run dir %s", cfg.worker, self.device, self.precision,
                 count_parameters(self.model) / 1e6, self.run_dir)

        bar = tqdm(total=cfg.train.total_steps, initial=self.opt.schedule_step, unit="step",
                   disable=not (cfg.run.progress and self.ranks.leader), dynamic_ncols=True, desc=cfg.worker)
        tally = _Tally(tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len,
                       global_hash=self.opt.global_hash())  # θ_global changes only at outer steps: hash it then
        stopping = stop.requested  # e.g. Ctrl-C during the join: no step at all
        if isinstance(self.comm, LocalRanks):
            _, stopping = self.comm.agree_step(0.0, stopping)
        while self.opt.schedule_step < cfg.train.total_steps and not stopping:
            if stop_after is not None and tally.steps >= stop_after:
                result.stopped = True
                break
            t0 = time.perf_counter()
            prev_sync = self.opt.last_sync
            loss, grad_norm = self.train_step()
            if self.on_step is not None:
                self.on_step(time.perf_counter() - t0)
            stopping = stop.requested
            if isinstance(self.comm, LocalRanks):  # the worker's loss; its ranks stop at the same step
                loss, stopping = self.comm.agree_step(loss, stopping)
            synced = self.opt.last_sync is not prev_sync
            tally.add(loss, time.perf_counter() - t0, sync_s=self.opt.blocked_s)
            result.losses.append(loss)
            evaluated = False if stopping else self._maybe_evaluate(synced, tally)  # a stop exits at once
            self._log_train(tally, grad_norm)
            if synced:
                self._outer_step_done(tally, evaluated)
            self._report_progress(tally, loss, synced)
            sync = self.opt.last_sync
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tally.tokens_per_s():,.0f}", outer=self.opt.outer_step,
                            peers=sync.group_size if sync else 0,
                            ar_s=f"{sync.allreduce_s:.2f}" if sync else "-", refresh=False)
            bar.update(self.opt.schedule_step - bar.n)
        bar.close()
        result.stopped = result.stopped or stopping
        if not result.stopped and self.opt.finish() is not None:  # a streamed round still in flight lands now
            self._outer_step_done(tally, evaluated=False)
        return self._end(result, tally)

    def _end(self, result: TrainResult, tally: _Tally) -> TrainResult:
        """After the last step: the last evaluation and checkpoint, the ``end`` record, the result."""
        loop_s = time.perf_counter() - tally.start
        if tally.steps:
            result.tokens_per_s = tally.tokens_per_s()
            if not result.stopped and tally.eval_step != self.opt.inner_steps_total:
                self._evaluate_and_log(tally)
            self.save_checkpoint()
        result.eval_loss = tally.eval_loss
        result.inner_steps = self.opt.inner_steps_total
        result.outer_steps = self.opt.outer_step
        self.metrics.write("end", inner_step=result.inner_steps, outer_step=result.outer_steps,
                           steps_taken=tally.steps, contributed_steps=self.opt.contributed_steps,
                           dropped_steps=self.opt.dropped_steps,
                           stopped=result.stopped, tokens_per_s=result.tokens_per_s, eval_loss=result.eval_loss,
                           loop_s=loop_s, compute_s=tally.compute_s, sync_s=tally.sync_s,
                           utilisation=tally.compute_s / loop_s if loop_s > 0 else None)
        log.info("%s after inner step %d (outer step %d): %.0f tokens/s, eval loss %s",
                 "stopped" if result.stopped else "done", result.inner_steps, result.outer_steps,
                 result.tokens_per_s, f"{result.eval_loss:.4f}" if result.eval_loss is not None else "n/a")
        return result

    def _evaluate_and_log(self, tally: _Tally) -> bool:
        if not self.ranks.leader:
            return False
        step = self.opt.inner_steps_total
        tally.eval_loss, tally.eval_step = self.evaluate(), step
        if tally.eval_loss is None:
            return False
        self.metrics.write("eval", inner_step=step, outer_step=self.opt.outer_step, eval_loss=tally.eval_loss,
                           perplexity=math.exp(min(tally.eval_loss, 50)))
        return True

    def _maybe_evaluate(self, synced: bool, tally: _Tally) -> bool:
        every, step = self.cfg.train.eval_every, self.opt.inner_steps_total
        # 0: after every whole-model sync (with streaming, every P-th outer step)
        whole = synced and self.opt.outer_step % self.opt.num_fragments == 0
        due = whole if every == 0 else step % every == 0 and tally.eval_step != step
        return self._evaluate_and_log(tally) if due else False

    def _log_train(self, tally: _Tally, grad_norm: float | None) -> None:
        step = self.opt.inner_steps_total
        if step % self.cfg.run.log_every == 0 and tally.log_losses:
            now = time.perf_counter()
            self.metrics.write("train", inner_step=step, outer_step=self.opt.outer_step,
                               loss=sum(tally.log_losses) / len(tally.log_losses), lr=self.opt.param_groups[0]["lr"],
                               tokens_per_s=tally.log_tokens / (now - tally.log_start), grad_norm=grad_norm)
            tally.log_losses, tally.log_start, tally.log_tokens = [], now, 0

    def _outer_step_done(self, tally: _Tally, evaluated: bool) -> None:
        report = self.opt.last_sync
        self.metrics.write("outer_step", outer_step=self.opt.outer_step, inner_step=self.opt.inner_steps_total,
                           loss=sum(tally.round_losses) / len(tally.round_losses),
                           eval_loss=tally.eval_loss if evaluated else None, ok=report.ok,
                           group_size=report.group_size, peers=list(report.peers), allreduce_s=report.allreduce_s,
                           sync_s=report.seconds, transfer_s=report.extra.get("transfer_s"),
                           matchmaking_s=report.extra.get("matchmaking_s"), bytes_sent=report.extra.get("bytes_sent"),
                           bytes_received=report.extra.get("bytes_received"), round_compute_s=tally.round_compute_s,
                           global_hash=report.global_hash, reason=report.reason, steps=report.steps,
                           contributed_steps=report.contributed_steps, dropped_steps=report.dropped_steps,
                           weight=report.weight, fragment=report.fragment,
                           clipped=report.extra.get("clipped"), capped=report.extra.get("capped"),
                           held=bool(report.extra.get("held")))
        tally.round_losses, tally.round_compute_s = [], 0.0
        tally.global_hash = report.global_hash or tally.global_hash
        # With streaming an outer step is one fragment's sync: count whole-model syncs.
        every = self.cfg.checkpoint.every_outer_steps * self.opt.num_fragments
        if report.ok and every and self.opt.outer_step % every == 0:
            self.save_checkpoint(background=self.cfg.checkpoint.background)

    def _report_progress(self, tally: _Tally, loss: float, synced: bool) -> None:
        """Tells the swarm how this worker is doing, at most about once a second."""
        now = time.monotonic()
        if now - tally.last_report < 1.0 and not synced:
            return
        tally.last_report = now
        self.comm.report_progress(
            outer_step=self.opt.outer_step, inner_step=self.opt.inner_steps_total,
            samples_per_s=tally.tokens_per_s() / self.cfg.data.seq_len, loss=loss, global_hash=tally.global_hash,
            name=self.cfg.worker)


@dataclass
class _Tally:
    """Running numbers of one ``Trainer.run``: throughput, losses to average, what was last evaluated."""

    tokens_per_step: int
    global_hash: str
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)
    step_s: float = 0.0
    """Moving average of the seconds one inner step takes (outer steps left out)."""
    compute_s: float = 0.0
    """Seconds spent in inner steps (forward, backward, inner optimizer), outer steps left out."""
    sync_s: float = 0.0
    """Seconds spent in outer steps (averaging with peers, waiting for them, applying)."""
    round_compute_s: float = 0.0
    round_losses: list[float] = field(default_factory=list)
    log_losses: list[float] = field(default_factory=list)
    log_start: float = field(default_factory=time.perf_counter)
    log_tokens: int = 0
    last_report: float = float("-inf")
    eval_loss: float | None = None
    eval_step: int | None = None

    def add(self, loss: float, seconds: float, sync_s: float = 0.0) -> None:
        """One inner step that took ``seconds`` in all, ``sync_s`` of them in an outer step."""
        compute = max(0.0, seconds - sync_s)
        self.steps += 1
        self.round_losses.append(loss)
        self.log_losses.append(loss)
        self.log_tokens += self.tokens_per_step
        self.compute_s += compute
        self.round_compute_s += compute
        self.sync_s += sync_s
        self.step_s = compute if self.steps == 1 else 0.9 * self.step_s + 0.1 * compute

    def tokens_per_s(self) -> float:
        return self.tokens_per_step * self.steps / max(1e-9, time.perf_counter() - self.start)


def train(cfg: Config, *, resume: bool = False, stop_after: int | None = None) -> TrainResult:
    return Trainer(cfg, resume=resume).run(stop_after=stop_after)

