"""The inner optimizer: AdamW, or Muon on the hidden weight matrices with AdamW on the rest.

Muon (momentum, then a Newton-Schulz orthogonalisation of the update) is meant for the 2-D weights
inside the network; embeddings, the output head, norms and biases keep AdamW, as torch documents
for ``torch.optim.Muon``. Which is which is read from the modules and shapes, not from names, so it
holds for any architecture: the embeddings are the ``nn.Embedding`` modules and
``get_input_embeddings()`` (a GPT-2's position table too), the head is ``get_output_embeddings()``
(with a tied head, the same tensor), every other 2-D weight is a hidden matrix (GPT-2's ``Conv1D``
weights included), and a 3-D weight is a stack of them (a mixture of experts' fused
``experts.gate_up_proj``: each expert's matrix is orthogonalised on its own). Its update is scaled
to AdamW's RMS (0.2·sqrt(max(rows, cols)), torch's ``adjust_lr_fn="match_rms_adamw"``), so both
halves share one learning rate and one schedule.

``Muon`` here is torch's algorithm with one change: the orthogonalisation runs in bf16 on CUDA, as
torch's does, but in fp32 on CPU, where bf16 matrix products are emulated (measured 60x slower on a
0.2M model's matrices: 430 ms against 7 ms per step). ``MuonWithAdamW`` is one optimizer over both
halves: one ``param_groups`` list (a scheduler drives both), one ``state`` (the halves' parameters
are disjoint), one ``state_dict``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import torch

INNER_KINDS = ("adamw", "muon")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""The quintic Newton-Schulz iteration's coefficients (torch's and Keller Jordan's defaults)."""


def orthogonalize(update: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately U·Vᵀ of ``update`` = U·S·Vᵀ, by ``steps`` Newton-Schulz iterations in ``dtype``
    (default: bf16 on CUDA, fp32 elsewhere)."""
    a, b, c = coefficients
    dtype = dtype or (torch.bfloat16 if update.device.type == "cuda" else torch.float32)
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _evaluate(closure):
    """The loss of an optimizer's ``step(closure)``: the closure run with gradients on, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Optimizer):
    """Muon on 2-D parameters (and 3-D ones: a stack of matrices, each orthogonalised on its own):
    Nesterov momentum, orthogonalised, RMS-matched to AdamW, decoupled weight decay. State per
    parameter: ``momentum_buffer``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7,
                 ortho_dtype: torch.dtype | None = None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps, eps=eps))
        self.ortho_dtype = ortho_dtype
        for group in self.param_groups:
            if any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon trains matrices (2-D parameters) and stacks of them (3-D) only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = functools.partial(orthogonalize, steps=group["ns_steps"], eps=group["eps"],
                                          dtype=self.ortho_dtype)
                update = ortho(update) if p.ndim == 2 else torch.stack([ortho(m) for m in update])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2:])))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the parameters ``use_muon`` picks (2-D and 3-D only), AdamW for every other one."""

    def __init__(self, params: Iterable[torch.Tensor], *, use_muon: Callable[[torch.Tensor], bool],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ortho_dtype: torch.dtype | None = None):
        params = list(params)
        matrices = [p for p in params if p.ndim in (2, 3) and use_muon(p)]
        picked = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in picked]
        if not matrices:
            raise ValueError("Muon found no 2-D weight matrix to train among the parameters")
        self.muon = Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_steps=ns_steps, ortho_dtype=ortho_dtype)
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay) if rest else None
        groups = [*self.muon.param_groups, *(self.adamw.param_groups if self.adamw else [])]
        super().__init__([{"params": g["params"]} for g in groups], {})
        self._share(groups)

    def _share(self, groups: list[dict]) -> None:
        """One list of groups and one state for this optimizer and both halves (the dicts themselves,
        so a scheduler's lr reaches the half that steps with it)."""
        self.param_groups = groups
        n = len(self.muon.param_groups)
        self.muon.param_groups = groups[:n]
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = groups[n:]
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # torch rebuilds the groups: share the new ones again
        self._share(self.param_groups)


def inner_optimizer(kind: str, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float, muon_momentum: float = 0.95, muon_ns_steps: int = 5):
    """A factory (params -> optimizer) for ``DiLoCoOptimizer``'s ``inner_optimizer``. Under ``"muon"``
    the hidden matrices of ``model`` get Muon; its embeddings and output head keep AdamW."""
    if kind == "adamw":
        return functools.partial(torch.optim.AdamW, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if kind != "muon":
        raise ValueError(f"inner optimizer {kind!r}: expected one of {', '.join(INNER_KINDS)}")
    vocabulary = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        table = getattr(model, getter, lambda: None)()
        if table is not None:
            vocabulary.add(id(table.weight))
    return functools.partial(MuonWithAdamW, use_muon=lambda p: id(p) not in vocabulary, lr=lr, betas=betas,
                             eps=eps, weight_decay=weight_decay, momentum=muon_momentum, ns_steps=muon_ns_steps)
