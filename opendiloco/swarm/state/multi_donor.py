"""A joiner's download from several donors at once: one manifest each, then parts from whoever has them.

1. Every donor is asked for its manifest at the same outer step (``layout.py``): its parts'
   digests and its skeleton, checked whole before anything is downloaded. The download starts once
   one manifest has passed and the others had a short grace (``MANIFEST_GRACE``: one stalled donor
   must not hold it for ``MANIFEST_TIMEOUT``); a manifest that comes later adds its donor to the
   download under way. The first donor in the caller's order (fast ones first) whose manifest
   passed by then is the *head*: the state is built on its skeleton and digests. Another donor
   serves a part only where its digest equals the head's, so every byte is the head's word, checked
   part by part as it arrives; a part that does not match names its sender, who is dropped.
2. Parts are handed out from one queue, at most ``PARTS_IN_FLIGHT_PER_DONOR`` per donor at a time:
   fast donors come back for more sooner and so serve more. A donor that fails a part (gone, stalled,
   refused) has it put back for the others (it takes it again only if nobody else can); after
   ``DONOR_FAILURES`` it is dropped. When the queue is
   empty, an idle donor also asks for a part that has been in flight elsewhere for longer than its
   own parts take (a slow or dying donor at the tail), and the first copy to arrive wins.
3. The whole state then goes through the same checks as a download from one donor
   (``transfer.checked_state``), and the caller checks θ_global against the run's hash, then
   tells the donors it has it (``tell_done``): they count it as coming from then on too.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...comm.wire import Code
from ...errors import ProtocolError
from ...timeouts import MANIFEST_GRACE, MANIFEST_TIMEOUT
from ...timeouts import STATE_STALL_TIMEOUT as STALL_TIMEOUT
from ..streams import P2PStreams
from . import layout
from .layout import Manifest, assemble, part_digest, read_manifest
from .transfer import CHUNK_BYTES, checked_state, connect_to, within

log = logging.getLogger(__name__)

MAX_DONORS = 4
"""Donors one download asks at once: enough to fill a joiner's link from peers of like links."""
PARTS_IN_FLIGHT_PER_DONOR = 2
DONOR_FAILURES = 2
MAX_MANIFEST_BYTES = 16 << 20


class PartMismatch(ProtocolError):
    """A donor sent bytes that do not match the digest the download builds on."""


class DonorAhead(ProtocolError):
    """A donor is past the asked outer step (the run moved on while the joiner read its records)."""

    def __init__(self, donor: str, outer_step: int):
        super().__init__(f"{donor[-8:]} is at outer step {outer_step}")
        self.outer_step = outer_step


class DonorsAhead(ProtocolError):
    """Every donor is past the asked outer step: ask again at ``outer_step`` once the run confirms it."""

    def __init__(self, outer_step: int):
        super().__init__(f"the donors moved on to outer step {outer_step}")
        self.outer_step = outer_step


def part_bytes_for(max_bytes: int) -> int:
    """What a joiner still asks for (a donor of an older version cuts so): ``layout.part_bytes_for``
    of its bound. A donor of this version chooses its own and says so in its manifest."""
    return layout.part_bytes_for(max_bytes)


async def fetch_manifest(streams: P2PStreams, donor: str, outer_step: int, part_bytes: int,
                         max_bytes: int) -> Manifest:
    stream = await connect_to(streams, donor)
    try:
        await stream.send(Code.STATE_MANIFEST_REQUEST, {"outer_step": outer_step, "part_bytes": part_bytes})
        frame = await asyncio.wait_for(stream.recv(max_payload=MAX_MANIFEST_BYTES, expect=Code.STATE_MANIFEST),
                                       MANIFEST_TIMEOUT)
    except asyncio.TimeoutError:
        raise ProtocolError(f"{donor[-8:]} sent no manifest within {MANIFEST_TIMEOUT:.0f}s") from None
    finally:
        stream.close()
    served = frame.meta.get("outer_step")
    if type(served) is int and served > outer_step:
        raise DonorAhead(donor, served)
    manifest = read_manifest(frame.meta, frame.payload, part_bytes=part_bytes, max_bytes=max_bytes)
    if manifest.outer_step != outer_step:
        raise ProtocolError(f"{donor[-8:]} sent a manifest of outer step {manifest.outer_step}, not {outer_step}")
    return manifest


async def fetch_part(streams: P2PStreams, donor: str, manifest: Manifest, index: int) -> bytearray:
    """Part ``index`` from ``donor``, checked against the manifest's digest."""
    size = manifest.part_size(index)
    stream = await connect_to(streams, donor)
    try:
        await stream.send(Code.STATE_PART_REQUEST, {
            "outer_step": manifest.outer_step, "part_bytes": manifest.part_bytes, "index": index,
            "digest": manifest.digests[index].hex()})
        data = bytearray()
        while len(data) < size:
            frame = await within(stream.recv(max_payload=min(CHUNK_BYTES, size - len(data)),
                                             expect=Code.STATE_PART), donor, STALL_TIMEOUT)
            if not frame.payload:
                raise ProtocolError("empty state part")
            data += frame.payload
    finally:
        stream.close()
    digest = await asyncio.get_running_loop().run_in_executor(None, part_digest, data)
    if digest != manifest.digests[index]:
        raise PartMismatch(f"{donor[-8:]} sent part {index} that does not match its digest")
    return data


class _Parts:
    """The parts still to fetch, who may serve each, and what each donor did."""

    def __init__(self, manifest: Manifest, sources: dict[str, set[int]]):
        self.manifest = manifest
        self.sources = sources
        self.todo = collections.deque(range(len(manifest.digests)))
        self.done: set[int] = set()
        self.running: dict[int, dict[str, tuple[asyncio.Task, float]]] = collections.defaultdict(dict)
        self.failures: collections.Counter[str] = collections.Counter()
        self.dropped: set[str] = set()
        self.errors: dict[str, str] = {}
        self.failed_by: dict[int, set[str]] = collections.defaultdict(set)
        self.served: collections.Counter[str] = collections.Counter()
        self.parts_served: collections.Counter[str] = collections.Counter()
        self.busy_s: collections.Counter[str] = collections.Counter()
        self.changed = asyncio.Event()
        self.flat = bytearray(manifest.size)

    def complete(self) -> bool:
        return len(self.done) == len(self.manifest.digests)

    def part_time(self, donor: str) -> float | None:
        """How long a part takes ``donor``, on average so far (None before its first)."""
        count = self.parts_served[donor]
        return self.busy_s[donor] / count if count else None

    def next_for(self, donor: str) -> int | None:
        """A queued part ``donor`` can serve, else a part it may race a slower donor for, else None."""
        mine = self.sources[donor]
        for index in self.todo:
            if index in mine and (donor not in self.failed_by[index] or not self._others_can(index, donor)):
                self.todo.remove(index)
                return index
        own = self.part_time(donor)
        if own is None:
            return None
        now, oldest = time.monotonic(), None
        for index, holders in self.running.items():
            if index in self.done or index not in mine or donor in holders or len(holders) >= 2:
                continue
            started = min(t for _, t in holders.values())
            if now - started > 2 * own and (oldest is None or started < oldest[1]):
                oldest = (index, started)
        return None if oldest is None else oldest[0]

    def _others_can(self, index: int, donor: str) -> bool:
        return any(index in parts and d != donor and d not in self.dropped for d, parts in self.sources.items())

    def put_back(self, index: int, donor: str) -> None:
        """``donor`` did not deliver part ``index``: it goes back first in line, unless another has it in flight."""
        if index not in self.done and set(self.running.get(index, {})) <= {donor}:
            self.todo.appendleft(index)

    def servable_by(self, donor: str) -> bool:
        return donor not in self.dropped and any(i in self.sources[donor] for i in range(len(self.manifest.digests))
                                                 if i not in self.done)


async def _serve_donor(streams: P2PStreams, donor: str, parts: _Parts) -> None:
    while not parts.complete() and parts.servable_by(donor):
        index = parts.next_for(donor)
        if index is None:
            parts.changed.clear()
            if not parts.running and not any(i in parts.sources[donor] for i in parts.todo):
                return  # what is left, others must serve; nothing of theirs can come back to this donor
            try:
                await asyncio.wait_for(parts.changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            continue
        started = time.monotonic()
        task = asyncio.ensure_future(fetch_part(streams, donor, parts.manifest, index))
        parts.running[index][donor] = (task, started)
        try:
            data = await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the download itself is cancelled
            parts.put_back(index, donor)  # another donor delivered it first (else: its fetch ended so)
            continue
        except Exception as e:
            parts.failures[donor] += 1
            parts.failed_by[index].add(donor)
            parts.errors[donor[-8:]] = str(e) or type(e).__name__
            if isinstance(e, PartMismatch) or parts.failures[donor] >= DONOR_FAILURES:
                parts.dropped.add(donor)
                log.warning("state download: dropped donor %s (%s)", donor[-8:], parts.errors[donor[-8:]])
            parts.put_back(index, donor)
            continue
        finally:
            parts.running[index].pop(donor, None)
            if not parts.running[index]:
                del parts.running[index]
            parts.changed.set()
        if index in parts.done:
            continue
        offset = index * parts.manifest.part_bytes
        parts.flat[offset : offset + len(data)] = data
        parts.done.add(index)
        parts.served[donor] += len(data)
        parts.parts_served[donor] += 1
        parts.busy_s[donor] += time.monotonic() - started
        for rival, _ in list(parts.running.get(index, {}).values()):
            rival.cancel()


@dataclass(frozen=True)
class Download:
    state: dict
    rates: dict[str, float]
    """Bytes per second of its own time each donor that served parts served them at."""
    donors: tuple[str, ...]
    """Every donor whose manifest the state was built with (they are told when it is taken: ``tell_done``)."""


async def tell_done(streams: P2PStreams, donors: tuple[str, ...], outer_step: int, timeout: float = 5.0) -> None:
    """Tells the donors this worker has taken their state of ``outer_step``: they count it as coming from
    now (a long download would outlast the window they count it from its request). Best effort."""
    async def tell(donor: str) -> None:
        stream = await connect_to(streams, donor)
        try:
            await stream.send(Code.STATE_DONE, {"outer_step": outer_step})
        finally:
            stream.close()

    # A donor that died since is no error here, and its failure is collected (an uncollected one was logged as
    # "Task exception was never retrieved" with a traceback: the CI scenario's killed donor).
    await asyncio.gather(*(asyncio.wait_for(tell(d), timeout) for d in donors), return_exceptions=True)


def _outcome(task: asyncio.Future) -> Manifest | BaseException:
    return asyncio.CancelledError() if task.cancelled() else task.exception() or task.result()


async def _first_manifests(asked: dict[asyncio.Future, str], t0: float) -> dict[str, Manifest | BaseException]:
    """The donors' answers until one manifest has passed and the rest had their grace (or all answered);
    ``asked`` keeps the requests still out."""
    answers: dict[str, Manifest | BaseException] = {}
    deadline = None
    while asked:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        finished, _ = await asyncio.wait(asked, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        if not finished:
            break
        for task in finished:
            answers[asked.pop(task)] = _outcome(task)
        if deadline is None and any(isinstance(a, Manifest) for a in answers.values()):
            deadline = time.monotonic() + max(MANIFEST_GRACE, time.monotonic() - t0)
    return answers


async def fetch_from_donors(streams: P2PStreams, donors: list[str], outer_step: int, max_bytes: int,
                            check: Callable[[dict, int | None], None] | None = None,
                            min_outer_step: int | None = None) -> Download:
    """The state of ``outer_step`` taken in parts from ``donors`` (fastest first), checked as
    ``fetch_state`` checks a whole one; also each donor's rate in bytes per second of its own time
    (for the caller to order donors by next time) and the donors it was built with. ``DonorsAhead``
    when every donor is past that step; ``ProtocolError`` when the donors cannot deliver every part
    (the message names what each did wrong)."""
    part_bytes = part_bytes_for(max_bytes)
    t0 = time.monotonic()
    asked = {asyncio.ensure_future(fetch_manifest(streams, d, outer_step, part_bytes, max_bytes)): d for d in donors}
    workers: set[asyncio.Future] = set()
    parts = None
    try:
        answers = await _first_manifests(asked, t0)
        errors = {d[-8:]: str(a) or type(a).__name__ for d, a in answers.items() if isinstance(a, BaseException)}
        answered = [(d, answers[d]) for d in donors if isinstance(answers.get(d), Manifest)]
        if not answered:
            if answers and all(isinstance(a, DonorAhead) for a in answers.values()):
                raise DonorsAhead(min(a.outer_step for a in answers.values()))
            raise ProtocolError(f"no donor sent a manifest of outer step {outer_step}: {errors}")
        head, manifest = answered[0]  # the first in the caller's order: the fastest known
        parts = _Parts(manifest, {})
        t1 = time.monotonic()

        def add(donor: str, other: Manifest) -> None:
            parts.sources[donor] = {i for i, digest in enumerate(manifest.digests) if i < len(other.digests)
                                    and other.digests[i] == digest and other.part_bytes == manifest.part_bytes}
            workers.update(asyncio.ensure_future(_serve_donor(streams, donor, parts))
                           for _ in range(PARTS_IN_FLIGHT_PER_DONOR))

        for donor, other in answered:
            add(donor, other)
        while (workers or asked) and not parts.complete():
            finished, _ = await asyncio.wait(workers | set(asked), return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                if task in workers:
                    workers.discard(task)
                    task.result()  # a worker's own exception is a bug, not a donor's fault: let it out
                    continue
                donor, late = asked.pop(task), _outcome(task)
                if isinstance(late, Manifest):
                    answered.append((donor, late))
                    add(donor, late)
                else:
                    errors[donor[-8:]] = str(late) or type(late).__name__
    finally:
        left = [*asked, *workers, *(task for holders in (parts.running.values() if parts is not None else ())
                                    for task, _ in holders.values())]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)  # their errors are spent; their streams close now
    if not parts.complete():
        errors.update(parts.errors)
        raise ProtocolError(f"{len(manifest.digests) - len(parts.done)} of {len(manifest.digests)} state parts "
                            f"found no donor: {errors}")
    rates = {d: parts.served[d] / parts.busy_s[d] * PARTS_IN_FLIGHT_PER_DONOR
             for d in parts.served if parts.busy_s[d] > 0}
    t2 = time.monotonic()
    state = await asyncio.get_running_loop().run_in_executor(None, assemble, manifest, parts.flat)
    log.info("state of outer step %d: %d parts from %s (manifests %.2fs, parts %.2fs, assembly %.2fs)", outer_step,
             len(manifest.digests), ", ".join(f"{d[-8:]} {parts.served[d] / 2**20:.1f} MiB" for d in parts.served),
             t1 - t0, t2 - t1, time.monotonic() - t2)
    state = await checked_state(state, head, check, min_outer_step)
    return Download(state, rates, tuple(d for d, _ in answered))
