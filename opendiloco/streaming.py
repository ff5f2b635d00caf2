"""Streaming DiLoCo's schedule: which fragment of the model synchronises when, and when it lands.

The model's trainable parameters are cut into ``P`` fragments. Each fragment synchronises every
``H`` inner steps, and the fragments take turns: sync events come every ``H / P`` steps, event
``e`` carries fragment ``e mod P``, and the last fragment syncs at multiples of ``H``, where plain
DiLoCo syncs the whole model. So every event sends about ``1/P`` of the model, and the peak
bandwidth is divided by ``P`` (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication", arXiv 2501.18512).

A fragment's round starts at its event and runs in the background. Its result is applied
``overlap`` (τ) inner steps later, then merged into the local weights:
``θ_local ← mix·θ_local + (1 − mix)·θ_global`` (``mix`` = α; 0 takes the global). One round is in
flight at a time, so τ must be shorter than the gap between two events.

``P = 1, τ = 0`` is plain DiLoCo: one event every ``H`` steps, applied at once.
This module is arithmetic only; the optimizer keeps the counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import time: the config validates schedules before torch loads
    import torch


def event_start(event: int, local_steps: int, fragments: int) -> int:
    """The inner step (counted from the run's start) at which event ``event`` begins: ``⌊(e+1)·H/P⌋``."""
    return ((event + 1) * local_steps) // fragments


def event_gap(event: int, local_steps: int, fragments: int) -> int:
    """Inner steps from the previous event's start to this one's (the first counts from step 0)."""
    return event_start(event, local_steps, fragments) - event_start(event - 1, local_steps, fragments)


def fragment_of(event: int, fragments: int) -> int:
    return event % fragments


def min_gap(local_steps: int, fragments: int) -> int:
    return min(event_gap(e, local_steps, fragments) for e in range(fragments))


def check_schedule(local_steps: int, fragments: int, overlap: int, mix: float) -> None:
    """Refuses a schedule that cannot run: more fragments than steps, or an overlap that would put
    two rounds in flight at once."""
    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ValueError(f"fragments must be a positive integer, got {fragments!r}")
    if fragments > local_steps:
        raise ValueError(f"{fragments} fragments need at least as many local_steps, got {local_steps}")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 0:
        raise ValueError(f"overlap must be a non-negative integer, got {overlap!r}")
    gap = min_gap(local_steps, fragments)
    if overlap >= gap:
        raise ValueError(f"overlap {overlap} must be shorter than the gap between two fragment syncs "
                         f"({gap} inner steps with local_steps={local_steps} and {fragments} fragment(s))")
    if not isinstance(mix, (int, float)) or isinstance(mix, bool) or not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be a number in [0, 1], got {mix!r}")


def split_evenly(params: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
    """Indices of ``params`` in ``fragments`` contiguous runs of about equal size (in values).

    Contiguous, so that a fragment is a run of consecutive layers; equal in size, so that every
    sync event sends the same number of bytes.
    """
    if fragments > len(params):
        raise ValueError(f"cannot cut {len(params)} parameter tensor(s) into {fragments} fragments")
    return _split_sizes([p.numel() for p in params], fragments)


def _split_sizes(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``fragments`` contiguous runs of about equal total."""
    total = sum(sizes)
    out: list[list[int]] = [[]]
    done = 0
    for i, size in enumerate(sizes):
        after = fragments - len(out)  # fragments still to open after the current one
        left = len(sizes) - i  # items left, this one included
        crossed = done + size / 2 > total * len(out) / fragments
        if out[-1] and after > 0 and (crossed or left == after):
            out.append([])
        out[-1].append(i)
        done += size
    return out


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (a transformer's layers), found by shape, not by name: the
    ``ModuleList`` or ``Sequential`` of two or more children of one type that holds the most
    parameters (``model.layers`` of a Llama or a Qwen, ``transformer.h`` of a GPT-2). None: ``[]``."""
    import torch

    best, most = [], 0
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                n = sum(p.numel() for p in module.parameters())
                if n > most:
                    best, most = children, n
    return best


def block_fragments(model: torch.nn.Module, fragments: int) -> int | list[list[torch.Tensor]]:
    """``fragments`` cuts of ``model``'s trainable parameters that follow its blocks, for
    ``DiLoCoOptimizer(fragments=...)``: each fragment is a run of whole consecutive blocks, about
    equal in size; what lies before the first block (embeddings) goes with it, what lies after
    the last (final norm, head) with the last. ``fragments`` itself (cut by size) where the model
    has no repeated blocks, or fewer blocks than fragments; 1 stays 1 (no cut)."""
    if fragments == 1:
        return 1
    blocks = find_blocks(model)
    if len(blocks) < fragments:
        return fragments
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    owner = {id(p): b for b, block in enumerate(blocks) for p in block.parameters()}
    units: list[list[torch.Tensor]] = [[] for _ in blocks]
    last = 0
    for p in params:
        last = owner.get(id(p), last)
        units[last].append(p)
    cuts = _split_sizes([sum(p.numel() for p in unit) for unit in units], fragments)
    return [[p for u in cut for p in units[u]] for cut in cuts]


def fragments_from_groups(params: Sequence[torch.Tensor], groups: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    """Indices of ``params`` per explicit group (e.g. one group per transformer block).

    The groups must cover every trainable parameter exactly once.
    """
    position = {id(p): i for i, p in enumerate(params)}
    out, seen = [], set()
    for g, group in enumerate(groups):
        ids = []
        for t in group:
            i = position.get(id(t))
            if i is None:
                raise ValueError(f"fragment {g} holds a tensor that is not one of the optimizer's trainable parameters")
            if i in seen:
                raise ValueError(f"parameter {i} is in more than one fragment")
            seen.add(i)
            ids.append(i)
        if not ids:
            raise ValueError(f"fragment {g} is empty")
        out.append(sorted(ids))
    missing = sorted(set(range(len(params))) - seen)
    if missing:
        raise ValueError(f"parameters {missing[:8]} are in no fragment")
    return out


def cut_fragments(params: Sequence[torch.Tensor], fragments, local_steps: int, overlap: int,
                  mix: float) -> list[list[int]]:
    """The parameter index groups of ``fragments`` (a count, cut by ``split_evenly``, or explicit groups of
    parameters), their schedule checked (``check_schedule``)."""
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        check_schedule(local_steps, fragments, overlap, mix)
        return split_evenly(params, fragments) if fragments > 1 else [list(range(len(params)))]
    groups = fragments_from_groups(params, fragments)
    check_schedule(local_steps, len(groups), overlap, mix)
    return groups
