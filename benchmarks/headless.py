"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``): no
websocket client, no package, only the standard library. For the status page's test and benchmark.

Chromium reads commands from its fd 3 and writes answers and events to its fd 4, each message one
JSON object followed by a NUL byte. ``Browser.page()`` opens a tab; ``Page.evaluate`` runs a JS
expression in it and returns the value; ``Page.screenshot`` writes a PNG.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium process (a fresh profile in a temporary directory), stopped by ``close``."""

    def __init__(self, binary: str | None = None, timeout: float = 60.0, width: int = 1280, height: int = 900):
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError("no chromium on PATH")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="opendiloco-chromium-")
        ours_r, its_w = os.pipe()  # its fd 4 -> us
        its_r, ours_w = os.pipe()  # us -> its fd 3
        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"]

        def fds():  # in the child: its ends as fd 3 and 4 (kept open by pass_fds), whatever their numbers were
            r, w = fcntl.fcntl(its_r, fcntl.F_DUPFD, 10), fcntl.fcntl(its_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        try:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, preexec_fn=fds, pass_fds=(3, 4),
                                         start_new_session=True)
        except OSError:
            for fd in (ours_r, ours_w):
                os.close(fd)
            shutil.rmtree(self.profile, ignore_errors=True)
            raise
        finally:
            os.close(its_r)
            os.close(its_w)
        self._in, self._out = os.fdopen(ours_r, "rb", buffering=0), os.fdopen(ours_w, "wb", buffering=0)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float | None = None) -> dict:
        """Sends one command and returns its result (``BrowserError`` for an error or no answer in time)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._out.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error'].get('message')}")
                return answer.get("result", {})
            self.events.append(answer)
            del self.events[:-200]

    def _read(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("chromium did not answer in time")
            ready, _, _ = select.select([self._in], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._in.fileno(), 1 << 20)
                if not chunk:
                    raise BrowserError(f"chromium closed its pipe (exit code {self.proc.poll()})")
                self._buffer += chunk
            elif self.proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self.proc.returncode}")
        line, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(line)

    def page(self, url: str = "about:blank") -> Page:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, session)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.send("Browser.close", timeout=5)
                except (BrowserError, OSError):
                    pass
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, 9)  # its own session: chromium and its helpers
                    self.proc.wait(10)
        finally:
            for f in (self._in, self._out):
                try:
                    f.close()
                except OSError:
                    pass
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str):
        """The value of a JS expression (awaited if it is a promise), as JSON."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, poll: float = 0.2):
        """Evaluates ``expression`` until it is truthy; returns its value (``BrowserError`` after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:  # the page is still loading
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression!r} was not true within {timeout:.0f}s")
            time.sleep(poll)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)
