"""Where a worker's process computes and in what precision: the one place that decides.

- ``train.device``: ``auto`` is CUDA when a GPU is visible, else the CPU. In a worker of several
  processes (torchrun) each local rank takes its own GPU: ``cuda`` becomes ``cuda:LOCAL_RANK``.
- ``train.precision``: ``auto`` is bf16 where the GPU supports it, else fp16. bf16 and fp16 need
  CUDA; elsewhere the worker trains in fp32 and says so. Both run the forward pass under autocast,
  and fp16 also scales the loss (``GradScaler``); fp32 runs plain.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from .ranks import RanksError, WorkerRanks

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The precisions that run the forward pass under autocast, and to which dtype."""


@dataclass(frozen=True)
class Placement:
    """This process's device and the precision it trains in (``fp32``, ``bf16`` or ``fp16``, never ``auto``)."""

    device: torch.device
    precision: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES.get(self.precision)

    def autocast(self):
        """The context a forward pass runs in: autocast to bf16 or fp16, nothing at all in fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh loss scaler in fp16 (whose range is small), None otherwise."""
        return torch.amp.GradScaler("cuda") if self.precision == "fp16" else None


def place(device: str, precision: str, ranks: WorkerRanks) -> Placement:
    """This process's placement for ``train.device`` and ``train.precision``; raises ``RanksError`` when
    the device would put every process of the worker on one GPU."""
    chosen = process_device(resolve_device(device), ranks)
    return Placement(chosen, resolve_precision(precision, chosen))


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a device: ``auto`` is CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def process_device(device: torch.device, ranks: WorkerRanks) -> torch.device:
    """Each local rank of a worker of several processes on its own GPU (``cuda`` becomes
    ``cuda:LOCAL_RANK``, made the current device); ``device`` itself otherwise."""
    if device.type == "cuda" and ranks.multi:
        if device.index is not None:
            raise RanksError(f"train.device {device} would put every process of the worker on one GPU; "
                             "use 'cuda' (each process takes cuda:LOCAL_RANK) and CUDA_VISIBLE_DEVICES")
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` on ``device``: ``fp32`` off CUDA (with a warning if something else was asked
    for), ``auto`` is bf16 where the GPU supports it, else fp16."""
    if device.type != "cuda":
        if precision not in ("auto", "fp32"):
            log.warning("train.precision=%s needs CUDA; training in fp32 on %s", precision, device)
        return "fp32"
    if precision == "auto":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return precision
