"""What a process's names and libraries say it is: the runtime table and `classify()`.

API
---
* `RUNTIMES`: the data table of runtimes recognised by the file name of a mapped shared
  object (CUDA runtime, cuBLAS, cuDNN, NCCL, TensorRT, ROCm/HIP, Vulkan, OpenCL, ggml
  backends, llama.cpp, PyTorch, ONNX Runtime, TensorFlow, JAX/XLA, OpenVINO, ...).
* ``detect_runtimes(paths) -> tuple[Runtime, ...]``: which of them a set of mapped paths holds.
* ``classify(name, argv, runtimes, models) -> Classification | None`` and the category
  names (`CATEGORIES`) with the name tables it uses.
* ``detect_server(name, argv, paths) -> ServerHint | None``: which serving runtime (vLLM,
  SGLang, text-generation-inference) a process runs, from the program its command line
  runs, the title a runtime's worker sets, or the runtime's own compiled modules in its
  memory map; it picks the API table to probe and allows the probe, never evidence or bytes.

Theory of operation
-------------------
A library in the memory map is *detection*, not proof of GPU work (PyTorch maps libcudart
on a CPU-only run too). Categories come first from evidence (a mapped or model-flag GGUF,
llama.cpp / whisper.cpp / stable-diffusion.cpp libraries: ``heuristic=False``), then from
names matched as whole words (``heuristic=True``, shown with ``?``), last from library
hints alone (video codecs, GL/Vulkan). ``decision?`` (tabular / decision-tree ML:
XGBoost, LightGBM, CatBoost, scikit-learn) only ever comes from names or their libraries
and is always a heuristic. A category never changes model evidence or any byte count.

Matching the combined runtime regex costs microseconds per name on a slow machine, and
every process maps libc and friends, so results are cached per base name (bounded).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gputaskman.base.procargs import program
from gputaskman.intel.evidence import ModelEvidence

_DELETED = " (deleted)"

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


# Appended to a category that only process or file names support (the CATEGORY column).
HEURISTIC_MARK = "?"

LLM = "LLM inference"
TRAINING = "training"
VISION = "vision"
SPEECH = "speech"
GRAPHICS = "graphics"
VIDEO = "video"
BROWSER = "browser"
COMPOSITOR = "compositor"
# tabular / decision-tree ML, only ever from names: a heuristic
DECISION = f"decision{HEURISTIC_MARK}"
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
    RuntimeSpec(
        "nvidia-gl", "NVIDIA OpenGL", r"lib(?:GLX_nvidia|EGL_nvidia|nvidia-glcore)\.so", GRAPHICS
    ),
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
    RuntimeSpec("stable-diffusion-cpp", "stable-diffusion.cpp", r"libstable-diffusion\.so", VISION),
    RuntimeSpec("ctranslate2", "CTranslate2", r"libctranslate2\.so"),
    # Frameworks
    RuntimeSpec(
        "pytorch",
        "PyTorch",
        r"(?:libtorch(?:_cpu|_cuda|_hip|_python|_global_deps)?|libc10(?:_cuda)?)\.so",
    ),
    RuntimeSpec(
        "onnxruntime",
        "ONNX Runtime",
        r"(?:libonnxruntime(?:_providers_[a-z_]+)?|onnxruntime_pybind11_state)[.-]",
    ),
    RuntimeSpec(
        "tensorflow",
        "TensorFlow",
        r"(?:libtensorflow(?:_framework|_cc)?|_pywrap_tensorflow_internal)\.so",
    ),
    RuntimeSpec("tflite", "TensorFlow Lite", r"libtensorflowlite(?:_c)?\.so"),
    RuntimeSpec("jax", "JAX/XLA", r"(?:xla_extension|xla_cuda_plugin|xla_rocm_plugin|_jax)[.-]"),
    RuntimeSpec("paddle", "PaddlePaddle", r"libpaddle\.so"),
    RuntimeSpec("mxnet", "MXNet", r"libmxnet\.so"),
    RuntimeSpec("xgboost", "XGBoost", r"libxgboost\.so", DECISION),
    RuntimeSpec("lightgbm", "LightGBM", r"lib_lightgbm\.so", DECISION),
)

_RUNTIME_RE = re.compile("|".join(f"(?P<r{i}>{s.pattern})" for i, s in enumerate(RUNTIMES)))

# Name tables for classify(): lower-case process names (comm or argv[0]/script base names).
COMPOSITOR_NAMES = frozenset(
    {
        "xorg",
        "x",
        "xwayland",
        "gnome-shell",
        "kwin_wayland",
        "kwin_x11",
        "sway",
        "hyprland",
        "weston",
        "mutter",
        "picom",
        "compton",
        "wayfire",
        "cosmic-comp",
        "labwc",
        "river",
        "niri",
        "gamescope",
        "xfwm4",
        "marco",
        "muffin",
        "enlightenment",
    }
)
BROWSER_NAMES = frozenset(
    {
        "firefox",
        "firefox-esr",
        "firefox-bin",
        "chrome",
        "google-chrome",
        "chromium",
        "chromium-browser",
        "brave",
        "brave-browser",
        "msedge",
        "microsoft-edge",
        "vivaldi",
        "vivaldi-bin",
        "opera",
        "librewolf",
        "epiphany",
        "qutebrowser",
        "thorium",
    }
)
VIDEO_NAMES = frozenset(
    {
        "ffmpeg",
        "obs",
        "obs-studio",
        "gst-launch-1.0",
        "handbrakecli",
        "ghb",
        "vlc",
        "mpv",
        "kdenlive",
        "shotcut",
        "resolve",
        "davinci-resolve",
        "totem",
        "celluloid",
    }
)
GRAPHICS_NAMES = frozenset(
    {
        "blender",
        "godot",
        "unity",
        "unityhub",
        "unrealeditor",
        "steam",
        "gzdoom",
        "glxgears",
        "vkcube",
        "glmark2",
        "vkmark",
        "krita",
        "gimp",
        "darktable",
        "freecad",
    }
)
# Word tables: matched as whole words (tokens split on anything not a letter or digit), so
# "train" matches train_lora.py and --do_train but not "constraint".
SPEECH_WORDS = (
    "whisper",
    "faster whisper",
    "piper",
    "vosk",
    "coqui",
    "tts",
    "parakeet",
    "handy",
    "wyoming",
    "speech",
    "riva",
    "kokoro",
    "asr",
    "stt",
)
VISION_WORDS = (
    "comfyui",
    "stable diffusion",
    "sd webui",
    "automatic1111",
    "invokeai",
    "fooocus",
    "diffusers",
    "yolo",
    "ultralytics",
    "detectron2",
    "sam2",
    "segment anything",
    "sdxl",
    "flux",
)
TRAINING_WORDS = (
    "train",
    "training",
    "trainer",
    "finetune",
    "finetuning",
    "fine tune",
    "torchrun",
    "deepspeed",
    "accelerate",
    "pretrain",
    "sft",
    "dpo",
)
LLM_WORDS = (
    "llama",
    "ollama",
    "vllm",
    "sglang",
    "text generation",
    "text generation launcher",
    "koboldcpp",
    "localai",
    "local ai",
    "lmstudio",
    "lm studio",
    "tabbyapi",
    "exllama",
    "exllamav2",
    "mlc llm",
    "gpt4all",
    "llamafile",
    "aphrodite",
    "tgi",
    "llm",
    "llama server",
    "llama cli",
    "mistral",
    "qwen",
    "gemma",
    "phi",
)
DECISION_WORDS = ("xgboost", "lightgbm", "catboost", "sklearn", "scikit learn")


@dataclass(frozen=True, slots=True)
class Runtime:
    """A detected runtime: `key`/`label` from `RUNTIMES`, `library` the mapped base name."""

    key: str
    label: str
    library: str


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
        mark = HEURISTIC_MARK
        return c if (not self.heuristic or c.endswith(mark)) else f"{c}{mark}"


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
    return tuple(Runtime(RUNTIMES[i].key, RUNTIMES[i].label, found[i]) for i in sorted(found))


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
    for category, table in (
        (SPEECH, SPEECH_WORDS),
        (VISION, VISION_WORDS),
        (TRAINING, TRAINING_WORDS),
        (LLM, LLM_WORDS),
        (DECISION, DECISION_WORDS),
    )
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
    if keys & {
        "llama",
        "ggml",
        "ggml-cuda",
        "ggml-vulkan",
        "ggml-hip",
        "ggml-sycl",
        "ggml-cpu",
        "ggml-metal",
        "ggml-opencl",
    }:
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


# --------------------------------------------------------------------------- servers

# The program a command line runs (`procargs.program`) -> the serving runtime's API table.
SERVER_PROGRAMS = {
    "vllm": "vllm",
    "sglang": "sglang",
    "text-generation-launcher": "tgi",
    "text-generation-server": "tgi",
    "text-generation-router": "tgi",
}
# The process title a runtime's worker sets (comm, lower case, truncated to 15 characters):
# vLLM's engine core and workers ("VLLM::EngineCore", "VLLM::Worker_TP0"), SGLang's
# scheduler ("sglang::scheduler").
SERVER_TITLES = (("vllm::", "vllm"), ("sglang::", "sglang"))
# A folder in the path of a mapped compiled module of the runtime's own package.
SERVER_MODULES = (
    ("/vllm/", "vllm"),
    ("/sgl_kernel/", "sglang"),
    ("/sglang/", "sglang"),
    ("/text_generation_server/", "tgi"),
)


@dataclass(frozen=True, slots=True)
class ServerHint:
    """A serving runtime a process runs (`key` is a `serverprobe.RUNTIMES` table) and what
    says so. It picks which API to ask; it is never model evidence and changes no bytes."""

    key: str
    basis: str


def detect_server(
    name: str | None, argv: tuple[str, ...] | None, paths: Iterable[str] = ()
) -> ServerHint | None:
    """Which serving runtime the process runs: its command line's program (``vllm serve``,
    ``python -m vllm.entrypoints.openai.api_server``, ``python -m sglang.launch_server``,
    ``text-generation-launcher``), its worker title, else a mapped module of the runtime."""
    prog = program(argv or ())[0] if argv else None
    if prog in SERVER_PROGRAMS:
        return ServerHint(SERVER_PROGRAMS[prog], f"command line runs {prog}")
    for seen in (name or "", *(argv or ())[:1]):
        for prefix, key in SERVER_TITLES:
            if seen.lower().startswith(prefix):
                return ServerHint(key, f"process title {seen[:40]}")
    for p in paths:
        if ".so" not in p:
            continue
        for folder, key in SERVER_MODULES:
            if folder in p:
                return ServerHint(key, f"maps {p[p.rfind('/') + 1 :]}")
    return None
