#!/usr/bin/env python
"""Build the training corpus of the bundled tiny-llama model from registry packages.

Sources (all fetched with the registries' ordinary clients, versions pinned):

* ``botchan.txt`` from sentencepiece's source distribution on PyPI (sentencepiece==0.2.0,
  ``test/botchan.txt``): Project Gutenberg EBook #8868, "Botchan (Master Darling)" by
  Natsume Soseki, English translation by Yasotaro Morri (1919). Public domain in the USA;
  the Gutenberg header, the translator's note and the licence footer are stripped.
* Debian's ``fortunes`` and ``fortunes-min`` (1:1.99.1-7.3): the inoffensive fortune-mod
  cookie files (the offensive ones live in the separate ``fortunes-off`` package, which is
  not used). Licence: the BSD licence of fortune-mod (see the package's copyright file);
  ``ascii-art`` and ``translate-me`` are skipped (not English prose).
* Debian's ``bible-kjv-text`` (4.38), decoded with the ``bible`` program of ``bible-kjv``:
  the King James Version (1611), whose copyright has expired (package copyright file);
  the data file is "provided for unrestricted use".

Output (deterministic for the pinned inputs):

    <out>/train.txt, <out>/valid.txt   documents separated by one blank line ("\\n\\n");
                                       inside a document, lines end with "\\n"
    <out>/sources.json                 per source: package, version, licence, sha256 of the
                                       downloaded archive, document and character counts

Every document goes to valid.txt when the first 8 bytes of sha256(document) read as an
integer fall below ``--valid-fraction`` of 2**64, so the split does not depend on the order
the sources are read in. Train documents are shuffled with a fixed seed (0).

Usage: ``python scripts/build_corpus.py [--out data/corpus] [--cache /tmp/jaxserve_corpus_src]``.
Needs ``pip`` (for ``pip download``), ``apt-get`` (run ``apt-get update`` once first) and
``dpkg-deb``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tarfile

SENTENCEPIECE_SDIST = "sentencepiece==0.2.0"
DEBIAN_PACKAGES = {
    "fortunes": "1:1.99.1-7.3",
    "fortunes-min": "1:1.99.1-7.3",
    "bible-kjv": "4.38",
    "bible-kjv-text": "4.38",
}
FORTUNE_FILES_SKIPPED = {"ascii-art", "translate-me"}


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def fetch_sentencepiece_sdist(cache: str) -> str:
    """Download sentencepiece's sdist into ``cache``; returns the archive path."""
    dest = os.path.join(cache, "pypi")
    os.makedirs(dest, exist_ok=True)
    found = glob.glob(os.path.join(dest, "sentencepiece-*.tar.gz"))
    if not found:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                SENTENCEPIECE_SDIST,
                "-d",
                dest,
            ]
        )
        found = glob.glob(os.path.join(dest, "sentencepiece-*.tar.gz"))
    return found[0]


def fetch_debian_packages(cache: str) -> dict[str, str]:
    """``apt-get download`` the pinned packages and unpack them under ``cache/root``."""
    dest = os.path.join(cache, "debian")
    root = os.path.join(cache, "root")
    os.makedirs(dest, exist_ok=True)
    debs = {}
    for name, version in DEBIAN_PACKAGES.items():
        found = glob.glob(os.path.join(dest, f"{name}_*.deb"))
        if not found:
            try:
                _run(["apt-get", "download", f"{name}={version}"], cwd=dest)
            except subprocess.CalledProcessError as e:
                raise SystemExit(
                    f"apt-get download {name}={version} failed ({e}); run `apt-get update` first"
                ) from e
            found = glob.glob(os.path.join(dest, f"{name}_*.deb"))
        debs[name] = found[0]
        _run(["dpkg-deb", "-x", found[0], root])
    return debs


def _normalize_lines(text: str) -> str:
    """Strip each line, collapse runs of blanks, drop empty lines; one "\\n" per line."""
    lines = [re.sub(r"[ \t]+", " ", ln).strip() for ln in text.splitlines()]
    return "".join(ln + "\n" for ln in lines if ln)


def botchan_documents(sdist: str) -> list[str]:
    """Botchan's chapters, each a document whose lines are the book's paragraphs."""
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/botchan.txt"))
        text = tar.extractfile(member).read().decode("utf-8-sig")
    start = text.index("*** START OF THIS PROJECT GUTENBERG EBOOK")
    start = text.index("\n", start) + 1
    end = text.index("*** END OF THIS PROJECT GUTENBERG EBOOK")
    body = text[start:end].replace("\r\n", "\n")
    docs = []
    # This edition has no blank lines between paragraphs, so each chapter is re-flowed
    # into lines of whole sentences of at most ~400 characters.
    for chapter in re.split(r"\n\s*CHAPTER [IVXL]+\.?\s*\n", body)[1:]:
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", " ".join(chapter.split()))
        lines, current = [], ""
        for sentence in sentences:
            if current and len(current) + len(sentence) > 400:
                lines.append(current)
                current = ""
            current = f"{current} {sentence}" if current else sentence
        lines.append(current)
        docs.append("".join(ln + "\n" for ln in lines if ln))
    return docs


def fortune_documents(root: str) -> list[str]:
    """One document per fortune cookie (the files are "%"-separated), duplicates removed."""
    directory = os.path.join(root, "usr/share/games/fortunes")
    seen, docs = set(), []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if (
            "." in name
            or name in FORTUNE_FILES_SKIPPED
            or os.path.islink(path)
            or not os.path.isfile(path)
        ):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for cookie in re.split(r"^%\n", f.read(), flags=re.MULTILINE):
                doc = _normalize_lines(cookie)
                if re.search("[\x80-\x9f\ufffd]", doc):
                    continue  # a few cookies are doubly-encoded UTF-8 (mojibake)
                if doc and doc not in seen:
                    seen.add(doc)
                    docs.append(doc)
    return docs


def kjv_documents(root: str) -> list[str]:
    """The King James Bible, one document per chapter, one verse per line (no references)."""
    out = subprocess.run(
        [
            os.path.join(root, "usr/bin/bible"),
            "-f",
            "-p",
            os.path.join(root, "usr/lib"),
            "gen1:1-rev22:21",
        ],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    ).stdout.decode("utf-8")
    chapters: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+) (.*)$", line)
        if m is None:
            continue
        chapters.setdefault(f"{m.group(1)}{m.group(2)}", []).append(m.group(4).strip())
    if len(chapters) != 1189:  # chapters in the Protestant canon
        raise SystemExit(f"bible decode produced {len(chapters)} chapters, expected 1189")
    return ["".join(v + "\n" for v in verses) for verses in chapters.values()]


def _is_valid(doc: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/corpus", help="output directory")
    ap.add_argument(
        "--cache",
        default="/tmp/jaxserve_corpus_src",
        help="where downloaded archives are kept and unpacked",
    )
    ap.add_argument(
        "--valid-fraction",
        type=float,
        default=0.02,
        help="share of documents held out for validation",
    )
    args = ap.parse_args(argv)
    if not 0.0 < args.valid_fraction < 0.5:
        raise SystemExit("--valid-fraction must be in (0, 0.5)")

    os.makedirs(args.out, exist_ok=True)
    sdist = fetch_sentencepiece_sdist(args.cache)
    debs = fetch_debian_packages(args.cache)
    root = os.path.join(args.cache, "root")

    sources = [
        (
            "botchan",
            botchan_documents(sdist),
            {
                "origin": f"PyPI {SENTENCEPIECE_SDIST} sdist, test/botchan.txt",
                "sha256": _sha256_file(sdist),
                "licence": "Public domain (Project Gutenberg EBook #8868; Gutenberg header and "
                "licence footer removed)",
            },
        ),
        (
            "fortunes",
            fortune_documents(root),
            {
                "origin": "Debian fortunes + fortunes-min " + DEBIAN_PACKAGES["fortunes"],
                "sha256": {k: _sha256_file(debs[k]) for k in ("fortunes", "fortunes-min")},
                "licence": "BSD (fortune-mod, University of California; see "
                "/usr/share/doc/fortunes/copyright); offensive set not used",
            },
        ),
        (
            "kjv",
            kjv_documents(root),
            {
                "origin": "Debian bible-kjv-text "
                + DEBIAN_PACKAGES["bible-kjv-text"]
                + " decoded by bible-kjv's `bible`",
                "sha256": {k: _sha256_file(debs[k]) for k in ("bible-kjv", "bible-kjv-text")},
                "licence": "Public domain (King James Version, 1611; copyright expired per the "
                "package's copyright file)",
            },
        ),
    ]

    train, valid, manifest = [], [], {}
    for name, docs, meta in sources:
        n_valid = 0
        for doc in docs:
            if _is_valid(doc, args.valid_fraction):
                valid.append(doc)
                n_valid += 1
            else:
                train.append(doc)
        manifest[name] = dict(
            meta, documents=len(docs), valid_documents=n_valid, characters=sum(len(d) for d in docs)
        )
    random.Random(0).shuffle(train)
    random.Random(1).shuffle(valid)

    for split, docs in (("train", train), ("valid", valid)):
        path = os.path.join(args.out, f"{split}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(docs))  # each doc ends in "\n", so docs are "\n\n"-separated
        manifest[f"{split}_sha256"] = _sha256_file(path)
        manifest[f"{split}_characters"] = sum(len(d) for d in docs)
        manifest[f"{split}_documents"] = len(docs)
    with open(os.path.join(args.out, "sources.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    print(json.dumps({k: v for k, v in manifest.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
