"""The run's tally: an inner step's loss stays on the device until the loop reads it, once per log interval."""

import sys

import pytest
import torch

from opendiloco.train.metrics import Tally
from opendiloco.train.trainer import Trainer
from tests.test_train_loop import small_config


def tally_of(steps):
    tally = Tally(tokens_per_step=1, global_hash="h")
    for micro, norm in steps:
        tally.add_loss(torch.tensor(micro), None if norm is None else torch.tensor(norm))
    return tally


@pytest.mark.parametrize("steps, grad_norm", [
    ([], None),
    ([([0.5], 1.5)], 1.5),
    ([([0.1, 0.2, 0.3], 2.0), ([0.3, 0.2, 0.1], 3.0)], 3.0),  # float32 values, summed in float64 in step order
    ([([1.0], None), ([2.0], None)], None),
])
def test_a_read_sums_each_steps_micro_batches_in_order_as_float_did_one_by_one(steps, grad_norm):
    tally = tally_of(steps)
    one_by_one = []
    for micro, _ in steps:
        loss = 0.0
        for x in micro:
            loss += float(torch.tensor(x))
        one_by_one.append(loss)
    assert tally.read_losses() == one_by_one and len(one_by_one) == len(steps)
    assert tally.grad_norm == grad_norm
    assert tally.read_losses() == [] and tally.unread == []


def test_losses_read_count_for_the_run_its_round_and_its_log_interval():
    tally = tally_of([([1.0], None), ([3.0], None)])
    assert tally.last_loss is None
    tally.record_losses(tally.read_losses())
    assert tally.losses == tally.round_losses == tally.log_losses == [1.0, 3.0] and tally.last_loss == 3.0
    tally.add(0.5)
    tally.add(0.5)
    loss, tokens_per_s = tally.take_log_interval()
    assert loss == 2.0 and tokens_per_s > 0 and tally.log_losses == [] and tally.log_tokens == 0
    assert tally.losses == [1.0, 3.0]  # the run's and the round's stay


TRAINER_FILES = ("opendiloco/train/trainer.py", "opendiloco/train/metrics.py")


def count_host_reads(monkeypatch, counting) -> list:
    """Counts tensor values brought to the host (``float``, ``item``, ``tolist``...) by the trainer and its
    tally while ``counting()`` is true."""
    reads = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and "opendiloco" not in frame.f_code.co_filename:
                frame = frame.f_back
            if counting() and frame is not None and frame.f_code.co_filename.endswith(TRAINER_FILES):
                reads.append(f"{frame.f_code.co_name}: {name}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        counted(name)
    return reads


def test_the_loop_reads_the_loss_once_per_log_interval(tmp_path, monkeypatch):
    cfg = small_config(tmp_path, "--train.total-steps", "10", "--optim.local-steps", "100", "--run.log-every", "3",
                       "--train.grad-accum", "2", "--train.eval-every", "100")
    trainer, steps = Trainer(cfg), []
    trainer.on_step = steps.append
    reads = count_host_reads(monkeypatch, lambda: 3 <= len(steps) < 9)  # steps 4 to 9: two whole log intervals
    result = trainer.run()
    assert reads == ["read_losses: tolist"] * 2  # before: 2 losses and a gradient norm every step, 18 reads
    assert len(result.losses) == 10
