"""Windows adapters from DXGI (IDXGIFactory1::EnumAdapters1), keyed by LUID.

Theory of operation
-------------------
`DxgiApi.enum_adapters()` returns one `AdapterDesc` per adapter DXGI lists: the
``DXGI_ADAPTER_DESC1`` fields (description, vendor/device/subsystem ids, dedicated video
memory, dedicated and shared system memory, LUID, flags) plus, where the kernel thunk
answers, the adapter's PCI bus/device/function (D3DKMTQueryAdapterInfo with
KMTQAITYPE_ADAPTERADDRESS; DXGI itself gives no PCI address, and the thunk gives no PCI
domain). `CtypesDxgi` is the real implementation; tests replace it with any object that
has `enum_adapters`.

The LUID is the pairing key on Windows: PDH names counter instances by it
(``luid_0x00000000_0x0000D1A2``), so `luid_key` spells it the way `pdh` parses it and
`to_adapter` puts it in `Adapter.pci_bus_id` (the model's pairing field). A LUID changes at
boot and when a GPU is disabled and re-enabled; `backend.WddmBackend` handles the latter.

Software adapters (the Microsoft Basic Render Driver, DXGI_ADAPTER_FLAG_SOFTWARE) are
skipped: they have no VRAM and PDH lists no processes on them.

COM calls go through the vtable by index; the indices are those of dxgi.h (IUnknown 0-2,
IDXGIObject 3-6, IDXGIFactory 7-11, IDXGIFactory1::EnumAdapters1 12; IDXGIAdapter 7-9,
IDXGIAdapter1::GetDesc1 10). Not validated on Windows hardware; the structure layout and
the call sequence are tested on Linux against a fake COM object built with ctypes.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from gputaskman.base.readings import Adapter

BACKEND: Final = "wddm"
DXGI_ERROR_NOT_FOUND: Final = 0x887A0002
DXGI_ADAPTER_FLAG_SOFTWARE: Final = 0x2
KMTQAITYPE_ADAPTERADDRESS: Final = 6
VT_RELEASE: Final = 2
VT_FACTORY_ENUM_ADAPTERS1: Final = 12
VT_ADAPTER_GET_DESC1: Final = 10
MAX_ADAPTERS: Final = 64  # a loop bound: no machine has more, a broken driver might say so

VENDORS: Final = {
    0x10DE: "nvidia",
    0x1002: "amd",
    0x1022: "amd",
    0x8086: "intel",
    0x5143: "qualcomm",
    0x1414: "microsoft",
}


class LUID(ctypes.Structure):
    _fields_ = (("LowPart", ctypes.c_uint32), ("HighPart", ctypes.c_int32))


class DXGI_ADAPTER_DESC1(ctypes.Structure):
    # WCHAR is 2 bytes on Windows; c_wchar is 4 on Linux, so the text is raw UTF-16 units.
    _fields_ = (
        ("Description", ctypes.c_uint16 * 128),
        ("VendorId", ctypes.c_uint32),
        ("DeviceId", ctypes.c_uint32),
        ("SubSysId", ctypes.c_uint32),
        ("Revision", ctypes.c_uint32),
        ("DedicatedVideoMemory", ctypes.c_size_t),
        ("DedicatedSystemMemory", ctypes.c_size_t),
        ("SharedSystemMemory", ctypes.c_size_t),
        ("AdapterLuid", LUID),
        ("Flags", ctypes.c_uint32),
    )


class GUID(ctypes.Structure):
    _fields_ = (
        ("Data1", ctypes.c_uint32),
        ("Data2", ctypes.c_uint16),
        ("Data3", ctypes.c_uint16),
        ("Data4", ctypes.c_uint8 * 8),
    )


IID_IDXGIFactory1: Final = GUID(
    0x770AAE78, 0xF26F, 0x4DBA, (ctypes.c_uint8 * 8)(0xA8, 0x29, 0x25, 0x3C, 0x83, 0xD1, 0xB3, 0x87)
)


class D3DKMT_OPENADAPTERFROMLUID(ctypes.Structure):
    _fields_ = (("AdapterLuid", LUID), ("hAdapter", ctypes.c_uint32))


class D3DKMT_QUERYADAPTERINFO(ctypes.Structure):
    _fields_ = (
        ("hAdapter", ctypes.c_uint32),
        ("Type", ctypes.c_uint32),
        ("pPrivateDriverData", ctypes.c_void_p),
        ("PrivateDriverDataSize", ctypes.c_uint32),
    )


class D3DKMT_ADAPTERADDRESS(ctypes.Structure):
    _fields_ = (
        ("BusNumber", ctypes.c_uint32),
        ("DeviceNumber", ctypes.c_uint32),
        ("FunctionNumber", ctypes.c_uint32),
    )


class D3DKMT_CLOSEADAPTER(ctypes.Structure):
    _fields_ = (("hAdapter", ctypes.c_uint32),)


@dataclass(frozen=True, slots=True)
class AdapterDesc:
    """One DXGI adapter. Memory sizes are bytes as DXGI reports them."""

    description: str
    vendor_id: int
    device_id: int
    subsys_id: int
    revision: int
    dedicated_video_memory: int
    dedicated_system_memory: int
    shared_system_memory: int
    luid_high: int
    luid_low: int
    flags: int = 0
    pci: tuple[int, int, int] | None = None  # (bus, device, function), no domain

    @property
    def luid(self) -> str:
        return luid_key(self.luid_high, self.luid_low)

    @property
    def software(self) -> bool:
        return bool(self.flags & DXGI_ADAPTER_FLAG_SOFTWARE)

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id, f"pci:{self.vendor_id:04x}")

    @property
    def pci_text(self) -> str | None:
        """``01:00.0`` (domainless; D3DKMT gives no domain), or None when unknown."""
        if self.pci is None:
            return None
        bus, dev, fn = self.pci
        return f"{bus:02x}:{dev:02x}.{fn:x}"


class DxgiApi(Protocol):
    """What the backend needs from DXGI. Raises OSError when DXGI cannot be asked."""

    def enum_adapters(self) -> list[AdapterDesc]: ...


def luid_key(high: int, low: int) -> str:
    """``luid_0x00000000_0x0000d1a2``: PDH's spelling, lower case (the pairing key)."""
    return f"luid_0x{high & 0xFFFFFFFF:08x}_0x{low & 0xFFFFFFFF:08x}"


def desc_from_struct(d: DXGI_ADAPTER_DESC1, pci: tuple[int, int, int] | None = None) -> AdapterDesc:
    units = bytes(memoryview(d.Description).cast("B"))
    text = units.decode("utf-16-le", "replace").split("\x00", 1)[0].strip()
    return AdapterDesc(
        description=text,
        vendor_id=int(d.VendorId),
        device_id=int(d.DeviceId),
        subsys_id=int(d.SubSysId),
        revision=int(d.Revision),
        dedicated_video_memory=int(d.DedicatedVideoMemory),
        dedicated_system_memory=int(d.DedicatedSystemMemory),
        shared_system_memory=int(d.SharedSystemMemory),
        luid_high=int(d.AdapterLuid.HighPart),
        luid_low=int(d.AdapterLuid.LowPart),
        flags=int(d.Flags),
        pci=pci,
    )


def to_adapter(desc: AdapterDesc, index: int) -> Adapter:
    """The model's adapter: the LUID key stands in the pairing field."""
    return Adapter(
        index=index,
        vendor=desc.vendor,
        name=desc.description or None,
        uuid=None,
        pci_bus_id=desc.luid,
        backend=BACKEND,
    )


def hardware_adapters(descs: list[AdapterDesc]) -> list[AdapterDesc]:
    """The adapters worth showing: not software, and each LUID once (first wins)."""
    seen: set[str] = set()
    out = []
    for d in descs:
        if d.software or (d.vendor_id == 0x1414 and d.device_id == 0x8C) or d.luid in seen:
            continue
        seen.add(d.luid)
        out.append(d)
    return out


def _hresult(hr: int) -> int:
    return hr & 0xFFFFFFFF


class CtypesDxgi:
    """DXGI through ctypes. `loader` and `functype` are seams: on Windows they are
    ``ctypes.WinDLL`` on the absolute path of dxgi.dll and ``ctypes.WINFUNCTYPE``; tests
    pass a fake factory creator and ``ctypes.CFUNCTYPE``."""

    def __init__(
        self,
        create_factory: Callable[[], int] | None = None,
        functype: Callable[..., Any] | None = None,
        adapter_address: Callable[[LUID], tuple[int, int, int] | None] | None = None,
    ) -> None:
        self._create_factory = create_factory
        self._functype = functype
        self._address = adapter_address

    def _ft(self) -> Callable[..., Any]:
        if self._functype is None:
            # ctypes.WINFUNCTYPE (stdcall) exists on Windows only; CFUNCTYPE elsewhere (tests)
            self._functype = getattr(ctypes, "WINFUNCTYPE", ctypes.CFUNCTYPE)
        assert self._functype is not None
        return self._functype

    def _method(self, obj: int, index: int, *argtypes: Any) -> Callable[..., int]:
        vtbl = ctypes.cast(obj, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)))[0]
        proto = self._ft()(ctypes.c_long, ctypes.c_void_p, *argtypes)
        return proto(vtbl[index])  # type: ignore[no-any-return]

    def _release(self, obj: int) -> None:
        vtbl = ctypes.cast(obj, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)))[0]
        self._ft()(ctypes.c_ulong, ctypes.c_void_p)(vtbl[VT_RELEASE])(obj)

    def enum_adapters(self) -> list[AdapterDesc]:
        factory = (self._create_factory or _windows_factory)()
        out: list[AdapterDesc] = []
        try:
            enum1 = self._method(
                factory, VT_FACTORY_ENUM_ADAPTERS1, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)
            )
            for i in range(MAX_ADAPTERS):
                adapter = ctypes.c_void_p()
                hr = _hresult(enum1(factory, i, ctypes.byref(adapter)))
                if hr == DXGI_ERROR_NOT_FOUND:
                    break
                if hr != 0 or not adapter.value:
                    raise OSError(f"IDXGIFactory1::EnumAdapters1({i}) failed: 0x{hr:08X}")
                try:
                    desc = DXGI_ADAPTER_DESC1()
                    get = self._method(
                        adapter.value, VT_ADAPTER_GET_DESC1, ctypes.POINTER(DXGI_ADAPTER_DESC1)
                    )
                    hr = _hresult(get(adapter.value, ctypes.byref(desc)))
                    if hr != 0:
                        raise OSError(f"IDXGIAdapter1::GetDesc1 failed: 0x{hr:08X}")
                finally:
                    self._release(adapter.value)
                lookup = self._address or _windows_adapter_address
                out.append(desc_from_struct(desc, lookup(desc.AdapterLuid)))
        finally:
            self._release(factory)
        return out


def _windows_factory() -> int:
    """CreateDXGIFactory1 from dxgi.dll, loaded by absolute path (Windows only)."""
    if sys.platform != "win32":
        raise OSError("DXGI exists only on Windows")
    from gputaskman.backends.win import _windows_system_directory, system_dll

    dll = ctypes.WinDLL(system_dll("dxgi.dll", get_system_directory=_windows_system_directory))  # type: ignore[attr-defined]
    factory = ctypes.c_void_p()
    hr = _hresult(dll.CreateDXGIFactory1(ctypes.byref(IID_IDXGIFactory1), ctypes.byref(factory)))
    if hr != 0 or not factory.value:
        raise OSError(f"CreateDXGIFactory1 failed: 0x{hr:08X}")
    return factory.value


def _windows_adapter_address(luid: LUID) -> tuple[int, int, int] | None:
    """PCI bus/device/function of an adapter from the kernel thunks in gdi32.dll; None when
    not on Windows or when any call fails (the address is then unknown, never guessed)."""
    if sys.platform != "win32":
        return None
    try:
        from gputaskman.backends.win import _windows_system_directory, system_dll

        gdi = ctypes.WinDLL(system_dll("gdi32.dll", get_system_directory=_windows_system_directory))  # type: ignore[attr-defined]
        open_args = D3DKMT_OPENADAPTERFROMLUID(luid, 0)
        if gdi.D3DKMTOpenAdapterFromLuid(ctypes.byref(open_args)) != 0:
            return None
        try:
            addr = D3DKMT_ADAPTERADDRESS()
            q = D3DKMT_QUERYADAPTERINFO(
                open_args.hAdapter,
                KMTQAITYPE_ADAPTERADDRESS,
                ctypes.cast(ctypes.byref(addr), ctypes.c_void_p),
                ctypes.sizeof(addr),
            )
            if gdi.D3DKMTQueryAdapterInfo(ctypes.byref(q)) != 0:
                return None
            return (int(addr.BusNumber), int(addr.DeviceNumber), int(addr.FunctionNumber))
        finally:
            gdi.D3DKMTCloseAdapter(ctypes.byref(D3DKMT_CLOSEADAPTER(open_args.hAdapter)))
    except (AttributeError, OSError):
        return None
