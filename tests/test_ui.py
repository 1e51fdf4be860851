"""The MLflow UI end to end: a short job against a real `mlflow server`, its run page in headless
Chromium, the `loss` and `lr` charts with every logged point, and a screenshot of them.

Chromium is Debian's `chromium` package, installed by `apt-get` when missing (CI runs as root on a
fresh machine); the test skips only where that is impossible. Playwright drives the system browser
(`executable_path`): `playwright install` is never run. The screenshot is saved in the test's tmp
dir and in `test-artifacts/ui-loss-curves.png` (kept after a failure too, to see what was drawn).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, demo_overrides, run_trainer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACT = ROOT / "test-artifacts" / "ui-loss-curves.png"
# MLflow draws a marker per point while a line has fewer than 60 points: the check counts markers.
MAX_ITER = 30
TIMEOUT_MS = 60_000  # each wait for the single-page app (2 slow CPU cores serve and render it)


def _apt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", *args], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


@pytest.fixture(scope="session")
def chromium() -> Path:
    """/usr/bin/chromium, installed from Debian's archive when missing; a skip only if it cannot be."""
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        pytest.skip("Chromium cannot be installed: /usr/bin/chromium is missing and there is no apt-get")
    if os.geteuid() != 0:
        pytest.skip("Chromium cannot be installed: /usr/bin/chromium is missing and apt-get needs root "
                    "(run `apt-get install -y chromium` as root)")
    start = time.monotonic()
    for args in (("update",), ("install", "-y", "chromium")):
        done = _apt(*args)
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-5:]
            pytest.skip(f"Chromium cannot be installed: apt-get {' '.join(args)} exited {done.returncode}: "
                        + " | ".join(tail))
    if not CHROMIUM.exists():
        pytest.skip("Chromium cannot be installed: apt-get installed chromium but not /usr/bin/chromium")
    print(f"installed Debian's chromium in {time.monotonic() - start:.0f} s")
    return CHROMIUM


def chart_card(page, key: str):
    """The chart card titled exactly `key` (`loss` is not `loss_box_reg`)."""
    return (page.locator('[data-testid="experiment-view-compare-runs-card"]')
            .filter(has=page.locator(f'h4[title="{key}"]')))


def check_chart(page, key: str, history) -> None:
    """The card for `key` is there and draws every logged point: one marker per point in the
    plotly SVG, a line through them, and the plotted (step, value) pairs are the logged ones.
    Without logged points there is no card (MLflow hides empty charts), or fewer markers."""
    from playwright.sync_api import expect

    card = chart_card(page, key)
    expect(card, f"no chart for {key!r} on the run page").to_have_count(1, timeout=TIMEOUT_MS)
    markers = card.locator(".js-plotly-plot g.scatterlayer g.trace g.points path.point")
    expect(markers, f"the {key!r} chart does not draw one marker per logged point").to_have_count(
        len(history), timeout=TIMEOUT_MS)
    line = card.locator(".js-plotly-plot g.scatterlayer g.trace path.js-line").first
    expect(line, f"the {key!r} chart draws no line").to_have_attribute("d", re.compile(r"^M[\d.,-]+L"),
                                                                       timeout=TIMEOUT_MS)
    plotted = card.locator(".js-plotly-plot").evaluate("gd => ({x: gd.data[0].x, y: gd.data[0].y})")
    assert plotted["x"] == [m.step for m in history], f"the {key!r} chart plots other steps than were logged"
    assert plotted["y"] == pytest.approx([m.value for m in history], rel=1e-6), \
        f"the {key!r} chart plots other values than were logged"


def test_run_page_shows_loss_and_lr_curves(tmp_path, data_dir, mlflow_server, s3_server, chromium):
    from playwright.sync_api import sync_playwright

    exp = f"ui-{uuid.uuid4().hex[:6]}"
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": mlflow_server.url, "TRACKING.EXPERIMENT": exp,
                                                 "TRACKING.FLUSH_TIMEOUT_S": 60, "SOLVER.MAX_ITER": MAX_ITER,
                                                 "LOG_PERIOD": 10, "TRAIN.SNAPSHOT_ITERS": 1000,
                                                 "TEST.VIS_IMAGES": 0})  # MLflow puts image cards first
    result = run_trainer(args, cwd=tmp_path, env=s3_server.env)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name(exp)
    (run,) = client.search_runs([experiment.experiment_id])
    history = {key: sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
               for key in ("loss", "lr")}
    assert all([m.step for m in h] == list(range(MAX_ITER)) for h in history.values())

    url = f"{mlflow_server.url}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics"
    shots = [tmp_path / "ui-loss-curves.png", ARTIFACT]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 720})
            # Cosmetic, for the screenshot: MLflow 3's "Model training" sidebar (a trainer's user picks
            # it), and its assistant panel, which opens by itself on a first visit, left closed.
            context.add_init_script("localStorage.setItem('mlflow.workflowType_v1', '\"machine_learning\"');"
                                    "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');")
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            try:
                page.goto(url)
                # Only the charts asked for: both in view (off-screen cards render lazily) and in the shot.
                page.get_by_placeholder("Search metric charts").fill("^(loss|lr)$")
                for key in ("loss", "lr"):
                    check_chart(page, key, history[key])
                page.mouse.move(0, 0)  # no hover label over a chart
            finally:
                page.wait_for_timeout(500)  # let the last re-render settle
                for shot in shots:
                    shot.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(shot))
        finally:
            browser.close()
    assert all(shot.stat().st_size > 10_000 for shot in shots)


def _browser_page(pw, chromium, width: int, height: int):
    browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS, headless=True)
    context = browser.new_context(viewport={"width": width, "height": height})
    context.add_init_script("localStorage.setItem('mlflow.workflowType_v1', '\"machine_learning\"');"
                            "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    return browser, page


def scroll_to_column(page, title: str) -> None:
    """The grid draws only the columns in view, and a model's columns come in no fixed order (the
    final model may also carry the run's loss metrics): scroll right until `title` is drawn."""
    from playwright.sync_api import expect

    header = page.get_by_role("columnheader", name=title, exact=True)
    expect(page.get_by_role("columnheader", name="Model name")).to_be_visible(timeout=TIMEOUT_MS)
    for _ in range(40):
        if header.count():
            return
        page.locator(".ag-body-horizontal-scroll-viewport, .ag-center-cols-viewport").evaluate_all(
            "els => els.forEach(el => { el.scrollLeft += 500 })")
        page.wait_for_timeout(250)
    raise AssertionError(f"no {title!r} column in the Models tab")


def test_models_tab_ranks_the_checkpoints_and_the_run_shows_what_the_detector_sees(
        tmp_path, data_dir, mlflow_server, s3_server, chromium):
    """The experiment's Models tab lists each evaluated checkpoint with its bbox/AP as MLflow has it,
    and an evaluation drawing opens in the run's artifact viewer. Screenshots of both go to
    test-artifacts/ (the README's copies in docs/ are from such a run)."""
    from playwright.sync_api import expect, sync_playwright

    exp = f"ui-models-{uuid.uuid4().hex[:6]}"
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": mlflow_server.url, "TRACKING.EXPERIMENT": exp,
                                                 "TRACKING.FLUSH_TIMEOUT_S": 60, "SOLVER.MAX_ITER": 6,
                                                 "TEST.EVAL_PERIOD": 2, "TRACKING.REGISTERED_MODEL": exp})
    result = run_trainer(args, cwd=tmp_path, env=s3_server.env)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name(exp)
    (run,) = client.search_runs([experiment.experiment_id])
    models = [m for m in client.search_logged_models([experiment.experiment_id])
              if m.model_type == "tracktron-checkpoint"]
    checkpoints = {m.name: next(x.value for x in m.metrics if x.key == "bbox/AP") for m in models}
    ids = {m.name: m.model_id for m in models}
    assert set(checkpoints) == {"model_iter1", "model_iter3", "model_final"}
    image = sorted(a.path for a in client.list_artifacts(run.info.run_id, "images")
                   if "+step+5+" in a.path and a.path.endswith(".png"))[0]

    models_shot, image_shot = ROOT / "test-artifacts" / "ui-models.png", ROOT / "test-artifacts" / "ui-eval-images.png"
    models_shot.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser, page = _browser_page(pw, chromium, 2200, 400)  # wide: the metric columns come after six others
        try:
            page.goto(f"{mlflow_server.url}/#/experiments/{experiment.experiment_id}/models")
            for name in checkpoints:
                expect(page.get_by_role("link", name=name, exact=True)).to_be_visible(timeout=TIMEOUT_MS)
            scroll_to_column(page, "bbox/AP")
            # Each checkpoint's row (the grid splits it into a pinned and a scrolling part) shows the AP
            # MLflow's API reports for it.
            for name, ap in checkpoints.items():
                cells = page.locator(f'[role="row"][row-id="{ids[name]}"]')
                expect(cells.first).to_be_visible(timeout=TIMEOUT_MS)
                numbers = [float(x) for x in re.findall(r"\d+\.\d+(?:e-?\d+)?|\b0\b", " ".join(cells.all_inner_texts()))]
                assert any(x == pytest.approx(ap, rel=1e-6, abs=1e-12) for x in numbers), (name, ap, numbers)
            page.mouse.move(0, 0)
            page.screenshot(path=str(models_shot))
        finally:
            browser.close()
        browser, page = _browser_page(pw, chromium, 1100, 560)
        try:
            page.goto(f"{mlflow_server.url}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/artifacts/"
                      f"{image}")
            picture = page.locator("img[src^='blob:']").first
            expect(picture).to_be_visible(timeout=TIMEOUT_MS)
            assert picture.evaluate("img => img.complete && img.naturalWidth") > 0  # the PNG decoded in the browser
            page.screenshot(path=str(image_shot))
        finally:
            browser.close()
    for shot in (models_shot, image_shot):  # docs/ has copies of these, made by hand
        assert shot.stat().st_size > 10_000
