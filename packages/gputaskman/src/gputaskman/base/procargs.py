"""Command lines: redact secrets, then find model-looking arguments (sans-io).

API
---
``redact_argv(argv) -> RedactedArgs`` replaces secret values with ``"<redacted>"`` and
records which argument indexes it touched. ``model_args(redacted) -> tuple[ModelArg, ...]``
finds model candidates in a *redacted* command line and never returns a redacted value.
``resolve(raw, cwd)`` turns a relative argument into the absolute path the process meant.
``flag_value(argv, flags)`` is the one reader of a flag's value (``-c 8192``,
``--ctx-size=8192``) for the rest of the tool: llm.py's context, cache types and log file,
evidence.py's API key.

What is redacted (documented list; keep README and tests in step)
------------------------------------------------------------------
* The value of a flag whose name, split on ``-``/``_``, contains one of `SECRET_FLAG_WORDS`
  (``--api-key X``, ``--api-key=X``, ``--token``, ``--hf-token``, ``--password``,
  ``--secret``, ``--auth``, ``--access-key``, camelCase ``--hfToken`` ...), in both
  ``--flag value`` and ``--flag=value`` forms. The value is the next argument unless it
  starts with ``--``. ``--max-tokens`` is *not* a secret: ``tokens`` is not ``token``.
* ``NAME=value`` arguments (``env HF_TOKEN=x cmd``, ``docker -e OPENAI_API_KEY=x``) whose
  upper-cased NAME contains one of `SECRET_ENV_WORDS`.
* The password of a URL with credentials (``https://user:pass@host``).
* ``Authorization:`` header values and ``Bearer`` tokens.
* An argument holding whitespace (a process that rewrote its title into one string) is
  split on whitespace and redacted by the same rules.

Over-redaction is accepted (``--auth-file path`` loses its path); under-redaction is not.
Model discovery runs on the redacted argv and skips redacted indexes, so a secret can never
become a model path.

Model arguments
---------------
* ``cmdline`` evidence: the value of a model flag (`MODEL_FLAGS`: ``-m``, ``--model``,
  ``--model-path``, ``--model-id``, ``--mmproj``, ``--lora``, ...), or the positional model of
  a serving program (`POSITIONAL_MODEL`: ``vllm serve MODEL``,
  ``text-generation-server serve MODEL``). ``-m`` is ambiguous (``python -m mod``,
  other tools), so its value must look like a path or carry a model extension; Python
  interpreter options are skipped so ``python -m vllm.entrypoints`` is not a model.
* A value shaped like a Hugging Face repo id (`is_repo_id`: ``Qwen/Qwen2.5-0.5B-Instruct``)
  is a name the runtime looks up in its hub cache, not a path; `procinfo` keeps it as a name
  unless a folder of that name exists in the process's working directory.
* ``path-arg`` evidence: any other argument (or ``--flag=value`` value) ending in a model
  extension (`MODEL_EXTENSIONS`). Informational only (the evidence ladder ranks it below
  ``cmdline``). At most `MAX_MODEL_ARGS` candidates from the first `MAX_ARGS` arguments.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

REDACTED = "<redacted>"

SECRET_FLAG_WORDS = frozenset(
    {
        "token",
        "password",
        "passwd",
        "secret",
        "apikey",
        "key",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "cookie",
        "bearer",
    }
)
SECRET_ENV_WORDS = (
    "TOKEN",
    "PASSWORD",
    "PASSWD",
    "SECRET",
    "API_KEY",
    "APIKEY",
    "ACCESS_KEY",
    "PRIVATE_KEY",
    "CREDENTIAL",
    "AUTH",
)

MODEL_EXTENSIONS = (
    ".gguf",
    ".safetensors",
    ".onnx",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".tflite",
    ".engine",
    ".plan",
    ".ggml",
)

MODEL_FLAGS = frozenset(
    {
        "-m",
        "--model",
        "--model-path",
        "--model_path",
        "--model-file",
        "--model_file",
        "--model-dir",
        "--model_dir",
        "--models",
        "--mmproj",
        "--lora",
        "--lora-base",
        "-md",
        "--model-draft",
        "--draft-model",
        "--checkpoint",
        "--ckpt",
        "--ckpt-path",
        "--weights",
        "--model-name-or-path",
        "--model_name_or_path",
        "--pretrained-model-name-or-path",
        "--pretrained_model_name_or_path",
        "--model-id",  # text-generation-inference's launcher
        "--model_id",
    }
)
# Programs whose first positional argument after a subcommand is the model
# (``vllm serve MODEL``, TGI's shard ``text-generation-server serve MODEL``).
POSITIONAL_MODEL = {"vllm": "serve", "text-generation-server": "serve"}
# Flags whose values are model names rather than files; still `cmdline` evidence.
_AMBIGUOUS_SHORT = frozenset({"-m", "-md"})

MAX_ARGS = 4096
MAX_MODEL_ARGS = 16

_ENV_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_URL_CRED_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):([^@\s/]+)@")
_AUTH_RE = re.compile(r"(?i)\b(authorization:\s*|bearer\s+)\S.*")
_PY_VALUE_OPTS = frozenset({"-X", "-W", "-Q"})
# huggingface_hub's REPO_ID_REGEX (utils/_validators.py validate_repo_id, huggingface_hub 2.4)
_REPO_ID_RE = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", re.ASCII)


@dataclass(frozen=True, slots=True)
class RedactedArgs:
    """A command line with secret values replaced; `redacted` holds the indexes changed."""

    argv: tuple[str, ...]
    redacted: frozenset[int]


@dataclass(frozen=True, slots=True)
class ModelArg:
    """A model-looking argument. `evidence` is ``cmdline`` (value of a model flag) or
    ``path-arg`` (an argument with a model extension); `flag` is the flag it followed."""

    raw: str
    evidence: str
    flag: str | None
    index: int


_CAMEL_RE = re.compile(r"([a-z0-9])([A-Z])")


def _secret_flag(arg: str) -> bool:
    # camelCase flags (--hfToken, --apiKey) split like kebab-case ones.
    name = _CAMEL_RE.sub(r"\1-\2", arg.lstrip("-")).lower()
    if not name:
        return False
    return any(w in SECRET_FLAG_WORDS for w in re.split(r"[-_.]", name))


def _secret_env(name: str) -> bool:
    upper = name.upper()
    return any(w in upper for w in SECRET_ENV_WORDS)


def _redact_text(arg: str) -> str:
    """Redact secrets embedded in one argument string (URLs, headers)."""
    # Cheap substring tests first: most arguments hold neither, and the regexes cost more.
    out = arg
    if "@" in out:
        out = _URL_CRED_RE.sub(lambda m: f"{m.group(1)}:{REDACTED}@", out)
    low = out.lower()
    if "bearer" in low or "authorization" in low:
        out = _AUTH_RE.sub(lambda m: f"{m.group(1)}{REDACTED}", out)
    return out


def _redact_words(argv: list[str]) -> tuple[list[str], set[int]]:
    out = list(argv)
    touched: set[int] = set()
    i = 0
    n = len(out)
    while i < n:
        arg = out[i]
        if arg.startswith("-") and len(arg) > 1:
            name, eq, _value = arg.partition("=")
            if _secret_flag(name):
                if eq:
                    out[i] = f"{name}={REDACTED}"
                    touched.add(i)
                elif i + 1 < n and not out[i + 1].startswith("--"):
                    out[i + 1] = REDACTED
                    touched.add(i + 1)
                    i += 1
                i += 1
                continue
        else:
            m = _ENV_RE.match(arg)
            if m and _secret_env(m.group(1)):
                out[i] = f"{m.group(1)}={REDACTED}"
                touched.add(i)
                i += 1
                continue
        new = _redact_text(arg)
        if new != arg:
            out[i] = new
            touched.add(i)
        i += 1
    return out, touched


def redact_argv(argv: list[str] | tuple[str, ...]) -> RedactedArgs:
    """Redact secret values (see the module docstring for the list). Never raises."""
    words, touched = _redact_words(list(argv))
    for i, arg in enumerate(words):
        if i in touched or not any(c.isspace() for c in arg):
            continue
        # A retitled process (setproctitle) shows its whole command line as one string.
        inner, inner_touched = _redact_words(arg.split())
        if inner_touched:
            words[i] = " ".join(inner)
            touched.add(i)
    return RedactedArgs(tuple(words), frozenset(touched))


def _looks_like_model(value: str) -> bool:
    return value.lower().endswith(MODEL_EXTENSIONS)


def is_repo_id(value: str) -> bool:
    """Whether `value` has the shape of a Hugging Face repo id (``name`` or
    ``namespace/name``, huggingface_hub's ``validate_repo_id`` rules) and no model file
    extension. Such a value on a command line is a *name* that a runtime looks up in its hub
    cache, unless a folder of that name exists where the process runs (transformers' and
    vLLM's own rule); the caller decides that with a stat."""
    return (
        value.count("/") <= 1
        and _REPO_ID_RE.fullmatch(value) is not None
        and "--" not in value
        and ".." not in value
        and not value.endswith(".git")
        and not _looks_like_model(value)
    )


def _program_start(argv: tuple[str, ...]) -> int:
    """Index of the first argument that belongs to the program rather than to a Python
    interpreter's own options (so ``python -m pkg`` is not read as ``-m MODEL``)."""
    if not argv:
        return 0
    base = posixpath.basename(argv[0]).lower()
    if not (base.startswith("python") or base.startswith("pypy")):
        return 1
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "-c"):
            return i + 2
        if a.startswith(("-m", "-c")) and len(a) > 2:  # -mpkg, -c'code'
            return i + 1
        if a in _PY_VALUE_OPTS:
            i += 2
            continue
        if a.startswith("-") and a != "-":
            i += 1
            continue
        return i + 1  # the script path
    return i


def program(argv: Sequence[str]) -> tuple[str | None, int]:
    """``(program, index of its first argument)``: the program a command line runs, lower
    case, as its executable's or script's base name (``vllm``, ``text-generation-server``)
    or, for ``python -m pkg.mod``, the module's top package (``vllm``, ``sglang``); None for
    ``python -c`` or an empty command line. Sans-io."""
    argv = tuple(argv)
    start = _program_start(argv)
    if not argv or start < 1 or start > len(argv):
        return None, start
    base = posixpath.basename(argv[0]).lower()
    if not (base.startswith("python") or base.startswith("pypy")):
        return base, start
    prev = argv[start - 1] if start >= 2 else ""
    opt = argv[start - 2] if start >= 3 else ""
    if opt == "-c" or prev.startswith("-c"):
        return None, start
    if opt == "-m":
        return prev.split(".", 1)[0].lower() or None, start
    if prev.startswith("-m") and len(prev) > 2:
        return prev[2:].split(".", 1)[0].lower() or None, start
    name = posixpath.basename(prev).lower()
    return (name.removesuffix(".py") or None), start


def model_args(args: RedactedArgs) -> tuple[ModelArg, ...]:
    """Model candidates in a redacted command line (bounded; redacted values skipped)."""
    if len(args.argv) == 1 and any(c.isspace() for c in args.argv[0]):
        # A retitled process: read its one string as words, redacted again by the same rules.
        args = redact_argv(args.argv[0].split())
    argv = args.argv[:MAX_ARGS]
    skip = args.redacted
    found: dict[str, ModelArg] = {}  # raw -> strongest evidence for it, in first-seen order

    def add(raw: str, evidence: str, flag: str | None, index: int) -> None:
        if not raw or REDACTED in raw:
            return
        old = found.get(raw)
        room = old is None and len(found) < MAX_MODEL_ARGS
        stronger = old is not None and old.evidence == "path-arg" and evidence == "cmdline"
        if room or stronger:
            found[raw] = ModelArg(raw, evidence, flag, index)

    prog, i = program(argv)
    sub = POSITIONAL_MODEL.get(prog or "")
    if sub and i + 1 < len(argv) and argv[i] == sub and i + 1 not in skip:
        val = argv[i + 1]
        if val and not val.startswith("-"):
            add(val, "cmdline", sub, i + 1)
    while i < len(argv):
        arg = argv[i]
        if i in skip:
            i += 1
            continue
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and name in MODEL_FLAGS:
            if eq:
                val, idx = value, i
            elif i + 1 < len(argv) and i + 1 not in skip:
                val, idx = argv[i + 1], i + 1
                i += 1
            else:
                i += 1
                continue
            ambiguous = name in _AMBIGUOUS_SHORT
            if val.startswith("-") or (ambiguous and "/" not in val and not _looks_like_model(val)):
                i += 1
                continue
            add(val, "cmdline", name, idx)
        elif arg.startswith("-") and eq and _looks_like_model(value):
            add(value, "path-arg", name, i)
        elif not arg.startswith("-") and _looks_like_model(arg):
            add(arg, "path-arg", None, i)
        i += 1
    return tuple(found.values())


def flag_value(argv: Sequence[str], flags: Collection[str]) -> str | None:
    """The value of the last of `flags` in `argv`, as ``FLAG VALUE`` or ``FLAG=VALUE``
    (the last one wins, as in llama.cpp's parser); None when absent or without a value.
    Never raises. Works on the raw argv: on a redacted one a secret reads ``<redacted>``."""
    val = None
    for i, a in enumerate(argv):
        if a in flags:
            if i + 1 < len(argv):
                val = argv[i + 1]
        else:
            name, eq, value = a.partition("=")
            if eq and name in flags:
                val = value
    return val


def resolve(raw: str, cwd: str | None) -> str | None:
    """Absolute, normalised path for `raw` as the process sees it; None when it is relative
    and the working directory is unknown. ``~`` is left alone (the shell expands it)."""
    if raw.startswith("/"):
        return posixpath.normpath(raw)
    if cwd is None:
        return None
    return posixpath.normpath(posixpath.join(cwd, raw))


def split_cmdline(data: bytes) -> tuple[str, ...]:
    """``/proc/PID/cmdline`` bytes as arguments (NUL separated, trailing NUL optional)."""
    if not data:
        return ()
    if data.endswith(b"\0"):
        data = data[:-1]
    return tuple(a.decode("utf-8", "replace") for a in data.split(b"\0"))
