"""A worker's calls to its DHT process, and their answers: one pipe each way, made before the fork.

hivemind's DHT runs in a child process; each call (``get``, ``store``, ``run_coroutine``) sends it
the method, its arguments and an ``MPFuture`` through a pipe, and the child answers through that
future. An ``MPFuture`` travels with a pipe end to answer on, and a pipe end that is pickled is
rebuilt in the child through a socket handshake with the caller (``multiprocessing``'s resource
sharer: a new connection, an HMAC challenge both ways, a passed file descriptor). For a worker that
waits in matchmaking and reads the DHT every 20 ms that was a third of the Python CPU of the worker
and its DHT process together.

Here the answers go back on one pipe that both processes hold from the fork: a call carries only a
number (``ReplyTo``), and the caller's side (``DhtCalls``) resolves the future of that number. What
a call returns is the same: a future with ``result(timeout)``, ``cancel()``, ``done()``, that an
asyncio coroutine may also ``await``. A cancelled call still runs in the DHT process (as with
``MPFuture``, whose ``get`` and ``store`` never look); its answer is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import threading

log = logging.getLogger(__name__)


class CallFuture(concurrent.futures.Future):
    """The answer to one call; awaitable from an event loop in any thread of the caller's process."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class ReplyTo:
    """Stands for the future of call ``number`` in the DHT process, where hivemind's handlers answer
    it (``set_result``/``set_exception``, after asking ``done()``)."""

    pipe = None
    """The DHT process's end of the answers' pipe (``serve_answers``)."""

    def __init__(self, number: int):
        self.number = number
        self._done = False

    def __getstate__(self):
        return self.number

    def __setstate__(self, number):
        self.number, self._done = number, False

    def done(self) -> bool:
        return self._done

    def set_result(self, value) -> None:
        self._answer(True, value)

    def set_exception(self, error: BaseException) -> None:
        self._answer(False, error)

    def _answer(self, ok: bool, payload) -> None:
        if self._done:
            return
        self._done = True
        try:
            ReplyTo.pipe.send((self.number, ok, payload))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the caller is gone
        except Exception as e:  # an answer that cannot be pickled: say so instead
            ReplyTo.pipe.send((self.number, False, RuntimeError(f"the DHT's answer could not be sent back: {e!r}")))


class DhtCalls:
    """The caller's side: sends calls through the DHT's request pipe, resolves their answers."""

    def __init__(self):
        self._answers, self._answer_end = mp.Pipe(duplex=False)
        self._numbers = itertools.count()
        self._pending: dict[int, CallFuture] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._ended = False

    def serve_answers(self) -> None:
        """In the DHT process, once forked: answers go back through its end of the pipe."""
        self._answers.close()
        ReplyTo.pipe = self._answer_end

    def started(self) -> None:
        """In the caller, once the DHT process is forked: only that process holds the answering end
        now (so that its death ends the reader), and the reader starts."""
        self._answer_end.close()
        self._reader = threading.Thread(target=self._read, name="opendiloco-dht-answers", daemon=True)
        self._reader.start()

    def call(self, requests, method: str, kwargs: dict) -> CallFuture:
        """Sends ``method(**kwargs, future=...)`` through ``requests`` (the DHT's request pipe)."""
        future = CallFuture()
        with self._lock:
            if self._ended:
                future.set_exception(RuntimeError("the DHT process has ended"))
                return future
            number = next(self._numbers)
            self._pending[number] = future
        try:
            self.send(requests, (method, [], dict(kwargs, future=ReplyTo(number))))
        except BaseException:
            with self._lock:
                del self._pending[number]
            raise
        return future

    def send(self, requests, message) -> None:
        """One message on the request pipe, never interleaved with another thread's."""
        with self._send_lock:
            requests.send(message)

    def _read(self) -> None:
        while True:
            try:
                number, ok, payload = self._answers.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # an answer that does not unpickle here: its call fails, the others go on
                log.warning("an answer from the DHT process could not be read: %r", e)
                continue
            with self._lock:
                future = self._pending.pop(number, None)
            if future is None or not future.set_running_or_notify_cancel():
                continue  # cancelled by its caller
            if ok:
                future.set_result(payload)
            else:
                future.set_exception(payload)
        with self._lock:  # the DHT process is gone: nothing more will answer
            pending, self._pending, self._ended = list(self._pending.values()), {}, True
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the DHT process ended before it answered"))
