"""evidence.py: the ladder, corroboration, and secrets never becoming model paths."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gputaskman.base.procargs import REDACTED, redact_argv, resolve
from gputaskman.intel.evidence import (
    CORROBORATING,
    Evidence,
    ModelEvidence,
    Source,
    api_key_from_argv,
    assess,
    from_procinfo,
    mapped_store_files,
)
from gputaskman.intel.procinfo import scan_process
from gputaskman.intel.stores import StoreIndex, StoreRoots

sys.path.insert(0, str(Path(__file__).parent))
from test_procinfo import children, start_mapper  # the real child process and its cleanup

__all__ = ["children"]  # a fixture used by name


def test_ladder_order() -> None:
    ranked = sorted(Source, key=lambda s: s.rank)
    assert [s.value for s in ranked] == ["api", "mapped", "cmdline", "path-arg", "installed"]
    assert {s.value for s in CORROBORATING} == {"api", "mapped", "cmdline"}


def test_confirmed_claims_come_before_stronger_single_sources() -> None:
    """Catches claims sorted by their best rung alone: an API-only claim (the top rung, one
    source) would then come before a claim two sources confirm (mapped and on the command
    line, lower rungs). Confirmed first, whatever the rung."""
    claims = assess(
        [
            Evidence(Source.API, model="served-alone"),
            Evidence(Source.CMDLINE, path="/m/b.gguf"),
            Evidence(Source.MAPPED, path="/m/b.gguf"),
            Evidence(Source.MAPPED, path="/m/a.gguf"),
        ]
    )
    assert [(c.path or c.model, c.confirmed, c.best) for c in claims] == [
        ("/m/b.gguf", True, Source.MAPPED),
        ("served-alone", False, Source.API),
        ("/m/a.gguf", False, Source.MAPPED),
    ]


@pytest.mark.parametrize(
    "sources,status,detail",
    [
        (("mapped", "cmdline"), "confirmed", True),
        (("api", "mapped"), "confirmed", True),
        (("api", "cmdline"), "confirmed", True),
        (("mapped",), "single source", True),
        (("cmdline", "path-arg"), "single source", True),
        (("cmdline", "cmdline"), "single source", True),  # the same source twice is not two
        (("path-arg",), "informational", False),
        (("path-arg", "installed"), "informational", False),
        (("installed",), "informational", False),
    ],
)
def test_only_api_mapped_cmdline_corroborate(
    sources: tuple[str, ...], status: str, detail: bool
) -> None:
    claims = assess(
        Evidence(Source(s), path="/m/x.gguf", detail=str(i)) for i, s in enumerate(sources)
    )
    assert len(claims) == 1
    c = claims[0]
    assert (c.status, c.allows_detail, c.confirmed) == (status, detail, status == "confirmed")
    assert c.best == min((Source(s) for s in sources), key=lambda s: s.rank)
    assert json.loads(json.dumps(c.to_json()))["status"] == status


def test_real_process_cmdline_evidence_resolves_and_never_holds_a_secret(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    """The one pipeline: procinfo (procargs redaction + discovery) -> from_procinfo."""
    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "tiny.gguf"
    model.write_bytes(b"GGUF")
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    args = [
        "-m",
        "models/../models/tiny.gguf",
        "--api-key",
        "secret.gguf",
        "--hf-token=tok.gguf",
        "--port",
        "8080",
        "extra/link.gguf",
        str(link),
    ]
    proc = start_mapper(args, tmp_path)
    children.append(proc)
    info = scan_process(proc.pid)
    ev = from_procinfo(info.models)
    got = [(e.source.value, e.path) for e in ev]
    assert ("cmdline", str(model)) in got
    assert ("path-arg", str(model)) in got  # the symlink resolves to the same file
    assert ("path-arg", str(tmp_path / "extra" / "link.gguf")) in got  # relative to cwd
    assert all("secret" not in (e.path or "") and "tok" not in (e.path or "") for e in ev)
    assert info.cmdline is not None
    assert "secret.gguf" not in info.cmdline and "--hf-token=tok.gguf" not in info.cmdline
    assert info.cmdline[info.cmdline.index("--api-key") + 1] == REDACTED


def test_relative_path_without_cwd_is_dropped() -> None:
    # procinfo leaves the path None when the process's cwd could not be read
    row = ModelEvidence("cmdline", resolve("rel.gguf", None), raw="rel.gguf", flag="-m")
    assert row.path is None and from_procinfo([row]) == []


def test_api_key_only_from_the_raw_argv() -> None:
    assert api_key_from_argv(["llama-server", "--api-key", "k1"]) == "k1"
    assert api_key_from_argv(["llama-server", "--api-key=k2"]) == "k2"
    assert api_key_from_argv(["llama-server", "-m", "x"]) is None
    assert api_key_from_argv(redact_argv(["llama-server", "--api-key", "k1"]).argv) == REDACTED


def test_api_name_joins_the_one_matching_path_claim() -> None:
    claims = assess(
        [
            Evidence(Source.MAPPED, path="/m/a.gguf"),
            Evidence(Source.CMDLINE, path="/m/b.gguf"),
            Evidence(Source.API, model="a.gguf"),
        ]
    )
    a = next(c for c in claims if c.path == "/m/a.gguf")
    assert a.confirmed and a.model == "a.gguf" and a.best is Source.API
    assert claims[0] is a  # confirmed first


def test_ambiguous_api_name_stays_alone() -> None:
    claims = assess(
        [
            Evidence(Source.MAPPED, path="/m/one/model.gguf"),
            Evidence(Source.MAPPED, path="/m/two/model.gguf"),
            Evidence(Source.API, model="model.gguf"),
        ]
    )
    alone = [c for c in claims if c.path is None]
    assert len(alone) == 1 and alone[0].model == "model.gguf" and not alone[0].confirmed


def test_evidence_needs_a_path_or_a_name() -> None:
    with pytest.raises(ValueError):
        Evidence(Source.API)


def test_from_procinfo_rows(tmp_path: Path) -> None:
    real = tmp_path / "w.gguf"
    real.write_bytes(b"GGUF")
    link = tmp_path / "l.gguf"
    link.symlink_to(real)
    rows = [
        ModelEvidence("mapped", str(link)),
        ModelEvidence("cmdline", str(real), flag="-m"),
        ModelEvidence("path-arg", None, raw="rel.gguf"),
        ModelEvidence("mapped", "/gone/x.gguf", deleted=True),
    ]
    ev = from_procinfo(rows)
    assert [(e.source.value, e.path) for e in ev] == [
        ("mapped", str(real)),
        ("cmdline", str(real)),
        ("mapped", "/gone/x.gguf"),
    ]
    claim = next(c for c in assess(ev) if c.path == str(real))
    assert claim.confirmed


def test_mapped_store_blobs_without_extension(tmp_path: Path) -> None:
    root = tmp_path / "models"
    content = b"weights"
    hexd = hashlib.sha256(content).hexdigest()
    blob = root / "blobs" / f"sha256-{hexd}"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(content)
    man = root / "manifests" / "registry.ollama.ai" / "library" / "m" / "latest"
    man.parent.mkdir(parents=True)
    man.write_text(
        json.dumps(
            {
                "layers": [
                    {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{hexd}"}
                ]
            }
        )
    )
    idx = StoreIndex(StoreRoots(ollama=(str(root),)))
    ev = mapped_store_files(["/usr/lib/libc.so.6", str(blob)], idx.name_for)
    assert [(e.source, e.path) for e in ev] == [(Source.MAPPED, os.path.realpath(blob))]


def test_the_demo_s_models_are_what_the_ladder_makes_of_their_evidence() -> None:
    """Catches the demo's llama-server shown ``[mapped?]`` unconfirmed while its own command
    line names the model (``-m``) and the same file is mapped: two corroborating sources, so
    the ladder confirms it. The demo is hand-written (fixtures import nothing above base);
    this runs its evidence through procinfo's steps (redact, model flags, resolve) and
    `assess`, and its ModelRef must say what they say."""
    from gputaskman.base.procargs import model_args
    from gputaskman.fixtures.demo import demo_snapshot

    with_model = [p for p in demo_snapshot().processes if p.model is not None]
    assert with_model
    for p in with_model:
        d, m = p.detail, p.model
        rows = [ModelEvidence("mapped", f) for f in d.model_files]
        for a in model_args(redact_argv(d.cmdline or ())):
            rows.append(ModelEvidence(a.evidence, resolve(a.raw, "/"), raw=a.raw, flag=a.flag))
        assert d.model_evidence == tuple((r.evidence, r.path) for r in rows), p.name
        claim = assess(from_procinfo(rows))[0]
        got = (m.evidence, m.confirmed, m.status, m.sources, m.path)
        want = (
            claim.best.value,
            claim.confirmed,
            claim.status,
            tuple(sorted(s.value for s in claim.sources)),
            claim.path,
        )
        assert got == want, p.name
    llama = next(p for p in with_model if p.name == "llama-server")
    assert llama.model.confirmed  # `-m` and the mapping agree
