"""DiLoCoOptimizer inside Hugging Face ``Trainer`` against the Trainer's own AdamW, per inner step
(target: at most 1.02x).

Both arms train the same small Llama (``LlamaForCausalLM``, random init from one seed) on the same
batches, with the same ``TrainingArguments`` (the Trainer's default optimizer, ``adamw_torch_fused``
here, with its lr schedule and gradient clipping). One passes nothing more; the other adds
``DiLoCoCallback(local_steps=H)`` (``opendiloco.integrations.hf``), a worker alone (no swarm), so its
outer steps (every H inner steps: pseudo-gradient, outer SGD-Nesterov, copy back) are in the timing.
A step is timed from the Trainer's ``on_step_begin`` to its ``on_step_end`` (forward, backward,
clipping, optimizer step, scheduler, zero_grad). The arms alternate in chunks of ``--steps`` steps
(A B A B ...; a fresh Trainer each chunk, its first ``--warmup`` steps left out), so that drift of the
machine falls on both. Prints each arm's mean and median step and the ratios against the plain
Trainer measured in the same run, in wall-clock time and in the CPU time of the process (which the
other load of a shared machine inflates far less), and the part of DiLoCo's steps spent in
``DiLoCoOptimizer.step`` beyond its inner optimizer's step (measured inside those same steps, so the
machine's load cannot fall on one arm only): the step with it against the step without it.

    .venv/bin/python scripts/bench_hf_trainer.py [--rounds 3 --steps 105 --local-steps 50]
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import tempfile
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from opendiloco.integrations.hf import DiLoCoCallback


class StepTimer(TrainerCallback):
    """Each step's wall-clock seconds and the CPU seconds the process spent in it (all its threads)."""

    def __init__(self):
        self.seconds: list[tuple[float, float]] = []
        self._began = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append((time.perf_counter() - self._began[0], time.process_time() - self._began[1]))


class Wrapped:
    """Seconds (wall-clock, CPU) spent in ``DiLoCoOptimizer.step`` beyond its inner optimizer's step: what
    DiLoCo adds to each inner step, its outer steps included, measured inside the same steps."""

    def __init__(self, opt):
        self.extra: list[tuple[float, float]] = []
        self._inner = (0.0, 0.0)
        outer_step, inner_step = opt.step, opt.inner.step

        def inner(*a, **k):
            began = (time.perf_counter(), time.process_time())
            try:
                return inner_step(*a, **k)
            finally:
                self._inner = (time.perf_counter() - began[0], time.process_time() - began[1])

        def outer(*a, **k):
            began = (time.perf_counter(), time.process_time())
            try:
                return outer_step(*a, **k)
            finally:
                self.extra.append((time.perf_counter() - began[0] - self._inner[0],
                                   time.process_time() - began[1] - self._inner[1]))

        opt.inner.step, opt.step = inner, outer  # instance attributes: what the Trainer and DiLoCo call


def chunk(args, data, diloco: bool, extra: list) -> list[tuple[float, float]]:
    """One Trainer of ``args.steps`` steps; the seconds of its steps after the warmup (and, for DiLoCo,
    what the wrapper added to each of them, into ``extra``)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                         intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                         max_position_embeddings=args.seq))
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(out, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=4e-4,
                                  weight_decay=0.1, save_strategy="no", report_to="none", use_cpu=True,
                                  disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0)
        timer = StepTimer()
        callbacks, optimizers = [timer], (None, None)
        if diloco:
            callback = DiLoCoCallback(None, local_steps=args.local_steps)
            callbacks.append(callback)
            optimizers = callback.optimizers(model, targs)
            wrapped = Wrapped(optimizers[0])
        Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks, optimizers=optimizers).train()
    if diloco:
        extra += wrapped.extra[args.warmup:]
    return timer.seconds[args.warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="chunks per arm, alternating")
    p.add_argument("--steps", type=int, default=105, help="Trainer steps per chunk")
    p.add_argument("--warmup", type=int, default=5, help="steps of each chunk left out")
    p.add_argument("--local-steps", type=int, default=50, help="DiLoCo's H")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("opendiloco").setLevel(logging.WARNING)
    rows = torch.randint(args.vocab, (args.batch * args.steps, args.seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "diloco": []}
    extra: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        for arm in times:
            times[arm] += chunk(args, data, arm == "diloco", extra)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
          f"{args.threads} thread(s); {args.rounds} chunks of {args.steps} steps per arm ({args.warmup} left out "
          f"of each), H={args.local_steps}")
    for i, clock in enumerate(("wall-clock", "CPU")):
        mean = {arm: statistics.fmean(t[i] for t in ts) for arm, ts in times.items()}
        median = {arm: statistics.median(t[i] for t in ts) for arm, ts in times.items()}
        for arm in times:
            print(f"{clock:>10} {arm:>6}: mean {mean[arm] * 1e3:7.1f} ms, median {median[arm] * 1e3:7.1f} ms per step "
                  f"({len(times[arm])} steps)")
        print(f"{clock:>10} DiLoCo / plain AdamW per inner step: {mean['diloco'] / mean['plain']:.4f}x (means, "
              f"outer steps included), {median['diloco'] / median['plain']:.4f}x (medians)")
        added = statistics.fmean(e[i] for e in extra)
        print(f"{clock:>10} DiLoCo's own part of its steps: {added * 1e3:.2f} ms per inner step (outer steps included) "
              f"of {mean['diloco'] * 1e3:.1f} ms: {mean['diloco'] / (mean['diloco'] - added):.4f}x the step without it")


if __name__ == "__main__":
    main()
