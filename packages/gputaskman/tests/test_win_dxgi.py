"""Windows adapters: DXGI structures and call sequence, LUID keys, disable/re-enable.

There is no Windows here. The ctypes layer is exercised against a fake COM object built
with ctypes (vtables of C callbacks), so the structure layout, the vtable calls, the loop
end on DXGI_ERROR_NOT_FOUND and the Release of every object are real code paths; what
Windows' dxgi.dll does is not validated. `WddmBackend` tests use mocked DXGI/PDH.
"""

from __future__ import annotations

import ctypes

import pytest
from gputaskman.backends.win import dxgi, pdh, system_dll
from gputaskman.backends.win.backend import LOST_DETAIL, WddmBackend
from gputaskman.backends.win.dxgi import (
    DXGI_ADAPTER_DESC1,
    AdapterDesc,
    CtypesDxgi,
    desc_from_struct,
    hardware_adapters,
    luid_key,
)
from gputaskman.backends.win.pdh import CounterRead
from gputaskman.base.readings import Reason

GIB = 1024**3


def desc(low: int, name: str = "NVIDIA Mock RTX", pci=(1, 0, 0), **kw) -> AdapterDesc:
    base = dict(
        description=name,
        vendor_id=0x10DE,
        device_id=0x2704,
        subsys_id=0x16F310DE,
        revision=0xA1,
        dedicated_video_memory=16 * GIB,
        dedicated_system_memory=0,
        shared_system_memory=32 * GIB,
        luid_high=0,
        luid_low=low,
        flags=0,
        pci=pci,
    )
    base.update(kw)
    return AdapterDesc(**base)


def test_desc1_has_the_windows_x64_layout():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        pytest.skip("layout checked for 64-bit builds")
    assert ctypes.sizeof(DXGI_ADAPTER_DESC1) == 312
    assert DXGI_ADAPTER_DESC1.VendorId.offset == 256
    assert DXGI_ADAPTER_DESC1.DedicatedVideoMemory.offset == 272
    assert DXGI_ADAPTER_DESC1.AdapterLuid.offset == 296
    assert DXGI_ADAPTER_DESC1.Flags.offset == 304


def struct(text: str, low: int, high: int = 0, flags: int = 0, vendor: int = 0x1002):
    d = DXGI_ADAPTER_DESC1()
    units = text.encode("utf-16-le")
    ctypes.memmove(d.Description, units, min(len(units), 254))
    d.VendorId, d.DeviceId, d.SubSysId, d.Revision = vendor, 0x744C, 0x1234, 0xC8
    d.DedicatedVideoMemory, d.SharedSystemMemory = 24 * GIB, 31 * GIB
    d.AdapterLuid.LowPart, d.AdapterLuid.HighPart = low, high
    d.Flags = flags
    return d


def test_desc_from_struct_decodes_utf16_and_luid():
    d = desc_from_struct(struct("AMD Radeon™ RX 7900 XTX", 0xC9A5), pci=(3, 0, 0))
    assert d.description == "AMD Radeon™ RX 7900 XTX"
    assert d.vendor == "amd" and d.dedicated_video_memory == 24 * GIB
    assert d.luid == "luid_0x00000000_0x0000c9a5" and d.pci_text == "03:00.0"


def test_luid_key_matches_pdh_instance_spelling():
    # the pairing key must be spelled the same by both sides
    i = pdh.parse_instance("pid_4_luid_0x00000000_0x0000D1A2_phys_0_eng_0_engtype_3D")
    assert i is not None and i.luid == luid_key(0, 0xD1A2)
    # HighPart is a signed LONG in the structure: a negative value keeps its 32 bits
    assert luid_key(-1, 5) == "luid_0xffffffff_0x00000005"


def test_hardware_adapters_skip_software_and_duplicates():
    basic = desc(0x10, name="Microsoft Basic Render Driver", vendor_id=0x1414, device_id=0x8C)
    warp = desc(0x11, name="software", flags=dxgi.DXGI_ADAPTER_FLAG_SOFTWARE)
    real = desc(0xD1A2)
    assert hardware_adapters([real, basic, warp, desc(0xD1A2, name="again")]) == [real]


class FakeCom:
    """A COM object in memory: its first word points to a vtable of C callbacks."""

    def __init__(self, methods: dict[int, object], size: int = 16) -> None:
        self.methods = methods  # keep the callbacks alive
        self.vtbl = (ctypes.c_void_p * size)()
        for i, fn in methods.items():
            self.vtbl[i] = ctypes.cast(fn, ctypes.c_void_p)
        self.obj = ctypes.c_void_p(ctypes.addressof(self.vtbl))
        self.ptr = ctypes.addressof(self.obj)


RELEASE = ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_void_p)
ENUM1 = ctypes.CFUNCTYPE(
    ctypes.c_long, ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)
)
GETDESC1 = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_void_p, ctypes.POINTER(DXGI_ADAPTER_DESC1))
NOT_FOUND = dxgi.DXGI_ERROR_NOT_FOUND - 2**32  # HRESULT is a signed LONG
E_FAIL = 0x80004005 - 2**32


def fake_dxgi(structs, fail_desc_at: int | None = None):
    released: list[int] = []
    calls: list[int] = []

    def release(this):
        released.append(this)
        return 0

    adapters = []
    for n, s in enumerate(structs):

        def get_desc(this, out, s=s, n=n):
            if n == fail_desc_at:
                return E_FAIL
            ctypes.memmove(out, ctypes.byref(s), ctypes.sizeof(s))
            return 0

        adapters.append(FakeCom({2: RELEASE(release), 10: GETDESC1(get_desc)}))

    def enum1(this, i, out):
        calls.append(i)
        if i >= len(adapters):
            return NOT_FOUND
        out[0] = adapters[i].ptr
        return 0

    factory = FakeCom({2: RELEASE(release), 12: ENUM1(enum1)})
    return factory, adapters, released, calls


def test_ctypes_dxgi_against_fake_com_enumerates_and_releases_everything():
    structs = [struct("GPU A", 0xD1A2, vendor=0x10DE), struct("GPU B", 0xC9A5, high=1)]
    factory, adapters, released, calls = fake_dxgi(structs)
    api = CtypesDxgi(
        create_factory=lambda: factory.ptr,
        functype=ctypes.CFUNCTYPE,
        adapter_address=lambda luid: (1, 0, 0) if luid.LowPart == 0xD1A2 else None,
    )
    out = api.enum_adapters()
    assert [d.description for d in out] == ["GPU A", "GPU B"]
    assert out[0].luid == "luid_0x00000000_0x0000d1a2" and out[0].pci == (1, 0, 0)
    assert out[1].luid == "luid_0x00000001_0x0000c9a5" and out[1].pci is None
    assert calls == [0, 1, 2]  # stops at DXGI_ERROR_NOT_FOUND
    assert sorted(released) == sorted([factory.ptr] + [a.ptr for a in adapters])


def test_ctypes_dxgi_failed_getdesc_raises_and_still_releases():
    factory, adapters, released, _ = fake_dxgi([struct("A", 1), struct("B", 2)], fail_desc_at=1)
    api = CtypesDxgi(lambda: factory.ptr, ctypes.CFUNCTYPE, lambda luid: None)
    with pytest.raises(OSError, match="GetDesc1 failed: 0x80004005"):
        api.enum_adapters()
    assert sorted(released) == sorted([factory.ptr, adapters[0].ptr, adapters[1].ptr])


def test_ctypes_dxgi_refuses_off_windows():
    with pytest.raises(OSError, match="only on Windows"):
        CtypesDxgi().enum_adapters()


def test_system_dlls_are_absolute_paths():
    p = system_dll("nvml.dll", environ={"SystemRoot": r"D:\Win"})
    assert p == r"D:\Win\System32\nvml.dll"
    assert system_dll("pdh.dll", environ={}, get_system_directory=lambda: r"C:\W\System32") == (
        r"C:\W\System32\pdh.dll"
    )
    with pytest.raises(ValueError):
        system_dll(r"..\evil\nvml.dll", environ={})
    with pytest.raises(ValueError):
        system_dll("nvml.dll", environ={}, get_system_directory=lambda: r"relative\dir")


class SeqDxgi:
    """Mocked DXGI: each call returns the next enumeration (the last one repeats)."""

    def __init__(self, *steps):
        self.steps = list(steps)

    def enum_adapters(self):
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        if isinstance(step, Exception):
            raise step
        return list(step)


class StaticPdh:
    def __init__(self, luids):
        self.luids = luids

    def read(self, paths):
        inst = {f"pid_10_luid_0x00000000_0x{lo:08X}_phys_0": 5 * GIB for lo in self.luids}
        adapter = {f"luid_0x00000000_0x{lo:08X}_phys_0": 6 * GIB for lo in self.luids}
        return {
            pdh.LOCAL: CounterRead.ok(inst),
            pdh.NON_LOCAL: CounterRead.ok(dict.fromkeys(inst, 0)),
            pdh.ENGINE: CounterRead.failed(pdh.PDH_INVALID_DATA),
            pdh.ADAPTER_DEDICATED: CounterRead.ok(adapter),
            pdh.ADAPTER_SHARED: CounterRead.ok({}),
        }

    def close(self):
        pass


def test_wddm_mocked_disabled_gpu_shows_unavailable_then_comes_back_at_its_index():
    igpu = desc(0x1111, name="Intel Mock iGPU", vendor_id=0x8086, device_id=0xA7A0, pci=(0, 2, 0))
    dgpu = desc(0xD1A2)
    dgpu_again = desc(0xE5F0)  # re-enabled: new LUID, same ids and PCI address
    pdh_fake = StaticPdh([0x1111, 0xD1A2])
    b = WddmBackend(dxgi=SeqDxgi([igpu, dgpu], [igpu], [igpu, dgpu_again]), pdh=pdh_fake, tcc=False)

    s1 = b.sample()
    assert [(a.index, a.pci_bus_id) for a in s1.adapters] == [
        (0, igpu.luid),
        (1, dgpu.luid),
    ]
    assert s1.metrics[dgpu.luid].memory_used_bytes.value == 6 * GIB

    s2 = b.sample()  # disabled in Device Manager: DXGI no longer lists it
    assert [a.index for a in s2.adapters] == [0, 1]
    lost = s2.metrics[dgpu.luid]
    assert lost.memory_used_bytes.value is None
    assert lost.memory_used_bytes.reason is Reason.GPU_LOST
    assert lost.memory_used_bytes.detail == LOST_DETAIL
    assert not [p for p in s2.processes if p.adapter == dgpu.luid]
    assert any(p.is_process_list and p.adapter == dgpu.luid for p in s2.problems)
    assert s2.probe.status == "ok" and s2.probe.partial

    pdh_fake.luids = [0x1111]  # PDH has not published the new LUID yet
    s3 = b.sample()
    assert [(a.index, a.pci_bus_id) for a in s3.adapters] == [
        (0, igpu.luid),
        (1, dgpu_again.luid),
    ]
    assert any("new LUID" in n for n in s3.notes)
    m = s3.metrics[dgpu_again.luid]
    assert m.memory_used_bytes.reason is Reason.UNAVAILABLE
    assert "yet" in (m.memory_used_bytes.detail or "")
    assert m.memory_total_bytes.value == 16 * GIB  # DXGI knows the size right away


def test_wddm_mocked_new_luid_without_pci_address_is_a_new_adapter_not_a_guess():
    old, new = desc(0xD1A2, pci=None), desc(0xE5F0, pci=None)
    b = WddmBackend(dxgi=SeqDxgi([old], [], [new]), pdh=StaticPdh([]), tcc=False)
    b.sample()
    b.sample()
    s = b.sample()
    # same name and ids, but no PCI address to prove it is the same GPU: index 1, old stays lost
    assert [(a.index, a.pci_bus_id) for a in s.adapters] == [(0, old.luid), (1, new.luid)]
    assert s.metrics[old.luid].util_gpu_percent.reason is Reason.GPU_LOST


def test_wddm_mocked_probe_tells_empty_from_failed():
    basic = desc(0x10, name="Microsoft Basic Render Driver", vendor_id=0x1414, device_id=0x8C)
    empty = WddmBackend(dxgi=SeqDxgi([basic]), pdh=StaticPdh([]), tcc=False).sample()
    assert empty.backend_problem is None and empty.probe.status == "empty"
    assert "probe succeeded, 0 GPUs" in empty.probe.line()
    failed = WddmBackend(
        dxgi=SeqDxgi(OSError("CreateDXGIFactory1 failed: 0x887A0004")), pdh=StaticPdh([]), tcc=False
    ).sample()
    assert failed.probe.status == "failed" and failed.probe.reason is Reason.QUERY_FAILED
    assert "probe failed" in failed.probe.line() and "0x887A0004" in failed.probe.line()
    assert failed.adapters == ()


def test_wddm_mocked_pdh_down_keeps_adapters_with_reasons():
    class BrokenPdh:
        def read(self, paths):
            raise OSError("PdhOpenQueryW failed: 0xC0000BB8")

        def close(self):
            raise OSError("closing a broken query")

    b = WddmBackend(dxgi=SeqDxgi([desc(0xD1A2)]), pdh=BrokenPdh(), tcc=False)
    s = b.sample()
    b.close()  # must not raise
    (a,) = s.adapters
    used = s.metrics[a.pci_bus_id].memory_used_bytes
    assert used.value is None and used.reason is Reason.QUERY_FAILED
    assert any(p.where == "processes.pdh" and p.adapter == a.pci_bus_id for p in s.problems)
