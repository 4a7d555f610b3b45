"""The Prometheus files the package ships (prometheus/): Debian's ``promtool`` (installed with
``prometheus`` by .ci/run) accepts each as shipped, checked from another working directory,
and a real Prometheus run on scrape.yml where it lies evaluates the recording rules as often
as it scrapes, so ``job:gputaskman_hosts_down:count`` follows a dead serve within one scrape
interval, not Prometheus's default minute. A missing tool is a SKIP with the reason."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fleet_helpers import wait_for  # noqa: E402
from prom_helpers import Prometheus  # noqa: E402

EXAMPLES = HERE.parent / "prometheus"
PROMTOOL = shutil.which("promtool")


def _promtool(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (apt install prometheus; .ci/run does)")
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("name", ["scrape.yml", "federation.yml"])
def test_promtool_accepts_each_shipped_config_as_is_from_another_directory(name, tmp_path):
    """Catches a shipped config that only works after editing: a rules file or token file
    it names but the directory does not hold, or a path read from the working directory."""
    r = _promtool(tmp_path, "check", "config", str(EXAMPLES / name))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout and "FAILED" not in r.stdout + r.stderr


def test_promtool_accepts_the_shipped_rules(tmp_path):
    r = _promtool(tmp_path, "check", "rules", str(EXAMPLES / "rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


def test_the_shipped_token_placeholder_is_never_a_token_serve_takes(tmp_path):
    """Catches a placeholder a host's serve would accept as its token (a public secret):
    serve must refuse it, whatever its file mode."""
    from gputaskman.serve.httpauth import TokenError, read_token

    copy = tmp_path / "gputaskman.token"
    copy.write_bytes((EXAMPLES / "gputaskman.token").read_bytes())
    copy.chmod(0o600)
    with pytest.raises(TokenError, match="without spaces"):
        read_token(copy)


def test_prometheus_evaluates_the_shipped_rules_as_often_as_it_scrapes(tmp_path):
    """Catches a scrape.yml without ``evaluation_interval``: Prometheus would evaluate the
    rules once a minute, and count a dead host as up for up to a minute after its scrape
    failed. Prometheus runs the shipped file unchanged (its hosts do not exist here)."""
    prom = Prometheus(tmp_path, [], config_file=EXAMPLES / "scrape.yml").wait_ready()
    try:
        (group,) = prom.api("/api/v1/rules")["groups"]

        def targets() -> list[dict]:  # listed once the scrape manager has synced
            return prom.api("/api/v1/targets?state=active")["activeTargets"]

        wait_for(lambda: len(targets()) == 2, 30, "Prometheus to list the example's hosts")
        intervals = {t["scrapeInterval"] for t in targets()}
    finally:
        prom.stop()
    assert group["name"] == "gputaskman" and len(group["rules"]) == 7
    assert intervals == {"15s"} and group["interval"] == 15
