"""The shipped systemd units: they parse, every command they run is a real duvm command line
that duvm's own parser accepts, the config file they name has a shipped example that loads for
both units, and `systemd-analyze verify` finds nothing to say about them.

This machine's PID 1 is not systemd, so the units are verified, not started.
"""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from duvm import cli
from duvm.node.lifecycle import control

PKG = Path(__file__).resolve().parents[1]
UNITS = PKG / "systemd"
INSTALLED_DUVM = "/usr/local/bin/duvm"


def unit(name: str) -> configparser.RawConfigParser:
    # systemd allows repeated keys; none of ours repeats one, so strict parsing also proves that
    cp = configparser.RawConfigParser(strict=True, delimiters=("=",), comment_prefixes=("#",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    cp.read_string((UNITS / name).read_text(), source=name)
    return cp


def parse_duvm(argv: list[str]) -> object:
    assert argv[0] == INSTALLED_DUVM, argv
    return cli.build_parser().parse_args(argv[1:])  # SystemExit(2) on a bad command line


def test_enable_unit_is_a_oneshot_that_disables_on_stop() -> None:
    u = unit("duvm-enable.service")
    s = u["Service"]
    assert s["Type"] == "oneshot" and s["RemainAfterExit"] == "yes"
    assert s["KillMode"] == "process"  # systemd must not kill the daemon disable refused to stop
    start = parse_duvm(shlex.split(s["ExecStart"]))
    stop = parse_duvm(shlex.split(s["ExecStop"]))
    pre = parse_duvm(shlex.split(s["ExecStartPre"]))
    assert start.command == "enable" and start.config == Path("/etc/duvm/duvm.toml")
    assert pre.command == "doctor" and pre.config == start.config
    assert stop.command == "disable" and stop.state_dir == control.DEFAULT_STATE_DIR
    assert u["Unit"]["ConditionPathExists"] == str(start.config)
    assert "network-online.target" in u["Unit"]["After"].split()
    assert u["Install"]["WantedBy"] == "multi-user.target"


def test_example_config_is_what_the_enable_unit_reads() -> None:
    example = PKG / "duvm.example.toml"
    cfg = control.load_config(example)  # the shipped example is a valid config
    assert cfg.state_dir == control.DEFAULT_STATE_DIR  # so ExecStop's default state dir fits
    assert "/etc/duvm/duvm.toml" in example.read_text().splitlines()[0]


def test_node_unit_runs_duvm_node_with_the_example_config() -> None:
    from duvm.node.lifecycle import node_command as node

    u = unit("duvm-node.service")
    s = u["Service"]
    assert "EnvironmentFile" not in s  # one config file for both units
    args = parse_duvm(shlex.split(s["ExecStart"]))
    assert args.command == "node" and args.config == Path("/etc/duvm/duvm.toml")
    assert u["Unit"]["ConditionPathExists"] == str(args.config)
    # what that command would run with the shipped example as /etc/duvm/duvm.toml
    args.config = PKG / "duvm.example.toml"
    cfg = node.node_config(args)
    ms = node.memserver_args(cfg)
    assert ms.listen == "10.0.0.2:7070" and ms.capacity == str(4 << 30)
    assert ms.secret_file == "/etc/duvm/cluster.secret"  # off loopback it must have one
    # the control socket is where gputaskman looks and inside the unit's writable RuntimeDirectory
    assert ms.control_socket == "/run/duvm/memserver.ctl"
    assert Path(ms.control_socket).parent == Path("/run") / s["RuntimeDirectory"]
    # the enable unit keeps its state there too: stopping the node must not delete it
    assert s["RuntimeDirectoryPreserve"] == "yes"
    assert control.load_config(args.config).state_dir == Path(ms.control_socket).parent
    assert s["LimitMEMLOCK"] == "infinity"
    assert s["CapabilityBoundingSet"] == "" and "DynamicUser" not in s
    assert "AF_UNIX" in s["RestrictAddressFamilies"].split()  # the control socket
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"  # secret rotation keeps the pages


def test_enable_unit_lets_the_swap_path_protect_itself() -> None:
    """Catches a unit hardening that would quietly take the daemon's memory-pressure
    protections away (duvm.base.pressure): a node short of memory could then hang on its own swap
    device."""
    s = unit("duvm-enable.service")["Service"]
    assert s.get("RestrictRealtime", "no") == "no"
    assert "CPUSchedulingPolicy" not in s and "Nice" not in s
    assert "CapabilityBoundingSet" not in s and "NoNewPrivileges" not in s
    assert s["LimitMEMLOCK"] == "infinity" and int(s["OOMScoreAdjust"]) <= -900


def test_units_name_only_existing_subcommands() -> None:
    for name in ("duvm-node.service", "duvm-enable.service"):
        for key, cmd in unit(name)["Service"].items():
            if key.startswith("Exec") and key != "ExecReload":
                sub = shlex.split(cmd)[1]
                assert sub in cli.SUBCOMMANDS, f"{name} {key} runs unknown subcommand {sub}"


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (apt package systemd)",
)
def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    # verify checks that ExecStart binaries exist: point the units at this venv's duvm
    duvm = shutil.which("duvm", path=os.path.dirname(sys.executable)) or shutil.which("duvm")
    if duvm is None:
        pytest.skip("no duvm console script to stand in for /usr/local/bin/duvm")
    paths = []
    for name in ("duvm-node.service", "duvm-enable.service"):
        p = tmp_path / name
        p.write_text((UNITS / name).read_text().replace(INSTALLED_DUVM, duvm))
        paths.append(str(p))
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *paths],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ours = [line for line in (res.stdout + res.stderr).splitlines() if "duvm" in line]
    assert not ours, ours


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_catches_a_broken_unit(tmp_path: Path) -> None:
    """The verify test above can fail: a unit with a typo and a missing binary is reported."""
    p = tmp_path / "duvm-enable.service"
    text = (UNITS / "duvm-enable.service").read_text()
    p.write_text(text.replace("KillMode=process", "KillMode=proces"))
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(p)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = res.stdout + res.stderr
    assert "Failed to parse kill mode" in out
    assert f"Command {INSTALLED_DUVM} is not executable" in out and res.returncode != 0
