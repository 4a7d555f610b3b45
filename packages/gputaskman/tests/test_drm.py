"""Tests of the DRM backend (amdgpu, Intel i915 and xe) on fake /sys and /proc trees.

Not validated on real hardware. The fdinfo text follows the kernel's
``Documentation/gpu/drm-usage-stats.rst`` and what the drivers print in the 2025 mainline
kernel, read from torvalds/linux blobs: drm-usage-stats.rst at f76ad354,
``drivers/gpu/drm/amd/amdgpu/amdgpu_fdinfo.c`` at 11aaec35,
``drivers/gpu/drm/xe/xe_drm_client.c`` at 0739b8ba (its documented example is used verbatim),
``drivers/gpu/drm/i915/i915_drm_client.c`` with ``show_meminfo``, and
``drm_print_memory_stats`` in ``drivers/gpu/drm/drm_file.c``. Legacy amdgpu text follows the
older ``amdgpu_fdinfo.c`` at 0604aa87 (``drm-memory-*`` only, no ``drm-shared-*``). The sysfs
files follow the amdgpu, i915 and xe sysfs code of the same kernel. Trees are laid out by
`gputaskman.fixtures.drm_fixtures`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest
from gputaskman.backends.drm import (
    BACKEND,
    DrmBackend,
    backend_for,
    bus_id,
    combine_with_nvml,
    drm_adapters,
    merge_adapters,
)
from gputaskman.backends.drm_clients import (
    Client,
    EngineRates,
    FdRecord,
    attribute,
    group_clients,
    scan_clients,
)
from gputaskman.backends.drm_fdinfo import parse_fdinfo
from gputaskman.backends.drm_sysfs import (
    INTEL_MEMORY_NOTE,
    enumerate_cards,
    parse_dpm_current,
    parse_largest_prefetchable_bar,
    read_amdgpu,
    read_intel,
)
from gputaskman.backends.linux import LinuxGpus, NotAsked
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuProcess, GpuSample
from gputaskman.base.readings import Adapter, Kind, Problem, Reading, Reason
from gputaskman.fixtures.drm_fixtures import (
    AMD_PDEV,
    GIB,
    INTEL_PDEV,
    KIB,
    MIB,
    FakeTree,
    Region,
    amdgpu_fdinfo,
    i915_fdinfo,
    intel_resource,
    print_size,
    write_demo_tree,
    xe_fdinfo,
)
from gputaskman.render import report, text_report
from hypothesis import given, settings
from hypothesis import strategies as st

# The example in the kernel's xe_drm_client.c "DRM Client usage stats" comment, verbatim
# (spaces, not tabs, after the colons: the parser must accept any whitespace).
XE_DOC_EXAMPLE = """\
pos:    0
flags:  0100002
mnt_id: 26
ino:    685
drm-driver:     xe
drm-client-id:  3
drm-pdev:       0000:03:00.0
drm-total-system:       0
drm-shared-system:      0
drm-active-system:      0
drm-resident-system:    0
drm-purgeable-system:   0
drm-total-gtt:  192 KiB
drm-shared-gtt: 0
drm-active-gtt: 0
drm-resident-gtt:       192 KiB
drm-total-vram0:        23992 KiB
drm-shared-vram0:       16 MiB
drm-active-vram0:       0
drm-resident-vram0:     23992 KiB
drm-total-stolen:       0
drm-shared-stolen:      0
drm-active-stolen:      0
drm-resident-stolen:    0
drm-cycles-rcs: 28257900
drm-total-cycles-rcs:   7655183225
drm-cycles-bcs: 0
drm-total-cycles-bcs:   7655183225
drm-cycles-vcs: 0
drm-total-cycles-vcs:   7655183225
drm-engine-capacity-vcs:        2
drm-cycles-vecs:        0
drm-total-cycles-vecs:  7655183225
drm-engine-capacity-vecs:       2
drm-cycles-ccs: 0
drm-total-cycles-ccs:   7655183225
drm-engine-capacity-ccs:        4
"""


# ------------------------------------------------------------------------ fdinfo parser


def test_parse_xe_kernel_doc_example() -> None:
    info = parse_fdinfo(XE_DOC_EXAMPLE)
    assert info is not None
    assert (info.driver, info.client_id, info.pdev) == ("xe", 3, "0000:03:00.0")
    assert info.regions["vram0"].resident == 23992 * KIB
    assert info.regions["vram0"].shared == 16 * MIB
    assert info.regions["gtt"].total == 192 * KIB
    assert info.regions["system"].purgeable == 0
    assert info.cycles["rcs"] == 28257900
    assert info.total_cycles["ccs"] == 7655183225
    assert info.capacity("ccs") == 4 and info.capacity("rcs") == 1
    # drm-total-cycles-* is not mistaken for a memory region called "cycles-rcs"
    assert not any(r.startswith("cycles") for r in info.regions)
    assert info.engines == ("bcs", "ccs", "rcs", "vcs", "vecs")
    assert info.errors == ()
    assert info.other["mnt_id"] == "26"


def test_parse_amdgpu_current_format_resident_and_legacy_alias_not_added() -> None:
    text = amdgpu_fdinfo(
        37,
        AMD_PDEV,
        vram=Region(private=3 * MIB, shared=1 * MIB, resident=4 * MIB),
        gtt=Region(private=1536 * KIB, resident=1536 * KIB),
        engines_ns={"gfx": 123_456, "compute": 0},
    )
    assert "drm-memory-gtt: \t1536 KiB" in text  # the driver's stray space before the tab
    info = parse_fdinfo(text)
    assert info is not None
    vram = info.regions["vram"]
    assert (vram.total, vram.shared, vram.resident, vram.memory) == (
        4 * MIB,
        1 * MIB,
        4 * MIB,
        4 * MIB,
    )
    assert vram.resident_bytes == 4 * MIB  # resident and its alias are one quantity
    assert info.regions["gtt"].resident_bytes == 1536 * KIB
    assert info.engine_ns == {"gfx": 123_456}  # amdgpu omits idle engines
    assert info.other["amd-requested-vram"] == "4096 KiB"
    assert info.other["pasid"] == str(32768 + 37)


def test_parse_legacy_amdgpu_memory_only() -> None:
    info = parse_fdinfo(amdgpu_fdinfo(5, AMD_PDEV, vram=Region(resident=8 * MIB), legacy=True))
    assert info is not None
    assert info.regions["vram"].resident is None
    assert info.regions["vram"].shared is None
    assert info.regions["vram"].resident_bytes == 8 * MIB


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", 0), ("17", 17), ("3 KiB", 3 * KIB), ("2 MiB", 2 * MIB), ("1 GiB", GIB), ("5 B", 5)],
)
def test_parse_memory_units(value: str, expected: int) -> None:
    info = parse_fdinfo(f"drm-driver:\ti915\ndrm-resident-local0:\t{value}\n")
    assert info is not None and info.regions["local0"].resident == expected


@pytest.mark.parametrize("value", ["-1", "1.5 MiB", "12 TiB", "abc", "", "1 KiB extra", "٣"])
def test_parse_bad_values_are_unknown_not_zero(value: str) -> None:
    info = parse_fdinfo(f"drm-driver:\txe\ndrm-resident-vram0:\t{value}\ndrm-shared-vram0:\t0\n")
    assert info is not None
    assert info.regions["vram0"].resident is None
    assert info.regions["vram0"].shared == 0
    assert len(info.errors) == 1 and "drm-resident-vram0" in info.errors[0]


def test_parse_unknown_keys_kept_and_bad_lines_reported() -> None:
    text = (
        "drm-driver:\tamdgpu\n"
        "drm-future-thing:\t42 widgets\n"
        "this line has no colon\n"
        "drm-client-id:\tnot-a-number\n"
        "drm-pdev:\tnonsense\n"
        "drm-engine-capacity-gfx:\t0\n"
        "drm-maxfreq-gfx:\t2 MHz\n"
    )
    info = parse_fdinfo(text)
    assert info is not None
    assert info.other["drm-future-thing"] == "42 widgets"
    assert info.client_id is None and info.pdev is None
    assert info.capacity("gfx") == 1  # zero capacity is forbidden: ignored, default kept
    assert info.maxfreq_hz["gfx"] == 2_000_000
    assert len(info.errors) == 4


def test_parse_without_drm_driver_is_not_a_client() -> None:
    assert parse_fdinfo("pos:\t0\nflags:\t02\nmnt_id:\t1\nino:\t7\n") is None
    assert parse_fdinfo("") is None


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("00000000:01:00.0", "0000:01:00.0"),
        ("0000:0A:1f.7", "0000:0a:1f.7"),
        ("01:00.0", "0000:01:00.0"),
        ("10000:00:02.0", "10000:00:02.0"),
    ],
)
def test_pci_addresses_normalise(raw: str, norm: str) -> None:
    info = parse_fdinfo(f"drm-driver:\ti915\ndrm-pdev:\t{raw}\n")
    assert info is not None and info.pdev == norm


_names = st.from_regex(r"[a-z][a-z0-9\-]{0,10}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_fuzz_parser_never_raises(text: str) -> None:
    info = parse_fdinfo(text)
    if info is not None:
        assert info.driver
        for region in info.regions.values():
            for v in (region.total, region.shared, region.resident, region.memory):
                assert v is None or v >= 0


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(_names, st.integers(0, 2**50), max_size=6),
    st.dictionaries(_names, st.integers(0, 2**62), max_size=4),
    st.integers(0, 2**32),
    st.lists(st.text(alphabet=" \t", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_fuzz_printed_values_round_trip(
    regions: dict[str, int], engines: dict[str, int], cid: int, gaps: list[str]
) -> None:
    gap = gaps[0]
    lines = ["drm-driver:" + gap + "i915", f"drm-client-id:{gap}{cid}"]
    lines += [f"drm-resident-{r}:{gap}{print_size(n)}" for r, n in regions.items()]
    lines += [f"drm-engine-{e}:{gap}{n} ns" for e, n in engines.items()]
    info = parse_fdinfo("\n".join(lines) + "\n")
    assert info is not None and info.client_id == cid and info.errors == ()
    assert {r: m.resident for r, m in info.regions.items()} == regions
    # a name like "capacity-x" would be read as a capacity key: exclude only those
    assert {e: n for e, n in info.engine_ns.items()} == {
        e: n for e, n in engines.items() if not e.startswith("capacity-")
    }


# ------------------------------------------------------------- clients and attribution


def _tree(tmp_path: Path) -> FakeTree:
    tree = FakeTree(tmp_path)
    tree.card("card0", AMD_PDEV, driver="amdgpu", vendor=0x1002, device=0x744C, render="renderD128")
    return tree


def test_dup_fds_of_one_client_count_once(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    text = amdgpu_fdinfo(11, AMD_PDEV, vram=Region(private=GIB, resident=GIB))
    tree.process(100, "app", {5: ("/dev/dri/renderD128", text), 9: ("/dev/dri/renderD128", text)})
    scan = scan_clients(str(tmp_path))
    assert len(scan.clients) == 1
    assert scan.clients[0].fds == ((100, 5), (100, 9))
    (usage,) = attribute(scan.clients)
    assert usage.private and usage.local_bytes == GIB  # not 2 GiB


def test_client_shared_between_processes_is_credited_to_nobody(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    shared = amdgpu_fdinfo(20, AMD_PDEV, vram=Region(private=200 * MIB, resident=200 * MIB))
    own = amdgpu_fdinfo(21, AMD_PDEV, vram=Region(private=MIB, resident=MIB))
    tree.process(300, "parent", {4: ("/dev/dri/renderD128", shared)})
    tree.process(
        301, "child", {4: ("/dev/dri/renderD128", shared), 6: ("/dev/dri/renderD128", own)}
    )
    usages = {u.pid: u for u in attribute(scan_clients(str(tmp_path)).clients)}
    for pid in (300, 301):
        assert usages[pid].local_bytes is None and not usages[pid].private
        assert usages[pid].memory_why == "DRM client 20 is held by processes 300, 301"
    # the child's own client is private, but one shared client makes its whole sum unprovable
    assert usages[301].client_ids == (20, 21)


@pytest.mark.parametrize(
    ("node", "text", "why"),
    [
        (
            "/dev/dri/card0",
            amdgpu_fdinfo(2, AMD_PDEV, vram=Region(private=MIB, resident=MIB)),
            "DRM client 2 is on a primary node (card0)",
        ),
        (
            "/dev/dri/renderD128",
            amdgpu_fdinfo(2, AMD_PDEV, vram=Region(private=MIB, shared=4 * KIB, resident=MIB)),
            "DRM client 2 shares buffers in vram",
        ),
        (
            "/dev/dri/renderD128",
            amdgpu_fdinfo(2, AMD_PDEV, vram=Region(resident=MIB), legacy=True),
            "DRM client 2: no drm-shared-* for cpu, gtt, vram",
        ),
    ],
    ids=["primary-node", "shared-buffers", "legacy-no-shared-keys"],
)
def test_unprovable_clients_get_no_bytes(tmp_path: Path, node: str, text: str, why: str) -> None:
    tree = _tree(tmp_path)
    tree.process(50, "p", {3: (node, text)})
    (usage,) = attribute(scan_clients(str(tmp_path)).clients)
    assert (usage.private, usage.local_bytes, usage.system_bytes) == (False, None, None)
    assert usage.memory_why == why


def test_scan_ignores_other_fds_and_non_drm_fdinfo_and_keeps_unkeyed(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    no_id = "pos:\t0\ndrm-driver:\tamdgpu\ndrm-resident-vram:\t1 MiB\ndrm-shared-vram:\t0\n"
    tree.process(
        70,
        "mixed",
        {
            0: ("/dev/pts/0", None),
            1: ("/dev/dri/renderD128", "pos:\t0\nflags:\t02\n"),  # old kernel: no stats
            2: ("/dev/dri/renderD128", no_id),
            3: ("socket:[1234]", None),
        },
    )
    scan = scan_clients(str(tmp_path))
    assert scan.clients == ()
    assert [(r.pid, r.fd) for r in scan.unkeyed] == [(70, 2)]
    assert attribute(scan.clients) == ()


def test_missing_pdev_falls_back_to_the_node_sysfs_link(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    text = (
        "drm-driver:\tamdgpu\ndrm-client-id:\t9\ndrm-resident-vram:\t2 MiB\ndrm-shared-vram:\t0\n"
    )
    tree.process(80, "p", {3: ("/dev/dri/renderD128", text)})
    (client,) = scan_clients(str(tmp_path)).clients
    assert client.pdev == AMD_PDEV


def test_scan_as_unprivileged_user_reports_denied_processes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the scan as another user")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")
    base = Path(tempfile.mkdtemp(prefix="gtm-drm-"))
    try:
        base.chmod(0o755)
        tree = FakeTree(base)
        tree.card("card0", AMD_PDEV, driver="amdgpu", vendor=0x1002, device=1, render="renderD128")
        text = amdgpu_fdinfo(1, AMD_PDEV, vram=Region(private=MIB, resident=MIB))
        tree.process(10, "mine", {3: ("/dev/dri/renderD128", text)})
        tree.process(11, "theirs", {3: ("/dev/dri/renderD128", text)})
        (base / "proc/11/fd").chmod(0o700)  # root-owned: unreadable to nobody
        # Fork and drop privileges in the child: the interpreter under /root is not
        # executable by nobody, but the already-imported code runs fine after setuid.
        rfd, wfd = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            try:
                os.close(rfd)
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                s = scan_clients(str(base))
                os.write(wfd, repr((s.denied, [c.pids for c in s.clients])).encode())
            finally:
                os._exit(0)
        os.close(wfd)
        with os.fdopen(rfd) as r:
            out = r.read()
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert out == "((11,), [(10,)])"
    finally:
        shutil.rmtree(base)


# -------------------------------------------------------------------------- engine rates


def _client(text: str, pid: int = 1, node: str = "renderD128") -> tuple[Client, ...]:
    info = parse_fdinfo(text)
    assert info is not None
    clients, _ = group_clients([FdRecord(pid, 3, node, info)])
    return clients


def test_engine_ns_rates_between_two_samples_first_is_none() -> None:
    rates = EngineRates()
    first = rates.update(_client(i915_fdinfo(1, INTEL_PDEV, engines_ns={"render": 10**9})), 0)
    assert first[(INTEL_PDEV, 1)] == {"render": None}
    text = i915_fdinfo(
        1,
        INTEL_PDEV,
        engines_ns={"render": 10**9 + 250_000_000, "video": 10**9},
        capacity={"video": 2},
    )
    second = rates.update(_client(text), 500_000_000)
    # 250 ms busy in 500 ms; video appeared (idle until now): 1 s busy / 0.5 s / 2 engines
    assert second[(INTEL_PDEV, 1)] == {"render": 50.0, "video": 100.0}


def test_counter_going_backwards_keeps_the_larger_value() -> None:
    rates = EngineRates()
    rates.update(_client(amdgpu_fdinfo(1, AMD_PDEV, engines_ns={"gfx": 5 * 10**9})), 0)
    back = rates.update(_client(amdgpu_fdinfo(1, AMD_PDEV, engines_ns={"gfx": 4 * 10**9})), 10**9)
    assert back[(AMD_PDEV, 1)] == {"gfx": 0.0}
    fwd = rates.update(
        _client(amdgpu_fdinfo(1, AMD_PDEV, engines_ns={"gfx": 5_100_000_000})), 2 * 10**9
    )
    assert fwd[(AMD_PDEV, 1)] == {"gfx": pytest.approx(10.0)}  # from the held 5 s, not 4 s


def test_xe_cycles_over_total_cycles_with_capacity() -> None:
    rates = EngineRates()
    caps = {"ccs": 4}
    rates.update(
        _client(
            xe_fdinfo(
                3, AMD_PDEV, cycles={"rcs": 1000, "ccs": 0}, total_cycles=10_000, capacity=caps
            )
        ),
        0,
    )
    r = rates.update(
        _client(
            xe_fdinfo(
                3, AMD_PDEV, cycles={"rcs": 4000, "ccs": 8000}, total_cycles=20_000, capacity=caps
            )
        ),
        123,  # wall time does not enter a cycles-over-total-cycles rate
    )
    assert r[(AMD_PDEV, 3)] == {"rcs": 30.0, "ccs": 20.0}


def test_cycles_with_maxfreq_and_zero_wall_time() -> None:
    rates = EngineRates()
    base = "drm-driver:\tpanfrost\ndrm-client-id:\t4\ndrm-pdev:\t0000:00:00.1\n"
    rates.update(_client(base + "drm-cycles-fragment:\t0\ndrm-maxfreq-fragment:\t1 MHz\n"), 0)
    same_time = rates.update(
        _client(base + "drm-cycles-fragment:\t10\ndrm-maxfreq-fragment:\t1 MHz\n"), 0
    )
    assert same_time[("0000:00:00.1", 4)] == {"fragment": None}
    later = rates.update(
        _client(base + "drm-cycles-fragment:\t500010\ndrm-maxfreq-fragment:\t1 MHz\n"), 10**9
    )
    assert later[("0000:00:00.1", 4)] == {"fragment": 50.0}


def test_rates_are_capped_and_shared_clients_give_no_engine_credit() -> None:
    rates = EngineRates()
    a = _client(amdgpu_fdinfo(1, AMD_PDEV, engines_ns={"gfx": 1}))
    rates.update(a, 0)
    b = _client(amdgpu_fdinfo(1, AMD_PDEV, engines_ns={"gfx": 3 * 10**9}))
    r = rates.update(b, 10**9)
    assert r[(AMD_PDEV, 1)] == {"gfx": 100.0}
    (u,) = attribute(b, r)
    assert u.engines == {"gfx": 100.0} and u.engine_why is None
    shared = [Client(c.pdev, c.client_id, c.driver, c.info, (1, 2), c.nodes, c.fds) for c in b]
    for u in attribute(shared, r):
        assert u.engines == {}
        assert u.engine_why == "every DRM client of this process is shared with another process"


# -------------------------------------------------------------------------------- sysfs


def test_enumerate_cards_skips_connectors_and_reads_identity(tmp_path: Path) -> None:
    tree = write_demo_tree(tmp_path)
    tree.card("card2", "0000:05:00.0", driver="simpledrm", vendor=0x1234, device=0x1111)
    cards = enumerate_cards(str(tmp_path))
    assert [c.card for c in cards] == ["card0", "card1", "card2"]  # card0-DP-1 skipped
    amd, intel, other = cards
    assert (amd.pdev, amd.vendor, amd.device_id, amd.driver, amd.name) == (
        AMD_PDEV,
        "amd",
        0x7550,
        "amdgpu",
        None,  # empty product_name is no name
    )
    assert (intel.pdev, intel.vendor, intel.driver) == (INTEL_PDEV, "intel", "i915")
    assert amd.supported and intel.supported and not other.supported


def test_amdgpu_readings(tmp_path: Path) -> None:
    write_demo_tree(tmp_path)
    card = enumerate_cards(str(tmp_path))[0]
    r = read_amdgpu(str(tmp_path), card)
    m = r.metrics
    assert m.memory_used_bytes.value == 5 * GIB and m.memory_used_bytes.kind is Kind.MEASURED
    assert m.memory_used_bytes.source == "sysfs:/sys/class/drm/card0/device/mem_info_vram_used"
    assert m.memory_total_bytes.value == 16 * GIB
    assert (r.gtt_used_bytes.value, r.gtt_total_bytes.value) == (300 * MIB, 12 * GIB)
    assert (m.util_gpu_percent.value, m.util_memory_percent.value) == (37, 12)
    assert (m.clock_graphics_mhz.value, m.clock_memory_mhz.value) == (1800, 1258)
    assert (m.power_w.value, m.power_limit_w.value, m.temperature_c.value) == (123.0, 220.0, 61.0)
    assert m.encoder_percent.value is None and m.encoder_percent.reason is Reason.NOT_SUPPORTED


def test_card_without_hwmon_and_with_power_input_only(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path)
    tree.card(
        "card0",
        AMD_PDEV,
        driver="amdgpu",
        vendor=0x1002,
        device=0x15BF,
        files={"mem_info_vram_used": "garbage\n"},
    )
    card = enumerate_cards(str(tmp_path))[0]
    m = read_amdgpu(str(tmp_path), card).metrics
    for r in (m.power_w, m.power_limit_w, m.temperature_c):
        assert (
            r.value is None and r.reason is Reason.NOT_SUPPORTED and r.detail == "card has no hwmon"
        )
    assert m.memory_used_bytes.reason is Reason.QUERY_FAILED
    assert m.memory_total_bytes.reason is Reason.NOT_SUPPORTED
    assert m.util_gpu_percent.value is None
    # an APU's hwmon: power1_input instead of power1_average
    hw = tmp_path / "sys/devices/pci0000:00" / AMD_PDEV / "hwmon/hwmon2"
    hw.mkdir(parents=True)
    (hw / "power1_input").write_text("15500000\n")
    m = read_amdgpu(str(tmp_path), card).metrics
    assert m.power_w.value == pytest.approx(15.5)
    assert m.power_w.source.endswith("hwmon2/power1_input")
    assert m.temperature_c.reason is Reason.NOT_SUPPORTED


def test_dpm_and_bar_parsers() -> None:
    assert parse_dpm_current("0: 500Mhz\n1: 800Mhz *\n2: 1000Mhz\n") == 800
    assert parse_dpm_current("S: 19Mhz *\n0: 500Mhz\n") == 19
    assert parse_dpm_current("0: 500Mhz\n1: 800Mhz\n") is None  # no current level: unknown
    assert parse_largest_prefetchable_bar(intel_resource(16 * GIB)) == 16 * GIB
    assert parse_largest_prefetchable_bar(intel_resource(0)) is None


def test_intel_total_zero_is_unknown_and_used_is_labelled(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path)
    tree.card(
        "card0",
        INTEL_PDEV,
        driver="xe",
        vendor=0x8086,
        device=0x56A0,
        files={"resource": intel_resource(0)},
    )
    card = enumerate_cards(str(tmp_path))[0]
    m = read_intel(str(tmp_path), card, 42 * MIB).metrics
    assert m.memory_total_bytes.value is None
    assert m.memory_total_bytes.reason is Reason.UNAVAILABLE
    assert INTEL_MEMORY_NOTE in (m.memory_total_bytes.detail or "")
    assert (m.memory_used_bytes.value, m.memory_used_bytes.kind) == (42 * MIB, Kind.INFERRED)
    assert m.memory_used_bytes.detail == INTEL_MEMORY_NOTE
    none_visible = read_intel(str(tmp_path), card, None).metrics.memory_used_bytes
    assert none_visible.value is None and none_visible.reason is Reason.UNAVAILABLE


def test_xe_frequency_throttle_and_energy_power(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path)
    gt = "tile0/gt0/freq0"
    tree.card(
        "card0",
        "0000:03:00.0",
        driver="xe",
        vendor=0x8086,
        device=0xE20B,
        render="renderD128",
        files={
            "resource": intel_resource(16 * GIB),
            f"{gt}/act_freq": "2050\n",
            f"{gt}/cur_freq": "2100\n",
            f"{gt}/throttle/status": "1\n",
            f"{gt}/throttle/reason_pl1": "0\n",
            f"{gt}/throttle/reason_thermal": "1\n",
            "tile0/gt1/freq0/throttle/status": "0\n",
            "tile0/gt1/freq0/throttle/reason_prochot": "1\n",
            "hwmon/hwmon5/energy1_input": "1000000\n",
        },
    )
    text = xe_fdinfo(
        3,
        "0000:03:00.0",
        regions={"vram0": Region(private=GIB, resident=GIB)},
        cycles={"rcs": 0},
        total_cycles=100,
    )
    tree.process(900, "game", {4: ("/dev/dri/renderD128", text)})
    clock = iter([0, 2 * 10**9])
    backend = DrmBackend(str(tmp_path), clock_ns=lambda: next(clock))
    s = backend.sample()
    (key,) = s.metrics
    m = s.metrics[key]
    assert m.clock_graphics_mhz.value == 2050
    assert m.clock_graphics_mhz.source.endswith("tile0/gt0/freq0/act_freq")
    # gt1's status is 0, so its stray reason bit is not reported
    assert f"GPU {key}: frequency throttled (thermal) [" in s.notes[-1]
    assert m.memory_total_bytes.value == 16 * GIB and m.memory_used_bytes.value == GIB
    assert m.power_w.value is None and m.power_w.reason is Reason.UNAVAILABLE
    (tmp_path / "sys/devices/pci0000:00/0000:03:00.0/hwmon/hwmon5/energy1_input").write_text(
        "31000000\n"
    )
    m = backend.sample().metrics[key]
    assert m.power_w.value == pytest.approx(15.0)  # 30 J over 2 s
    (p,) = s.processes
    assert p.dedicated.value == GIB and p.dedicated.kind is Kind.MEASURED


# ------------------------------------------------------------------- adapters, backend


def _nvml(bus: str, index: int = 0) -> Adapter:
    return Adapter(index, "nvidia", "RTX 4050 Laptop GPU", "GPU-1", bus, "nvml")


def test_merge_adapters_pairs_by_pci_address(tmp_path: Path) -> None:
    write_demo_tree(tmp_path)
    drm = drm_adapters(enumerate_cards(str(tmp_path)))
    assert [a.pci_bus_id for a in drm] == ["00000000:03:00.0", "00000000:00:02.0"]
    nv = _nvml("00000000:01:00.0")
    merged = merge_adapters([nv], drm)
    assert [(a.index, a.vendor, a.backend) for a in merged] == [
        (0, "nvidia", "nvml"),
        (1, "amd", "drm"),
        (2, "intel", "drm"),
    ]
    # NVML already lists the device at 03:00.0 (spelt in upper case): it appears once
    again = merge_adapters([nv, _nvml("00000000:03:00.0".upper(), 1)], drm)
    assert [a.pci_bus_id.lower() for a in again] == [
        "00000000:01:00.0",
        "00000000:03:00.0",
        "00000000:00:02.0",
    ]
    assert [a.backend for a in again] == ["nvml", "nvml", "drm"]


def test_backend_for_selected_adapter() -> None:
    assert backend_for(Adapter(1, "amd", None, None, bus_id(AMD_PDEV), BACKEND), "nvml") == "drm"
    assert (
        backend_for(Adapter(2, "intel", None, None, bus_id(INTEL_PDEV), BACKEND), "nvml") == "drm"
    )
    assert backend_for(_nvml("00000000:01:00.0"), "nvml") == "nvml"
    assert backend_for(None, "nvml") == "nvml"


def _drm_collector(root: Path, clock_ns=None):
    """The real collector over a fixture tree: DRM backend, host sample and names from the
    tree's /proc (as ``--sysroot`` builds it), with a clock seam for engine rates."""
    from gputaskman.sampling.collector import Collector, NullScanner
    from gputaskman.sampling.host import HostSampler

    source = LinuxGpus(NotAsked("nvml", "not asked"), DrmBackend(str(root), clock_ns=clock_ns))
    return Collector(
        scan_budget=None,
        source=source,
        scanner=NullScanner(),
        models=None,
        host=HostSampler(proc_root=str(root / "proc"), duvm=False),
    )


def test_demo_tree_end_to_end_json_and_text(tmp_path: Path) -> None:
    write_demo_tree(tmp_path)
    clock = iter([0, 10**9])
    collector = _drm_collector(tmp_path, lambda: next(clock))
    first, _ = collector.sample_with_system()
    procs = {p.pid: p for p in first.processes}
    assert procs[4100].engines["gfx_percent"].value is None  # first sample: no rate
    write_demo_tree(tmp_path, step=1)
    snap, system = collector.sample_with_system()
    doc = report.to_json_dict(snap, system)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    by_pid = {p["pid"]: p for p in doc["processes"]}
    llama = by_pid[4100]
    assert llama["vram_bytes"]["value"] == 4 * GIB and llama["vram_bytes"]["kind"] == "measured"
    assert llama["engines"]["gfx_percent"]["value"] == 40.0
    assert llama["engines"]["compute_percent"]["value"] == 80.0
    # the name and start time come from the host sample, as for every backend
    assert llama["gpu"] == "00000000:03:00.0" and llama["name"] == "llama-server"
    assert llama["started_at"] == system.processes[4100].create_time is not None
    for pid in (4300, 4301):
        assert by_pid[pid]["vram_bytes"]["value"] is None
        assert (
            by_pid[pid]["vram_bytes"]["detail"] == "DRM client 20 is held by processes 4300, 4301"
        )
    assert by_pid[4200]["vram_bytes"]["value"] is None  # Xorg: primary node
    assert by_pid[4400]["vram_bytes"]["value"] == 150 * MIB  # Intel iGPU: system regions
    amd, intel = (a for a in doc["adapters"] if a["backend"] == BACKEND)
    assert amd["attributed_bytes"] == 4 * GIB and amd["attributed_complete"] is False
    assert intel["metrics"]["memory_used_bytes"]["kind"] == "inferred"
    assert intel["metrics"]["memory_total_bytes"]["value"] == 256 * MIB
    assert doc["backend"] == "drm"
    assert any("00000000:00:02.0: frequency throttled (pl1)" in n for n in doc["notes"])
    text = text_report.render_text(snap, system)
    assert "llama-server" in text and "00000000:00:02.0" in text


def test_drm_sample_reads_no_comm_or_stat_and_one_sysfs_link_per_node(
    tmp_path: Path, monkeypatch
) -> None:
    write_demo_tree(tmp_path)
    tree = FakeTree(tmp_path)
    no_pdev = (
        "drm-driver:\tamdgpu\ndrm-client-id:\t{}\ndrm-resident-vram:\t2 MiB\ndrm-shared-vram:\t0\n"
    )
    # many descriptors on one node whose fdinfo names no device: the sysfs fallback
    tree.process(
        90, "many", {fd: ("/dev/dri/renderD128", no_pdev.format(100 + fd)) for fd in range(3, 23)}
    )
    opened: list[str] = []
    links: list[str] = []
    real_os_open, real_open, real_readlink = os.open, open, os.readlink

    def os_open(path, *a, **kw):
        opened.append(str(path))
        return real_os_open(path, *a, **kw)

    def py_open(path, *a, **kw):
        opened.append(str(path))
        return real_open(path, *a, **kw)

    def readlink(path, *a, **kw):
        links.append(str(path))
        return real_readlink(path, *a, **kw)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr("builtins.open", py_open)
    monkeypatch.setattr(os, "readlink", readlink)
    s = DrmBackend(str(tmp_path)).sample()
    monkeypatch.undo()
    proc = str(tmp_path / "proc")
    assert not [p for p in opened if p.startswith(proc) and p.endswith(("/comm", "/stat"))]
    sysfs = [p for p in links if "sys/class/drm" in p]
    assert len(sysfs) == len(set(sysfs)), sysfs  # once per node, not per descriptor
    assert any(p.endswith("renderD128/device") for p in sysfs)
    rows = {p.pid: p for p in s.processes}
    assert rows[90].dedicated.value == 20 * 2 * MIB  # 20 private clients of 2 MiB each
    assert all(p.name is None for p in s.processes)  # identity comes from the host sample


def test_combine_with_nvml_sample_data_and_collector_backend(tmp_path: Path) -> None:
    write_demo_tree(tmp_path)
    drm = DrmBackend(str(tmp_path)).sample()
    nv_metrics = drm.metrics[bus_id(AMD_PDEV)]  # any DeviceMetrics will do as NVML's
    nvml = GpuSample(
        "nvml",
        adapters=(_nvml("00000000:01:00.0"),),
        metrics={"00000000:01:00.0": nv_metrics},
        processes=(GpuProcess(7, "00000000:01:00.0", ("compute",), Reading.measured(1, "nvml:x")),),
        driver_version="550.54",
    )
    both = combine_with_nvml(nvml, drm)
    assert [a.pci_bus_id for a in both.adapters] == [
        "00000000:01:00.0",
        "00000000:03:00.0",
        "00000000:00:02.0",
    ]
    assert set(both.metrics) == {a.pci_bus_id for a in both.adapters}
    assert [p.pid for p in both.processes] == [7, 4100, 4200, 4300, 4301, 4400]
    assert both.backend_problem is None and both.driver_version == "550.54"
    assert set(both.extra_metrics) == {bus_id(AMD_PDEV)}  # amdgpu's GTT
    backend_for = LinuxGpus(NotAsked("nvml", "unused"), DrmBackend(str(tmp_path))).backend_for
    assert backend_for(both, None) == "nvml"  # first adapter: NVIDIA
    assert backend_for(both, 1) == "drm"
    assert backend_for(both, 2) == "drm"

    # NVML absent (an AMD/Intel-only machine): usable, NVML's reason kept as a problem
    missing = Problem("backend.init", Reason.NO_LIBRARY, "NVML Shared Library Not Found")
    alone = combine_with_nvml(GpuSample("nvml", problems=(missing,), backend_problem=missing), drm)
    assert alone.backend_problem is None and alone.problems == (missing,)
    assert [(a.index, a.vendor) for a in alone.adapters] == [(0, "amd"), (1, "intel")]
    assert backend_for(alone, None) == "drm"
    # NVML already lists 03:00.0: the DRM copy, its metrics and its processes are dropped
    owned = GpuSample("nvml", adapters=(_nvml("00000000:03:00.0"),), metrics={})
    merged = combine_with_nvml(owned, drm)
    assert [a.backend for a in merged.adapters] == ["nvml", "drm"]
    assert bus_id(AMD_PDEV) not in merged.metrics
    assert {p.adapter for p in merged.processes} == {bus_id(INTEL_PDEV)}
    assert merged.extra_metrics == {}  # the GTT of a card NVML lists goes with it
    # no DRM card: NVML's sample unchanged
    assert combine_with_nvml(nvml, DrmBackend(str(tmp_path / "empty")).sample()) is nvml


def test_names_from_product_name_else_pci_ids(tmp_path: Path) -> None:
    write_demo_tree(tmp_path)
    ids = tmp_path / "usr/share/hwdata/pci.ids"
    ids.parent.mkdir(parents=True)
    ids.write_text(
        "# comment\n"
        "1002  Advanced Micro Devices, Inc. [AMD/ATI]\n"
        "\t7550  Navi 48 [Radeon RX 9070/9070 XT/9070 GRE]\n"
        "\t\t1002 7550  a subsystem line, skipped\n"
        "8086  Intel Corporation\n"
        "\t4680  AlderLake-S GT1 [UHD Graphics 730]\n"
        "C 03  Display controller\n"
    )
    amd, intel = enumerate_cards(str(tmp_path))
    assert amd.name == "Navi 48 [Radeon RX 9070/9070 XT/9070 GRE]"
    assert intel.name == "AlderLake-S GT1 [UHD Graphics 730]"
    product = tmp_path / "sys/devices/pci0000:00" / AMD_PDEV / "product_name"
    product.write_text("AMD Radeon Pro W7900\n")
    assert enumerate_cards(str(tmp_path))[0].name == "AMD Radeon Pro W7900"


def test_collector_with_nvml_with_drm_source(tmp_path: Path) -> None:
    from gputaskman.backends.nvml import NvmlBackend
    from gputaskman.sampling.collector import Collector, NullScanner

    write_demo_tree(tmp_path)
    source = LinuxGpus(NvmlBackend(), DrmBackend(str(tmp_path)))
    collector = Collector(scan_budget=None, source=source, scanner=NullScanner())
    try:
        snap, _system = collector.sample_with_system()
    finally:
        collector.close()
    drm_adapters_seen = [a for a in snap.adapters if a.backend == BACKEND]
    assert [a.pci_bus_id for a in drm_adapters_seen] == [bus_id(AMD_PDEV), bus_id(INTEL_PDEV)]
    assert snap.available  # usable even where NVML has no library
    rows = {p.pid: p for p in snap.processes if p.adapter in {bus_id(AMD_PDEV), bus_id(INTEL_PDEV)}}
    assert rows[4100].dedicated.value == 4 * GIB
    assert rows[4300].dedicated.value is None
    assert snap.attributed_on(bus_id(AMD_PDEV)) == 4 * GIB
    assert snap.backend == "drm"  # the first adapter is an AMD card (no NVML here)
    assert any(INTEL_MEMORY_NOTE in n for n in snap.notes)
