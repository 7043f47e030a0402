"""The user's own prompts: local JSONL, JSON, Parquet or Arrow files (or folders of them), or `datasets` folders,
in OpenAI `messages`, ShareGPT `conversations` or plain `prompt` form.

Every record is read, then either accepted as a prompt or quarantined with a reason, as trajectory logs are
(`data/trajectory/quarantine.py`'s items, one JSON line each), so that per source
`read == accepted + quarantined`. Reasons: `malformed_json`, `not_an_object`, `missing_field`,
`wrong_type`, `unknown_role`, `no_user_turn`, `empty`, `too_long` (over the prompt budget in characters),
`duplicate` (the same conversation already read, in this source or an earlier one).

A prompt's id is `<source name>:<sha256 of its messages>`, so ids are stable across runs and a duplicate is
found by its id. The held-out split is by the first user message (`data/sources/split.py`'s salted hash),
so every version of one question lands on the same side, whatever file or order it comes in.

Multi-turn conversations (`turns`):
- `last`: the target answers the last user turn; the conversation before it is kept as given.
- `every`: the target answers the first user turn, then each later one after its own earlier answers
  (the later user turns are the prompt's `followups`; `data/sources/mixture.py` regenerates them in rounds).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from data.sources.prompts import Prompt
from data.sources.split import heldout_score
from data.trajectory.quarantine import QuarantineItem

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")
EXCERPT_CHARS = 300


class PromptSourceError(ValueError):
    """A source that cannot be read at all (missing path, unknown file type); the message names it."""


@dataclass
class SourceRead:
    """One source's prompts of one split, and how every record read was accounted for."""

    name: str
    prompts: list[Prompt] = field(default_factory=list)
    read: int = 0
    heldout: int = 0  # accepted records of the other split
    quarantined: list[QuarantineItem] = field(default_factory=list)

    @property
    def by_reason(self) -> dict[str, int]:
        return dict(Counter(q.reason for q in self.quarantined))


class _Bad(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def source_files(path: str | Path) -> list[Path]:
    """The files a source path names: itself, or the known files of a folder (sorted; a `datasets` folder's arrow files)."""
    path = Path(path)
    if not path.exists():
        raise PromptSourceError(f"prompt source {path} does not exist")
    if path.is_file():
        if not path.name.endswith(FILE_SUFFIXES):
            raise PromptSourceError(f"prompt source {path}: unknown file type (expected one of {', '.join(FILE_SUFFIXES)})")
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES)
                   and not (p.name.endswith(".json") and is_datasets_metadata(p)))
    if not found:
        raise PromptSourceError(f"prompt source {path}: a folder with no {', '.join(FILE_SUFFIXES)} files")
    return found


def is_datasets_metadata(path: Path) -> bool:
    return path.name in ("dataset_info.json", "state.json", "dataset_dict.json")


def source_content_hash(path: str | Path) -> str:
    """sha256 over the source's files (names and bytes): the regenerated mixture's key changes when they do."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in source_files(root):
        digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _records(file: Path) -> Iterator[tuple[dict, Any]]:
    """(where, record or _Bad) for every record of a file; where = {"line": n} or {"row": i}."""
    name = file.name
    if name.endswith(".jsonl"):
        with open(file, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    yield {"line": number}, json.loads(raw.decode("utf-8"))
                except (ValueError, UnicodeDecodeError) as err:
                    yield {"line": number, "raw": raw[:EXCERPT_CHARS].decode("utf-8", "replace")}, \
                        _Bad("malformed_json", f"not a JSON record ({err})")
    elif name.endswith(".json"):
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            yield {}, _Bad("malformed_json", f"the file is not JSON ({err})")
            return
        rows = data.get("data") if isinstance(data, dict) and isinstance(data.get("data"), list) else data
        if not isinstance(rows, list):
            yield {}, _Bad("wrong_type", "a JSON source holds a list of records (or {\"data\": [...]})")
            return
        for i, row in enumerate(rows):
            yield {"row": i}, row
    else:  # Parquet, or an Arrow file (a `datasets` cache file or an Arrow IPC stream)
        for i, row in enumerate(_table_rows(file)):
            yield {"row": i}, row


def _table_rows(file: Path) -> Iterator[dict]:
    if file.name.endswith(".parquet"):
        parquet = pq.ParquetFile(file)
        for batch in parquet.iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            for index in range(reader.num_record_batches):
                yield from reader.get_batch(index).to_pylist()
            return
        for batch in reader:
            yield from batch.to_pylist()


def _text(value: Any, what: str) -> str:
    if isinstance(value, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(value) or not all(isinstance(p, str) for p in parts):
            raise _Bad("wrong_type", f"{what}: content parts other than text")
        value = "".join(parts)
    if not isinstance(value, str):
        raise _Bad("wrong_type", f"{what} is {type(value).__name__}, not text")
    return value


def messages_of(record: Any, fmt: str) -> list[dict[str, str]]:
    """The record's conversation as [{"role", "content"}], validated; raises _Bad."""
    if not isinstance(record, dict):
        raise _Bad("not_an_object", f"a record is a JSON object, got {type(record).__name__}")
    if fmt == "prompt":
        if "prompt" not in record:
            raise _Bad("missing_field", "no 'prompt' field")
        messages = [{"role": "system", "content": _text(record["system"], "'system'")}] if record.get("system") else []
        messages.append({"role": "user", "content": _text(record["prompt"], "'prompt'")})
    else:
        key = "messages" if fmt == "messages" else "conversations"
        turns = record.get(key)
        if turns is None:
            raise _Bad("missing_field", f"no '{key}' field")
        if not isinstance(turns, list):
            raise _Bad("wrong_type", f"'{key}' is {type(turns).__name__}, not a list")
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise _Bad("wrong_type", f"{key}[{i}] is {type(turn).__name__}, not an object")
            if fmt == "messages":
                role, content = turn.get("role"), turn.get("content")
            else:
                role, content = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower(), turn.get("from")), turn.get("value")
            if role == "tool" or role not in ROLES:
                raise _Bad("unknown_role", f"{key}[{i}] has role {role!r} (expected system, user or assistant)")
            messages.append({"role": role, "content": _text(content, f"{key}[{i}] content")})
    if not any(m["role"] == "user" for m in messages):
        raise _Bad("no_user_turn", "no user turn to answer")
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        raise _Bad("empty", "every user turn is empty")
    return messages


def conversation_prompt(messages: list[dict[str, str]], turns: str) -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """(messages the target answers first, later user turns it answers in rounds)."""
    if turns == "last":
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        return messages[:last_user + 1], ()
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    later = tuple(m["content"] for m in messages[first_user + 1:] if m["role"] == "user")
    return messages[:first_user + 1], later


def read_source(name: str, path: str | Path, fmt: str, category: str, *, split: str, heldout_fraction: float,
                max_chars: int, turns: str = "last", seen: set[str] | None = None) -> SourceRead:
    """Every record of the source, accepted into `split` (train or heldout), the other split, or quarantine.
    seen: prompt contents already taken by earlier sources (duplicates across sources are quarantined too)."""
    seen = set() if seen is None else seen
    out = SourceRead(name)
    root = Path(path)
    for file in source_files(root):
        for where, record in _records(file):
            out.read += 1
            try:
                if isinstance(record, _Bad):
                    raise record
                messages = messages_of(record, fmt)
                prompt_messages, followups = conversation_prompt(messages, turns)
                size = sum(len(m["content"]) for m in prompt_messages)
                if size > max_chars or any(len(f) > max_chars for f in followups):
                    raise _Bad("too_long", f"{size} characters, over the prompt budget of {max_chars} "
                                           "(data.mixture.max_prompt_tokens x 3)")
                content = json.dumps([prompt_messages, followups], ensure_ascii=False, sort_keys=True)
                key = hashlib.sha256(content.encode("utf-8")).hexdigest()[:20]
                if key in seen:
                    raise _Bad("duplicate", "the same conversation was already read")
                seen.add(key)
            except _Bad as bad:
                raw = where.pop("raw", None) if isinstance(record, _Bad) else json.dumps(record, ensure_ascii=False, default=str)
                out.quarantined.append(QuarantineItem(reason=bad.reason, message=bad.message, source_file=str(file),
                                                      line=where.get("line"), row=where.get("row"),
                                                      raw=(raw or "")[:EXCERPT_CHARS], raw_chars=len(raw or ""),
                                                      raw_truncated=len(raw or "") > EXCERPT_CHARS))
                continue
            first_user = next(m["content"] for m in prompt_messages if m["role"] == "user")
            side = "heldout" if heldout_score(f"{category}\0{first_user}") < heldout_fraction else "train"
            if side != split:
                out.heldout += 1
                continue
            out.prompts.append(Prompt(id=f"{name}:{key}", category=category, messages=prompt_messages, source=name,
                                      document_id=f"{file.name}:{where.get('line', where.get('row'))}", task="user",
                                      followups=followups))
    return out


def sample(prompts: list[Prompt], count: int, seed: int) -> list[Prompt]:
    """`count` of the prompts, the same ones for the same seed whatever the file order (by a hash of each id)."""
    def rank(prompt: Prompt) -> bytes:
        return hashlib.sha256(f"{seed}\0{prompt.id}".encode()).digest()

    return sorted(prompts, key=rank)[:count]
