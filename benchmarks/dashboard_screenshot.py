"""The README's dashboard screenshot: a ``fedmoe simulate`` run with ``--dashboard``, shown in
headless Debian Chromium (Playwright, ``executable_path=/usr/bin/chromium``) once
``--rounds`` rounds are closed, with the page's own Content-Security-Policy in force.

    python -m benchmarks.dashboard_screenshot [--rounds 4] [--out results/dashboard]

Writes ``dashboard.png`` and ``state.json`` (what ``/api/state`` served at that moment).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("dashboard_screenshot")


def main() -> int:
    from fedmoe.broker import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--devices", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "results" / "dashboard"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from playwright.sync_api import sync_playwright

    port, out = free_port(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = ROOT / "runs" / "dashboard"
    cmd = [str(ROOT / ".venv" / "bin" / "fedmoe"), "simulate", "--tiny", "--devices", str(args.devices),
           "--rounds", str(args.rounds + 1), "--dashboard", f"127.0.0.1:{port}",
           "--out", str(work)]
    log.info("%s", " ".join(cmd[1:]))
    sim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        state, deadline = None, time.time() + 1800
        while time.time() < deadline and sim.poll() is None:
            try:
                with urllib.request.urlopen(url + "/api/state", timeout=5) as r:
                    state = json.loads(r.read())
                if len(state["rounds"]) >= args.rounds:
                    break
                log.info("%d of %d rounds closed", len(state["rounds"]), args.rounds)
            except OSError:
                pass
            time.sleep(5)
        if not state or len(state["rounds"]) < args.rounds:
            raise SystemExit(f"the federation closed {len(state['rounds']) if state else 0} rounds, not {args.rounds}")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/")
            page.wait_for_selector("#devices tbody tr", timeout=30_000)
            time.sleep(1)
            shown = page.get_attribute("body", "data-rounds")
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            browser.close()
        (out / "state.json").write_text(json.dumps(state, indent=1))
        log.info("page showed %s rounds; wrote %s", shown, out / "dashboard.png")
    finally:
        sim.terminate()
        sim.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
