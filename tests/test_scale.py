"""``benchmarks/scale.py --tiny`` end to end on the CPU (issue 33): every method through the launch path the GPU run
uses (M = 2 single-device nodes, forked, gloo), the JSONL fields, resuming, the figures and the claims table; and
``benchmarks/build_corpus.py`` on a tiny input (stable checksums, a held-out split disjoint from training).

The tiny run here trains 32 steps (one sync at K = 32) to keep the test near 30 s on 2 idle cores; the committed
tiny results use the stage's 64."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import build_corpus  # noqa: E402

METHODS = ("ddp", "ddp_powersgd", "diloco", "lowrank_ddp", "lordo", "lordo_compressed", "lordo_small_rank",
           "lordo_local", "lordo_noqhm")
FIELDS = ("final_val_loss", "final_val_ppl", "curve", "bytes_payload", "bytes_wire", "peak_memory_bytes",
          "optimizer_state_bytes", "train_seconds", "compute_seconds", "comm_seconds", "replicas_identical",
          "replica_max_abs_diff", "provenance", "wall_seconds", "device", "backend")


def _fake_docs(root: Path) -> list[Path]:
    """An extracted ``python3.11-doc`` in miniature, a plain-text file of 30 paragraphs, and an exact copy of one
    of the documents (which must be kept once)."""
    sources = root / "tree" / "usr" / "share" / "doc" / "python3.11" / "html" / "_sources" / "library"
    sources.mkdir(parents=True)
    for i in range(40):
        (sources / f"mod{i:02d}.rst.txt").write_text(f"Module {i}\n=========\n\n" + f"Sentence {i} of prose. " * 30)
    (root / "extra.txt").write_text("\n\n".join(f"Paragraph {j}: " + "words " * 200 for j in range(30)))
    (root / "copy.txt").write_text((sources / "mod03.rst.txt").read_text())
    return [root / "extra.txt", root / "copy.txt"]


def test_corpus_builder_is_stable_and_holds_out_whole_documents(tmp_path):
    extras = _fake_docs(tmp_path)
    argv = ["--tree", str(tmp_path / "tree"), "--extra", *map(str, extras), "--val-fraction", "0.2"]
    first = build_corpus.main(argv + ["--out", str(tmp_path / "a")])
    second = build_corpus.main(argv + ["--out", str(tmp_path / "b")])
    for part in ("train", "val"):
        assert first[part]["sha256"] == second[part]["sha256"]
        data = (tmp_path / "a" / f"{part}.txt").read_bytes()
        assert build_corpus.sha256(data) == first[part]["sha256"] == json.loads(
            (tmp_path / "a" / "manifest.json").read_text())[part]["sha256"]
    docs = build_corpus.documents_from_tree(tmp_path / "tree")
    for path in extras:
        docs += build_corpus.documents_from_file(path)
    assert len(docs) == 42
    train, val = build_corpus.split(docs, 0.2)
    assert len(train) + len(val) == 41  # the copy is kept once
    assert first["train"]["documents"] == len(train) and first["val"]["names"] == sorted(n for n, _ in val)
    assert val and not {n for n, _ in train} & {n for n, _ in val}
    train_text = (tmp_path / "a" / "train.txt").read_text()
    assert not any(text in train_text for _, text in val)  # no held-out document (or copy of one) is trained on
    total = sum(len(t) for _, t in train + val)
    assert 0.15 <= sum(len(t) for _, t in val) / total <= 0.2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lightning_lordo.models import default_corpus

    folder = tmp_path_factory.mktemp("corpus")
    (folder / "stdlib.txt").write_text(default_corpus())
    build_corpus.main(["--extra", str(folder / "stdlib.txt"), "--out", str(folder)])
    return folder


def _scale(corpus: Path, out: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--tiny", "--steps", "32", "--corpus",
            str(corpus), "--out", str(out)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_tiny_run_records_every_method_resumes_and_reports_the_claims(corpus, tmp_path):
    out = tmp_path / "scale-tiny.jsonl"
    start = time.perf_counter()
    first = _scale(corpus, out)
    first_s = time.perf_counter() - start
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["method"] for r in rows) == sorted(METHODS)
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        assert not missing, (row["method"], missing)
        assert row["stage"] == "tiny-cpu" and row["spec"]["workers"] == 2 and row["backend"] == "gloo"
        assert row["curve"] and {"step", "val_loss", "val_ppl", "bytes", "wire_bytes"} <= set(row["curve"][-1])
        assert row["bytes_payload"] > 0 and row["bytes_wire"] >= row["bytes_payload"] / 2
        assert len(row["peak_memory_bytes"]) == 2 and min(row["peak_memory_bytes"]) > 0
        assert row["compute_seconds"] > 0 and row["comm_seconds"] >= 0
        assert row["replicas_identical"] and row["replica_max_abs_diff"] == 0.0, row["method"]
        assert {"command", "commit", "torch", "lightning", "machine"} <= set(row["provenance"])
        assert (row["lowrank_tensors"] > 0) == (row["method"] not in ("ddp", "ddp_powersgd", "diloco"))
    by = {r["method"]: r for r in rows}
    assert by["lordo"]["bytes_payload"] < by["lowrank_ddp"]["bytes_payload"] < 1.01 * by["ddp"]["bytes_payload"]
    assert by["ddp_powersgd"]["bytes_payload"] < by["ddp"]["bytes_payload"]
    assert by["lordo_small_rank"]["optimizer_state_bytes"] < by["lordo"]["optimizer_state_bytes"]
    for suffix in ("loss-steps", "loss-bytes", "memory"):
        assert (tmp_path / f"scale-tiny-{suffix}.png").stat().st_size > 0
    summary = first.stdout[first.stdout.index("Summary"):]
    for claim in range(1, 5):
        assert f"  claim {claim} " in summary
    assert "not measured until the GPU run" in summary

    start = time.perf_counter()
    second = _scale(corpus, out)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.count("done before, skipped") == len(METHODS)
    assert len(out.read_text().splitlines()) == len(rows)  # nothing ran again
    assert "  claim 4 " in second.stdout
    assert time.perf_counter() - start < first_s
