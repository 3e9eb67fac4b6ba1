"""Headless Chromium driven over the DevTools protocol from Python (no Node, no Playwright).

```
with Chromium.launch(tmp_path / "profile") as browser:
    page = browser.new_page()
    page.goto("http://127.0.0.1:8080/")
    page.click("#speak")
    page.wait_for("document.querySelector('#status').textContent === 'done'")
    page.screenshot(tmp_path / "page.png")
```
The browser runs in its own process group with a fresh profile; `close()` ends the group. It finds its
debugging port in `<profile>/DevToolsActivePort` (`--remote-debugging-port=0` picks a free one). Clicks
and typing go through `Input.*` events, so the page sees real user gestures (which Web Audio wants).
Console messages and uncaught exceptions are collected in `page.console` / `page.errors`.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio",
         "--autoplay-policy=no-user-gesture-required",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",  # a fake microphone
         "--window-size=1200,1000", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")


def find_chromium() -> str | None:
    given = os.environ.get("CHROMIUM")
    if given:
        return given if os.access(given, os.X_OK) else None
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Chromium:
    def __init__(self, proc: subprocess.Popen, ws_url: str, profile: Path):
        from websockets.sync.client import connect

        self.proc = proc
        self.profile = profile
        self.ws = connect(ws_url, max_size=64 * 1024 * 1024, open_timeout=30).__enter__()  # closed by close()
        self._next_id = 0
        self._events: list[dict] = []

    @classmethod
    def launch(cls, profile: str | Path, executable: str | None = None, timeout_s: float = 60.0,
               extra_flags: tuple[str, ...] = ()) -> Chromium:
        executable = executable or find_chromium()
        if executable is None:
            raise FileNotFoundError("no chromium found (apt-get install chromium, or set CHROMIUM)")
        profile = Path(profile)
        profile.mkdir(parents=True, exist_ok=True)
        log = open(profile.parent / f"{profile.name}-chromium.log", "wb")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen([executable, *FLAGS, *extra_flags, f"--user-data-dir={profile}", "about:blank"],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while True:
            if port_file.exists():
                lines = port_file.read_text().split()
                if len(lines) >= 2:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                _kill_group(proc)
                raise CDPError(f"chromium did not start (exit {proc.returncode}); see {log.name}")
            time.sleep(0.1)
        try:
            return cls(proc, f"ws://127.0.0.1:{lines[0]}{lines[1]}", profile)
        except Exception:
            _kill_group(proc)
            raise

    # -- protocol ---------------------------------------------------------------------------------------
    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 60.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"{method}: no answer in {timeout_s:.0f} s")
            reply = json.loads(self.ws.recv(timeout=left))
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def pump(self, timeout_s: float = 0.0) -> None:
        """Read pending events (console messages, exceptions)."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                reply = json.loads(self.ws.recv(timeout=max(0.0, end - time.monotonic())))
            except TimeoutError:
                return
            if "method" in reply:
                self._events.append(reply)

    def new_page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log"):
            page.call(f"{domain}.enable")
        return page

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001 - the browser may be gone already
            pass
        _kill_group(self.proc)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Chromium, session: str):
        self.browser = browser
        self.session = session

    def call(self, method: str, params: dict | None = None, timeout_s: float = 60.0) -> dict:
        return self.browser.call(method, params, self.session, timeout_s)

    # -- events -----------------------------------------------------------------------------------------
    def _mine(self, method: str) -> list[dict]:
        return [e["params"] for e in self.browser._events if e.get("sessionId") == self.session
                and e["method"] == method]

    @property
    def console(self) -> list[str]:
        """Console messages so far, as "type: text"."""
        out = []
        for params in self._mine("Runtime.consoleAPICalled"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            out.append(f"{params.get('type')}: {text}")
        for params in self._mine("Log.entryAdded"):
            entry = params["entry"]
            out.append(f"{entry.get('level')}: {entry.get('text')} {entry.get('url', '')}".rstrip())
        return out

    @property
    def errors(self) -> list[str]:
        """Uncaught exceptions so far."""
        return [p["exceptionDetails"].get("exception", {}).get("description")
                or p["exceptionDetails"].get("text", "") for p in self._mine("Runtime.exceptionThrown")]

    # -- actions ----------------------------------------------------------------------------------------
    def goto(self, url: str, timeout_s: float = 30.0) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout_s)

    def evaluate(self, expression: str, await_promise: bool = True):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": await_promise, "userGesture": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CDPError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0, interval_s: float = 0.1):
        """Poll `expression` until it is truthy (in JavaScript's sense); returns its value (None for objects)."""
        deadline = time.monotonic() + timeout_s
        probe = f"(() => {{ const v = ({expression}); return [!!v, typeof v === 'object' ? null : v]; }})()"
        while True:
            ok, value = self.evaluate(probe)
            if ok:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout_s:.0f} s: {expression}")
            self.browser.pump(interval_s)

    def _center(self, selector: str) -> tuple[float, float]:
        box = self.evaluate(f"""(() => {{
            const el = document.querySelector({json.dumps(selector)});
            if (!el) return null;
            el.scrollIntoView({{block: 'center'}});
            const r = el.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2];
        }})()""")
        if box is None:
            raise CDPError(f"no element {selector}")
        return box[0], box[1]

    def click(self, selector: str) -> None:
        x, y = self._center(selector)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def fill(self, selector: str, text: str) -> None:
        """Focus the field, clear it, and type `text` into it."""
        self.evaluate(f"""(() => {{
            const el = document.querySelector({json.dumps(selector)});
            el.focus(); el.select && el.select();
        }})()""")
        self.call("Input.dispatchKeyEvent", {"type": "keyDown", "key": "Backspace", "code": "Backspace",
                                             "windowsVirtualKeyCode": 8})
        self.call("Input.dispatchKeyEvent", {"type": "keyUp", "key": "Backspace", "code": "Backspace",
                                             "windowsVirtualKeyCode": 8})
        self.call("Input.insertText", {"text": text})

    def select(self, selector: str, value: str) -> None:
        self.evaluate(f"""(() => {{
            const el = document.querySelector({json.dumps(selector)});
            el.value = {json.dumps(value)};
            el.dispatchEvent(new Event('change', {{bubbles: true}}));
        }})()""")

    def text(self, selector: str) -> str:
        return self.evaluate(f"document.querySelector({json.dumps(selector)})?.textContent ?? ''")

    def screenshot(self, path: str | Path, full_page: bool = True) -> Path:
        params = {"format": "png"}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params.update({"captureBeyondViewport": True,
                           "clip": {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}})
        data = self.call("Page.captureScreenshot", params)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
