"""The trace viewer in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright.

A real gateway process over the real embedded engine (tiny model) records sessions made with the
``openai`` SDK; the test logs in through the form, clicks from the sessions list to a session, to the row
export will produce and to its token view, hovers a token, and visits the group and trainer pages,
checking what each shows against the JSON APIs. Screenshots go to ``tmp_path``, or to the folder named by
``AGENTRL_UI_SCREENSHOTS`` (``AGENTRL_UI_SCREENSHOTS=docs/img`` refreshes the README's pictures).

Playwright never downloads a browser here: it is pointed at ``/usr/bin/chromium`` (``apt-get install
chromium``; ``.ci/run`` installs it). Without it, or without the ``playwright`` package, the test skips.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import GatewayProc

CHROMIUM = os.environ.get("AGENTRL_CHROMIUM", "/usr/bin/chromium")
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (dev extra) is not installed")
HAVE_CHROMIUM = Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is not None
# checked at collection, before the session-scoped engine fixture would start for nothing
pytestmark = pytest.mark.skipif(
    not HAVE_CHROMIUM, reason=f"no Chromium at {CHROMIUM}: `apt-get install chromium` (CI's .ci/run does) to run the browser tests")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _record(gw: GatewayProc) -> dict[str, Any]:
    """Group ``demo`` of two sessions over the real tiny model: A has a first turn, a retried follow-up
    (the first try abandoned) and two branches; B has two turns. Rewards on leaves and on B."""
    a = gw.create_session(group_id="demo", task_id="arith-7", metadata={"group_size": 2})
    b = gw.create_session(group_id="demo", task_id="arith-7")
    ca = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=a["api_key"], max_retries=0)
    cb = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=b["api_key"], max_retries=0)

    seeds = iter(range(100))

    def ask(client: openai.OpenAI, messages: list[dict[str, Any]], n: int = 12) -> Any:
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=1.0,
                                              seed=next(seeds))

    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Answer with a number."},
                                  {"role": "user", "content": "What is 3 + 4?"}]
    r1 = ask(ca, msgs)
    msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}]
    retry = ask(ca, msgs)
    r2 = ask(ca, msgs)
    msgs += [r2.choices[0].message.model_dump(exclude_none=True)]
    r3 = ask(ca, msgs + [{"role": "user", "content": "Say it once more."}])
    r4 = ask(ca, msgs + [{"role": "user", "content": "Explain."}], n=6)
    b1 = ask(cb, [{"role": "user", "content": "What is 3 + 4?"}])
    solo = gw.create_session(task_id="arith-9")  # a group of one: once finished, export consumes it
    ask(openai.OpenAI(base_url=gw.base_url + "/v1", api_key=solo["api_key"], max_retries=0),
        [{"role": "user", "content": "What is 5 + 4?"}])
    with gw.admin() as admin:
        for body in ({"response_id": r3.id, "reward": 1.0}, {"response_id": r4.id, "reward": 0.0},
                     {"session_id": b["session_id"], "reward": 0.2}, {"session_id": solo["session_id"], "reward": 1.0}):
            admin.post("/reward", json=body).raise_for_status()
        admin.post(f"/v1/sessions/{solo['session_id']}/finish").raise_for_status()
        for step, (reward, gap) in enumerate([(0.20, 4e-3), (0.35, 3e-3), (0.30, 5e-3), (0.55, 2e-3)], start=1):
            admin.post("/admin/trainer", json={"version": step, "batch_size": 2, "staleness_bound": 1, "metrics": {
                "step": step, "reward/mean": reward, "logprob_gap/mean": gap}}).raise_for_status()
    return {"a": a["session_id"], "b": b["session_id"], "solo": solo["session_id"], "r1": r1.id, "retry": retry.id, "r2": r2.id,
            "r3": r3.id, "r4": r4.id, "b1": b1.id}


@pytest.mark.slow  # ~100 s here, most of it starting the engine and gateway processes
def test_click_through_the_viewer(browser: Any, gateway_factory: Callable[..., GatewayProc], tmp_path: Path) -> None:
    gw = gateway_factory()
    ids = _record(gw)
    shots = Path(os.environ.get("AGENTRL_UI_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    api = httpx.Client(base_url=gw.base_url, headers={"Authorization": f"Bearer {gw.admin_key}"}, timeout=60)
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    try:
        # no cookie: the login form; an agent key is refused there
        page.goto(gw.base_url + "/ui/sessions")
        assert page.url.endswith("/ui/login")
        page.fill("#key", gw.agent_key)
        page.click("#login")
        assert "admin key" in page.inner_text("#login-error")
        page.fill("#key", gw.admin_key)
        page.click("#login")
        page.wait_for_url("**/ui/sessions")
        assert gw.admin_key not in page.url

        # sessions list: all three sessions, counts per status
        rows = page.locator("#sessions tbody tr")
        assert rows.count() == 3
        assert page.locator("#sessions tbody tr").first.get_attribute("data-session") == ids["solo"]
        assert page.locator("#status-counts [data-status=active] b").inner_text() == "2"
        page.screenshot(path=str(shots / "ui_sessions.png"), full_page=True)

        # session page: the tree with the dropped retry and the two leaves that become rows
        page.click(f"a[href='/ui/sessions/{ids['a']}']")
        page.wait_for_selector("#tree")
        assert page.locator("#tree li.node").count() == 5
        assert page.locator(f"li.node.dropped[data-turn='{ids['retry']}']").count() == 1
        assert page.locator("#tree li.leaf").count() == 2
        assert page.locator("#rows tbody tr").count() == 2
        r3 = page.locator(f"li.node[data-turn='{ids['r3']}'] > .card")
        r3.locator("details.conv > summary").click()
        assert "Say it once more." in r3.inner_text()
        assert [m.inner_text().split()[0] for m in r3.locator(".msg .role").all()][:5] == \
            ["SYSTEM", "USER", "ASSISTANT", "USER", "ASSISTANT"]
        page.screenshot(path=str(shots / "ui_session.png"), full_page=True)

        # the row export will produce for leaf r3, token by token
        page.click(f"li.node[data-turn='{ids['r3']}'] > .card a.row-badge")
        page.wait_for_selector("#tokens")
        expected = api.get(f"/ui/api/sessions/{ids['a']}/rows/{ids['r3']}/tokens").json()
        tokens = page.locator("#tokens .tok")
        assert tokens.count() == len(expected["tokens"]["ids"])
        trained = page.locator("#tokens .tok.m1")
        assert trained.count() == sum(expected["tokens"]["loss_mask"]) > 0
        first = trained.first
        first.hover()
        info = page.inner_text("#tok-info")
        k = expected["tokens"]["loss_mask"].index(1)
        assert f"id {expected['tokens']['ids'][k]}" in info and "logprob" in info and "version 0" in info
        page.click("#mode-logprob")
        assert "mode-logprob" in (page.get_attribute("#tokens", "class") or "")
        colour = first.evaluate("e => getComputedStyle(e).backgroundColor")
        assert colour not in ("rgba(0, 0, 0, 0)", "transparent")
        page.screenshot(path=str(shots / "ui_tokens.png"), full_page=False)

        # group page: both sessions side by side with the advantages
        page.goto(f"{gw.base_url}/ui/groups/demo")
        cards = page.locator(".session-card")
        assert cards.count() == 2
        group = api.get("/ui/api/groups/demo").json()["grpo_groups"][0]
        shown = [float(x) for x in page.locator(".session-card td.adv").all_inner_texts()]
        assert shown == pytest.approx([r["advantage"] for s in group["sessions"] for r in s["rows"]], abs=1e-3)
        page.screenshot(path=str(shots / "ui_group.png"), full_page=True)

        # trainer page: versions and the two charts of the reported steps
        page.click("nav a[href='/ui/trainer']")
        page.wait_for_selector("#trainer-figures")
        assert page.inner_text("#trainer-version") == "4"
        assert page.locator("figure.chart polyline").count() == 2
        assert page.locator("figure.chart[data-metric='reward/mean'] circle").count() == 4
        page.screenshot(path=str(shots / "ui_trainer.png"), full_page=True)

        # the header's search box takes a response id to its turn in the tree
        page.fill("nav input[name=id]", ids["r2"])
        page.press("nav input[name=id]", "Enter")
        page.wait_for_url(f"**/ui/sessions/{ids['a']}#turn-{ids['r2']}")
        assert page.locator("li.node:target").get_attribute("data-turn") == ids["r2"]

        # a turn's token view from the session page, then logging out ends access
        page.click(f"li.node[data-turn='{ids['r2']}'] > .card a.tokens-link")
        page.wait_for_selector("#tokens")
        assert page.locator("#tokens .tok.k-context").count() > 0 and page.locator("#tokens .tok.m1").count() > 0
        page.click("nav button.link")
        page.wait_for_url("**/ui/login")
        page.goto(gw.base_url + "/ui/trainer")
        assert page.url.endswith("/ui/login")
    finally:
        page.close()
        api.close()
