"""What a process is: runtime libraries, mapped model files, command line, category.

API
---
* ``scan_process(pid, create_time=None) -> ProcInfo``: one full look at one process
  (``/proc/PID/stat``, ``cmdline``, ``maps``, ``cwd``, ``exe``). Never raises for a process
  that is gone or protected: the `ProcInfo` says so in `gone` / `reasons`.
* ``Scanner(budget=0.150).scan(order) -> ScanResult``: the budgeted, cached version for
  refreshes. `order` is the caller's priority (e.g. processes with GPU memory first), as
  pids or ``(pid, create_time)`` pairs. ``budget=None`` scans everything (one-shot output).
* ``classify(...) -> Classification | None`` and the data tables `RUNTIMES`,
  `MODEL_EXTENSIONS` (re-exported from `procargs`) and the name tables below.
* ``parse_maps_line`` / ``mapped_paths`` / ``detect_runtimes`` / ``mapped_models``:
  sans-io helpers over the text of ``/proc/PID/maps``.

Theory of operation
-------------------
Runtime detection reads the memory map, never the process's memory: a shared object whose
file name matches a `RUNTIMES` entry (``libcudart.so.12`` -> CUDA runtime) is *detection*,
not proof of GPU work (PyTorch maps libcudart even on a CPU-only run). Mapped files with a
model extension are ``mapped`` evidence; model-looking arguments are ``cmdline`` (value of
a model flag) or ``path-arg`` evidence, found only after secrets are redacted, resolved
against the process's working directory. ``psutil.open_files()`` is never used: it costs
seconds per process; one read of ``maps`` costs tens of microseconds (see the benchmark).

The `Scanner` keeps one `ProcInfo` per ``(pid, create_time)``, so a process is scanned
once and a reused PID never inherits another process's runtimes. Each refresh first scans
processes never seen, in the caller's order, until the budget is spent (at least one per
refresh, so a tiny budget still makes progress; the last scan may overrun the budget by one
process); then, if time remains, rescans entries older than
`maps_max_age` (libraries loaded after start, e.g. a Python that imports torch later).
`scan_one` rescans on demand (the inspector). Entries for processes not requested for
`forget_after` refreshes are dropped, so the cache stays bounded.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from gputaskman import procfs
from gputaskman.model import Reason
from gputaskman.procargs import (
    MODEL_EXTENSIONS,
    model_args,
    redact_argv,
    resolve,
    split_cmdline,
)

__all__ = [
    "CATEGORIES",
    "MODEL_EXTENSIONS",
    "RUNTIMES",
    "Classification",
    "FieldReason",
    "MapsEntry",
    "ModelEvidence",
    "ProcInfo",
    "Runtime",
    "RuntimeSpec",
    "ScanResult",
    "Scanner",
    "classify",
    "detect_runtimes",
    "mapped_models",
    "mapped_paths",
    "parse_maps_line",
    "scan_process",
]

# --------------------------------------------------------------------------- tables


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    """A runtime recognised by the file name of a mapped shared object.

    `pattern` is matched at the start of the file's base name. `hint` is the category the
    library suggests (used by `classify`), or None when the library says nothing about it.
    """

    key: str
    label: str
    pattern: str
    hint: str | None = None


LLM = "LLM inference"
TRAINING = "training"
VISION = "vision"
SPEECH = "speech"
GRAPHICS = "graphics"
VIDEO = "video"
BROWSER = "browser"
COMPOSITOR = "compositor"
DECISION = "decision?"  # tabular / decision-tree ML, only ever from names: a heuristic
CATEGORIES = (LLM, TRAINING, VISION, SPEECH, GRAPHICS, VIDEO, BROWSER, COMPOSITOR, DECISION)

RUNTIMES: tuple[RuntimeSpec, ...] = (
    # NVIDIA CUDA and its libraries
    RuntimeSpec("cuda-runtime", "CUDA runtime", r"libcudart\.so"),
    RuntimeSpec("cuda-driver", "CUDA driver", r"libcuda\.so"),
    RuntimeSpec("nvrtc", "NVRTC", r"libnvrtc\.so"),
    RuntimeSpec("cublas", "cuBLAS", r"libcublas(?:Lt)?\.so"),
    RuntimeSpec("cudnn", "cuDNN", r"libcudnn(?:_[a-z_]+)?\.so"),
    RuntimeSpec("cufft", "cuFFT", r"libcufft\.so"),
    RuntimeSpec("cusparse", "cuSPARSE", r"libcusparse\.so"),
    RuntimeSpec("cusolver", "cuSOLVER", r"libcusolver\.so"),
    RuntimeSpec("curand", "cuRAND", r"libcurand\.so"),
    RuntimeSpec("nccl", "NCCL", r"libnccl\.so"),
    RuntimeSpec("tensorrt", "TensorRT", r"libnvinfer(?:_plugin)?\.so"),
    RuntimeSpec("nvenc", "NVENC", r"libnvidia-encode\.so", VIDEO),
    RuntimeSpec("nvdec", "NVDEC", r"libnvcuvid\.so", VIDEO),
    RuntimeSpec("nvidia-gl", "NVIDIA OpenGL", r"lib(?:GLX_nvidia|EGL_nvidia|nvidia-glcore)\.so",
                GRAPHICS),
    # AMD ROCm
    RuntimeSpec("hip", "ROCm HIP", r"libamdhip64\.so"),
    RuntimeSpec("hsa", "ROCm HSA runtime", r"libhsa-runtime64\.so"),
    RuntimeSpec("rocblas", "rocBLAS/hipBLAS", r"lib(?:rocblas|hipblas|hipblaslt)\.so"),
    RuntimeSpec("miopen", "MIOpen", r"libMIOpen\.so"),
    RuntimeSpec("rccl", "RCCL", r"librccl\.so"),
    # Intel
    RuntimeSpec("level-zero", "oneAPI Level Zero", r"libze_loader\.so"),
    RuntimeSpec("sycl", "SYCL", r"libsycl\.so"),
    RuntimeSpec("openvino", "OpenVINO", r"libopenvino\.so"),
    # Cross-vendor APIs
    RuntimeSpec("vulkan", "Vulkan", r"libvulkan\.so", GRAPHICS),
    RuntimeSpec("opencl", "OpenCL", r"libOpenCL\.so"),
    RuntimeSpec("opengl", "OpenGL", r"lib(?:GL|GLX|EGL|OpenGL)\.so", GRAPHICS),
    RuntimeSpec("vaapi", "VA-API", r"libva\.so", VIDEO),
    RuntimeSpec("ffmpeg", "FFmpeg", r"libavcodec\.so", VIDEO),
    # ggml family (backend in the name: libggml-cuda.so, libggml-cpu-haswell.so)
    RuntimeSpec("ggml-cuda", "ggml CUDA backend", r"libggml-cuda\.so", LLM),
    RuntimeSpec("ggml-vulkan", "ggml Vulkan backend", r"libggml-vulkan\.so", LLM),
    RuntimeSpec("ggml-hip", "ggml HIP backend", r"libggml-hip\.so", LLM),
    RuntimeSpec("ggml-sycl", "ggml SYCL backend", r"libggml-sycl\.so", LLM),
    RuntimeSpec("ggml-opencl", "ggml OpenCL backend", r"libggml-opencl\.so", LLM),
    RuntimeSpec("ggml-metal", "ggml Metal backend", r"libggml-metal\.so", LLM),
    RuntimeSpec("ggml-blas", "ggml BLAS backend", r"libggml-blas\.so", LLM),
    RuntimeSpec("ggml-rpc", "ggml RPC backend", r"libggml-rpc\.so", LLM),
    RuntimeSpec("ggml-cpu", "ggml CPU backend", r"libggml-cpu(?:-[a-z0-9_]+)?\.so", LLM),
    RuntimeSpec("ggml", "ggml", r"libggml(?:-base)?\.so", LLM),
    RuntimeSpec("llama", "llama.cpp", r"libllama\.so", LLM),
    RuntimeSpec("whisper", "whisper.cpp", r"libwhisper\.so", SPEECH),
    RuntimeSpec("stable-diffusion-cpp", "stable-diffusion.cpp", r"libstable-diffusion\.so",
                VISION),
    RuntimeSpec("ctranslate2", "CTranslate2", r"libctranslate2\.so"),
    # Frameworks
    RuntimeSpec("pytorch", "PyTorch",
                r"(?:libtorch(?:_cpu|_cuda|_hip|_python|_global_deps)?|libc10(?:_cuda)?)\.so"),
    RuntimeSpec("onnxruntime", "ONNX Runtime",
                r"(?:libonnxruntime(?:_providers_[a-z_]+)?|onnxruntime_pybind11_state)[.-]"),
    RuntimeSpec("tensorflow", "TensorFlow",
                r"(?:libtensorflow(?:_framework|_cc)?|_pywrap_tensorflow_internal)\.so"),
    RuntimeSpec("tflite", "TensorFlow Lite", r"libtensorflowlite(?:_c)?\.so"),
    RuntimeSpec("jax", "JAX/XLA", r"(?:xla_extension|xla_cuda_plugin|xla_rocm_plugin|_jax)[.-]"),
    RuntimeSpec("paddle", "PaddlePaddle", r"libpaddle\.so"),
    RuntimeSpec("mxnet", "MXNet", r"libmxnet\.so"),
    RuntimeSpec("xgboost", "XGBoost", r"libxgboost\.so", DECISION),
    RuntimeSpec("lightgbm", "LightGBM", r"lib_lightgbm\.so", DECISION),
)

_RUNTIME_RE = re.compile("|".join(f"(?P<r{i}>{s.pattern})" for i, s in enumerate(RUNTIMES)))

# Name tables for classify(): lower-case process names (comm or argv[0]/script base names).
COMPOSITOR_NAMES = frozenset({
    "xorg", "x", "xwayland", "gnome-shell", "kwin_wayland", "kwin_x11", "sway", "hyprland",
    "weston", "mutter", "picom", "compton", "wayfire", "cosmic-comp", "labwc", "river",
    "niri", "gamescope", "xfwm4", "marco", "muffin", "enlightenment",
})
BROWSER_NAMES = frozenset({
    "firefox", "firefox-esr", "firefox-bin", "chrome", "google-chrome", "chromium",
    "chromium-browser", "brave", "brave-browser", "msedge", "microsoft-edge", "vivaldi",
    "vivaldi-bin", "opera", "librewolf", "epiphany", "qutebrowser", "thorium",
})
VIDEO_NAMES = frozenset({
    "ffmpeg", "obs", "obs-studio", "gst-launch-1.0", "handbrakecli", "ghb", "vlc", "mpv",
    "kdenlive", "shotcut", "resolve", "davinci-resolve", "totem", "celluloid",
})
GRAPHICS_NAMES = frozenset({
    "blender", "godot", "unity", "unityhub", "unrealeditor", "steam", "gzdoom", "glxgears",
    "vkcube", "glmark2", "vkmark", "krita", "gimp", "darktable", "freecad",
})
# Word tables: matched as whole words (tokens split on anything not a letter or digit), so
# "train" matches train_lora.py and --do_train but not "constraint".
SPEECH_WORDS = ("whisper", "faster whisper", "piper", "vosk", "coqui", "tts", "parakeet",
                "handy", "wyoming", "speech", "riva", "kokoro", "asr", "stt")
VISION_WORDS = ("comfyui", "stable diffusion", "sd webui", "automatic1111", "invokeai",
                "fooocus", "diffusers", "yolo", "ultralytics", "detectron2", "sam2",
                "segment anything", "sdxl", "flux")
TRAINING_WORDS = ("train", "training", "trainer", "finetune", "finetuning", "fine tune",
                  "torchrun", "deepspeed", "accelerate", "pretrain", "sft", "dpo")
LLM_WORDS = ("llama", "ollama", "vllm", "sglang", "text generation", "text generation launcher",
             "koboldcpp", "localai", "local ai", "lmstudio", "lm studio", "tabbyapi",
             "exllama", "exllamav2", "mlc llm", "gpt4all", "llamafile", "aphrodite", "tgi",
             "llm", "llama server", "llama cli", "mistral", "qwen", "gemma", "phi")
DECISION_WORDS = ("xgboost", "lightgbm", "catboost", "sklearn", "scikit learn")

# --------------------------------------------------------------------------- data


@dataclass(frozen=True, slots=True)
class Runtime:
    """A detected runtime: `key`/`label` from `RUNTIMES`, `library` the mapped base name."""

    key: str
    label: str
    library: str


@dataclass(frozen=True, slots=True)
class ModelEvidence:
    """One reason to think the process holds a model file.

    `evidence` is ``mapped`` (the file is in the memory map), ``cmdline`` (the value of a
    model flag) or ``path-arg`` (a model-looking argument; informational only).
    `path` is the absolute path as the process sees it (None when relative and the cwd is
    unknown); `raw` is the argument as written (None for mapped). `deleted` means the maps
    line ended in ``(deleted)``. `exists` / `size_bytes` come from a stat through
    ``/proc/PID/root`` (mapped and cmdline evidence only) and are None when not checked.
    """

    evidence: str
    path: str | None
    raw: str | None = None
    flag: str | None = None
    deleted: bool = False
    exists: bool | None = None
    size_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Classification:
    """A category with what it rests on. `heuristic` is true when only names support it
    (the UI shows ``?``); false when mapped libraries or model files do."""

    category: str
    heuristic: bool
    basis: str

    @property
    def label(self) -> str:
        c = self.category
        return c if (not self.heuristic or c.endswith("?")) else f"{c}?"


@dataclass(frozen=True, slots=True)
class FieldReason:
    """Why a field of `ProcInfo` is missing: `field` is ``maps``, ``cmdline``, ``cwd``,
    ``exe``, ``stat`` or ``process``."""

    field: str
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """Everything procinfo knows about one process. Unknown is None (with a `FieldReason`);
    an empty tuple means "looked and found none" (only when the field has no reason)."""

    pid: int
    create_time: float | None
    name: str | None
    exe: str | None
    cwd: str | None
    cmdline: tuple[str, ...] | None  # redacted
    redacted: int  # how many argument values were hidden
    runtimes: tuple[Runtime, ...]
    models: tuple[ModelEvidence, ...]
    classification: Classification | None
    scanned_at: float  # time.monotonic() of the scan
    gone: bool = False
    reasons: tuple[FieldReason, ...] = ()
    kernel_thread: bool = False  # no user memory: maps, cwd and exe are not read

    @property
    def key(self) -> tuple[int, float | None]:
        return (self.pid, self.create_time)

    @property
    def category(self) -> str | None:
        return self.classification.label if self.classification else None

    @property
    def runtime_keys(self) -> tuple[str, ...]:
        return tuple(r.key for r in self.runtimes)

    def reason(self, name: str) -> FieldReason | None:
        return next((r for r in self.reasons if r.field == name), None)


@dataclass(frozen=True, slots=True)
class MapsEntry:
    """One parsed ``/proc/PID/maps`` line."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str | None  # None for anonymous mappings
    deleted: bool


# --------------------------------------------------------------------------- maps parsing

_DELETED = " (deleted)"


def parse_maps_line(line: str) -> MapsEntry | None:
    """Parse one maps line; None when it is not in the kernel's format. Never raises.

    ``start-end perms offset dev inode   path``: the path may contain spaces (the kernel
    escapes only newlines) and may end in `` (deleted)``.
    """
    parts = line.rstrip("\n").split(None, 5)
    if len(parts) < 5:
        return None
    addr, perms, offset, dev, inode = parts[:5]
    lo, dash, hi = addr.partition("-")
    try:
        start, end = int(lo, 16), int(hi, 16)
        off = int(offset, 16)
        ino = int(inode)
    except ValueError:
        return None
    if not dash or len(perms) != 4 or ":" not in dev or start < 0 or end < 0 or ino < 0:
        return None
    path = parts[5] if len(parts) == 6 else None
    deleted = False
    if path is not None and path.endswith(_DELETED):
        path, deleted = path[: -len(_DELETED)], True
    return MapsEntry(start, end, perms, off, dev, ino, path or None, deleted)


_PATH_RE = re.compile(r"/[^\n]*")


def mapped_paths(text: str) -> set[str]:
    """Unique file paths in maps text (with any `` (deleted)`` suffix kept).

    Fast path for refreshes: the address, perms, offset, dev and inode columns never hold
    a ``/``, so a line's path runs from its first ``/`` to the end of the line, and one
    regex pass finds them all (about 3x cheaper than a Python loop over lines). Pseudo
    entries (``[heap]``) and anonymous mappings have no ``/`` and are skipped.
    """
    return set(_PATH_RE.findall(text))


# Base name -> index into RUNTIMES (or -1). Libraries repeat across processes (every
# process maps libc), so the combined regex runs once per distinct file name. Bounded.
_RUNTIME_CACHE: dict[str, int] = {}
_RUNTIME_CACHE_MAX = 16384


def _runtime_index(base: str) -> int:
    idx = _RUNTIME_CACHE.get(base)
    if idx is None:
        m = _RUNTIME_RE.match(base)
        idx = int(m.lastgroup[1:]) if m is not None and m.lastgroup is not None else -1
        if len(_RUNTIME_CACHE) >= _RUNTIME_CACHE_MAX:
            _RUNTIME_CACHE.clear()
        _RUNTIME_CACHE[base] = idx
    return idx


def detect_runtimes(paths: Iterable[str]) -> tuple[Runtime, ...]:
    """Runtimes whose library appears among `paths`, one per key, in `RUNTIMES` order."""
    found: dict[int, str] = {}
    for path in paths:
        base = path[path.rfind("/") + 1 :]
        idx = _runtime_index(base)
        if idx >= 0:
            base = base[: -len(_DELETED)] if base.endswith(_DELETED) else base
            if idx not in found or base < found[idx]:  # deterministic: smallest name
                found[idx] = base
    return tuple(
        Runtime(RUNTIMES[i].key, RUNTIMES[i].label, found[i]) for i in sorted(found)
    )


def mapped_models(paths: Iterable[str]) -> list[tuple[str, bool]]:
    """(path, deleted) for mapped files with a model extension, deduplicated, sorted."""
    out: dict[str, bool] = {}
    for p in paths:
        deleted = p.endswith(_DELETED)
        clean = p[: -len(_DELETED)] if deleted else p
        if clean.lower().endswith(MODEL_EXTENSIONS):
            out[clean] = out.get(clean, False) or deleted
    return sorted(out.items())


# --------------------------------------------------------------------------- classify


_TOKEN_SPLIT = re.compile(r"[^a-z0-9]+")


def _tokens(text: str) -> str:
    """Lower-case words joined by single spaces and padded, for whole-word matching."""
    return " " + " ".join(t for t in _TOKEN_SPLIT.split(text.lower()) if t) + " "


def _names(name: str | None, argv: tuple[str, ...] | None) -> tuple[set[str], str]:
    """(exact lower-case base names, padded word string) from comm and the first args."""
    bases: set[str] = set()
    texts: list[str] = []
    if name:
        bases.add(name.lower())
        texts.append(name)
    for a in (argv or ())[:8]:
        if not a:
            continue
        if a.startswith("-"):
            texts.append(a)
        else:
            base = posixpath.basename(a)
            bases.add(base.lower())
            texts.append(base)
    return bases, _tokens(" ".join(texts))


def _padded(table: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple((t, f" {t} ") for t in table)


def _hit(words: str, table: tuple[tuple[str, str], ...]) -> str | None:
    return next((t for t, padded in table if padded in words), None)


_WORD_TABLES = tuple(
    (category, _padded(table))
    for category, table in ((SPEECH, SPEECH_WORDS), (VISION, VISION_WORDS),
                            (TRAINING, TRAINING_WORDS), (LLM, LLM_WORDS),
                            (DECISION, DECISION_WORDS))
)


def classify(
    name: str | None,
    argv: tuple[str, ...] | None,
    runtimes: Iterable[Runtime] = (),
    models: Iterable[ModelEvidence] = (),
) -> Classification | None:
    """Category of a process, or None when nothing points anywhere.

    Evidence first (heuristic=False): a mapped or model-flag ``.gguf`` or a llama.cpp/ggml,
    whisper.cpp or stable-diffusion.cpp library. Then names (heuristic=True): compositors,
    browsers, video, graphics, speech, vision, training, LLM servers, decision-tree ML
    (``decision?``). Last, library hints alone (video codecs, GL/Vulkan -> graphics),
    heuristic. Pass the *redacted* argv. A category says what the process is, never that
    it uses the GPU.
    """
    rts = list(runtimes)
    keys = {r.key for r in rts}
    mods = [m for m in models if m.evidence in ("mapped", "cmdline")]
    # --- evidence
    if "whisper" in keys:
        return Classification(SPEECH, False, "maps libwhisper")
    if "stable-diffusion-cpp" in keys:
        return Classification(VISION, False, "maps libstable-diffusion")
    for m in mods:
        p = m.path or m.raw or ""
        if p.lower().endswith((".gguf", ".ggml")):
            return Classification(LLM, False, f"{m.evidence} {posixpath.basename(p)}")
    if keys & {"llama", "ggml", "ggml-cuda", "ggml-vulkan", "ggml-hip", "ggml-sycl",
               "ggml-cpu", "ggml-metal", "ggml-opencl"}:
        return Classification(LLM, False, "maps llama.cpp/ggml libraries")
    # --- names
    base_names, words = _names(name, argv)
    if base_names & COMPOSITOR_NAMES:
        return Classification(COMPOSITOR, True, "process name")
    if base_names & BROWSER_NAMES:
        return Classification(BROWSER, True, "process name")
    if base_names & VIDEO_NAMES:
        return Classification(VIDEO, True, "process name")
    if base_names & GRAPHICS_NAMES:
        return Classification(GRAPHICS, True, "process name")
    for category, table in _WORD_TABLES:
        hit = _hit(words, table)
        if hit:
            return Classification(category, True, f"name contains {hit!r}")
    # --- library hints alone
    for rt in rts:
        hint = next((s.hint for s in RUNTIMES if s.key == rt.key), None)
        if hint in (VIDEO, DECISION):
            return Classification(hint, True, f"maps {rt.library}")
    if keys & {"nvidia-gl", "vulkan", "opengl"}:
        return Classification(GRAPHICS, True, "maps GL/Vulkan libraries")
    return None


# --------------------------------------------------------------------------- scanning


def _stat_model(pid: int, path: str | None, root: str) -> tuple[bool | None, int | None]:
    """(exists, size) of `path` inside the process's mount namespace."""
    if path is None:
        return None, None
    try:
        st = os.stat(f"{root}/{pid}/root{path}")
    except FileNotFoundError:
        return False, None
    except OSError:
        return None, None
    return True, st.st_size


def _gone(pid: int, create_time: float | None, err: procfs.ProcError) -> ProcInfo:
    return ProcInfo(pid, create_time, None, None, None, None, 0, (), (), None,
                    time.monotonic(), gone=True,
                    reasons=(FieldReason("process", err.reason, err.detail),))


def scan_process(
    pid: int,
    create_time: float | None = None,
    *,
    root: str = procfs.PROC,
    btime: float | None = None,
) -> ProcInfo:
    """Look at one process. `create_time`, when given, must match the process found at
    `pid`, else the process the caller meant is gone (its PID was reused)."""
    reasons: list[FieldReason] = []
    try:
        st = procfs.read_stat(pid, root=root)
    except procfs.ProcError as err:
        return _gone(pid, create_time, err) if isinstance(err, procfs.NoSuchProcess) else (
            ProcInfo(pid, create_time, None, None, None, None, 0, (), (), None,
                     time.monotonic(), reasons=(FieldReason("stat", err.reason, err.detail),))
        )
    bt = btime if btime is not None else procfs.boot_time(root)
    ct = procfs.create_time(st.start_ticks, bt) if bt is not None else None
    if create_time is not None and ct is not None and abs(ct - create_time) > 1e-6:
        return _gone(pid, create_time, procfs.NoSuchProcess(
            pid, f"pid {pid} now belongs to a process started at {ct:.2f}"))

    if st.kernel_thread:
        # Kernel threads have no memory map, command line or executable; skip three reads.
        return ProcInfo(pid, ct, st.name, None, None, (), 0, (), (), None, time.monotonic(),
                        kernel_thread=True)

    argv: tuple[str, ...] | None = None
    redacted = 0
    margs = ()
    try:
        raw = split_cmdline(procfs.read_proc(pid, "cmdline", root=root))
        red = redact_argv(raw)
        argv, redacted = red.argv, len(red.redacted)
        margs = model_args(red)
    except procfs.NoSuchProcess as err:
        return _gone(pid, ct, err)
    except procfs.ProcError as err:
        reasons.append(FieldReason("cmdline", err.reason, err.detail))

    links: dict[str, str | None] = {}
    for what in ("cwd", "exe"):
        try:
            links[what] = procfs.readlink_proc(pid, what, root=root)
        except procfs.ProcError as err:
            links[what] = None
            reasons.append(FieldReason(what, err.reason, err.detail))

    paths: set[str] = set()
    try:
        paths = mapped_paths(procfs.read_proc(pid, "maps", root=root).decode("utf-8", "replace"))
        runtimes = detect_runtimes(paths)
    except procfs.NoSuchProcess as err:
        return _gone(pid, ct, err)
    except procfs.ProcError as err:
        runtimes = ()
        reasons.append(FieldReason("maps", err.reason, err.detail))

    models: list[ModelEvidence] = []
    for path, deleted in mapped_models(paths):
        exists, size = (None, None) if deleted else _stat_model(pid, path, root)
        models.append(ModelEvidence("mapped", path, deleted=deleted, exists=exists,
                                    size_bytes=size))
    cwd = links["cwd"]
    for ma in margs:
        path = resolve(ma.raw, cwd)
        # path-arg is informational only: no stat (a stat of an arbitrary argument could
        # block on a dead network mount, and the ladder gives it no weight anyway).
        exists, size = _stat_model(pid, path, root) if ma.evidence == "cmdline" else (None, None)
        models.append(ModelEvidence(ma.evidence, path, raw=ma.raw, flag=ma.flag,
                                    exists=exists, size_bytes=size))
    name = st.name
    return ProcInfo(
        pid=pid,
        create_time=ct,
        name=name,
        exe=links["exe"],
        cwd=cwd,
        cmdline=argv,
        redacted=redacted,
        runtimes=runtimes,
        models=tuple(models),
        classification=classify(name, argv, runtimes, models),
        scanned_at=time.monotonic(),
        reasons=tuple(reasons),
    )


@dataclass(frozen=True, slots=True)
class ScanResult:
    """One budgeted refresh. `infos` holds every requested process that has a `ProcInfo`
    (scanned now or cached); `pending` those the budget did not reach (they are scanned on
    a later refresh, first in line); `gone` those that exited. `elapsed_s` is the wall time
    of this call; `scanned` how many processes were read this time."""

    infos: Mapping[int, ProcInfo]
    pending: tuple[int, ...]
    gone: tuple[int, ...]
    scanned: int
    elapsed_s: float
    budget_s: float | None
    stale_rescanned: int = 0
    cache_size: int = 0


_DEFAULT = object()


class Scanner:
    """Budgeted, cached `scan_process` over many processes (see the module docstring)."""

    DEFAULT_BUDGET = 0.150

    def __init__(
        self,
        budget: float | None = DEFAULT_BUDGET,
        *,
        maps_max_age: float = 60.0,
        forget_after: int = 3,
        root: str = procfs.PROC,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.budget = budget
        self.maps_max_age = maps_max_age
        self.forget_after = forget_after
        self._root = root
        self._clock = clock
        self._btime = procfs.boot_time(root)
        self._cache: dict[tuple[int, float], ProcInfo] = {}
        self._by_pid: dict[int, float] = {}  # pid -> create_time of the cached entry
        self._last_used: dict[tuple[int, float], int] = {}
        self._generation = 0

    def _key_of(self, item: int | tuple[int, float | None]) -> tuple[int, float | None]:
        if isinstance(item, tuple):
            return item[0], item[1]
        return item, None

    def _current_ct(self, pid: int) -> float | None:
        """The create_time of whatever runs at `pid` now (one stat read), None if gone."""
        try:
            st = procfs.read_stat(pid, root=self._root)
        except procfs.ProcError:
            return None
        if self._btime is None:
            return None
        return procfs.create_time(st.start_ticks, self._btime)

    def _store(self, info: ProcInfo) -> None:
        if info.create_time is None or info.gone:
            return
        old = self._by_pid.get(info.pid)
        if old is not None and old != info.create_time:
            self._cache.pop((info.pid, old), None)
            self._last_used.pop((info.pid, old), None)
        key = (info.pid, info.create_time)
        self._cache[key] = info
        self._by_pid[info.pid] = info.create_time
        self._last_used[key] = self._generation

    def cached(self, pid: int, create_time: float | None = None) -> ProcInfo | None:
        """The cached info for `pid` (and `create_time` when given), without any I/O."""
        ct = self._by_pid.get(pid) if create_time is None else create_time
        return None if ct is None else self._cache.get((pid, ct))

    def invalidate(self, pid: int) -> None:
        """Forget `pid` so the next `scan` reads it again (e.g. the user asked)."""
        ct = self._by_pid.pop(pid, None)
        if ct is not None:
            self._cache.pop((pid, ct), None)
            self._last_used.pop((pid, ct), None)

    def scan_one(self, pid: int, create_time: float | None = None) -> ProcInfo:
        """Scan `pid` now, ignoring the budget and the cache (on demand, e.g. inspector)."""
        info = scan_process(pid, create_time, root=self._root, btime=self._btime)
        self._store(info)
        return info

    def scan(
        self,
        order: Iterable[int | tuple[int, float | None]],
        budget: float | object | None = _DEFAULT,
    ) -> ScanResult:
        """Scan in `order` within the budget (None: no limit); see the module docstring."""
        limit = cast("float | None", self.budget if budget is _DEFAULT else budget)
        clock = self._clock
        start = clock()
        self._generation += 1
        gen = self._generation
        infos: dict[int, ProcInfo] = {}
        todo: list[tuple[int, float | None]] = []
        stale: list[tuple[int, float]] = []
        now_mono = time.monotonic()
        asked: set[int] = set()
        for item in order:
            pid, ct = self._key_of(item)
            if pid in asked:  # a PID listed twice (e.g. on two GPUs) is scanned once
                continue
            asked.add(pid)
            if ct is None:
                ct = self._current_ct(pid)
                if ct is None:
                    todo.append((pid, None))  # let scan_process report why
                    continue
            hit = self._cache.get((pid, ct))
            if hit is None:
                todo.append((pid, ct))
                continue
            infos[pid] = hit
            self._last_used[(pid, ct)] = gen
            if now_mono - hit.scanned_at > self.maps_max_age:
                stale.append((pid, ct))
        pending: list[int] = []
        gone: list[int] = []
        scanned = 0
        for pid, ct in todo:
            # At least one scan per refresh, so even a tiny budget makes progress.
            if limit is not None and scanned and clock() - start >= limit:
                pending.append(pid)
                continue
            info = scan_process(pid, ct, root=self._root, btime=self._btime)
            scanned += 1
            if info.gone:
                gone.append(pid)
                continue
            self._store(info)
            infos[pid] = info
        rescanned = 0
        for pid, ct in stale:
            if limit is not None and clock() - start >= limit:
                break
            info = scan_process(pid, ct, root=self._root, btime=self._btime)
            rescanned += 1
            if info.gone:
                self.invalidate(pid)
                infos.pop(pid, None)
                gone.append(pid)
                continue
            self._store(info)
            infos[pid] = info
        self._forget(gen)
        return ScanResult(
            infos=MappingProxyType(infos),
            pending=tuple(pending),
            gone=tuple(gone),
            scanned=scanned,
            elapsed_s=clock() - start,
            budget_s=limit,
            stale_rescanned=rescanned,
            cache_size=len(self._cache),
        )

    def _forget(self, gen: int) -> None:
        cutoff = gen - self.forget_after
        if cutoff <= 0:
            return
        old = [k for k, g in self._last_used.items() if g < cutoff]
        for key in old:
            self._last_used.pop(key, None)
            self._cache.pop(key, None)
            if self._by_pid.get(key[0]) == key[1]:
                del self._by_pid[key[0]]
