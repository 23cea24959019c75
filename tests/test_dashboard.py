"""The live dashboard (issue 17) in a real browser: headless Debian Chromium driven by
Playwright (``executable_path=/usr/bin/chromium``; Playwright's own browser download is not
used). ``make install`` installs Chromium where it is missing; the browser tests skip, with
the reason, where it still is: ``apt-get install chromium``."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
import urllib.error
import urllib.request

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "dashboard-secret-0123456789"


def _get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_dashboard_config_refuses_an_open_port_without_a_token():
    from cloud.config import AggregatorConfig, TaskConfig

    TASKS = {"bbc": TaskConfig(labels=["a", "b"])}
    AggregatorConfig(tasks=TASKS, dashboard="127.0.0.1:0")
    AggregatorConfig(tasks=TASKS, dashboard="0.0.0.0:8080", dashboard_token=TOKEN)
    with pytest.raises(ValueError, match="beyond loopback without a dashboard_token"):
        AggregatorConfig(tasks=TASKS, dashboard="0.0.0.0:8080")
    with pytest.raises(ValueError, match="dashboard_token"):
        AggregatorConfig(tasks=TASKS, dashboard="127.0.0.1:0", dashboard_token="short")


def _browser():
    """Playwright's sync API, or a skip naming what is missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium at /usr/bin/chromium (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


def test_dashboard_shows_the_open_round_devices_and_events_in_chromium(tmp_path):
    """A store 90 s into round 2 (``tests.test_status.open_round_store``): the open-round
    panel shows its progress against the deadline and who reported, the device table when
    each was last seen, the events table the refused message and the exclusion."""
    from types import SimpleNamespace

    from cloud.config import StrategyConfig
    from cloud.dashboard import Dashboard
    from cloud.store import Store
    from tests.test_status import open_round_store

    sync_api = _browser()
    url = f"sqlite:///{tmp_path}/agg.db"
    open_round_store(url)
    store = Store(url)
    strategy = StrategyConfig(name="fedmoe")
    cfg = SimpleNamespace(strategy=strategy, assignment=strategy, aggregation=strategy, federation="demo")
    dash = Dashboard(SimpleNamespace(store=store, registry=None, engine=None, cfg=cfg))
    port = dash.serve("127.0.0.1", 0)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            # (the browser's own favicon request is answered 404: not an error of the page)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "404" not in m.text else None)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#open-round[data-round='2']", timeout=60_000)
            states = page.eval_on_selector_all("#open-devices tbody tr", "rows => rows.map(r => [r.dataset.device, "
                                                                         "r.dataset.state, r.children[2].textContent])")
            title = page.text_content("#open-title")
            progress = page.text_content("#open-progress")
            width = page.eval_on_selector("#open-progress .fill", "e => e.getBoundingClientRect().width / "
                                                                  "e.parentElement.getBoundingClientRect().width")
            devices = page.eval_on_selector_all("#devices tbody tr", "rows => rows.map(r => [...r.children].map("
                                                                     "c => c.textContent))")
            events = page.eval_on_selector_all("#events tbody tr", "rows => rows.map(r => [...r.children].map("
                                                                   "c => c.textContent))")
            charts = {c: page.get_attribute(f"#chart-{c}", "data-points") for c in ("quality", "loss", "bytes")}
            scale = page.text_content(".heat .scale")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        dash.stop()
        store.close()
    assert not errors, errors
    assert title == "Open round 2: 1 of 2 reported"
    assert states == [["dev-a", "reported", ""], ["dev-b", "training", ""],
                      ["dev-c", "excluded", "over budget: the plan needs 600 MiB"]]
    elapsed = int(progress.split(" s of ")[0])
    assert 90 <= elapsed < 150 and "240 s (round_timeout_s)" in progress and "deadline passed" not in progress
    assert width == pytest.approx(elapsed / 240, abs=0.02)  # the bar: elapsed against the deadline
    seen = {row[0]: row[3] for row in devices}
    assert seen["dev-a"].endswith(" s ago") and int(seen["dev-a"].split()[0]) < 60
    assert seen["dev-c"] == "10 min ago"
    assert [(e[1], e[2], e[3]) for e in events] == [("reject", "dev-c", "2"), ("exclude", "dev-c", "2")]
    assert events[0][4] == "stats rejected: dev-c was not selected in round 2" and events[0][0][:2] == "20"
    assert charts == {"quality": "2", "loss": "2", "bytes": "2"}  # round 0 (initial) and 1, apart; MiB up and down
    # the heatmap's colour scale: "0", the colour ramp, "40 tokens" (the layer's largest count)
    assert scale == "040 tokens"
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    shot = os.environ.get("FEDMOE_DASHBOARD_SHOT")
    if shot:  # keep the screenshot (a person looks at it; results/dashboard/)
        shutil.copy(tmp_path / "dashboard.png", shot)


@pytest.mark.slow
def test_dashboard_shows_the_store_live_in_chromium(embedded_url, tmp_path):
    sync_api = _browser()
    from tests.federation import Federation

    # more rounds than the checks need: a loaded machine may take a minute to start Chromium; the
    # checks stop the aggregator when done
    fed = Federation(embedded_url, str(tmp_path), rounds=30, experts=(2, 4, 4),
                     config_kw={"dashboard": "127.0.0.1:0", "dashboard_token": TOKEN})
    seen: dict = {}

    def during(f):
        deadline = time.time() + 60
        while f.aggregator.dashboard_port is None and time.time() < deadline:
            time.sleep(0.1)
        base = f"http://127.0.0.1:{f.aggregator.dashboard_port}"
        seen["no_token"] = _get(base + "/api/state")[0]
        seen["wrong_token"] = _get(base + "/api/state", {"Authorization": "Bearer nope"})[0]
        basic = base64.b64encode(f"operator:{TOKEN}".encode()).decode()
        seen["basic"] = _get(base + "/", {"Authorization": f"Basic {basic}"})[0]
        seen["post"] = _get(base + "/api/state", {"Authorization": f"Bearer {TOKEN}"}, method="POST")[0]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            # bypass_csp: the page forbids eval (Content-Security-Policy); Playwright evaluates its predicates
            page = browser.new_page(extra_http_headers={"Authorization": f"Bearer {TOKEN}"}, bypass_csp=True,
                                    viewport={"width": 1300, "height": 1000})
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"error: {e}"))
            page.goto(base + "/")
            try:
                page.wait_for_function("Number(document.body.dataset.rounds || 0) >= 2", timeout=240_000)
            except sync_api.TimeoutError:
                raise AssertionError(f"the page did not show 2 rounds (store: {len(f.aggregator.store.rounds())}); "
                                     f"console: {console[:3]} ... {console[-2:]}") from None
            # compare with the store once the page shows every round the store holds
            for _ in range(30):
                records, devices = f.aggregator.store.rounds(), f.aggregator.store.devices()
                try:
                    page.wait_for_function(f"Number(document.body.dataset.rounds) === {len(records)}", timeout=5000)
                except sync_api.TimeoutError:
                    continue
                seen["table"] = page.eval_on_selector_all(
                    "#devices tbody tr", "rows => rows.map(r => [...r.children].map(c => c.textContent))")
                seen["cells"] = page.eval_on_selector_all(
                    "#heatmap td", "cells => cells.map(c => [c.closest('.heat').dataset.layer, c.dataset.round, "
                                   "c.dataset.expert, Number(c.dataset.load)])")
                seen["round_rows"] = page.eval_on_selector_all("#rounds tbody tr", "rows => rows.map(r => r.dataset.round)")
                if len(f.aggregator.store.rounds()) == len(records):
                    seen["records"], seen["devices"] = records, devices
                    break
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
        f.aggregator.stop()

    fed.run(during, timeout=500)
    assert seen["no_token"] == 401 and seen["wrong_token"] == 401 and seen["basic"] == 200 and seen["post"] == 405
    records, devices = seen["records"], seen["devices"]
    assert len(records) >= 2 and sorted(seen["round_rows"], key=int) == [str(r["round"]) for r in records]
    # the device table: one row per registered device, with the store's budget and experts held
    last = {}
    for r in records:
        for d, v in r["devices"].items():
            last[d] = (r["round"], sum(len(e) for e in v["experts"].values()))
    table = {row[0]: row for row in seen["table"]}
    assert sorted(table) == sorted(devices)
    for d, info in devices.items():
        row = table[d]
        assert row[4] == f"{info['budget_bytes'] / 2**20:.0f}" and row[3].endswith(" ago")
        assert (row[6], row[9]) == (str(last[d][1]), str(last[d][0]))
    # the heatmap: every (layer, round, expert) cell holds the store's routed-token count
    cells = {(layer, int(rnd), int(e)): v for layer, rnd, e, v in seen["cells"]}
    expected = {(str(layer), r["round"], e): float(v) for r in records
                for layer, load in r["expert_load"].items() for e, v in enumerate(load)}
    assert cells == expected and any(v > 0 for v in expected.values())
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    json.dumps(seen["table"])  # plain data came back from the page
