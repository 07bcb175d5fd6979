"""Builds the text corpus of ``benchmarks/scale.py`` (issue 33): English text any machine here can obtain, split by
document into a training file and a held-out validation file, with SHA-256 checksums.

Sources:

* the reStructuredText sources of the Python 3.11 documentation in Debian's ``python3.11-doc`` package (its
  ``html/_sources/**/*.rst.txt``: 497 files, 11.0 MB in 3.11.2-6+deb12u8). ``--download`` fetches the package with
  ``apt-get download`` (works on this project's CPU machines; the GPU machine has no network, so build the corpus
  here and carry it there); ``--deb PATH`` takes a downloaded one; ``--tree DIR`` an extracted tree;
* ``--extra FILE ...``: plain-text files (by default the shared ``tinyshakespeare.txt`` and ``wikitext2-valid.txt``
  when present), each cut into documents of about 64 KB at blank lines.

Documents with identical text are kept once. The held-out documents are taken in the order of the SHA-256 of their
names, each one that still fits in ``--val-fraction`` of the bytes, so the split depends on the names and sizes only,
and no document (nor any copy of one) is in both files. The training documents keep their source order. Outputs in
``--out``: ``train.txt``, ``val.txt`` (documents separated by a blank line, UTF-8) and ``manifest.json`` (sizes,
checksums, sources, the held-out document names). The same inputs give the same bytes and checksums.

Usage: ``python benchmarks/build_corpus.py --download [--out benchmarks/cache/scale-corpus]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "cache" / "scale-corpus"
SHARED = Path("/work/shared/data")
DEFAULT_EXTRAS = (SHARED / "tinyshakespeare.txt", SHARED / "wikitext2-valid.txt")
PACKAGE = "python3.11-doc"
CHUNK = 64 * 1024

Document = tuple[str, str]  # (name, text)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def documents_from_tree(root: Path) -> list[Document]:
    """Every ``*.rst.txt`` under a ``_sources`` folder of ``root`` (an extracted ``python3.11-doc``), sorted."""
    files = sorted(p for p in root.rglob("*.rst.txt") if "_sources" in p.parts)
    if not files:
        raise SystemExit(f"no _sources/**/*.rst.txt under {root}: is it an extracted {PACKAGE}?")
    return [(f"{PACKAGE}:{p.relative_to(root)}", p.read_text(encoding="utf-8")) for p in files]


def documents_from_file(path: Path, chunk: int = CHUNK) -> list[Document]:
    """``path`` cut at blank lines into documents of at least ``chunk`` bytes (the last one may be shorter)."""
    docs, current, size = [], [], 0
    for paragraph in path.read_text(encoding="utf-8").split("\n\n"):
        current.append(paragraph)
        size += len(paragraph.encode("utf-8")) + 2
        if size >= chunk:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return [(f"{path.name}#{i}", text) for i, text in enumerate(docs) if text.strip()]


def split(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Training and held-out documents: duplicates dropped, then the held-out ones by the hash order of the names."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    seen, unique = set(), []
    for name, text in docs:
        digest = sha256(text.encode("utf-8"))
        if digest not in seen:
            seen.add(digest)
            unique.append((name, text))
    total = sum(len(text.encode("utf-8")) for _, text in unique)
    held, size = set(), 0
    for name, text in sorted(unique, key=lambda d: sha256(d[0].encode("utf-8"))):
        n = len(text.encode("utf-8"))
        if size + n <= val_fraction * total:  # a document that would overshoot is passed over
            held.add(name)
            size += n
    return [d for d in unique if d[0] not in held], [d for d in unique if d[0] in held]


def build(docs: list[Document], out: Path, val_fraction: float = 0.05,
          sources: dict[str, str] | None = None) -> dict:
    """Write ``train.txt``, ``val.txt`` and ``manifest.json`` to ``out``; return the manifest."""
    train, val = split(docs, val_fraction)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"sources": sources or {}, "val_fraction": val_fraction, "documents": len(train) + len(val)}
    for part, chosen in (("train", train), ("val", val)):
        data = "\n\n".join(text for _, text in chosen).encode("utf-8") + b"\n"
        (out / f"{part}.txt").write_bytes(data)
        manifest[part] = {"file": f"{part}.txt", "bytes": len(data), "documents": len(chosen), "sha256": sha256(data)}
    manifest["val"]["names"] = sorted(name for name, _ in val)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def download(folder: Path) -> Path:
    """``apt-get download python3.11-doc`` into ``folder``; the path of the ``.deb``."""
    subprocess.run(["apt-get", "download", PACKAGE], cwd=folder, check=True, capture_output=True, text=True)
    return next(folder.glob(f"{PACKAGE}_*.deb"))


def extract(deb: Path, folder: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(folder)], check=True)
    return folder


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--download", action="store_true", help=f"apt-get download {PACKAGE}")
    source.add_argument("--deb", type=Path, help=f"a downloaded {PACKAGE} .deb")
    source.add_argument("--tree", type=Path, help=f"an extracted {PACKAGE} (or any folder with _sources/*.rst.txt)")
    parser.add_argument("--extra", type=Path, nargs="*", default=None,
                        help="plain-text files to add (default: the shared tinyshakespeare and wikitext2-valid)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args(argv)
    extras = [p for p in DEFAULT_EXTRAS if p.exists()] if args.extra is None else args.extra
    docs: list[Document] = []
    sources: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        deb = download(Path(tmp)) if args.download else args.deb
        tree = args.tree
        if deb is not None:
            sources[deb.name] = sha256(deb.read_bytes())
            tree = extract(deb, Path(tmp) / "tree")
        if tree is not None:
            docs += documents_from_tree(tree)
        if args.tree is not None:
            sources[PACKAGE] = str(args.tree)
        for path in extras:
            sources[path.name] = sha256(path.read_bytes())
            docs += documents_from_file(path)
    if not docs:
        raise SystemExit("no input: give --download, --deb, --tree or --extra FILE")
    manifest = build(docs, args.out, args.val_fraction, sources)
    for part in ("train", "val"):
        m = manifest[part]
        print(f"{args.out / m['file']}: {m['bytes'] / 1e6:.2f} MB, {m['documents']} documents, sha256 {m['sha256']}")
    return manifest


if __name__ == "__main__":
    main()
