"""enable/disable/status plumbing that needs no daemon: config parsing, refusals, status of a
node where nothing is enabled, and peers that do not answer (unknown, never 0)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from duvm.node.lifecycle import config, control, supervisor_process
from hypothesis import given
from hypothesis import strategies as st


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "duvm.toml"
    p.write_text(text)
    return p


def test_config_file_parsed(tmp_path: Path) -> None:
    cfg = control.load_config(
        write(
            tmp_path,
            """
peers = ["10.0.0.2:7070", "[::1]:7071", "node3"]
size = "2G"
replicas = 2
priority = 50
state_dir = "/run/duvm-test"
""",
        )
    )
    assert cfg.peers == ["10.0.0.2:7070", "[::1]:7071", "node3"]
    assert cfg.size == 2 << 30 and cfg.replicas == 2 and cfg.priority == 50
    assert cfg.socket == "/run/duvm-test/nbd.sock"


EXAMPLE = Path(__file__).parents[1] / "duvm.example.toml"


def test_example_config_in_docs_is_valid() -> None:
    cfg = control.load_config(EXAMPLE)
    # the example's own memserver ([node] listen 10.0.0.2:7070) is skipped among its peers
    assert cfg.peers == ["10.0.0.3:7070", "10.0.0.4:7070"]
    assert cfg.skipped_self == ["10.0.0.2:7070"] and cfg.replicas == 2
    # the cluster secret reaches the daemon's command line as the daemon's own flag
    assert cfg.daemon_args[:2] == ["--secret-file", "/etc/duvm/cluster.secret"]
    assert control.daemon_command(cfg)[-2:] == ["--secret-file", "/etc/duvm/cluster.secret"]
    node = control.load_node_config(EXAMPLE)
    assert node.listen == "10.0.0.2:7070" and node.capacity == 4 << 30
    assert node.secret_file == Path("/etc/duvm/cluster.secret") and node.lease == 60


def _example_with_secret(tmp_path: Path, secret: str | None) -> Path:
    lines = EXAMPLE.read_text().splitlines()
    out = [line for line in lines if not line.startswith("secret_file")]
    assert len(out) == len(lines) - 1, "the example has exactly one secret_file line"
    if secret is not None:
        out.insert(0, f'secret_file = "{secret}"')
    return write(tmp_path, "\n".join(out) + "\n")


def test_example_config_passes_doctors_parse_and_peer_auth(tmp_path: Path) -> None:
    """doctor reads the example as enable would, and its off-loopback peers are authenticated by
    the secret_file line; without that line the daemon's rule refuses them."""
    from duvm.node.doctor import doctor, doctor_check, doctor_cluster

    secret = tmp_path / "cluster.secret"
    res = run_cli("secret", "generate", str(secret))
    assert res.returncode == 0, res.stderr
    ns = argparse.Namespace(
        config=_example_with_secret(tmp_path, str(secret)),
        peers=None,
        secret_file=None,
        method=None,
        insecure=False,
        timeout=1.0,
    )
    opts = doctor.options_from_args(ns)
    assert opts.config_error is None and doctor.check_config(opts).status == doctor_check.OK
    assert opts.peers == ["10.0.0.3:7070", "10.0.0.4:7070"]
    assert doctor_cluster.secret_path(opts) == secret
    security, check = doctor_cluster.check_peer_auth(opts)
    assert check.status == doctor_check.OK and str(secret) in check.detail, check
    assert security is not None and security.keyring is not None

    ns.config = _example_with_secret(tmp_path, None)
    _, check = doctor_cluster.check_peer_auth(doctor.options_from_args(ns))
    assert check.status == doctor_check.FAIL and "--secret-file" in check.detail


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('size = "1G"', "no peers"),
        ('peers = ["a:1"]', "size is missing"),
        ('peers = ["a:1"]\nsize = "lots"', "not a size"),
        ('peers = ["a:1"]\nsize = "1G"\nreplicas = 2', "replicas = 2 needs 1..1"),
        ('peers = ["a:99999"]\nsize = "1G"', "bad peer address"),
        ('peers = [1, 2]\nsize = "1G"', "list of"),
        ('peers = ["a:1"]\nsize = "1G"\ncolour = "blue"', "unknown key"),
        ('peers = ["a:1"]\nsize = "1000"', "at least 1 MiB"),
        ("peers = [", "not valid TOML"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(control.ControlError, match=message):
        control.load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("priority = true", "priority must be a whole number, not True"),
        ("priority = 1.5", "priority must be a whole number"),
        ('priority = "50"', "priority must be a whole number"),
        ('replicas = "2"', "replicas must be a whole number"),
        ('daemon_args = "--verbose"', "daemon_args must be a list of strings"),
        ("daemon_args = [1]", "daemon_args must be a list of strings"),
        ("state_dir = 5", "state_dir must be a non-empty string"),
        ('method = "floppy"', "method 'floppy' is not one of"),
        ("size = true", "size must be a size"),
        ("size = [1]", "size must be a size"),
        ('secret_file = ""', "secret_file must be a non-empty string"),
        ('secret_file = "/x"\ndaemon_args = ["--secret-file", "/y"]', "keep one"),
        ('daemon_args = ["--workers", "2"]', "daemon_args has --workers: use workers = N"),
        ('daemon_args = ["--workers=2"]', "daemon_args has --workers: use workers = N"),
        ("workers = 0", "workers = 0 is outside 1..64"),
        ("workers = 65", "workers = 65 is outside 1..64"),
        ('workers = "2"', "workers must be a whole number"),
        ('workers = 2\nmethod = "nbdfuse-loop"', "workers = 2 needs kernel nbd"),
        ("node = 5", "node must be a table"),
        ('[node]\ncapacity = "1G"', "node.listen is missing"),
        ('[node]\nlisten = "a:1"', "node.capacity is missing"),
        ('[node]\nlisten = "a:1"\ncapacity = "1G"\ncolour = 1', "unknown [node] key(s) ['colour']"),
        ('[node]\nlisten = "a:1"\ncapacity = "1G"\nlease = -1', "node.lease must be a positive"),
        ('[node]\nlisten = "a:1"\ncapacity = "1G"\nlease = true', "node.lease must be a positive"),
        ('[node]\nlisten = "a:70000"\ncapacity = "1G"', "node.listen: bad port"),
        ('[node]\nlisten = "a:1"\ncapacity = "lots"', "node.capacity: not a size"),
        ('[node]\nlisten = "a:1"\ncapacity = "1G"\nmemserver_args = "-v"', "list of strings"),
    ],
)
def test_wrong_types_are_a_clear_error_naming_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    body = text if text.startswith("size") else f'size = "1G"\n{text}'
    if not text.startswith("[node]"):
        body = f'peers = ["a:1"]\n{body}'
    else:
        body = f'peers = ["a:1"]\nsize = "1G"\n{text}'
    path = write(tmp_path, body)
    with pytest.raises(control.ControlError, match=re.escape(message)) as exc:
        control.load_config(path)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)


def test_non_utf8_config_is_a_one_line_error_for_every_command(tmp_path: Path) -> None:
    path = tmp_path / "duvm.toml"
    path.write_bytes(b'peers = ["a:1"]\nsize = "1G"\n# caf\xe9 latin-1\n')
    with pytest.raises(
        control.ControlError, match=r"cannot be read as text: not UTF-8 \(byte \d+, line 3\)"
    ):
        control.load_config(path)
    with pytest.raises(control.ControlError, match="not UTF-8"):
        control.load_node_config(path)
    for argv, code in (
        (["enable", "--config", str(path), "--state-dir", str(tmp_path)], 1),
        (["node", "--config", str(path)], 2),
        (["doctor", "--config", str(path), "--json"], 1),
    ):
        res = run_cli(*argv)
        assert res.returncode == code, (argv, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr + res.stdout
        if argv[0] == "doctor":  # doctor reports it as its failed config check
            checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
            assert checks["config"]["status"] == "fail"
            assert "not UTF-8" in checks["config"]["detail"]
        else:
            assert res.stderr.count("\n") == 1 and "not UTF-8" in res.stderr, res.stderr


def test_malformed_configs_exit_non_zero_with_one_line(tmp_path: Path) -> None:
    for i, text in enumerate(
        (
            "peers = [",
            'peers = ["a:1"]\nsize = "1G"\npriority = true',
            'peers = ["a:1"]\nsize = "1G"\nbogus = 1',
        )
    ):
        path = tmp_path / f"c{i}.toml"
        path.write_text(text)
        res = run_cli("enable", "--config", str(path), "--state-dir", str(tmp_path))
        assert res.returncode == 1 and res.stderr.startswith("duvm enable: config ")
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr


def test_node_section_parsed_and_own_memserver_skipped(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
secret_file = "/etc/duvm/s"
peers = ["127.0.0.1:7070", "127.0.0.1:7071", "10.9.9.9:7070"]
size = "64M"
[node]
listen = "127.0.0.1:7070"
capacity = 33554432
memserver_args = ["--verbose"]
""",
    )
    cfg = control.load_config(path)
    assert cfg.peers == ["127.0.0.1:7071", "10.9.9.9:7070"]
    assert cfg.skipped_self == ["127.0.0.1:7070"]
    node = control.load_node_config(path)
    assert node.capacity == 32 << 20 and node.lease is None
    assert node.memserver_argv() == [
        "--listen",
        "127.0.0.1:7070",
        "--capacity",
        str(32 << 20),
        "--control-socket",
        "/run/duvm/memserver.ctl",
        "--secret-file",
        "/etc/duvm/s",
        "--verbose",
    ]
    # the only peer being this node itself leaves none: said so
    only_self = write(
        tmp_path,
        'peers = ["127.0.0.1:7070"]\nsize = "64M"\n[node]\n'
        'listen = "127.0.0.1:7070"\ncapacity = "32M"',
    )
    with pytest.raises(control.ControlError, match="skipping this node's own memserver"):
        control.load_config(only_self)


def test_node_config_without_node_table_says_what_to_add(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match=r"no \[node\] table"):
        control.load_node_config(write(tmp_path, 'peers = ["a:1"]\nsize = "1G"'))
    # a provider-only node needs no peers or size
    node = control.load_node_config(
        write(tmp_path, '[node]\nlisten = "0.0.0.0:7070"\ncapacity = "1G"')
    )
    assert node.listen == "0.0.0.0:7070"


@pytest.mark.parametrize(
    ("peer", "listen", "own"),
    [
        ("10.0.0.2:7070", "10.0.0.2:7070", True),
        ("10.0.0.2", "10.0.0.2:7070", True),  # port-less peer: the default port
        ("10.0.0.2:7071", "10.0.0.2:7070", False),
        ("10.0.0.3:7070", "10.0.0.2:7070", False),
        ("127.0.0.1:7070", "0.0.0.0:7070", True),  # wildcard listen serves loopback too
        ("localhost:7070", "0.0.0.0:7070", True),
        ("192.0.2.1:7070", "0.0.0.0:7070", False),  # TEST-NET: not an address of this machine
        ("127.0.0.1:7070", "10.0.0.2:7070", False),  # a specific listen does not serve loopback
        ("nonsense:port", "0.0.0.0:7070", False),
    ],
)
def test_is_own_memserver(peer: str, listen: str, own: bool) -> None:
    from duvm.node.lifecycle.config import is_own_memserver

    assert is_own_memserver(peer, listen) is own


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="cannot read config"):
        control.load_config(tmp_path / "absent.toml")


_TOML_VALUES = st.one_of(
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=20),
    st.lists(st.text(max_size=8), max_size=3),
    st.lists(st.integers(), max_size=3),
)
_KEYS = st.sampled_from([*config.TOP_KEYS, "colour"])


def _load_both(data: bytes) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".toml", delete=False) as f:
        f.write(data)
    try:
        for load in (control.load_config, control.load_node_config):
            try:
                load(Path(f.name))
            except control.ControlError as exc:
                assert "\n" not in str(exc) or "TOML" in str(exc)
    finally:
        os.unlink(f.name)


@given(st.text(max_size=300))
def test_fuzz_config_never_crashes(text: str) -> None:
    _load_both(text.encode("utf-8", "surrogatepass"))


@given(st.binary(max_size=300))
def test_fuzz_config_bytes_never_crash(data: bytes) -> None:
    _load_both(data)


@given(
    st.dictionaries(_KEYS, _TOML_VALUES, max_size=6),
    st.dictionaries(st.sampled_from([*config.NODE_KEYS, "x"]), _TOML_VALUES, max_size=5),
)
def test_fuzz_config_values_of_every_type(top: dict, node: dict) -> None:
    """Well-formed TOML with any value under any key: a Config/NodeConfig or a ControlError."""

    def toml(v: object) -> str:  # JSON scalars and arrays are TOML, but for nan/inf
        return json.dumps(v, allow_nan=False)

    try:
        lines = [f"{k} = {toml(v)}" for k, v in top.items() if k != "node"]
        if node:
            lines += ["[node]", *(f"{k} = {toml(v)}" for k, v in node.items())]
    except ValueError:  # nan/inf: not expressible this way
        return
    _load_both("\n".join(lines).encode("utf-8", "surrogatepass"))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duvm.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_when_nothing_is_enabled(tmp_path: Path) -> None:
    res = run_cli("status", "--json", "--state-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["enabled"] is False and st["device"] is None and st["swap"] is None
    assert st["peers"] == []
    text = run_cli("status", "--state-dir", str(tmp_path))
    assert text.returncode == 0 and "not enabled" in text.stdout
    # and what to do next
    assert "to enable: sudo duvm enable --config" in text.stdout and "duvm doctor" in text.stdout


def test_unreachable_peer_is_unknown_not_zero(dead_port: int) -> None:
    (st,) = control.peer_statuses([f"127.0.0.1:{dead_port}"], timeout=2)
    assert st["health"] == "unreachable" and st["pages"] is None and st["error"]


def test_workers_reach_the_daemon_and_its_record(tmp_path: Path) -> None:
    """Catches `workers` read but not given to the daemon (one process serving N sockets), or
    left out of daemon.json (a restart would come back with one worker)."""
    from duvm.node.lifecycle import enable

    cfg = control.load_config(write(tmp_path, 'peers = ["a:1", "b:1"]\nsize = "1G"\nworkers = 4'))
    assert cfg.workers == 4
    cmd = control.daemon_command(cfg)
    assert cmd[cmd.index("--workers") + 1] == "4"
    assert cfg.daemon_flags()[:2] == ["--workers", "4"]  # what daemon.json records
    assert supervisor_process.workers_arg(cfg.daemon_flags()) == 4
    parser = argparse.ArgumentParser()
    enable.add_arguments(parser)
    base = ["--peers", "a:1,b:1", "--size", "1G"]
    one = enable.config_from_args(parser.parse_args(base))
    assert one.workers == 1 and "--workers" not in control.daemon_command(one)
    two = enable.config_from_args(parser.parse_args([*base, "--workers", "2"]))
    assert two.workers == 2 and two.supervise


def test_enable_argument_errors(tmp_path: Path) -> None:
    res = run_cli("enable", "--peers", "127.0.0.1:1", "--state-dir", str(tmp_path))
    assert res.returncode != 0 and "--size" in res.stderr
    res = run_cli("enable", "--config", str(tmp_path / "x.toml"), "--size", "1G")
    assert res.returncode != 0 and "not both" in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_enable_and_disable_refuse_without_root(tmp_path: Path) -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msgs = []
        try:
            os.setgid(65534)
            os.setuid(65534)
            cfg = control.Config(peers=["127.0.0.1:1"], size=1 << 30, state_dir=tmp_path)
            for fn in (lambda: control.enable(cfg), lambda: control.disable(tmp_path)):
                try:
                    fn()
                    msgs.append("no error")
                except Exception as exc:
                    msgs.append(f"{type(exc).__name__}: {exc}")
        finally:
            os.write(w, json.dumps(msgs).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msgs = json.loads(f.read())
    os.waitpid(pid, 0)
    assert len(msgs) == 2
    assert all(m.startswith("AttachError: attaching swap needs root") for m in msgs), msgs
    assert not (tmp_path / "daemon.json").exists()


def test_disable_when_not_enabled(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    res = run_cli("disable", "--state-dir", str(tmp_path))
    assert res.returncode == 0 and "was not enabled" in res.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_demo_without_root_says_why() -> None:
    from duvm.cli import demo

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, json.dumps(demo.preflight()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        problems = json.loads(f.read())
    os.waitpid(pid, 0)
    assert problems and problems[0].startswith("needs root") and "sudo" in problems[0]


@pytest.mark.parametrize(
    ("peers", "setting", "expected"),
    [
        (["a:1", "b:1", "c:1"], None, 2),  # replicated whenever the pool allows it
        (["a:1", "b:1"], None, 2),
        (["a:1"], None, 1),
        (["a:1", "b:1", "c:1"], 1, 1),  # an explicit choice is kept
        (["a:1", "b:1", "c:1"], 3, 3),
    ],
)
def test_replicas_default_to_two_when_the_peers_allow(
    tmp_path: Path, peers: list[str], setting: int | None, expected: int
) -> None:
    text = f'peers = {json.dumps(peers)}\nsize = "1G"\n'
    if setting is not None:
        text += f"replicas = {setting}\n"
    cfg = control.load_config(write(tmp_path, text))
    assert cfg.replicas == expected
    cmd = control.daemon_command(cfg)
    assert cmd[cmd.index("--replicas") + 1] == str(expected)
    # the command line's own defaults agree with the config file's
    from duvm.node.lifecycle import enable

    parser = argparse.ArgumentParser()
    enable.add_arguments(parser)
    argv = ["--peers", ",".join(peers), "--size", "1G"]
    if setting is not None:
        argv += ["--replicas", str(setting)]
    from_args = enable.config_from_args(parser.parse_args(argv))
    assert from_args.replicas == expected
    warning = enable.replica_warning(from_args)
    if expected == 1:
        assert warning and "I/O errors" in warning
        assert ("second peer" in warning) == (len(peers) == 1)
    else:
        assert warning is None
