"""The agent's workspace: the standard-library files of one split, and the tools that read them for real
(numbered lines, os.listdir, a regex search, python -m py_compile / tabnanny / pyclbr in a subprocess)."""

from __future__ import annotations

import ast
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

from data.sources.builtin import (
    DEFAULT_HELDOUT_FRACTION,
    Document,
    load_code,
    split_documents,
    stdlib_dir,
)
from drafters.target.chat import encode

OUTLINE_SCRIPT = ("import ast, sys; t = ast.parse(open(sys.argv[1]).read()); "
                   "print(*[f'{n.lineno}: {type(n).__name__} {n.name}' for n in ast.walk(t) "
                   "if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], sep='\\n')")


def split_code_documents(split: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> tuple[list[Document], list[Document]]:
    """(documents of ``split``, documents of the other split) among the stdlib code documents."""
    train, heldout = split_documents(load_code(), heldout_fraction)
    return (train, heldout) if split == "train" else (heldout, train)


@dataclass(frozen=True)
class Subject:
    """A function / class / method of a file: the subject of a task."""

    doc_id: str
    path: str  # relative to the stdlib folder
    name: str  # qualified (Class.method)
    start: int  # 1-based lines, inclusive
    end: int

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path)


class Workspace:
    """The stdlib files of one split, and the tools that read them. Records every file a tool reads."""

    def __init__(self, docs: Sequence[Document], tokenizer, tool_tokens: int):
        self.root = stdlib_dir()
        self.docs = {d.id[len("code:"):]: d for d in docs}
        self.paths = sorted(self.docs)
        self.by_folder: dict[str, list[str]] = {}
        for p in self.paths:
            self.by_folder.setdefault(os.path.dirname(p), []).append(p)
        self.tokenizer = tokenizer
        self.tool_tokens = tool_tokens
        self.read: set[str] = set()  # document ids read by any tool
        self._targets: dict[str, list[Subject]] = {}
        self._pycache = tempfile.mkdtemp(prefix="simulate-agentic-pycache-")

    def close(self) -> None:
        shutil.rmtree(self._pycache, ignore_errors=True)

    # -- subjects -------------------------------------------------------------------------------

    def targets(self, path: str) -> list[Subject]:
        if path not in self._targets:
            out: list[Subject] = []
            try:
                tree = ast.parse(self.docs[path].text)
            except (SyntaxError, ValueError):
                tree = None
            defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            for node in tree.body if tree else []:
                if isinstance(node, defs):
                    out.append(Subject(f"code:{path}", path, node.name, node.lineno, node.end_lineno or node.lineno))
                if isinstance(node, ast.ClassDef):
                    for m in node.body:
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("__"):
                            out.append(Subject(f"code:{path}", path, f"{node.name}.{m.name}", m.lineno,
                                               m.end_lineno or m.lineno))
            self._targets[path] = out
        return self._targets[path]

    def pick_target(self, rng: random.Random, folder: str | None = None, exclude: str | None = None) -> Subject:
        pool = [p for p in (self.by_folder.get(folder, []) if folder is not None else self.paths) if p != exclude]
        if not pool:
            pool = [p for p in self.paths if p != exclude] or self.paths
        for path in rng.sample(pool, len(pool)):
            targets = self.targets(path)
            if targets:
                return rng.choice(targets)
        if folder is not None:
            return self.pick_target(rng, None, exclude)
        raise RuntimeError("no stdlib file of this split defines a function or class")

    # -- tools ------------------------------------------------------------------------------------

    def trim(self, text: str) -> str:
        """The longest prefix of whole lines within the tool-token budget, with a truncation note."""
        text = text.rstrip("\n")
        if len(encode(self.tokenizer, text)) <= self.tool_tokens:
            return text
        lines = text.split("\n")
        budget = max(1, self.tool_tokens - 16)  # room for the note
        lo, hi = 0, len(lines)
        while lo < hi:  # largest k with the first k lines within budget
            mid = (lo + hi + 1) // 2
            if len(encode(self.tokenizer, "\n".join(lines[:mid]))) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:  # one very long first line: cut it by tokens
            ids = encode(self.tokenizer, lines[0])[:budget]
            head = self.tokenizer.decode(ids)
            return f"{head}\n... [output truncated]"
        return "\n".join(lines[:lo]) + f"\n... [{len(lines) - lo} more lines truncated]"

    def read_file(self, path: str, start: int, end: int) -> tuple[str, str]:
        lines = self.docs[path].text.split("\n")
        start = max(1, min(start, len(lines)))
        end = max(start, min(end, len(lines)))
        self.read.add(f"code:{path}")
        body = "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(start, end + 1))
        call = f'read_file(path="{path}", start={start}, end={end})'
        return call, self.trim(body), [f"code:{path}"]

    def list_dir(self, folder: str) -> tuple[str, str]:
        base = self.root / folder if folder else self.root
        entries = []
        for name in sorted(os.listdir(base)):
            if name == "__pycache__":
                continue
            entries.append(name + "/" if (base / name).is_dir() else name)
        call = f'list_dir(path="{folder or "."}")'
        return call, self.trim("\n".join(entries) if entries else "(empty folder)"), []

    def grep(self, pattern: str, folder: str) -> tuple[str, str]:
        regex = re.compile(r"\b" + re.escape(pattern) + r"\b")
        hits: list[str] = []
        files = [f"code:{path}" for path in self.by_folder.get(folder, [])]
        self.read.update(files)
        for path in self.by_folder.get(folder, []):
            for n, line in enumerate(self.docs[path].text.split("\n"), 1):
                if regex.search(line):
                    hits.append(f"{path}:{n}:{line.strip()[:160]}")
        call = f'grep(pattern="{pattern}", path="{folder or "."}")'
        return call, self.trim("\n".join(hits) if hits else "(no matches)"), files

    def run(self, kind: str, path: str) -> tuple[str, str]:
        """Run a real command on one file of the split (cwd = the stdlib folder) and capture its output."""
        module = path[:-3].replace("/", ".")
        if kind == "pyclbr" and ("." in module or module.endswith("__init__")):
            kind = "tabnanny"  # pyclbr would also read a parent package: keep to this one file
        if kind == "py_compile":
            shown, args = f"python -m py_compile {path}", ["-m", "py_compile", path]
        elif kind == "tabnanny":
            shown, args = f"python -m tabnanny -v {path}", ["-m", "tabnanny", "-v", path]
        elif kind == "pyclbr":
            shown, args = f"python -m pyclbr {module}", ["-m", "pyclbr", module]
        elif kind == "outline":
            shown, args = f'python -c "{OUTLINE_SCRIPT}" {path}', ["-c", OUTLINE_SCRIPT, path]
        else:
            raise ValueError(f"unknown run kind {kind!r}")
        self.read.add(f"code:{path}")
        cmd = [sys.executable, "-I", "-X", f"pycache_prefix={self._pycache}", *args]
        try:
            proc = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, timeout=60,
                                  env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8"})
            output = (proc.stdout + proc.stderr).rstrip("\n")
            status = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            output, status = "", "timed out after 60 s"
        text = f"$ {shown}\n" + (output + "\n" if output else "") + f"[{status}{'' if output else ', no output'}]"
        return f'run(command="{shown[:80]}")', self.trim(text), [f"code:{path}"]
