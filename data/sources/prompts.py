"""Chat prompts built from corpus documents: code prompts show a function, class or method with an instruction,
prose prompts an excerpt with an instruction, chat and writing prompts are the question or request itself. Deterministic in the
seed; every prompt's messages hold at most max_chars characters (see data/sources/builtin.py)."""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from data.sources.corpus import Document, normalise_utterance
from data.sources.split import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SALT,
    load_corpus,
    unit_hash,
)

DEFAULT_MAX_CHARS = 2000


@dataclass(frozen=True)
class Prompt:
    """A chat prompt for the target. ``id`` is ``<document id>#<excerpt index>`` (``@<pass>`` appended
    on passes after the first). ``task`` names the instruction (code: complete / explain / docstring /
    tests / type_hints / review; prose: continue / summarise / modernise / analyse / questions; chat:
    question / two_turns; writing: the form, letter / story / description ...). ``followups`` holds later user turns (MT-Bench's second turn, on the
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

# Chat prompts on passes after the first: the same question asked another way, so the target writes a new
# answer instead of the same greedy one again (the chat sources hold about 800 training questions). Pass p
# uses phrasing (p - 1 + a per-question offset) mod len; past the last phrasing a question has nothing new to ask
# and yields no more prompts (the same prompt would be regenerated into the same answer).
CHAT_REPHRASINGS = (
    "{question} Please explain in detail.",
    "{question} Give an example.",
    "Explain to a beginner: {question}",
    "{question} Answer in a few sentences.",
    'A friend asked me: "{question}" How should I answer?',
)


# Writing requests on passes after the first: the same request with another tone or length, so the target writes
# a new piece (pass p uses variation p - 1; past the last a request yields no more prompts).
WRITING_VARIATIONS = (
    "{request} Keep it under 150 words.",
    "{request} Use a humorous, light-hearted tone.",
    "{request} Write it for a formal, professional audience.",
    "{request} Make it vivid, with concrete details.",
)


# ---- assembly -------------------------------------------------------------------------------------


def _document_prompts(doc: Document, seed: int, max_chars: int, pass_index: int) -> Iterator[Prompt]:
    rng = _rng("prompts", seed, pass_index, doc.id)
    suffix = "" if pass_index == 0 else f"@{pass_index}"
    if doc.category == "chat":
        if not doc.turns or len(doc.turns[0]) > max_chars or pass_index > len(CHAT_REPHRASINGS):
            return
        def asked(question: str) -> str:
            if pass_index == 0:
                return question
            offset = int(unit_hash(f"rephrase\x00{seed}\x00{doc.id}") * len(CHAT_REPHRASINGS))
            return CHAT_REPHRASINGS[(pass_index - 1 + offset) % len(CHAT_REPHRASINGS)].format(question=question)

        followups = tuple(t for t in doc.turns[1:] if len(t) <= max_chars) if doc.source == "mtbench" else ()
        if len(asked(doc.turns[0])) <= max_chars:
            yield Prompt(id=f"{doc.id}#0{suffix}", category="chat", messages=_user(asked(doc.turns[0])),
                         source=doc.source, document_id=doc.id, task="question", followups=followups)
        if doc.source == "mtbench" and len(doc.turns) >= 2:
            # The second turn refers to the first answer; as a single message both requests go together.
            content = asked(MTBENCH_TWO_TURNS.format(first=doc.turns[0], second=doc.turns[1]))
            if len(content) <= max_chars:
                yield Prompt(id=f"{doc.id}#1{suffix}", category="chat", messages=_user(content), source=doc.source,
                             document_id=doc.id, task="two_turns")
        return
    if doc.category == "writing":
        if not doc.turns or pass_index > len(WRITING_VARIATIONS):
            return
        request = doc.turns[0] if pass_index == 0 else WRITING_VARIATIONS[pass_index - 1].format(request=doc.turns[0])
        if len(request) <= max_chars:
            yield Prompt(id=f"{doc.id}#0{suffix}", category="writing", messages=_user(request), source=doc.source,
                         document_id=doc.id, task=doc.title)
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
        keep.setdefault((doc.source, normalise_utterance(doc.turns[0])), doc)
    kept = {d.id for d in keep.values()}
    return [d for d in docs if d.category != "chat" or d.id in kept]


def iter_document_prompts(docs: Iterable[Document], seed: int = 0, max_chars: int = DEFAULT_MAX_CHARS, *,
                          passes: int | None = 1) -> Iterator[Prompt]:
    """Prompts of the given documents, round-robin over a seeded shuffle of them (excerpt 0 of every
    document, then excerpt 1, ...), so any prefix of the stream is spread over many documents.

    ``passes`` > 1 (or None: until no document has a new prompt) repeats the corpus with fresh seeded excerpt
    boundaries and task choices, and chat questions rephrased (``CHAT_REPHRASINGS``, so chat runs out after
    ``len(CHAT_REPHRASINGS) + 1`` passes); later passes' prompt ids end in ``@<pass>``."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    docs = _dedupe_chat(list(docs))
    order = sorted(docs, key=lambda d: (unit_hash(f"order\x00{seed}\x00{d.id}"), d.id))
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
