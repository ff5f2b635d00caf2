"""θ_global and the outer optimizer, kept on CPU in fp32 (docs/invariants.md, 1, 3 and 5)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .fingerprint import fingerprint, new_hasher

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def tensors_hash(tensors: Sequence[torch.Tensor], length: int = 16) -> str:
    """A short hex digest of the exact bytes of ``tensors`` (equal iff bit-identical)."""
    return fingerprint(tensors, length)


def fragmented_hash(tensors: Sequence[torch.Tensor], fragments: Sequence[Sequence[int]],
                    digests: list[str | None] | None = None, length: int = 16) -> str:
    """θ_global's hash when it is kept in fragments: a digest of the fragments' full digests.

    ``digests`` caches one digest per fragment (None: stale); a streamed outer step changes one
    fragment, so only that one is hashed again. One fragment is the plain ``tensors_hash``.
    """
    if len(fragments) == 1:
        return tensors_hash(tensors, length)
    digests = digests if digests is not None else [None] * len(fragments)
    for f, ids in enumerate(fragments):
        if digests[f] is None:
            digests[f] = fingerprint([tensors[i] for i in ids], 64)
    h = new_hasher()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()[:length]


class OuterState:
    """The shared global weights, their outer optimizer, and the local tensors they track.

    ``params`` are the model's trainable floating parameters; ``buffers`` its floating buffers,
    which are averaged plainly (their average replaces the local value; no outer optimizer).
    """

    def __init__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                 outer_optimizer: OptimizerFactory):
        self.params = list(params)
        self.buffers = list(buffers)
        self.global_params = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in self.params
        ]
        self.optimizer = outer_optimizer(self.global_params)

    @property
    def num_params(self) -> int:
        return len(self.params)

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local, fp32 on CPU: a gradient that points *away* from θ_local."""
        return [g.detach() - p.detach().to("cpu", torch.float32) for g, p in zip(self.global_params, self.params)]

    def buffer_values(self) -> list[torch.Tensor]:
        return [b.detach().to("cpu", torch.float32, copy=True) for b in self.buffers]

    def select(self, indices: Sequence[int] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(local, global) parameters at ``indices`` (all of them for None)."""
        if indices is None:
            return self.params, self.global_params
        return [self.params[i] for i in indices], [self.global_params[i] for i in indices]

    @torch.no_grad()
    def pseudo_gradient_into(self, views: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        """Writes Δ = θ_global − θ_local into preallocated fp32 CPU ``views`` (one pass per tensor),
        for the parameters at ``indices`` (a fragment; all of them for None)."""
        params, global_params = self.select(indices)
        devices = set()
        for view, p in zip(views, params, strict=True):
            local = p.detach()
            if local.device.type == "cpu" and local.dtype == torch.float32:
                continue
            view.copy_(local.reshape(view.shape), non_blocking=True)  # to (pinned) host memory
            devices.add(local.device)
        for device in devices:  # the asynchronous copies must have landed before we read them
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elif device.type != "cpu" and hasattr(torch, device.type):
                getattr(torch, device.type).synchronize()
        for view, g, p in zip(views, global_params, params):
            local = p.detach()
            if local.device.type == "cpu" and local.dtype == torch.float32:
                torch.sub(g.detach(), local, out=view)
            else:
                torch.sub(g.detach(), view, out=view)

    @torch.no_grad()
    def buffer_values_into(self, views: Sequence[torch.Tensor]) -> None:
        for view, b in zip(views, self.buffers, strict=True):
            view.copy_(b.detach().reshape(view.shape))

    @torch.no_grad()
    def apply(self, averaged_deltas: Sequence[torch.Tensor], averaged_buffers: Sequence[torch.Tensor] | None,
              indices: Sequence[int] | None = None, mix: float = 0.0) -> None:
        """One outer optimizer step on θ_global (on the parameters at ``indices`` only, for a
        fragment), then θ_local := mix·θ_local + (1 − mix)·θ_global for those parameters.

        Parameters outside the fragment get no gradient, so the outer optimizer leaves them and
        their momentum alone. The averaged tensors are used as gradients in place (no copy); the
        caller must not reuse them until this returns.
        """
        _, global_params = self.select(indices)
        for g, delta in zip(global_params, averaged_deltas, strict=True):
            g.grad = delta.to(torch.float32).reshape(g.shape)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if averaged_buffers is not None:  # None: a fragment that does not carry the buffers
            for b, avg in zip(self.buffers, averaged_buffers, strict=True):
                b.copy_(avg.reshape(b.shape))
        self.reset_local(indices, mix)

    @torch.no_grad()
    def reset_local(self, indices: Sequence[int] | None = None, mix: float = 0.0) -> None:
        """Copies θ_global into the model's parameters (whatever their device and dtype); with
        ``mix`` > 0 keeps that share of the local weights (θ_local := mix·θ_local + (1 − mix)·θ_global)."""
        params, global_params = self.select(indices)
        for p, g in zip(params, global_params):
            if mix == 0.0:
                p.copy_(g)
            else:
                p.lerp_(g.to(p.device, p.dtype), 1.0 - mix)

    @torch.no_grad()
    def restart_local(self, pseudo_gradients: Sequence[torch.Tensor]) -> None:
        """θ_local := θ_global − Δ: local work measured against an older θ_global, moved onto this one."""
        for p, g, delta in zip(self.params, self.global_params, pseudo_gradients, strict=True):
            p.copy_(torch.sub(g, delta.reshape(g.shape)))

    def global_hash(self) -> str:
        return tensors_hash(self.global_params)

    def state_dict(self) -> dict:
        return {
            "global_params": [g.detach().clone() for g in self.global_params],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        validate_tensors(state["global_params"], self.global_params, "global_params")
        validate_optimizer_state(state["optimizer"], self.global_params)
        self.optimizer.load_state_dict(state["optimizer"])  # first: it may refuse, and nothing is changed yet
        for g, src in zip(self.global_params, state["global_params"]):
            g.copy_(src)


def averaged_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers ``module=`` averages: the floating, persistent ones (those in ``state_dict``, e.g.
    BatchNorm's running statistics), each once, in ``module.buffers()`` order. Integer buffers are
    counters, and non-persistent ones are constants a module computes for itself (a rotary
    embedding's ``inv_freq``): averaging those through a lossy wire would only round them, and a run
    restored from a checkpoint would then differ from one that never stopped."""
    seen, out = set(), []
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is None or name in owner._non_persistent_buffers_set or not buf.is_floating_point():
                continue
            if id(buf) not in seen:
                seen.add(id(buf))
                out.append(buf)
    return out


def validate_tensors(incoming: Sequence, expected: Sequence[torch.Tensor], what: str) -> None:
    """Refuses tensors whose count, shapes or dtypes differ from ``expected``, or that are not finite."""
    if not isinstance(incoming, (list, tuple)) or len(incoming) != len(expected):
        got = len(incoming) if isinstance(incoming, (list, tuple)) else type(incoming).__name__
        raise ValueError(f"{what}: expected {len(expected)} tensors, got {got}")
    for i, (t, ref) in enumerate(zip(incoming, expected)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}[{i}]: expected a tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise ValueError(f"{what}[{i}]: shape {tuple(t.shape)} != expected {tuple(ref.shape)}")
        if t.dtype != ref.dtype:
            raise ValueError(f"{what}[{i}]: dtype {t.dtype} != expected {ref.dtype}")
        if t.is_floating_point() and not _finite(t):
            raise ValueError(f"{what}[{i}]: contains NaN or Inf")


def _finite(t: torch.Tensor) -> bool:
    """``isfinite(t).all()``, in one pass without a mask: a NaN or ±inf reaches the min or the max."""
    if t.numel() == 0:
        return True
    if t.dtype in (torch.float16, torch.bfloat16) and t.device.type == "cpu":  # CPU aminmax of half types is slow
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all())


def validate_optimizer_state(state: dict, params: Sequence[torch.Tensor]) -> None:
    """Refuses outer-optimizer state (e.g. momentum from a peer) whose tensors don't fit ``params``."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise ValueError("outer optimizer state is malformed")
    for index, entry in state["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entry, dict):
            raise ValueError(f"outer optimizer state has an unexpected entry {index!r}")
        for name, value in entry.items():
            where = f"outer optimizer state[{index}].{name}"
            if name == "step":  # the one scalar entry torch's optimizers keep per parameter
                if not (isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)):
                    raise ValueError(f"{where}: expected a scalar")
            elif isinstance(value, torch.Tensor):
                validate_tensors([value], [params[index]], where)  # e.g. a momentum buffer: the parameter's shape
            elif value is not None:
                raise ValueError(f"{where}: unexpected {type(value).__name__}")
