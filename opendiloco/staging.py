"""Getting a fragment of a CUDA model into host memory without making the training loop wait.

A streamed round starts while training goes on, so its pseudo-gradient must be a snapshot: the
next inner step rewrites the parameters. On CUDA the snapshot is a device-to-device copy queued on
the training stream (it reads the weights as that step left them). The copy to pinned host memory
then runs on a side stream that waits only for that snapshot. The training thread returns at once;
a helper thread waits for the copy's event and only then touches the host buffer. The inner step
never waits for the host, and the host never reads a half-copied tensor.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import torch


class DeviceSnapshot:
    """One side stream per device and one helper thread: at most one snapshot in flight (the
    streaming schedule has at most one round in flight)."""

    def __init__(self):
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opendiloco-snapshot")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def capture(self, params: Sequence[torch.Tensor], host_views: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Queues ``host_views[i] := params[i]`` (as fp32) and returns a function that blocks until it
        has landed. ``host_views`` should be pinned for the copy to be asynchronous."""
        events = []
        for device in {p.device for p in params if p.device.type == "cuda"}:
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
            with torch.no_grad():
                mine = [(p, v) for p, v in zip(params, host_views, strict=True) if p.device == device]
                staged = [p.detach().clone() for p, _ in mine]  # on the training stream, after this step
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for t, (_, view) in zip(staged, mine):
                        view.copy_(t.reshape(view.shape), non_blocking=True)
                        t.record_stream(stream)  # the allocator must not reuse it before the copy is done
                    done = torch.cuda.Event()
                    done.record(stream)
            events.append(done)
        cpu = [(p, v) for p, v in zip(params, host_views, strict=True) if p.device.type != "cuda"]
        with torch.no_grad():
            for p, view in cpu:
                view.copy_(p.detach().reshape(view.shape))

        def wait() -> None:
            for event in events:
                event.synchronize()

        return wait
