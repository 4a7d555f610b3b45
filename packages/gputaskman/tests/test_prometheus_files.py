"""The Prometheus files the package ships (prometheus/): Debian's ``promtool`` (installed with
``prometheus`` by .ci/run) accepts each as shipped, checked from another working directory,
and a real Prometheus run on scrape.yml where it lies evaluates the recording rules as often
as it scrapes, so ``job:gputaskman_hosts_down:count`` follows a dead serve within one scrape
interval, not Prometheus's default minute. A missing tool is a SKIP with the reason."""

from __future__ import annotations

import json
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
    assert "SUCCESS: 11 rules found" in r.stdout


# promtool's rule unit test: two hosts' series as serve exports them (processes of one pod on
# one host, one of them on two GPUs; a Slurm job's on both hosts; a process of unknown owner
# and one of hidden memory) and
# kube-state-metrics' kube_pod_info; what the owner rules must record from them
GIB = 1 << 30


def _series(metric: str, value: float, **labels: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{body}}}", "values": str(int(value))}


def _vram(instance: str, pid: str, gpu: str, gib: int) -> dict[str, str]:
    return _series(
        "gputaskman_process_vram_bytes",
        gib * GIB,
        job="gputaskman",
        instance=instance,
        pid=pid,
        name="p",
        gpu=gpu,
        provenance="measured",
    )


def _owner(instance: str, pid: str, gpu: str, pod: str = "", slurm: str = "") -> dict[str, str]:
    return _series(
        "gputaskman_process_owner_info",
        1,
        job="gputaskman",
        instance=instance,
        pid=pid,
        name="p",
        gpu=gpu,
        pod_uid=pod,
        pod_namespace="",
        pod_name="",
        slurm_job=slurm,
    )


def _expect(expr: str, *samples: tuple[str, int]) -> dict:
    return {
        "expr": expr,
        "eval_time": "0m",
        "exp_samples": [{"labels": f"{expr}{{{lab}}}", "value": v * GIB} for lab, v in samples],
    }


def owner_rules_test(rules: Path) -> dict:
    """promtool's test file for the owner rules (YAML is a superset of JSON)."""
    inputs = [
        _vram("a", "1", "0", 1),
        _vram("a", "1", "1", 1),  # the same process on a second GPU: a row of its own
        _vram("a", "2", "1", 2),
        _vram("a", "3", "0", 4),
        _vram("b", "3", "0", 8),
        _vram("b", "5", "0", 1),
        _vram("a", "9", "0", 16),  # its owner unknown: no info series
        _owner("a", "1", "0", pod="u-1"),
        _owner("a", "1", "1", pod="u-1"),
        _owner("a", "2", "1", pod="u-1"),
        _owner("a", "4", "0", pod="u-2"),  # its memory hidden: no VRAM series
        _owner("a", "3", "0", slurm="77"),
        _owner("b", "3", "0", slurm="77"),
        _owner("b", "5", "0", slurm="77"),
        _series("kube_pod_info", 1, namespace="ml", pod="trainer-0", uid="u-1", node="a"),
    ]
    pod = 'job="gputaskman",instance="a",pod_uid="u-1",pod_namespace="",pod_name=""'
    expect = [
        _expect("instance_pod:gputaskman_process_vram_bytes:sum", (pod, 4)),
        _expect(
            "instance_slurm_job:gputaskman_process_vram_bytes:sum",
            ('job="gputaskman",instance="a",slurm_job="77"', 4),
            ('job="gputaskman",instance="b",slurm_job="77"', 9),
        ),
        _expect("slurm_job:gputaskman_process_vram_bytes:sum", ('slurm_job="77"', 13)),
        _expect(
            "pod:gputaskman_process_vram_bytes:sum",
            ('uid="u-1",namespace="ml",pod="trainer-0"', 4),
        ),
    ]
    test = {"interval": "1m", "input_series": inputs, "promql_expr_test": expect}
    return {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [test]}


def test_promtool_checks_the_owner_rules_on_series_as_serve_exports_them(tmp_path):
    """Catches a rule that joins a process's memory to another process's owner, adds memory
    of a process whose owner is unknown (pid 9 has no info series) or a pod whose memory is
    hidden (pid 4 has no VRAM series), loses a Slurm job on one of its hosts, or does not
    take the pod's name from kube-state-metrics."""
    tests = tmp_path / "owner_rules_test.yml"
    tests.write_text(json.dumps(owner_rules_test(EXAMPLES / "rules.yml"), indent=1))
    r = _promtool(tmp_path, "test", "rules", str(tests))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


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
    assert group["name"] == "gputaskman" and len(group["rules"]) == 11
    assert intervals == {"15s"} and group["interval"] == 15
