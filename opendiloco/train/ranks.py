"""The trainer's side of a worker that is a torchrun job: which rank this process is, its rows of the
worker's batch, and the DDP wrapper of the model. Which GPU a rank takes is decided with the rest
of the device choice, in ``device.py``.

``train.batch_size`` is the worker's batch, whatever its number of processes: each of N ranks
takes rows ``[r*B/N, (r+1)*B/N)`` of the same batch, and DDP averages their gradients, so a
worker computes the same inner step (to floating-point rounding) on 1, 2 or 8 processes. That is
also why a checkpoint loads on any number of ranks that divides the batch.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class RanksError(ValueError):
    """The torchrun environment does not describe a usable worker (printed as one line)."""


@dataclass
class WorkerRanks:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    _owns_group: bool = field(default=False, repr=False)

    @classmethod
    def from_env(cls, env=None) -> WorkerRanks:
        """Read from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); one process without them."""
        env = os.environ if env is None else env
        try:
            size = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
            local_size = int(env.get("LOCAL_WORLD_SIZE", str(size)))
        except ValueError as e:
            raise RanksError(f"torchrun's environment is not numeric: {e}") from None
        if size < 1 or not 0 <= rank < size or not 0 <= local_rank < local_size:
            raise RanksError(f"invalid ranks: RANK={rank} WORLD_SIZE={size} LOCAL_RANK={local_rank} "
                             f"LOCAL_WORLD_SIZE={local_size}")
        return cls(rank, size, local_rank, local_size)

    @property
    def multi(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the process that joins the swarm, logs and writes checkpoints for the worker."""
        return self.rank == 0

    def rows(self, batch_size: int) -> int:
        if batch_size % self.size:
            raise RanksError(f"train.batch_size {batch_size} is the worker's batch; it must divide evenly "
                             f"over its {self.size} processes")
        return batch_size // self.size

    def init(self, device: torch.device, timeout: float = 1800.0) -> None:
        """Joins the worker's process group: NCCL between GPUs, gloo on CPU."""
        if not self.multi or dist.is_initialized():
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
        self._owns_group = True

    def from_leader(self, value):
        """Rank 0's ``value`` (any picklable object) on every rank; the value itself in one process."""
        if not self.multi:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def my_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the worker's batch."""
        n = batch.shape[0] // self.size
        return batch[self.rank * n:(self.rank + 1) * n]

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """DDP over the worker's ranks (the model itself when there is one). Buffers are not broadcast
        at every forward: the trainer's models hold constant buffers (RoPE tables), and outer steps
        change them identically on every rank. A model with running statistics (BatchNorm) would
        need them broadcast."""
        if not self.multi:
            return model
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # Newer torch renames the option (older releases, e.g. 2.11, only know the first name).
        names = inspect.signature(DistributedDataParallel.__init__).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)

    def barrier(self) -> None:
        if self.multi and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Leaves the process group, if ``init`` created it (a library user's own group stays)."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
