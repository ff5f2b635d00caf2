"""Faults and observations injected into a real worker's rounds through ``SwarmCommunicator.hooks``.

``RoundRecorder`` is what the swarm tests' worker sets: it writes every attempt (its group and how it
ended) and, on request, each round's contribution and result to files the test reads, stalls inside
one round's all-reduce (the test kills or stops the worker there), and injects one protocol fault
into the first attempt of one round (``FaultyRunner``). Each is off until asked for.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import torch

from ..comm.runner import RoundRunner
from ..comm.wire import Code
from ..swarm.hooks import RoundHooks

FAULTS = ("lose-confirms", "freeze")
"""``lose-confirms``: the others' CONFIRMs never reach this worker (nor what follows them, until its own
CONFIRMs are out); ``freeze``: its streams go silent (nothing in or out) once its parts and its shard's
result are out."""


class FaultyStream:
    """A stream of a ``FaultyRunner``, which decides what it lets through."""

    def __init__(self, stream, runner: FaultyRunner):
        self.stream, self.runner, self.remote, self.parts = stream, runner, stream.remote, None

    async def send(self, code, meta=None, payload=b""):
        r = self.runner
        if r.frozen:
            return
        if code == Code.CONTRIBUTE:
            self.parts = meta["parts"]
        sent = {**r.sent, code: r.sent.get(code, 0) + (code != Code.PART or meta["i"] == self.parts - 1)}
        others = len(r.members) - 1
        # Frozen from the moment this last frame leaves: whatever the others send in answer to it must
        # not reach us, even if our receiving side runs before this coroutine resumes (a busy machine).
        freezes = r.fault == "freeze" and sent.get(Code.PART) == others and sent.get(Code.RESULT_END) == others
        r.freezing = r.freezing or freezes
        await self.stream.send(code, meta, payload)
        r.sent = sent
        if freezes:
            r.frozen = True
            r.fired()
        if r.sent.get(Code.CONFIRM) == others:
            r.confirmed.set()

    async def recv(self, **kw):
        while True:
            if self.runner.frozen or self.runner.freezing:
                await asyncio.Event().wait()  # until the round gives up on us
            frame = await self.stream.recv(**kw)
            if self.runner.frozen or self.runner.freezing:
                continue  # it arrived while this recv was already waiting: frozen means nothing gets in
            if not (self.runner.fault == "lose-confirms" and frame.code == Code.CONFIRM):
                return frame
            self.runner.fired()
            await self.runner.confirmed.wait()  # its own CONFIRMs go out before it sees the stream end

    async def refuse(self, reason):
        await self.stream.refuse(reason)

    def close(self):
        self.stream.close()


class FaultyRunner(RoundRunner):
    """The protocol as it is, over streams that carry one of ``FAULTS`` (the class's ``fault``)."""

    fault: str | None = None
    on_fired = None
    """Called (no arguments) the first time the fault takes effect in an attempt."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.frozen, self.freezing, self.sent, self.confirmed = False, False, {}, asyncio.Event()

    def fired(self) -> None:
        if self.on_fired is not None and not getattr(self, "_fired", False):
            self._fired = True
            type(self).on_fired()

    async def run(self, connect):
        async def faulty(peer):
            return FaultyStream(await connect(peer), self)

        return await super().run(faulty)

    async def serve(self, stream, opening):
        return await super().serve(FaultyStream(stream, self), opening)


def faulty_runner(fault: str, on_fired=None) -> type[FaultyRunner]:
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
    return type(f"Faulty[{fault}]", (FaultyRunner,), {"fault": fault, "on_fired": staticmethod(on_fired)})


class RoundRecorder(RoundHooks):
    """``attempts``: a file that gets one JSON line per attempt (outer step, members, ok, error type,
    time). ``dump_dir``: one ``{peer}-{outer_step}.pt`` per round with what was sent and received.
    ``stall``: (outer step, seconds) to sleep inside the all-reduce of the first round at or after that
    outer step that this worker takes part in (and of that round's retries), first writing a line
    "outer step, time" to ``marker`` (a worker that joined late may have skipped the step itself).
    ``fault``: (outer step, one of ``FAULTS``) for that round's attempts until it has taken effect
    once (an attempt that failed for another reason before the fault's moment is not the one asked for)."""

    def __init__(self, peer_id: str, *, attempts: str | None = None, dump_dir: str | None = None,
                 stall: tuple[int, float] | None = None, marker: str | None = None,
                 fault: tuple[int, str] | None = None):
        self.peer_id, self.attempts, self.dump_dir, self.stall, self.marker = peer_id, attempts, dump_dir, stall, marker
        self.fault = (fault[0], faulty_runner(fault[1], on_fired=self._fired)) if fault else None
        self._sent: dict = {}
        self._stalled_at: int | None = None

    def round_began(self, key, contribution):
        if self.dump_dir:
            self._sent[key] = contribution.clone()

    def _fired(self) -> None:
        self.fault = None

    def runner_for(self, group, default):
        if self.fault and self.fault[0] == group.key.outer_step:
            return self.fault[1]
        return default

    async def before_exchange(self, group):
        step = group.key.outer_step
        if self.stall and self._stalled_at is None and step >= self.stall[0]:
            self._stalled_at = step
        if self.stall and step == self._stalled_at:
            with open(self.marker, "a") as f:  # tells the test we are inside the all-reduce
                f.write(f"{group.key.outer_step} {time.time()}\n")
            await asyncio.sleep(self.stall[1])

    def attempt_ended(self, group, error):
        if self.attempts:
            with open(self.attempts, "a") as f:
                f.write(json.dumps({"outer_step": group.key.outer_step, "members": list(group.members),
                                    "ok": error is None, "error": type(error).__name__ if error else None,
                                    "time": time.time()}) + "\n")

    def round_ended(self, key, result, error):
        sent = self._sent.pop(key, None)
        if self.dump_dir and sent is not None:
            torch.save({"sent": [sent], "got": [result.flat.clone()], "peers": result.peers,
                        "error": [error.clone()] if error is not None else []},
                       os.path.join(self.dump_dir, f"{self.peer_id}-{key.outer_step}.pt"))
