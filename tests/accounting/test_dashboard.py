"""`GET /`, `GET /metrics` and the health/status CLI against a real `python -m motor serve`.

The dashboard is loaded in headless Chromium; its DOM must show the running job's id on
the CPU map (skipped when Chromium is not installed).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import httpx
import pytest
from polling import wait_for

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(serve_factory, tmp_path):
    port = free_port()
    serve = serve_factory("--listen", f"127.0.0.1:{port}", "--isolation", "none").start()
    barrier = tmp_path / "go"
    script = f"while [ ! -e {barrier} ]; do sleep 0.01; done"
    job_id = serve.cli("submit", "--weight", "1", "--workspace", "dash",
                       "--repository", "/src/app", "--", "sh", "-c", script)
    assert job_id.returncode == 0, job_id.stderr.decode()
    job_id = job_id.stdout.decode().strip()
    base = f"http://127.0.0.1:{port}"  # no --token-file: TCP serves the read-only dashboard
    unix = httpx.Client(transport=httpx.HTTPTransport(uds=str(serve.socket)), base_url="http://motor")
    with unix:  # job records are not on the token-less TCP listener: read them on the socket
        wait_for(lambda: unix.get(f"/v1/jobs/{job_id}").json()["state"] == "running",
                 what="the job to run")
        assert httpx.get(f"{base}/v1/jobs/{job_id}").status_code == 401
    yield serve, base, job_id
    barrier.write_text("")


def test_dashboard_shows_the_running_job_on_the_cpu_map(served, tmp_path):
    serve, base, job_id = served
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<title>motor</title>" in html and "/v1/health" in html and "/v1/status" in html
    assert "<script src" not in html and "<link " not in html and "http://" not in html  # self-contained
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium); DOM check skipped")
    profile = tmp_path / "chromium-profile"
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
         "--dump-dom", f"{base}/"],
        capture_output=True, timeout=120)
    dom = result.stdout.decode(errors="replace")
    assert result.returncode == 0 and dom, result.stderr.decode(errors="replace")[-2000:]
    assert 'data-loaded="1"' in dom, dom[-3000:]
    cpus = httpx.get(f"{base}/v1/health").json()["cpus"]["jobs"][job_id]
    for cpu in cpus:  # the cell of each CPU the job holds names the job
        cell = dom.split(f'data-cpu="{cpu}"', 1)[1].split("</div>", 1)[0]
        assert job_id in cell, cell
    assert 'id="qwchart"' in dom  # the hourly queue-wait chart (inline SVG)


def test_metrics_and_health_cli_on_a_real_runner(served):
    serve, base, job_id = served
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = metrics.text
    for name in ("motor_permits_held 1.0", "motor_capacity_max_weight", "motor_queue_pending_jobs 0.0",
                 "motor_disk_free_bytes", "motor_running_jobs 1.0"):
        assert name in text, name
    report = serve.cli_json("health")
    assert report["capacity"]["held_permits"] == 1 and report["active"]["jobs"] == 1
    readable = serve.cli("health")
    assert readable.returncode == 0
    out = readable.stdout.decode()
    assert "permits 1/" in out and "disk: free" in out and "admission refusals: none" in out
    status = serve.cli("status")
    assert status.returncode == 0 and job_id in status.stdout.decode()
    assert json.loads(serve.cli("status", "--json").stdout)["running"][0]["job_id"] == job_id


def test_the_page_reads_only_fields_a_status_row_has():
    """The page draws its job tables from `GET /v1/status`, whose entries are status rows
    since stop 31 (scheduling/view.py): every field it reads of an entry is one of theirs."""
    import re

    from motor.accounting import dashboard
    from motor.scheduling.view import LIVE_FIELDS, ROW_FIELDS

    source = dashboard.PAGE
    body = source[source.index("function renderStatus"):source.index("function renderDisk")]
    read = set(re.findall(r"\br\.([a-z_]+)", body))
    assert {"job_id", "workspace", "claim", "cpus", "command", "waiting_on",
            "queue_wait_ms"} <= read
    assert read <= set(ROW_FIELDS) | set(LIVE_FIELDS)
