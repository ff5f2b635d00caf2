"""Checkpoint size and the time the training loop waits for it: the old synchronous full write against
the background write of the lean state, in one run.

The trainer is built from ``configs/150m.toml`` (short sequences and batch 1, so that an inner
step fits a CPU) and trained to its first outer step. Then, on the same state:

- before: the whole state (θ_global stored next to identical weights) written synchronously, as
  the loop used to; the loop is blocked for the whole write.
- after: ``Trainer.checkpoint_state`` (θ_global only where it differs from the weights) written
  by ``CheckpointManager.save_in_background``; the loop is blocked for the host snapshot.

Each is repeated ``--repeats`` times (median). The figures are bytes per parameter and
seconds blocked, with ratios after/before.

    .venv/bin/python scripts/bench_checkpoint.py [--config configs/150m.toml] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "150m.toml"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    args = p.parse_args(argv)

    import torch

    from opendiloco.comm.local import SingleWorker
    from opendiloco.train.checkpoint import CheckpointManager
    from opendiloco.train.config import load_config
    from opendiloco.train.metrics import MetricsWriter
    from opendiloco.train.trainer import Trainer

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cfg = load_config(args.config, ["--run.dir", str(Path(tmp) / "run"), "--data.seq-len", "64",
                                        "--train.batch-size", "1", "--train.grad-accum", "1",
                                        "--optim.local-steps", "1", "--optim.warmup-steps", "1",
                                        "--train.device", args.device, "--train.eval-batches", "0"])
        trainer = Trainer(cfg)
        trainer.build(SingleWorker(compression=cfg.swarm.compression))
        trainer.metrics = MetricsWriter(Path(tmp) / "metrics.jsonl")
        trainer.train_step()  # one inner step and the outer step after it
        assert trainer.opt.outer_step == 1
        params = sum(p.numel() for p in trainer.model.parameters())

        before_dir, after_dir = Path(tmp) / "before", Path(tmp) / "after"
        old, new = CheckpointManager(before_dir, keep=1), CheckpointManager(after_dir, keep=1)
        blocked = {"before": [], "after": []}
        written = []
        for i in range(args.repeats):
            t = time.perf_counter()
            full = trainer.checkpoint_state()
            full["optimizer"] = trainer.opt.state_dict()  # θ_global in full, as before
            path = old.save(full, i)
            blocked["before"].append(time.perf_counter() - t)
            before_bytes = path.stat().st_size
            del full

            t = time.perf_counter()
            new.save_in_background(trainer.checkpoint_state(), i)
            blocked["after"].append(time.perf_counter() - t)
            new.wait()
            written.append(new.last_write["write_s"])
            after_bytes = new.last_write["bytes"]
        new.close()
        trainer.metrics.close()

    out = {
        "command": " ".join(["python scripts/bench_checkpoint.py", *(argv or sys.argv[1:])]),
        "device": args.device, "parameters": params, "threads": torch.get_num_threads(),
        "bytes_per_parameter_before": before_bytes / params, "bytes_per_parameter_after": after_bytes / params,
        "blocked_s_before": statistics.median(blocked["before"]),
        "blocked_s_after": statistics.median(blocked["after"]),
        "background_write_s": statistics.median(written),
    }
    out["size_ratio"] = out["bytes_per_parameter_after"] / out["bytes_per_parameter_before"]
    out["blocked_ratio"] = out["blocked_s_after"] / out["blocked_s_before"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
