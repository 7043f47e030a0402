"""Features kept during regeneration equal a separate capture, and the feature cache reuses them.

Real SmolLM2-135M-Instruct target, fp32 (so incremental decoding and one full forward agree to float
rounding), a few prompts of different lengths in one left-padded batch, some stopping early.
"""

import pytest
import torch
from datasets import Dataset, concatenate_datasets

from data.feature_cache import FeatureCacheReader, write_feature_cache
from data.regeneration.regenerate import regenerate
from data.feature_cache.regenerated import RegeneratedFeatures, features_dir, row_key
from drafters.target.capture import HFCapture

LAYERS = [1, 14, 29]  # 29 is the last layer: its id returns the final-norm output
PROMPTS = [
    {"id": "capital", "category": "chat", "source": "test",
     "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "code", "category": "code", "source": "test",
     "messages": [{"role": "user", "content": "Write a Python function that reverses a string, with a docstring."}]},
    {"id": "yes", "category": "chat", "source": "test",
     "messages": [{"role": "user", "content": "Answer with one word: is water wet?"}]},
]


@pytest.fixture(scope="module")
def model(testbed_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(testbed_target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def regenerated(testbed_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen")
    dataset = regenerate(PROMPTS, testbed_target, out, batch_size=3, max_new_tokens=24, dtype="fp32",
                         progress=False, feature_layers=LAYERS)
    return out, dataset


def test_kept_features_equal_a_separate_capture(regenerated, model):
    out, dataset = regenerated
    assert len(set(dataset["finished"])) == 2, "the batch should hold rows that stopped early and rows cut at the limit"
    known = RegeneratedFeatures(features_dir(out, LAYERS))
    assert len(known) == len(dataset)
    capture = HFCapture(model, LAYERS)
    for row in dataset:
        ids = torch.tensor(row["input_ids"])
        kept = known.lookup(ids)
        fresh = capture.capture(ids[None])
        assert kept.selected.shape == fresh.selected[0].shape
        # Every position, the last generated token included (generation never feeds it back itself).
        torch.testing.assert_close(kept.selected, fresh.selected[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept.final_hidden, fresh.final_hidden[0], rtol=1e-4, atol=1e-4)
    assert known.lookup(torch.tensor(dataset[0]["input_ids"][:-1])) is None


def test_feature_cache_runs_the_target_only_on_rows_it_does_not_know(regenerated, model, tmp_path):
    out, dataset = regenerated
    extra = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]})
    mixed = concatenate_datasets([dataset.select_columns(["input_ids"]), extra])
    reusing = HFCapture(model, LAYERS)
    reusing.known_features = RegeneratedFeatures(features_dir(out, LAYERS)).lookup
    reused = write_feature_cache(mixed, reusing, tmp_path / "reused", progress=False, batch_size=4)
    plain = HFCapture(model, LAYERS)
    write_feature_cache(mixed, plain, tmp_path / "plain", progress=False, batch_size=4)

    regenerated_tokens = sum(len(r) for r in dataset["input_ids"])
    assert reusing.tokens_reused == regenerated_tokens
    assert reusing.computed_tokens == 7 + 3
    assert reused.tokens_reused == regenerated_tokens and reused.tokens_captured == 7 + 3
    with FeatureCacheReader(tmp_path / "reused", mixed) as a, FeatureCacheReader(tmp_path / "plain", mixed) as b:
        for i in range(len(mixed)):
            sel_a, fin_a = a.get(i, dtype=torch.float32)
            sel_b, fin_b = b.get(i, dtype=torch.float32)
            torch.testing.assert_close(sel_a, sel_b, rtol=2e-2, atol=2e-2)  # the cache stores bf16
            torch.testing.assert_close(fin_a, fin_b, rtol=2e-2, atol=2e-2)


def test_row_key_depends_on_every_token():
    assert row_key([1, 2, 3]) == row_key(torch.tensor([1, 2, 3]))
    assert row_key([1, 2, 3]) != row_key([1, 2, 4])
    assert row_key([1, 2, 3]) != row_key([1, 2, 3, 0])


def test_greedy_choices_of_regenerated_responses_are_read_not_projected_again(regenerated, model):
    # Training's labels (the target's greedy choice after every position) over a greedily regenerated row:
    # inside the response they are the next tokens the decode steps chose, so only the prompt and the last
    # position go through the lm_head. The result equals projecting every position.
    from configs.schema import load_config
    from data.sources.mixture import greedy_response_spans
    from drafters.target.capture import Captured
    from train.batches import collate
    from train.features import TargetChoices

    out, dataset = regenerated
    known = RegeneratedFeatures(features_dir(out, LAYERS))
    spans = greedy_response_spans(load_config(None).data.mixture, dataset)
    assert spans == [(p - 1, p + g - 1) for p, g in zip(dataset["num_prompt_tokens"], dataset["num_generated"])]
    head = model.lm_head.weight.detach()
    read, projected = TargetChoices(head, 16, next_token_spans=spans), TargetChoices(head, 16)
    for i in range(len(dataset)):
        batch = collate(dataset, [i], 1024, pad_id=0)
        kept = known.lookup(batch.input_ids[0])
        captured = Captured(kept.selected[None], kept.final_hidden[None])
        assert torch.equal(read(batch, captured), projected(batch, captured))
    total = sum(len(ids) for ids in dataset["input_ids"])
    assert projected.projected_positions == total
    assert read.projected_positions == total - sum(dataset["num_generated"])  # the prompt but its last position, and the last
    # A sampled regeneration, a prepared dataset or stage 2 holds text the target did not choose greedily.
    assert greedy_response_spans(load_config(None, ["data.mixture.temperature=0.7"]).data.mixture, dataset) is None
