"""Headless Chromium driven over the DevTools protocol (CDP, through aiohttp's websocket client)
for the page checks: open a page at a fixed viewport, evaluate JavaScript, type into inputs,
take screenshots, and a layout audit (elements that overflow their container or overlap a
sibling, from each element's bounding box in the rendered page).

    with Browser(CHROMIUM, tmp_path) as b:
        b.open(url, 1280, 800); b.wait("document.body.dataset.polls >= 2")
        problems = b.layout_problems(); b.screenshot(path)
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

# Runs in the page: every visible element whose box leaves its container's box (unless the
# container scrolls or clips on purpose), and every pair of in-flow siblings whose boxes
# intersect. SVG internals are drawings (their shapes overlap by design) and are skipped; the
# <svg> element itself is checked like any other box.
LAYOUT_AUDIT_JS = r"""
(() => {
  const out = [];
  const vw = document.documentElement.clientWidth;
  const name = e => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") +
    (e.className && typeof e.className === "string" ? "." + e.className.split(" ")[0] : "") +
    (e.getAttribute("data-field") ? "[" + e.getAttribute("data-field") + "]" : "");
  const visible = e => {
    const cs = getComputedStyle(e);
    if (cs.display === "none" || cs.visibility === "hidden") return false;
    const r = e.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  };
  const scrolls = e => ["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(e).overflowX);
  const inSvg = e => e.ownerSVGElement != null;
  if (document.documentElement.scrollWidth > vw + 1)
    out.push({kind: "page", detail: "page scrolls sideways: " +
              document.documentElement.scrollWidth + " > " + vw});
  for (const e of document.body.querySelectorAll("*")) {
    if (inSvg(e) || !visible(e) || ["script", "style", "title"].includes(e.tagName.toLowerCase()))
      continue;
    const r = e.getBoundingClientRect();
    // overflow: leaves the nearest ancestor that does not scroll (or the viewport)
    let p = e.parentElement, clipped = false;
    while (p && p !== document.body) {
      if (scrolls(p)) { clipped = true; break; }
      const cs = getComputedStyle(p);
      if (cs.display !== "inline" && cs.display !== "contents") break;
      p = p.parentElement;
    }
    if (!clipped && p) {
      const q = p.getBoundingClientRect();
      if (r.right > q.right + 1 || r.left < q.left - 1)
        out.push({kind: "overflow", element: name(e), container: name(p),
                  detail: `x ${r.left.toFixed(0)}..${r.right.toFixed(0)} outside ` +
                          `${q.left.toFixed(0)}..${q.right.toFixed(0)}`});
    }
    // inside a box that scrolls sideways it is that box (checked itself) that must fit
    let scroller = e.parentElement;
    while (scroller && scroller !== document.body && !scrolls(scroller))
      scroller = scroller.parentElement;
    if (!clipped && (!scroller || scroller === document.body) && r.right > vw + 1)
      out.push({kind: "overflow", element: name(e), container: "viewport",
                detail: `right ${r.right.toFixed(0)} > ${vw}`});
    // text cut off inside an element that hides its overflow
    if (getComputedStyle(e).overflowX === "hidden" && e.scrollWidth > e.clientWidth + 1)
      out.push({kind: "clipped", element: name(e),
                detail: `content ${e.scrollWidth} > box ${e.clientWidth}`});
  }
  // overlap between in-flow siblings
  for (const parent of document.body.querySelectorAll("*")) {
    if (inSvg(parent) || parent.tagName.toLowerCase() === "svg") continue;
    const kids = [...parent.children].filter(k => visible(k) && !inSvg(k) &&
      !["absolute", "fixed"].includes(getComputedStyle(k).position));
    for (let i = 0; i < kids.length; i++) {
      const a = kids[i].getBoundingClientRect();
      for (let j = i + 1; j < kids.length; j++) {
        const b = kids[j].getBoundingClientRect();
        const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
        const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
        if (w > 1 && h > 1)
          out.push({kind: "overlap", element: name(kids[i]), other: name(kids[j]),
                    container: name(parent), detail: `${w.toFixed(0)}x${h.toFixed(0)} px`});
      }
    }
  }
  return out;
})()
"""


class Browser:
    """One headless Chromium with one page, driven synchronously (each call runs to its answer)."""

    def __init__(self, binary: str, workdir: Path, timeout_s: float = 30.0) -> None:
        self.binary, self.workdir, self.timeout_s = binary, Path(workdir), timeout_s
        self.loop = asyncio.new_event_loop()
        self.proc: subprocess.Popen | None = None
        self._ids = itertools.count(1)

    # ---- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Browser:
        profile = self.workdir / "cdp-profile"
        profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.loop.run_until_complete(self._connect(port))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.loop.run_until_complete(self._close())
        finally:
            if self.proc is not None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            self.loop.close()

    async def _connect(self, port: int) -> None:
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t.get("type") == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    async def _close(self) -> None:
        await self.ws.close()
        await self.session.close()

    async def _send(self, method: str, params: dict | None) -> dict:
        mid = next(self._ids)
        await self.ws.send_str(json.dumps({"id": mid, "method": method, "params": params or {}}))
        while True:
            msg = json.loads((await asyncio.wait_for(self.ws.receive(), self.timeout_s)).data)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    # ---- page ----------------------------------------------------------------------------------
    def call(self, method: str, **params: Any) -> dict:
        return self.loop.run_until_complete(self._send(method, params))

    def open(self, url: str, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'")

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page error: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait(self, expression: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not self.eval(f"!!({expression})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never got to: {expression}")
            time.sleep(0.1)

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element and type, as a person would (key events, not a value set)."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, text="\r" if kind == "keyDown" else "")

    def layout_problems(self) -> list[dict]:
        return self.eval(LAYOUT_AUDIT_JS)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
