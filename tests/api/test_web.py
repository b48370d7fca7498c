"""The web page at `/`, driven through a real browser (Debian's Chromium) against a real
`autoshard serve`: upload a model with plan options, watch the plan, find it listed with its
links; a bad option is shown on the page in words; every user string is escaped. (A running
plan's page, its stage and the solver's figures: test_restart.py, whose job runs long.)

The real `service` package is not imported here: in this folder that name is the tests'."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from autoshard.cli.main import main
from autoshard.document.plan_document import PlanDocument
from autoshard.units import format_bytes, format_seconds

from .conftest import MODELS, Server

MLP = MODELS / "mlp.onnx"

# The pages read the store as the API does: test_api.py runs on both stores, these on SQLite.
pytestmark = pytest.mark.parametrize("server", ["sqlite"], indirect=True)


def untimed(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if k != "timing"}


def test_upload_form_plans_the_model(
    server: Server, page: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    tab, console = page
    tab.goto(f"{server.url}/")
    assert tab.title() == "autoshard"
    tab.set_input_files("#model", str(MLP))
    tab.fill("#mesh", "2x2")
    tab.fill("#dims", '{"batch": 4}')
    tab.select_option("#mode", "training")
    tab.select_option("#optimizer", "sgd")
    tab.select_option("#precision", "fp32")
    tab.click("button[type=submit]")
    tab.wait_for_url(re.compile(r"/plans/[0-9a-f]{20}$"))
    job_id = tab.url.rsplit("/", 1)[1]
    # The page polls until the plan is done, then shows its links.
    tab.wait_for_selector("#job .done", timeout=90_000)
    base = f"/v1/plans/{job_id}"
    for path in ("report.html", "plan.json", "report.md", "spmd.mlir"):
        assert tab.locator(f'#job a[href="{base}/{path}"]').count() == 1
    assert "mlp.onnx: mesh 2x2, batch=4, training" in tab.inner_text("main")

    # The form's fields are the REST API's: the plan is what the CLI plans with those flags.
    tab.click(f'#job a[href="{base}/plan.json"]')
    plan = json.loads(tab.inner_text("body"))
    flags = ["--mesh", "2x2", "--dim", "batch=4", "--mode", "training", "--optimizer", "sgd",
             "--precision", "fp32", "--json", "-q"]  # fmt: skip
    assert main(["plan", str(MLP), *flags]) == 0
    assert untimed(plan) == untimed(json.loads(capsys.readouterr().out))

    # Listed on the front page, with its page and its report.
    tab.goto(f"{server.url}/")
    row = tab.locator("#plans tr", has=tab.locator(f'a[href="/plans/{job_id}"]'))
    assert row.count() == 1
    assert row.locator(f'a[href="{base}/report.html"]').count() == 1
    assert "done" in row.inner_text()

    # ...which opens: the HTML report of this plan, its strategy first.
    row.locator(f'a[href="{base}/report.html"]').click()
    tab.wait_for_url(re.compile(r"/report\.html$"))
    assert plan["story"] in tab.inner_text("body")
    assert console.errors == []


def test_a_bad_option_is_shown_on_the_page_escaped(server: Server, page: Any) -> None:
    tab, console = page
    tab.goto(f"{server.url}/")
    tab.set_input_files("#model", str(MLP))
    tab.fill("#mesh", "<b>2</b>x2")
    tab.fill("#dims", '{"batch": 8}')
    with tab.expect_navigation() as navigation:
        tab.click("button[type=submit]")
    assert navigation.value.status == 422
    error = tab.locator("#error")
    assert error.inner_text().startswith("The plan was not started: invalid mesh '<b>2</b>x2'")
    assert error.locator("b").count() == 0  # the user's text, not markup
    assert tab.input_value("#mesh") == "<b>2</b>x2"  # the form as given, to correct it
    assert tab.input_value("#dims") == '{"batch": 8}'
    # The browser reports the 422 of the page itself; nothing else.
    assert [e for e in console.errors if "status of 422" not in e] == []


def test_unknown_plan_page(server: Server) -> None:
    response = server.get("/plans/%3Cscript%3E")
    assert response.status_code == 404
    assert "No plan &lt;script&gt;" in response.text and "<script>" not in response.text


DECODER = MODELS / "decoder_32l_shape_only.onnx"  # seconds of solving: long enough to watch
DECODER_FIELDS = {"mesh": "2x4x8", "dims": json.dumps({"batch": 8, "seq": 2048}),
                  "bandwidth": "450GB/s", "memory": "8GB"}  # fmt: skip


def test_a_running_plans_page_refreshes_itself_until_it_ends(
    server: Server, browser: Any, page: Any
) -> None:
    job_id = server.submit(DECODER, DECODER_FIELDS).json()["id"]
    url = f"{server.url}/plans/{job_id}"
    # Without script, the page reloads itself (a meta refresh) while the plan runs.
    plain = browser.new_context(java_script_enabled=False)
    try:
        still = plain.new_page()
        still.goto(url)
        assert "running" in still.inner_text("#job") or "queued" in still.inner_text("#job")
        with still.expect_navigation(timeout=5_000):
            pass
    finally:
        plain.close()
    # With script, it fetches itself and redraws the plan's section, without a reload, while
    # the figures change; once the plan ended it shows the links and asks for nothing more.
    tab, console = page
    fetched: list[str] = []
    tab.on("request", lambda request: fetched.append(request.url))
    tab.goto(url)
    navigations = 0

    def navigated(_: Any) -> None:
        nonlocal navigations
        navigations += 1

    tab.on("framenavigated", navigated)
    tab.wait_for_selector("#job .running", timeout=60_000)
    seen = {tab.inner_text("#job")}
    while len(seen) < 3 and tab.locator("#job .running").count():
        tab.wait_for_timeout(500)
        seen.add(tab.inner_text("#job"))
    assert len(seen) >= 3 and navigations == 0, seen  # redrawn in place while it ran
    tab.wait_for_selector("#job .done", timeout=180_000)
    assert tab.locator(f'#job a[href="/v1/plans/{job_id}/report.html"]').count() == 1
    asked = len(fetched)
    tab.wait_for_timeout(3_000)
    assert fetched[asked:] == []  # polling stopped
    assert console.errors == []


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"mesh": "2x2", "dims": '{"batch": 8}', "memory": "120KB"}, id="inference"),
        pytest.param({"mesh": "2x2", "dims": '{"batch": 8}', "mode": "training"}, id="training"),
    ],
)
def test_a_done_plans_page_shows_its_strategy_step_time_and_memory(
    server: Server, page: Any, fields: dict[str, str]
) -> None:
    job = server.wait(server.submit(MLP, fields).json()["id"])
    assert job["status"] == "done", job["error"]
    plan = PlanDocument.from_json(job["plan"], "the job's plan")
    assert plan.cost is not None and plan.cluster is not None and plan.story
    tab, console = page
    tab.goto(f"{server.url}/plans/{job['id']}")
    shown = tab.inner_text("#plan")
    assert tab.inner_text("#plan #story") == plan.story
    assert plan.recipes is not None  # the standard recipes beside it, and how it differs
    assert tab.inner_text("#recipes #difference") == plan.recipes.difference
    assert "dp" in tab.inner_text("#recipes table")
    cost, budget = plan.cost, plan.cluster.memory_bytes
    overlapped = ", overlapped: the critical path" if cost.scheduled_s is not None else ""
    step = (
        f"step time\n{format_seconds(cost.step_time_s)} (compute "
        f"{format_seconds(cost.compute_time_s)} + communication "
        f"{format_seconds(cost.comm_time_s)}{overlapped}, "
        f"{format_bytes(cost.comm_bytes_per_device)} sent per device)"
    )
    assert step in shown
    peak = cost.memory_bytes_per_device
    memory = f"peak memory\n{format_bytes(peak)} per device of {format_bytes(budget)} budget "
    assert memory + f"({peak / budget:.1%})" in shown
    if fields.get("mode") == "training":  # what the peak holds, by kind
        kinds = cost.memory_by_kind or {}
        said = [f"{kind.replace('_', ' ')} {format_bytes(n)}" for kind, n in kinds.items() if n]
        assert said and f"budget ({peak / budget:.1%}): {', '.join(said)}" in shown
    assert f"priced on\n{plan.cluster.device}, mesh 2x2" in shown
    assert console.errors == []


def test_the_form_takes_a_cluster(server: Server, page: Any) -> None:
    tab, console = page
    tab.goto(f"{server.url}/")
    assert tab.locator("textarea#cluster").count() == 1  # room for a cluster file's content
    tab.set_input_files("#model", str(MLP))
    tab.fill("#mesh", "2x2")
    tab.fill("#dims", '{"batch": 8}')
    tab.fill("#cluster", "dgx-h10")
    with tab.expect_navigation() as navigation:
        tab.click("button[type=submit]")
    assert navigation.value.status == 422
    assert tab.inner_text("#error") == (
        "The plan was not started: unknown cluster preset 'dgx-h10'; presets: dgx-h100, "
        "dgx-a100, selene, grand-teton-h100, mi300x-8, tpu-v5e-256, g2-l4-8 (or give a cluster "
        "file's JSON or YAML content)"
    )
    assert tab.input_value("#cluster") == "dgx-h10"  # kept, to correct it
    tab.set_input_files("#model", str(MLP))
    tab.fill("#cluster", "dgx-a100")
    tab.click("button[type=submit]")
    tab.wait_for_selector("#job .done", timeout=90_000)
    assert "NVIDIA A100" in tab.inner_text("#plan")
    assert [e for e in console.errors if "status of 422" not in e] == []
