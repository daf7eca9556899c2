"""Headless Chromium driven over the DevTools protocol on a pipe: open a page, evaluate
JavaScript in it, click like a user, take a screenshot. Standard library only.

[Note: why the DevTools protocol]
The scoreboard's browser test (tests/harness/test_html_browser.py), its screenshot and its
open-time measurement need a real browser, not a DOM emulation. Chromium speaks the DevTools
protocol over two file descriptors when started with ``--remote-debugging-pipe`` (it reads
NUL-terminated JSON commands on fd 3 and writes replies and events on fd 4), so the client is
``subprocess`` + ``json``: no pip package, no WebDriver server whose version must match the
browser's (Selenium needs ``chromedriver`` of the same build, and its Python bindings pull ten
packages whose newest release did not resolve on this project's package index). Clicks are real
input events (``Input.dispatchMouseEvent`` at the element's centre), so a click on a hidden or
covered element misses, as a user's would.

``python -m conformance.html.browser PAGE.html [--screenshot OUT.png] [--width W]`` opens a page
and prints how long it took until the page's script finished (``document.body.dataset.ready``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# --headless etc.: no display; the background-networking flags stop Chromium's own update and
# sync requests (this machine has no network; without them it logs refused connections).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


class BrowserError(Exception):
    """Chromium is missing, did not start, or a DevTools command failed."""


def find_chromium() -> str | None:
    """The Chromium binary: ``$CHROMIUM`` if set, else the first of :data:`CANDIDATES` on PATH."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, binary: str | None = None, width: int = 1280, height: int = 900):
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError(
                "no Chromium found: install it (Debian: apt-get install chromium) or set "
                "$CHROMIUM to its path"
            )
        self._profile = tempfile.mkdtemp(prefix="conformance-chromium-")
        to_browser, self._out = _pipe_above(10)
        self._in, from_browser = _pipe_above(10)

        def child_fds():  # the browser's fd 3 reads commands, fd 4 writes replies
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self._proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=child_fds, pass_fds=(3, 4),
        )  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session = None
        try:
            targets = self.send("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            attached = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)
            self.session = attached["sessionId"]
            self.send("Page.enable")
            self.send("Runtime.enable")
            self.resize(width, height)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the protocol ------------------------------------------------------------------------
    def send(self, method: str, timeout: float = 30, **params) -> dict:
        """Send one command (to the page once attached) and return its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout, f"the reply to {method}")
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        """The next event ``method`` (one already received counts), removed from :attr:`events`."""
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read(timeout, f"the event {method}"))

    def _read(self, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            import select

            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserError(f"Chromium sent no {what} within {timeout:g} s")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed the pipe before {what} (it exited?)")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(raw)

    # -- what the tests use ------------------------------------------------------------------
    def open(self, path: Path, timeout: float = 30) -> float:
        """Load ``path`` from disk; return the seconds from navigation until the page's script
        set ``document.body.dataset.ready`` (or its load event, for a page without it)."""
        self.events.clear()
        started = time.perf_counter()
        self.send("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait_event("Page.loadEventFired", timeout)
        while not self.evaluate("!document.body || document.body.dataset.ready !== undefined"):
            if time.perf_counter() - started > timeout:
                raise BrowserError(f"{path}: the page's script did not finish in {timeout:g} s")
            time.sleep(0.01)
        return time.perf_counter() - started

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable values only);
        an exception in the page is a :class:`BrowserError` with its message."""
        result = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"the page raised: {text}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """Click the centre of the first element matching ``selector`` with real mouse events
        (after scrolling it into view); it must be visible."""
        box = self.evaluate(
            f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: 'center'}});
            const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2, r.width * r.height]; }})()"""
        )
        if box is None:
            raise BrowserError(f"no element matches {selector!r}")
        if not box[2]:
            raise BrowserError(f"{selector!r} is not visible (zero size)")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left",
                clickCount=0 if kind == "mouseMoved" else 1,
            )  # fmt: skip

    def resize(self, width: int, height: int) -> None:
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip

    def screenshot(self, out: Path, full_height: int | None = None) -> None:
        """A PNG of the viewport (or its top ``full_height`` pixels of the page) into ``out``."""
        params = {"format": "png"}
        if full_height:
            width = self.evaluate("document.documentElement.scrollWidth")
            params.update(
                clip={"x": 0, "y": 0, "width": width, "height": full_height, "scale": 1},
                captureBeyondViewport=True,
            )
        data = self.send("Page.captureScreenshot", **params)["data"]
        Path(out).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.session = None
                self.send("Browser.close", timeout=5)
            except (BrowserError, OSError):
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (self._in, self._out):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)


def _pipe_above(low: int) -> tuple[int, int]:
    """A pipe whose two ends are numbered ``low`` or more (so that moving them to fd 3 and 4 in
    the child can never overwrite one with the other)."""
    import fcntl

    ends = []
    for fd in os.pipe():
        ends.append(fcntl.fcntl(fd, fcntl.F_DUPFD, low))
        os.close(fd)
    return ends[0], ends[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.html.browser", description=__doc__)
    parser.add_argument("page", type=Path)
    parser.add_argument("--screenshot", type=Path, help="write a PNG of the page's top here")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900, help="the screenshot's height")
    parser.add_argument("--click", help="a CSS selector to click before the screenshot")
    args = parser.parse_args(argv)
    try:
        with Browser(width=args.width, height=args.height) as browser:
            seconds = browser.open(args.page)
            if args.click:
                browser.click(args.click)
            if args.screenshot:
                browser.screenshot(args.screenshot, full_height=args.height)
    except BrowserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = args.page.stat().st_size
    print(f"{args.page}: {size / 1e6:.2f} MB, opened and rendered in {seconds:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
