"""Regeneration with the real SmolLM2-135M-Instruct target (tiny budgets: a few prompts x 8 new tokens)."""

import json
from dataclasses import dataclass, field

import pytest
import torch

from data.regeneration.regenerate import (
    DATASET_DIR, QUARANTINE_FILE, SUMMARY_FILE, WORK_DIR, RegenerationInterrupted, dataset_schema, load_regenerated,
    read_quarantine, regenerate,
)

NEW = 8
EOS = 2  # <|im_end|>


@dataclass
class Prompt:
    id: str
    category: str
    messages: list = field(default_factory=list)
    source: str = "test"


PROMPTS = [
    Prompt("capital", "chat", [{"role": "user", "content": "What is the capital of France?"}]),
    Prompt("code", "code", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
    {"id": "prose", "category": "prose", "source": "test", "messages": [
        {"role": "user", "content": "Explain photosynthesis in two sentences to a child who likes plants."}]},
    # Multi-turn prompt whose trailing assistant turn is the response to replace.
    Prompt("multi", "chat", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                             {"role": "user", "content": "Name three colors."},
                             {"role": "assistant", "content": "an old answer from another model"}]),
    Prompt("too-long", "prose", [{"role": "user", "content": "word " * 300}]),
    Prompt("no-user", "chat", [{"role": "system", "content": "Only a system message."}]),
]
VALID_IDS = ["capital", "code", "prose", "multi"]
MAX_PROMPT = 128


@pytest.fixture(scope="module")
def target(testbed_target):
    return testbed_target


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


@pytest.fixture(scope="module")
def fp32_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32")
    ds = regenerate(PROMPTS, target, out, batch_size=4, max_new_tokens=NEW, max_prompt_tokens=MAX_PROMPT,
                    dtype="fp32", progress=False)
    return out, ds


def _prompt_messages(p):
    messages = p["messages"] if isinstance(p, dict) else p.messages
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return messages


def _unbatched_greedy(model, ids):
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=EOS)
    gen = out[0, len(ids):].tolist()
    return gen[: gen.index(EOS) + 1] if EOS in gen else gen


def _check_rows_against_unbatched(ds, target, tokenizer, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).eval()
    by_id = {p["id"] if isinstance(p, dict) else p.id: p for p in PROMPTS}
    for row in ds:
        prompt = tokenizer.apply_chat_template(_prompt_messages(by_id[row["prompt_id"]]), add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        n = row["num_prompt_tokens"]
        assert row["input_ids"][:n] == list(prompt) and n == len(prompt)
        generated = row["input_ids"][n:]
        assert len(generated) == row["num_generated"] >= 1
        assert row["loss_mask"] == [0] * n + [1] * row["num_generated"]
        assert generated == _unbatched_greedy(model, list(prompt)), row["prompt_id"]
        assert row["finished"] == (generated[-1] == EOS)
        assert EOS not in generated[:-1]
        if not row["finished"]:
            assert row["num_generated"] == NEW


def test_batched_fp32_equals_unbatched_greedy_and_quarantine(fp32_run, target, tokenizer):
    out, ds = fp32_run
    assert ds.features == dataset_schema()
    assert ds["prompt_id"] == VALID_IDS  # input order, not generation (length-sorted) order
    assert ds["category"] == ["chat", "code", "prose", "chat"] and set(ds["source"]) == {"test"}
    _check_rows_against_unbatched(ds, target, tokenizer, torch.float32)
    # "The capital of France is Paris.<|im_end|>" is exactly 8 tokens: EOS on the last allowed step.
    capital = ds[0]
    assert capital["finished"] and capital["num_generated"] == NEW
    assert tokenizer.decode(capital["input_ids"][-NEW:]) == "The capital of France is Paris.<|im_end|>"
    assert not all(ds["finished"])  # the others hit max_new_tokens and are kept, marked unfinished
    # The multi-turn prompt kept its earlier turns but not the stale trailing answer.
    multi = tokenizer.decode(ds[3]["input_ids"])
    assert "Hello!<|im_end|>" in multi and "an old answer" not in multi
    # Quarantine: recorded with reasons, counted, never silently dropped.
    q = {r["prompt_id"]: r for r in read_quarantine(out)}
    assert set(q) == {"too-long", "no-user"}
    assert q["too-long"]["reason"] == "prompt_too_long" and q["too-long"]["num_prompt_tokens"] > MAX_PROMPT
    assert q["too-long"]["limit"] == MAX_PROMPT and q["no-user"]["reason"] == "no_user_turn"
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["prompts"] == 6 and summary["regenerated"] == 4 and summary["quarantined"] == 2
    assert summary["quarantine_reasons"] == {"no_user_turn": 1, "prompt_too_long": 1}
    assert summary["response_tokens"] == sum(ds["num_generated"])
    assert load_regenerated(out).to_dict() == ds.to_dict()


def test_bf16_batch_of_one_equals_unbatched_greedy(target, tokenizer, tmp_path):
    # In bf16, batched left-padded generation may legitimately differ from unbatched at near-ties, so
    # bf16 equality is checked with batch_size=1; fp32 batched equality is checked above.
    ds = regenerate(PROMPTS, target, tmp_path, batch_size=1, max_new_tokens=NEW, max_prompt_tokens=MAX_PROMPT, dtype="bf16",
                    progress=False)
    assert ds["prompt_id"] == VALID_IDS
    _check_rows_against_unbatched(ds, target, tokenizer, torch.bfloat16)


def test_interrupted_run_resumes_to_identical_dataset(target, tmp_path):
    kwargs = dict(batch_size=2, max_new_tokens=NEW, max_prompt_tokens=MAX_PROMPT, progress=False)
    full = regenerate(PROMPTS, target, tmp_path / "a", **kwargs)
    b = tmp_path / "b"
    with pytest.raises(RegenerationInterrupted) as info:
        regenerate(PROMPTS, target, b, max_batches=1, **kwargs)
    assert info.value.done == 2 and info.value.remaining == 2
    shards = sorted((b / WORK_DIR).glob("shard-*.parquet"))
    assert len(shards) == 1 and not (b / DATASET_DIR).exists()
    # A crash can leave a lock behind: one whose process is gone is taken over.
    (b / WORK_DIR / ".lock").write_text("999999999")
    resumed = regenerate(PROMPTS, target, b, **kwargs)
    summary = json.loads((b / SUMMARY_FILE).read_text())
    assert summary["this_call"]["new_batches"] == 1  # only the missing batch was generated
    assert resumed.to_dict() == full.to_dict()
    assert sorted(resumed["prompt_id"]) == sorted(VALID_IDS)
    assert shards[0].read_bytes() == sorted((b / WORK_DIR).glob("shard-*.parquet"))[0].read_bytes()
    # Quarantine is rewritten, not appended to, on resume.
    assert len((b / QUARANTINE_FILE).read_text().splitlines()) == 2


def test_subset_then_full_skips_done_prompts(fp32_run, target, tmp_path):
    _, reference = fp32_run
    kwargs = dict(batch_size=4, max_new_tokens=NEW, max_prompt_tokens=MAX_PROMPT, dtype="fp32", progress=False)
    first = regenerate(PROMPTS[:2], target, tmp_path, **kwargs)
    assert first["prompt_id"] == ["capital", "code"]
    full = regenerate(PROMPTS, target, tmp_path, **kwargs)
    assert json.loads((tmp_path / SUMMARY_FILE).read_text())["this_call"]["new_batches"] == 1
    assert full["prompt_id"] == VALID_IDS  # no duplicates, none missing
    assert full.to_dict() == reference.to_dict()
    # Changing generation settings on an existing work folder is refused instead of mixing data.
    with pytest.raises(ValueError, match="other settings"):
        regenerate(PROMPTS, target, tmp_path, **{**kwargs, "max_new_tokens": NEW + 1})


def test_sampling_is_seeded(target, tmp_path):
    kwargs = dict(batch_size=4, max_new_tokens=NEW, max_prompt_tokens=MAX_PROMPT, temperature=1.0, progress=False)
    a = regenerate(PROMPTS, target, tmp_path / "a", seed=0, **kwargs)
    b = regenerate(PROMPTS, target, tmp_path / "b", seed=0, **kwargs)
    c = regenerate(PROMPTS, target, tmp_path / "c", seed=1, **kwargs)
    assert a.to_dict() == b.to_dict()
    assert a["input_ids"] != c["input_ids"]
    for row in c:
        n = row["num_prompt_tokens"]
        assert row["loss_mask"] == [0] * n + [1] * row["num_generated"]
        assert row["finished"] == (row["input_ids"][-1] == EOS)


def test_duplicate_prompt_ids_are_rejected(target, tmp_path):
    with pytest.raises(ValueError, match="duplicate prompt id"):
        regenerate([PROMPTS[0], PROMPTS[0]], target, tmp_path, max_new_tokens=NEW, progress=False)
