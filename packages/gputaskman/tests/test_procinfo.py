"""procinfo.py and procargs.py against real processes on this machine, plus fuzzing of the
maps-line parser and the command-line redactor."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from gputaskman.base import procfs
from gputaskman.base.procargs import (
    REDACTED,
    flag_value,
    model_args,
    redact_argv,
    resolve,
    split_cmdline,
)
from gputaskman.base.readings import Reason
from gputaskman.intel.procinfo import (
    LLM,
    RUNTIMES,
    Runtime,
    classify,
    detect_runtimes,
    mapped_models,
    mapped_paths,
    parse_maps_line,
    scan_process,
)
from gputaskman.intel.procscan import Scanner
from hypothesis import given, settings
from hypothesis import strategies as st

# A child that maps every file named after "--map" and then sleeps; prints "ready".
MAPPER = r"""
import mmap, sys, time
maps = []
args = sys.argv[1:]
for i, a in enumerate(args):
    if a == "--map":
        f = open(args[i + 1], "rb")
        maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
print("ready", flush=True)
time.sleep(120)
"""


def write_tiny_llama_gguf(path: Path) -> None:
    """A real GGUF file (llama architecture, 2 layers, one tiny tensor) via `gguf`."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def start_mapper(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MAPPER, *args], cwd=cwd, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        pytest.fail(f"mapper child did not start: {line!r}")
    return proc


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


# --------------------------------------------------------------------------- real processes


def test_real_process_mapping_a_gguf_with_cmdline_and_secret(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    model = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(model)
    assert gguf.GGUFReader(str(model)).fields["general.architecture"] is not None
    # The secret is model-shaped on purpose: a redacted value must never become a model.
    proc = start_mapper(
        ["--map", model.name, "-m", model.name, "--api-key", "s3cr3t-key.gguf", "--port", "1"],
        tmp_path,
    )
    children.append(proc)
    info = scan_process(proc.pid)
    assert not info.gone and info.reasons == ()
    assert info.cwd == str(tmp_path) and info.exe is not None
    # mapped evidence: the file the kernel shows in the memory map
    mapped = [m for m in info.models if m.evidence == "mapped"]
    assert [m.path for m in mapped] == [str(model)]
    assert mapped[0].exists is True and mapped[0].size_bytes == model.stat().st_size
    assert mapped[0].deleted is False
    # cmdline evidence: "-m tiny-llama.gguf" resolved against the child's cwd
    cmd = [m for m in info.models if m.evidence == "cmdline"]
    assert [(m.raw, m.flag, m.path, m.exists) for m in cmd] == [
        (model.name, "-m", str(model), True)
    ]
    # the secret is redacted in the command line and is not a model candidate anywhere
    assert info.cmdline is not None and info.redacted == 1
    assert "s3cr3t" not in " ".join(info.cmdline)
    assert info.cmdline[info.cmdline.index("--api-key") + 1] == REDACTED
    assert not any("s3cr3t" in (m.raw or "") + (m.path or "") for m in info.models)
    # "--map tiny-llama.gguf" is a path-arg (informational), deduplicated with -m's value
    assert [m.evidence for m in info.models].count("path-arg") == 0
    assert info.classification is not None and info.classification.category == LLM
    assert info.classification.heuristic is False
    assert info.create_time is not None and (info.name or "").startswith("python")


def test_deleted_mapped_model_is_flagged(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    model = tmp_path / "gone.safetensors"
    model.write_bytes(b"x" * 4096)
    proc = start_mapper(["--map", str(model)], tmp_path)
    children.append(proc)
    model.unlink()
    info = scan_process(proc.pid)
    (ev,) = [m for m in info.models if m.evidence == "mapped"]
    assert ev.path == str(model) and ev.deleted is True and ev.exists is None
    # the argument still names it, as a path-arg: informational, never stat'ed
    (arg,) = [m for m in info.models if m.evidence == "path-arg"]
    assert arg.path == str(model) and arg.exists is None and arg.size_bytes is None


def test_library_named_libcudart_is_detected_as_cuda_runtime(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    real_so = Path(np.__file__).parent  # any real shared object will do; take one of numpy's
    candidates = sorted(real_so.rglob("*.so"))
    if not candidates:
        pytest.skip("no shared object found to copy")
    fake = tmp_path / "libcudart.so.12"
    shutil.copyfile(candidates[0], fake)
    proc = start_mapper(["--map", str(fake)], tmp_path)
    children.append(proc)
    info = scan_process(proc.pid)
    assert Runtime("cuda-runtime", "CUDA runtime", "libcudart.so.12") in info.runtimes
    assert "cuda-driver" not in info.runtime_keys  # libcudart is not libcuda
    # detection is not a category by itself (nothing else points anywhere)
    assert info.classification is None


def test_exited_and_zombie_processes_give_reasons_not_crashes() -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    if os.path.exists(f"/proc/{done.pid}"):
        pytest.skip("the PID was reused immediately")
    info = scan_process(done.pid)
    assert info.gone and info.reason("process") is not None
    assert info.reason("process").reason is Reason.PROCESS_GONE  # type: ignore[union-attr]
    assert info.runtimes == () and info.cmdline is None

    zombie = subprocess.Popen(["true"])
    try:
        for _ in range(100):  # not waited for: it stays a zombie
            if procfs.read_stat(zombie.pid).state == "Z":
                break
            time.sleep(0.02)
        z = scan_process(zombie.pid)
        assert not z.gone and z.runtimes == () and z.models == () and z.cmdline == ()
    finally:
        zombie.wait()

    scanner = Scanner(budget=None)
    result = scanner.scan([done.pid])
    assert result.gone == (done.pid,) and done.pid not in result.infos


def test_kernel_thread_is_recognised_and_not_read_further() -> None:
    kthreads = []
    for pid in procfs.list_pids():
        try:
            if procfs.read_stat(pid).kernel_thread:
                kthreads.append(pid)
        except procfs.ProcError:
            continue
    if not kthreads:
        pytest.skip("no kernel threads visible in this PID namespace")
    info = scan_process(kthreads[0])
    assert info.kernel_thread and not info.gone and info.reasons == ()
    assert info.cmdline == () and info.exe is None and info.runtimes == ()
    me = scan_process(os.getpid())
    assert not me.kernel_thread and me.exe is not None


def test_create_time_mismatch_means_the_meant_process_is_gone() -> None:
    me = scan_process(os.getpid())
    assert me.create_time is not None
    other = scan_process(os.getpid(), me.create_time - 100.0)
    assert other.gone and "now belongs" in other.reasons[0].detail


def test_permission_denied_is_a_reason(children: list[subprocess.Popen[str]]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as two other users")
    # Another user's process: /proc/PID/maps, cwd and exe are refused to a third user
    # (ptrace access check). The probe is a forked copy of this test process that drops to
    # uid 65533 and reports the reasons through a pipe.
    proc = subprocess.Popen(["sleep", "30"], user=65534, group=65534)
    children.append(proc)  # type: ignore[arg-type]
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked probe
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(65533)
            os.setuid(65533)
            info = scan_process(proc.pid)
            text = ";".join(f"{r.field}={r.reason}" for r in info.reasons)
            os.write(wfd, f"{info.gone}|{info.cmdline}|{text}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd) as f:
        out = f.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    gone, cmdline, reasons = out.split("|")
    assert gone == "False" and cmdline == "('sleep', '30')"  # cmdline is world-readable
    assert dict(kv.split("=") for kv in reasons.split(";")) == {
        "cwd": "denied",
        "exe": "denied",
        "maps": "denied",
    }


# --------------------------------------------------------------------------- scanner budget


class StepClock:
    """A clock that advances `step` seconds per reading: scans cost a known amount."""

    def __init__(self, step: float) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_budget_is_respected_in_priority_order_and_progresses(
    children: list[subprocess.Popen[str]],
) -> None:
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(40)]
    children.extend(sleepers)  # type: ignore[arg-type]
    pids = [p.pid for p in sleepers]
    # Each clock reading advances 1/8 s and the scanner reads the clock once before every
    # scan after the first, so a 1 s budget admits exactly 8 scans per refresh.
    scanner = Scanner(budget=1.0, clock=StepClock(0.125))
    first = scanner.scan(pids)
    assert first.scanned == 8 and list(first.infos) == pids[:8]
    assert first.pending == tuple(pids[8:])
    seen = set(first.infos)
    rounds = 1
    while len(seen) < len(pids):
        r = scanner.scan(pids)
        rounds += 1
        assert r.scanned == 8 and r.gone == ()
        assert set(r.infos) >= seen  # cached entries stay
        seen = set(r.infos)
    assert rounds == 5  # 40 processes, 8 per refresh
    again = scanner.scan(pids)
    assert again.scanned == 0 and again.pending == () and len(again.infos) == 40
    # budget=None (one-shot) scans everything at once, each PID once even if listed twice
    assert Scanner(budget=None).scan(pids + pids[:5]).scanned == 40
    # a tiny budget still makes progress: one process per refresh
    assert Scanner(budget=0.0).scan(pids).scanned == 1


def test_scanner_rescans_reused_pid_and_stale_entries() -> None:
    pid = os.getpid()
    scanner = Scanner(budget=None, maps_max_age=3600)
    info = scanner.scan([pid]).infos[pid]
    assert info.create_time is not None
    assert scanner.scan([(pid, info.create_time)]).scanned == 0  # cache hit, no I/O
    # a different create_time for the same PID is another process: not served from cache
    r = scanner.scan([(pid, info.create_time + 1.0)])
    assert r.gone == (pid,) and pid not in r.infos
    stale = Scanner(budget=None, maps_max_age=0.0)
    stale.scan([pid])
    assert stale.scan([pid]).stale_rescanned == 1
    # entries not requested for `forget_after` refreshes are dropped
    forget = Scanner(budget=None, forget_after=2)
    forget.scan([pid])
    for _ in range(3):
        forget.scan([])
    assert forget.cached(pid) is None


# --------------------------------------------------------------------------- tables, classify


@pytest.mark.parametrize(
    ("basename", "key"),
    [
        ("libcudart.so.12.4.127", "cuda-runtime"),
        ("libcuda.so.1", "cuda-driver"),
        ("libcublasLt.so.12", "cublas"),
        ("libcudnn_ops.so.9", "cudnn"),
        ("libnccl.so.2", "nccl"),
        ("libnvinfer.so.10", "tensorrt"),
        ("libamdhip64.so.6", "hip"),
        ("libvulkan.so.1", "vulkan"),
        ("libOpenCL.so.1", "opencl"),
        ("libggml-cuda.so", "ggml-cuda"),
        ("libggml-vulkan.so", "ggml-vulkan"),
        ("libggml-cpu-haswell.so", "ggml-cpu"),
        ("libggml-base.so", "ggml"),
        ("libllama.so", "llama"),
        ("libtorch_cuda.so", "pytorch"),
        ("libc10.so", "pytorch"),
        ("libonnxruntime.so.1.20.1", "onnxruntime"),
        ("onnxruntime_pybind11_state.cpython-311-x86_64-linux-gnu.so", "onnxruntime"),
        ("libtensorflow_framework.so.2", "tensorflow"),
        ("xla_extension.so", "jax"),
        ("libopenvino.so.2450", "openvino"),
        ("libnvcuvid.so.1", "nvdec"),
    ],
)
def test_runtime_table(basename: str, key: str) -> None:
    (rt,) = detect_runtimes([f"/opt/x y/lib/{basename}"])
    assert rt.key == key and rt.library == basename
    assert key in {s.key for s in RUNTIMES}


@pytest.mark.parametrize(
    "basename",
    ["libcurl.so.4", "libglib-2.0.so.0", "libc.so.6", "libcudart_static.a", "mylibcudart.so"],
)
def test_runtime_table_negatives(basename: str) -> None:
    assert detect_runtimes([f"/usr/lib/{basename}"]) == ()


@pytest.mark.parametrize(
    ("name", "argv", "category", "heuristic"),
    [
        ("Xorg", ("/usr/lib/xorg/Xorg", ":0"), "compositor", True),
        ("firefox-esr", ("/usr/lib/firefox-esr/firefox-esr",), "browser", True),
        ("ffmpeg", ("ffmpeg", "-i", "in.mp4"), "video", True),
        ("python3", ("python3", "train_lora.py", "--epochs", "3"), "training", True),
        ("python3", ("python3", "-m", "vllm.entrypoints.openai.api_server"), "LLM inference", True),
        ("python3", ("python3", "fit.py", "--use", "xgboost"), "decision?", True),
        ("constraint", ("constraint-solver",), None, None),
        ("settings", ("gsd-settings",), None, None),
    ],
)
def test_classify_by_name_is_heuristic(
    name: str, argv: tuple[str, ...], category: str | None, heuristic: bool | None
) -> None:
    c = classify(name, argv)
    if category is None:
        assert c is None
    else:
        assert c is not None and (c.category, c.heuristic) == (category, heuristic)
        assert c.label.endswith("?")


def test_classify_prefers_evidence_over_names() -> None:
    runtimes = detect_runtimes(["/usr/lib/libwhisper.so.1"])
    c = classify("firefox", ("firefox",), runtimes)
    assert c is not None and c.category == "speech" and c.heuristic is False


# --------------------------------------------------------------------------- cmdline


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["srv", "--api-key", "X1"], ["srv", "--api-key", REDACTED]),
        (["srv", "--api-key=X1"], ["srv", f"--api-key={REDACTED}"]),
        (
            ["srv", "--token", "X1", "--max-tokens", "5"],
            ["srv", "--token", REDACTED, "--max-tokens", "5"],
        ),
        (["srv", "--hf-token", "X1"], ["srv", "--hf-token", REDACTED]),
        (["srv", "--password", "X1"], ["srv", "--password", REDACTED]),
        (
            ["srv", "--hfToken", "X1", "--apiKey=X2"],
            ["srv", "--hfToken", REDACTED, f"--apiKey={REDACTED}"],
        ),
        (
            ["env", "HF_TOKEN=X1", "OPENAI_API_KEY=X2", "PATH=/bin"],
            ["env", f"HF_TOKEN={REDACTED}", f"OPENAI_API_KEY={REDACTED}", "PATH=/bin"],
        ),
        (["curl", "https://me:X1@host/p"], ["curl", f"https://me:{REDACTED}@host/p"]),
        (["curl", "-H", "Authorization: Bearer X1"], ["curl", "-H", f"Authorization: {REDACTED}"]),
        (["llama-server -m a.gguf --api-key X1"], [f"llama-server -m a.gguf --api-key {REDACTED}"]),
    ],
)
def test_redaction_list(argv: list[str], expected: list[str]) -> None:
    assert list(redact_argv(argv).argv) == expected


def test_model_args_flags_python_m_and_retitled() -> None:
    r = redact_argv(["python3", "-m", "llama_cpp.server", "--model", "m/q4.gguf", "x.onnx"])
    assert [(a.raw, a.evidence, a.flag) for a in model_args(r)] == [
        ("m/q4.gguf", "cmdline", "--model"),
        ("x.onnx", "path-arg", None),
    ]
    r = redact_argv(["llama-server -m /m/a.gguf --port 8"])
    assert [(a.raw, a.evidence) for a in model_args(r)] == [("/m/a.gguf", "cmdline")]
    assert model_args(redact_argv(["tar", "-m", "stuff"])) == ()  # -m needs a path-like value
    r = redact_argv(["python3", "-mllama_cpp.server", "-m", "q.gguf"])
    assert [(a.raw, a.flag) for a in model_args(r)] == [("q.gguf", "-m")]
    assert resolve("a/../b.gguf", "/w") == "/w/b.gguf" and resolve("x", None) is None
    assert split_cmdline(b"a\0b c\0") == ("a", "b c") and split_cmdline(b"") == ()


_secret = st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ23456789", min_size=6, max_size=20).map(
    lambda s: "Q9" + s + ".gguf"
)
_plain = st.text(alphabet=st.characters(blacklist_characters="\x00Q"), max_size=20)
_flag = st.sampled_from(
    [
        "--api-key",
        "--token",
        "--hf-token",
        "--password",
        "--secret",
        "--auth",
        "--access-key",
        "--db-password",
        "--openai_api_key",
    ]
)


@given(
    before=st.lists(_plain, max_size=6),
    after=st.lists(_plain, max_size=6),
    flag=_flag,
    secret=_secret,
    form=st.sampled_from(["space", "equals", "env", "url"]),
)
@settings(max_examples=400)
def test_fuzz_redactor_never_leaks_and_never_offers_secret_as_model(
    before: list[str], after: list[str], flag: str, secret: str, form: str
) -> None:
    if form == "space":
        mid = [flag, secret]
    elif form == "equals":
        mid = [f"{flag}={secret}"]
    elif form == "env":
        mid = [f"HF_TOKEN={secret}"]
    else:
        mid = [f"https://user:{secret}@example.org/x"]
    argv = ["prog", *before, *mid, *after]
    red = redact_argv(argv)
    assert len(red.argv) == len(argv)
    assert not any(secret in a for a in red.argv)
    assert red.redacted
    for arg in model_args(red):
        assert secret not in arg.raw


def test_flag_value_both_forms_last_wins() -> None:
    assert flag_value(["llama-server", "-c", "4096"], ("-c", "--ctx-size")) == "4096"
    assert flag_value(["x", "--ctx-size=8192"], ("-c", "--ctx-size")) == "8192"
    assert flag_value(["x", "-c", "1", "--ctx-size=2"], ("-c", "--ctx-size")) == "2"
    assert flag_value(["x", "--log-file=a=b"], ("--log-file",)) == "a=b"  # first = splits
    assert flag_value(["x", "-c"], ("-c",)) is None  # no value
    assert flag_value(["x", "-cc", "3", "--c=4"], ("-c",)) is None  # other flags
    assert flag_value([], ("-c",)) is None


@given(
    st.lists(st.text(max_size=12), max_size=10),
    st.sampled_from(["-c", "--api-key", "--log-file"]),
    st.text(max_size=12),
)
@settings(max_examples=300)
def test_fuzz_flag_value_total_and_finds_an_appended_flag(argv, flag, value) -> None:
    flag_value(argv, (flag,))  # never raises
    assert flag_value([*argv, flag, value], (flag,)) == value
    assert flag_value([*argv, f"{flag}={value}"], (flag,)) == value


@given(st.lists(st.text(max_size=30), max_size=12))
@settings(max_examples=300)
def test_fuzz_redactor_total_and_idempotent(argv: list[str]) -> None:
    once = redact_argv(argv)
    assert redact_argv(once.argv).argv == once.argv
    model_args(once)


_path_chars = st.characters(blacklist_characters="\n\x00", blacklist_categories=("Cs",))


@given(
    start=st.integers(0, 2**48),
    length=st.integers(1, 2**32),
    perms=st.sampled_from(["r--p", "r-xp", "rw-p", "rw-s", "---p"]),
    offset=st.integers(0, 2**40),
    inode=st.integers(0, 2**40),
    path=st.one_of(
        st.none(),
        st.sampled_from(["[heap]", "[stack]", "[vdso]"]),
        st.text(_path_chars, min_size=1, max_size=60).map(lambda s: "/" + s),
    ),
    deleted=st.booleans(),
)
@settings(max_examples=400)
def test_fuzz_maps_line_roundtrip_and_fast_path_agree(
    start: int,
    length: int,
    perms: str,
    offset: int,
    inode: int,
    path: str | None,
    deleted: bool,
) -> None:
    if path is not None:
        # The kernel pads before the path; trailing blanks and a literal " (deleted)" in the
        # name itself are indistinguishable from its own suffix, so leave them out.
        path = path.rstrip()
        while path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")].rstrip()
        path = path or None
    shown = None if path is None else path + (" (deleted)" if deleted else "")
    line = f"{start:08x}-{start + length:08x} {perms} {offset:08x} fd:01 {inode}"
    if shown is not None:
        line += " " * 19 + shown
    e = parse_maps_line(line)
    assert e is not None
    assert (e.start, e.end, e.perms, e.offset, e.inode) == (
        start,
        start + length,
        perms,
        offset,
        inode,
    )
    if path is None:
        assert e.path is None
    else:
        assert e.path == path and e.deleted == deleted
    fast = mapped_paths(line + "\n")
    if shown is not None and shown.startswith("/"):
        assert fast == {shown}
    else:
        assert fast == set()


@given(st.text(max_size=200))
@settings(max_examples=300)
def test_fuzz_maps_parsers_never_raise(text: str) -> None:
    parse_maps_line(text)
    paths = mapped_paths(text)
    detect_runtimes(paths)
    mapped_models(paths)


def test_a_scan_names_the_user_and_the_parent(tmp_path: Path) -> None:
    """The user (effective uid) and parent PID of a real child process; in a fixture tree the
    effective uid of its status file, and without one an unknown user, never a made-up one."""
    import pwd

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        info = scan_process(child.pid)
        assert info.ppid == os.getpid()
        assert info.user == pwd.getpwuid(os.getuid()).pw_name
    finally:
        child.kill()
        child.wait()
    pid_dir = tmp_path / "4321"
    pid_dir.mkdir()
    (pid_dir / "stat").write_text("4321 (x) S 77 4321 4321 0 -1 4194304 " + "0 " * 40 + "\n")
    (pid_dir / "cmdline").write_bytes(b"x\0")
    (pid_dir / "maps").write_text("")
    (tmp_path / "stat").write_text("btime 1700000000\n")
    fake = scan_process(4321, root=str(tmp_path))
    assert fake.ppid == 77 and fake.user is None
    (pid_dir / "status").write_text("Name:\tx\nUid:\t0\t65534\t65534\t65534\n")
    assert scan_process(4321, root=str(tmp_path)).user in ("nobody", "65534")
