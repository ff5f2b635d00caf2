"""The reference training loop: a plain PyTorch loop that uses ``DiLoCoOptimizer`` like any user would."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from opendiloco import Communicator
from opendiloco.comm import LocalRanks

from .allocator import release_freed_tensors
from .checkpoint import CheckpointManager, atomic_write
from .checkpoint_format import make_checkpoint
from .config import Config, to_toml
from .data import make_streams
from .device import place
from .hf_model import ModelError
from .metrics import Tally, outer_step_fields
from .model import build_model, count_parameters
from .ranks import RanksError, WorkerRanks
from .seeding import seed_generators
from .sinks import missing_package
from .startup import (
    TrainError,
    check_fresh_start,
    check_membership,
    checkpoint_to_resume,
    diloco_optimizer,
    join_at_peers_state,
    join_worker_processes,
    open_metrics,
    resume_from,
    start_exporter,
    worker_communicator,
    worker_failure,
    worker_run_dir,
)
from .stop import StopRequest
from .tokenizer import make_tokenizer

log = logging.getLogger(__name__)


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
        """Called by ``run`` after every inner step with the seconds it took (benchmarks, probes). The loss
        stays on the device until a log interval ends: on a GPU a step's seconds are those it took to queue
        its work, and the step that ends an interval also waits for the device to finish the interval's."""

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
        self.opt = diloco_optimizer(cfg, self.model, comm)
        schedule = functools.partial(lr_lambda, warmup=o.warmup_steps, total=cfg.train.total_steps,
                                     min_ratio=o.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.scaler = self.placement.grad_scaler()
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.checkpoint.keep)

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
        micro_losses, grad_norm = self._inner_step()
        return sum(micro_losses.tolist()), None if grad_norm is None else float(grad_norm)

    def _inner_step(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``train_step`` without waiting for the device: the loss of each micro-batch (their sum is the
        step's) and the gradient norm, as tensors on the device."""
        cfg = self.cfg.train
        micro_losses = []
        for i in range(cfg.grad_accum):
            batch = self.ranks.my_rows(self.stream.next_batch(cfg.batch_size)).to(self.device, non_blocking=True)
            # DDP averages the ranks' gradients once per inner step, at its last micro-batch.
            sync = self.ddp.no_sync() if self.ranks.multi and i < cfg.grad_accum - 1 else contextlib.nullcontext()
            with sync:
                with self.autocast():
                    loss = self.forward(input_ids=batch, labels=batch).loss / cfg.grad_accum
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            micro_losses.append(loss.detach())
        if cfg.throttle:
            time.sleep(cfg.throttle)
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        grad_norm = None
        if self.cfg.optim.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip).detach()
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
        return torch.stack(micro_losses), grad_norm

    # -- the loop -----------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> TrainResult:
        """Trains to ``train.total_steps`` (or ``stop_after`` more inner steps, or a signal)."""
        missing = missing_package(self.cfg.run.log_to)
        if missing:
            raise TrainError(missing)
        join_worker_processes(self.ranks, self.device)
        try:
            with worker_run_dir(self.ranks, self.run_dir):
                result = self._run_locked(stop_after)
            self.ranks.barrier()  # no process tears down its connections while another still uses them
            return result
        except RuntimeError as e:
            failure = worker_failure(e, self.ranks)
            if failure is None:
                raise
            log.debug("collective failed", exc_info=True)
            raise failure from e
        finally:
            self.ranks.close()

    def _run_locked(self, stop_after: int | None) -> TrainResult:
        check_fresh_start(self.run_dir, resume=self.resume, leader=self.ranks.leader)
        self.build_model_and_data()  # before joining a swarm: a data problem fails fast
        self._checkpoint = checkpoint_to_resume(self.run_dir, self.ranks, self.model, self.cfg) if self.resume else None
        with contextlib.ExitStack() as stack:  # closed in reverse: checkpoints, metrics, communicator, exporter
            exporter = start_exporter(self.cfg, self.ranks)
            self.metrics_url = exporter.url if exporter is not None else None
            if exporter is not None:
                stack.callback(exporter.close)  # once the metrics hold it, their close closes it first
            self.comm = worker_communicator(self.cfg, self.run_dir, self.ranks)
            stack.callback(self.comm.close)
            self.metrics = open_metrics(self.cfg, self.ranks, exporter)
            stack.callback(self.metrics.close)
            self.build_optimizer(self.comm)
            stack.callback(self.checkpoints.close)  # a write still in progress finishes first
            with StopRequest(on_stop=self.comm.interrupt) as stop, logging_redirect_tqdm():
                return self._loop(stop, stop_after)

    def _loop(self, stop: StopRequest, stop_after: int | None) -> TrainResult:
        cfg = self.cfg
        resumed = self.resume and resume_from(self._checkpoint, self.checkpoints.dir, model=self.model, opt=self.opt,
                                              scheduler=self.scheduler, stream=self.stream, scaler=self.scaler)
        self._checkpoint = None
        join_at_peers_state(self.comm, self.opt, self.cfg.swarm, resumed=resumed, adopt=self.adopt_state)
        if self.ranks.leader:
            atomic_write(self.run_dir / "config.toml", lambda f: f.write(to_toml(self.cfg).encode()))
        self._start_record(resumed)
        result = TrainResult(self.run_dir)
        bar = tqdm(total=cfg.train.total_steps, initial=self.opt.schedule_step, unit="step",
                   disable=not (cfg.run.progress and self.ranks.leader), dynamic_ncols=True, desc=cfg.worker)
        tally = Tally(tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len,
                      global_hash=self.opt.global_hash())  # θ_global changes only at outer steps: hash it then
        stopping = stop.requested  # e.g. Ctrl-C during the join: no step at all
        if isinstance(self.comm, LocalRanks):
            _, stopping = self.comm.agree_step(0.0, stopping)
        while self.opt.schedule_step < cfg.train.total_steps and not stopping:
            if stop_after is not None and tally.steps >= stop_after:
                result.stopped = True
                break
            stopping, synced = self._timed_step(tally, stop)
            evaluated = False if stopping else self._maybe_evaluate(synced, tally)  # a stop exits at once
            self._log_train(tally)
            if synced:
                self._outer_step_done(tally, evaluated)
            self._report_progress(tally, synced)
            sync, loss = self.opt.last_sync, tally.last_loss
            bar.set_postfix(loss="-" if loss is None else f"{loss:.3f}", tok_s=f"{tally.tokens_per_s():,.0f}",
                            outer=self.opt.outer_step, peers=sync.group_size if sync else 0,
                            ar_s=f"{sync.allreduce_s:.2f}" if sync else "-", refresh=False)
            bar.update(self.opt.schedule_step - bar.n)
        bar.close()
        tally.record_losses(tally.read_losses())
        result.stopped = result.stopped or stopping
        if not result.stopped and self.opt.finish() is not None:  # a streamed round still in flight lands now
            self._outer_step_done(tally, evaluated=False)
        return self._end(result, tally)

    def _timed_step(self, tally: Tally, stop: StopRequest) -> tuple[bool, bool]:
        """One inner step of ``run``, its loss left on the device but at the end of a log interval, at an
        outer step, or in a worker of several processes (whose ranks agree on the loss every step).
        Returns whether to stop and whether an outer step was applied."""
        t0 = time.perf_counter()
        prev_sync = self.opt.last_sync
        tally.add_loss(*self._inner_step())
        synced = self.opt.last_sync is not prev_sync
        ranks = self.comm if isinstance(self.comm, LocalRanks) else None
        read = ranks is not None or synced or self.opt.inner_steps_total % self.cfg.run.log_every == 0
        losses = tally.read_losses() if read else []  # the one wait for the device of a log interval
        if self.on_step is not None:
            self.on_step(time.perf_counter() - t0)
        stopping = stop.requested
        if ranks is not None:  # the worker's loss; its ranks stop at the same step
            losses[0], stopping = ranks.agree_step(losses[0], stopping)
        tally.record_losses(losses)
        tally.add(time.perf_counter() - t0, sync_s=self.opt.blocked_s)
        return stopping, synced

    def _start_record(self, resumed: bool) -> None:
        cfg = self.cfg
        self.metrics.write("start", worker=cfg.worker, peer_id=self.comm.peer_id, device=str(self.device),
                           precision=self.precision, parameters=count_parameters(self.model),
                           inner_step=self.opt.inner_steps_total, outer_step=self.opt.outer_step,
                           resumed=resumed, metrics_url=self.metrics_url, config=cfg.model_dump())
        log.info("worker %s on %s (%s): %.2fM parameters, run dir %s", cfg.worker, self.device, self.precision,
                 count_parameters(self.model) / 1e6, self.run_dir)

    def _end(self, result: TrainResult, tally: Tally) -> TrainResult:
        """After the last step: the last evaluation and checkpoint, the ``end`` record, the result."""
        loop_s = time.perf_counter() - tally.start
        if tally.steps:
            result.tokens_per_s = tally.tokens_per_s()
            if not result.stopped and tally.eval_step != self.opt.inner_steps_total:
                self._evaluate_and_log(tally)
            self.save_checkpoint()
        result.losses = tally.losses
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

    def _evaluate_and_log(self, tally: Tally) -> bool:
        if not self.ranks.leader:
            return False
        step = self.opt.inner_steps_total
        tally.eval_loss, tally.eval_step = self.evaluate(), step
        if tally.eval_loss is None:
            return False
        self.metrics.write("eval", inner_step=step, outer_step=self.opt.outer_step, eval_loss=tally.eval_loss,
                           perplexity=math.exp(min(tally.eval_loss, 50)))
        return True

    def _maybe_evaluate(self, synced: bool, tally: Tally) -> bool:
        every, step = self.cfg.train.eval_every, self.opt.inner_steps_total
        # 0: after every whole-model sync (with streaming, every P-th outer step)
        whole = synced and self.opt.outer_step % self.opt.num_fragments == 0
        due = whole if every == 0 else step % every == 0 and tally.eval_step != step
        return self._evaluate_and_log(tally) if due else False

    def _log_train(self, tally: Tally) -> None:
        step = self.opt.inner_steps_total
        if step % self.cfg.run.log_every == 0 and tally.log_losses:
            loss, tokens_per_s = tally.take_log_interval()
            self.metrics.write("train", inner_step=step, outer_step=self.opt.outer_step, loss=loss,
                               lr=self.opt.param_groups[0]["lr"], tokens_per_s=tokens_per_s, grad_norm=tally.grad_norm)

    def _outer_step_done(self, tally: Tally, evaluated: bool) -> None:
        report = self.opt.last_sync
        self.metrics.write("outer_step", outer_step=self.opt.outer_step, inner_step=self.opt.inner_steps_total,
                           **outer_step_fields(report, tally, eval_loss=tally.eval_loss if evaluated else None))
        tally.round_losses, tally.round_compute_s = [], 0.0
        tally.global_hash = report.global_hash or tally.global_hash
        # With streaming an outer step is one fragment's sync: count whole-model syncs.
        every = self.cfg.checkpoint.every_outer_steps * self.opt.num_fragments
        if report.ok and every and self.opt.outer_step % every == 0:
            self.save_checkpoint(background=self.cfg.checkpoint.background)

    def _report_progress(self, tally: Tally, synced: bool) -> None:
        """Tells the swarm how this worker is doing (its loss: the last one read), at most about once a second."""
        now = time.monotonic()
        if now - tally.last_report < 1.0 and not synced:
            return
        tally.last_report = now
        self.comm.report_progress(
            outer_step=self.opt.outer_step, inner_step=self.opt.inner_steps_total,
            samples_per_s=tally.tokens_per_s() / self.cfg.data.seq_len, loss=tally.last_loss,
            global_hash=tally.global_hash, name=self.cfg.worker)


def train(cfg: Config, *, resume: bool = False, stop_after: int | None = None) -> TrainResult:
    return Trainer(cfg, resume=resume).run(stop_after=stop_after)

