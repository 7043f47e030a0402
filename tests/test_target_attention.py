"""Grouped-query SDPA for a target on the CPU (drafters/target/attention.py): the same numbers as transformers'
`sdpa`, which repeats the key/value heads under a padding mask, on real targets and left-padded batches."""

import pytest
import torch

from drafters.target.chat import load_tokenizer, prompt_ids
from engines.hf.generation import BatchGenerator
from drafters.target.attention import ATTENTION
from drafters.target.loading import load_target_model

PROMPTS = [[1, 9690, 198, 2683, 314, 253, 5356, 17599, 30, 2], [1, 4093, 198, 504], [1, 4093, 198, 21131, 282, 1029, 314]]


def _padded(prompts, pad_id=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture
def grouped_masked_calls(monkeypatch):
    """Counts torch SDPA calls that got a padding mask and enable_gqa=True: proof the grouped branch ran."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        if kwargs.get("enable_gqa") and kwargs.get("attn_mask") is not None:
            calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def _pair(folder, **kwargs):
    grouped = load_target_model(folder, dtype=torch.float32, **kwargs)
    library = load_target_model(folder, dtype=torch.float32, **kwargs)
    library.set_attn_implementation("sdpa")
    return grouped, library


def test_cpu_target_attends_grouped_with_the_library_numbers(testbed_target, grouped_masked_calls):
    grouped, library = _pair(testbed_target)
    assert grouped.config._attn_implementation == ATTENTION
    assert grouped.config.num_key_value_heads < grouped.config.num_attention_heads  # SmolLM2: 3 for 9
    ids, mask = _padded(PROMPTS)
    with torch.inference_mode():
        expected = library(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        assert grouped_masked_calls == []  # the library repeats the key/value heads under a mask
        torch.testing.assert_close(grouped(input_ids=ids, attention_mask=mask).logits[mask.bool()], expected,
                                   rtol=0, atol=1e-5)
    assert len(grouped_masked_calls) == grouped.config.num_hidden_layers
    tokenizer = load_tokenizer(testbed_target)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in
               ("Write a Python function that merges two sorted lists.", "Why is the sky blue?", "Hi")]
    new_tokens = [BatchGenerator(model, tokenizer, 0.0, 0).generate(prompts, 48, ["a", "b", "c"])
                  for model in (grouped, library)]
    assert new_tokens[0] == new_tokens[1]
    assert len({len(p) for p in prompts}) == 3 and max(map(len, new_tokens[0])) == 48


@pytest.mark.parametrize("kind, grouped_branch", [("llama", True), ("deepseek_v3", False)])
def test_tiny_targets_with_the_library_numbers(kind, grouped_branch, tmp_path, grouped_masked_calls):
    """Two key/value heads for four query heads (Llama: the grouped branch); MLA's keys and values already have a
    head per query head, so DeepSeek-V3 is handed to the library's own path."""
    from drafters.target.testbed import save_tiny_target

    grouped, library = _pair(save_tiny_target(kind, tmp_path / kind))
    assert grouped.config._attn_implementation == ATTENTION
    ids, mask = _padded(PROMPTS)
    with torch.inference_mode():
        expected = library(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        torch.testing.assert_close(grouped(input_ids=ids, attention_mask=mask).logits[mask.bool()], expected,
                                   rtol=0, atol=1e-5)
    assert len(grouped_masked_calls) == (grouped.config.num_hidden_layers if grouped_branch else 0)


def test_batched_decoding_step_takes_grouped_matmuls_with_the_library_numbers(testbed_target, grouped_masked_calls):
    """One query per sequence under a padding mask (regeneration's decode steps) skips torch's kernel: the same
    logits as the library's attention, on a left-padded batch after a prefill."""
    from transformers import DynamicCache

    grouped, library = _pair(testbed_target)
    ids, mask = _padded(PROMPTS)
    step_mask = torch.cat([mask, torch.ones(len(PROMPTS), 1, dtype=mask.dtype)], 1)
    next_ids = torch.tensor([[504], [198], [30]])
    logits = {}
    with torch.inference_mode():
        for name, model in (("library", library), ("grouped", grouped)):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            calls_after_prefill = len(grouped_masked_calls)
            logits[name] = model(input_ids=next_ids, attention_mask=step_mask, past_key_values=cache, use_cache=True,
                                 position_ids=step_mask.sum(1, keepdim=True) - 1).logits
            assert len(grouped_masked_calls) == calls_after_prefill  # the decode step called no masked SDPA
    assert calls_after_prefill == grouped.config.num_hidden_layers  # the grouped model's prefill did
    # fp32 sums in another order: logits of about 20 agree to 1e-4
    torch.testing.assert_close(logits["grouped"], logits["library"], rtol=0, atol=1e-4)


def test_decoding_cache_keeps_fp32_keys_in_buffers_with_the_library_cache_numbers(testbed_target):
    """Batched generation's cache (regeneration, the simulator): a bf16 target's keys kept in fp32, keys and values
    written into buffers, a buffer too small grown. Converting bf16 keys to fp32 is exact, so the logits of a prefill
    and of each decode step are the library cache's, bit for bit."""
    from transformers import DynamicCache

    from drafters.target.attention import decoding_cache

    model = load_target_model(testbed_target, dtype=torch.bfloat16)
    ids, mask = _padded(PROMPTS)
    steps = [torch.tensor([[504], [198], [30]]), torch.tensor([[30], [504], [198]])]
    logits = {}
    with torch.inference_mode():
        for name, cache in (("library", DynamicCache(config=model.config)),
                            ("buffered", decoding_cache(model, mask, capacity=ids.shape[1] + 1))):
            logits[name] = [model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits]
            step_mask = mask
            for next_ids in steps:
                step_mask = torch.cat([step_mask, torch.ones(len(PROMPTS), 1, dtype=mask.dtype)], 1)
                logits[name].append(model(input_ids=next_ids, attention_mask=step_mask, past_key_values=cache,
                                          use_cache=True, position_ids=step_mask.sum(1, keepdim=True) - 1).logits)
            if name == "buffered":
                layer = cache.layers[0]
                assert layer.keys.dtype == torch.float32 and layer.values.dtype == torch.bfloat16
                assert layer.keys.shape[2] == ids.shape[1] + len(steps)
                assert layer.key_buffer.shape[2] == 2 * (ids.shape[1] + 1)  # the second step grew it
    for buffered, library in zip(logits["buffered"], logits["library"]):
        assert torch.equal(buffered, library)


def test_batched_generation_uses_the_decoding_cache_and_projects_a_contiguous_last_row(testbed_target, monkeypatch):
    """A padded batch generates through the decoding cache, with the library cache's tokens; an unpadded one (a batch
    of one in regeneration) keeps the library's cache and torch's kernel, the eval's numbers. The prefill hands the
    vocabulary projection its last positions contiguous (a strided slice makes torch copy the whole head once per
    sequence)."""
    from drafters.target.attention import BufferedLayer

    updates, contiguous = [], []  # cache updates; whether each head input was contiguous
    update = BufferedLayer.update
    monkeypatch.setattr(BufferedLayer, "update", lambda self, *a, **k: updates.append(1) or update(self, *a, **k))
    model = load_target_model(testbed_target, dtype=torch.bfloat16)
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: contiguous.append(args[0].is_contiguous()))
    tokenizer = load_tokenizer(testbed_target)

    def prompts(*texts):
        return [prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]

    padded = prompts("Write a Python function that merges two sorted lists.", "Why is the sky blue?", "Hi")
    unpadded = prompts("Name a color.", "Name a fruit.")
    assert len({len(p) for p in unpadded}) == 1
    for batch in (padded, unpadded):
        keys = [str(i) for i in range(len(batch))]
        updates.clear()
        buffered = BatchGenerator(model, tokenizer, 0.0, 0).generate(batch, 24, keys)
        assert bool(updates) == (batch is padded)
        library = BatchGenerator(model, tokenizer, 0.0, 0, buffered_cache=False).generate(batch, 24, keys)
        assert library == buffered
    assert contiguous and all(contiguous)


def test_decoding_cache_only_for_grouped_heads_with_plain_keys(tmp_path):
    """MLA (DeepSeek-V3, Kimi K2) caches a latent that its bf16 projection reads back, and a head per query head
    never takes the one-query path: both keep the library's cache, and batched generation in bf16 runs."""
    from drafters.target.attention import decoding_cache
    from drafters.target.testbed import save_tiny_target

    ids, mask = _padded([[1, 5, 7], [1, 9]])
    for kind, buffered in (("llama", True), ("deepseek_v3", False)):
        model = load_target_model(save_tiny_target(kind, tmp_path / kind), dtype=torch.bfloat16)
        cache = decoding_cache(model, mask, ids.shape[1] + 4)
        assert (cache is not None) == buffered
        assert decoding_cache(model, torch.ones_like(mask), ids.shape[1] + 4) is None  # no padding: the library's
        with torch.inference_mode():
            tokens = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                     pad_token_id=0, **({"past_key_values": c} if c is not None else {}))
                      for c in (cache, None)]
        assert tokens[0].shape == (2, ids.shape[1] + 4) and torch.equal(tokens[0], tokens[1])
