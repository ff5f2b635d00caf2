"""Inner-step overhead of DiLoCoOptimizer against plain AdamW (target: <= 1.02x).

Two identical small Llama models (transformers ``LlamaForCausalLM``, random init) train on the
same batch, one with ``torch.optim.AdamW`` and one with ``DiLoCoOptimizer`` wrapping an AdamW
with identical hyperparameters. ``local_steps`` is huge, so no outer step happens in the timed
window: this measures only what the wrapper adds to every inner step. The two alternate step
by step (A B B A A B ...) after a warmup, so that drift of the machine cancels out. It also
times the wrapper alone (``DiLoCoOptimizer.step`` against its inner ``step`` on a 1-element
parameter), which is the overhead in absolute terms and does not depend on the model.

    .venv/bin/python scripts/bench_inner_overhead.py [--device cuda --precision bf16]

On CUDA both models run with deterministic algorithms (so that the bit-identity check means
what it says) and the same autocast; times are taken after a device synchronisation.
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import statistics
import time

import torch


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def wrapper_cost_us(diloco_cls, calls: int = 20000, repeats: int = 5) -> float:
    """Median extra time of ``DiLoCoOptimizer.step`` over calling its inner optimizer directly."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    opt = diloco_cls([p], local_steps=10**9, inner_optimizer=torch.optim.AdamW)

    def per_call(f) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            f()
        return (time.perf_counter() - start) / calls

    diffs = [(per_call(opt.step) - per_call(opt.inner.step)) * 1e6 for _ in range(repeats)]
    return statistics.median(diffs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per optimizer first")
    p.add_argument("--rounds", type=int, default=100, help="alternating rounds; each times a block of each")
    p.add_argument("--block", type=int, default=1, help="timed steps per optimizer per round")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="autocast dtype of both models")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    if args.threads:
        torch.set_num_threads(args.threads)

    from opendiloco import DiLoCoOptimizer

    hp = dict(lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
    model_a = build(args).to(device)
    model_b = copy.deepcopy(model_a)
    plain = torch.optim.AdamW(model_a.parameters(), **hp)
    diloco = DiLoCoOptimizer(model_b.parameters(), local_steps=10**9,
                             inner_optimizer=functools.partial(torch.optim.AdamW, **hp))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    runs = {"adamw": (model_a, plain), "diloco": (model_b, diloco)}

    def step(name: str) -> tuple[float, float]:
        model, opt = runs[name]
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    for _ in range(args.warmup):
        step("adamw")
        step("diloco")
    full = {"adamw": [], "diloco": []}
    only_step = {"adamw": [], "diloco": []}
    paired = []
    for r in range(args.rounds):
        order = ("adamw", "diloco") if r % 2 == 0 else ("diloco", "adamw")
        block = {}
        for name in order:
            times = [step(name) for _ in range(args.block)]
            full[name] += [t for t, _ in times]
            only_step[name] += [s for _, s in times]
            block[name] = statistics.median(t for t, _ in times)
        paired.append(block["diloco"] / block["adamw"])

    # Same math: DiLoCo's inner optimizer is AdamW with the same hyperparameters, no outer step happened.
    assert diloco.outer_step == 0 and diloco.local_step == args.warmup + args.rounds * args.block
    same = all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))

    wrapper_us = wrapper_cost_us(DiLoCoOptimizer)
    med = {k: statistics.median(v) for k, v in full.items()}
    med_step = {k: statistics.median(v) for k, v in only_step.items()}
    n_params = sum(p.numel() for p in model_a.parameters())
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), "
          f"precision {args.precision}")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"model: Llama {args.layers}x{args.hidden}, {n_params / 1e6:.1f}M params, batch {args.batch}x{args.seq}; "
          f"{args.rounds} rounds x {args.block} steps each, after {args.warmup} warmup")
    for name, label in (("adamw", "plain AdamW    "), ("diloco", "DiLoCoOptimizer")):
        print(f"{label}  median step {med[name] * 1e3:8.2f} ms   (optimizer.step() {med_step[name] * 1e3:.3f} ms)")
    step_diff_us = (med_step["diloco"] - med_step["adamw"]) * 1e6
    print(f"ratio of medians {med['diloco'] / med['adamw']:.4f}x   median of paired block ratios "
          f"{statistics.median(paired):.4f}x   step() difference {step_diff_us:+.0f} us")
    print(f"wrapper alone: DiLoCoOptimizer.step() costs {wrapper_us:+.1f} us over its inner AdamW.step() "
          f"({wrapper_us * 1e-6 / med['adamw'] * 100:.3f}% of a plain step here)")
    print(f"weights bit-identical after the run: {same}")


if __name__ == "__main__":
    main()
