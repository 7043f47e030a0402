"""Hook capture equals HF's output_hidden_states, on Llama, DeepSeek-V3 and Kimi-shaped tiny targets."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from drafters.target.capture import HFCapture, make_capture
from drafters.target.testbed import save_tiny_target, tiny_deepseek_v3_target, tiny_kimi_target, tiny_llama_target

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32; batching the same ops differently (cache vs one pass)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3", "kimi"])
def target(request):
    build = {"llama": tiny_llama_target, "deepseek_v3": tiny_deepseek_v3_target, "kimi": tiny_kimi_target}
    return build[request.param]()


def ids_for(model, shape=(2, 12), seed=0):
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_selected_layers_are_hidden_states_i_plus_1_and_final_gives_logits(target):
    num_layers = target.config.num_hidden_layers
    layer_ids = [0, 2, num_layers - 2, num_layers - 1]  # the last id maps to HF's normed hidden_states[L]
    capture = HFCapture(target, layer_ids)
    ids = ids_for(target)
    got = capture.capture(ids)
    reference = target(ids, output_hidden_states=True)
    expected = torch.cat([reference.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert got.selected.shape == (2, 12, len(layer_ids) * target.config.hidden_size)
    torch.testing.assert_close(got.selected, expected, **TOL)
    # The final hidden state is the one the target's logits come from.
    torch.testing.assert_close(target.lm_head(got.final_hidden), reference.logits, **TOL)
    # Off by one would be caught: the neighbouring hidden state differs.
    assert not torch.allclose(got.selected[..., : target.config.hidden_size], reference.hidden_states[0], atol=1e-3)
    capture.remove()


@torch.no_grad()
def test_hooks_are_inert_outside_capture_and_removable(target):
    ids = ids_for(target, (1, 8))
    before = target(ids).logits
    hooks = lambda: sum(len(m._forward_hooks) for m in target.modules())  # noqa: E731
    count = hooks()  # transformers may keep its own output recorders
    capture = HFCapture(target, [1, 3])
    assert hooks() == count + 3  # two layers and the final norm
    capture.capture(ids)
    torch.testing.assert_close(target(ids).logits, before, atol=0, rtol=0)
    capture.remove()
    assert hooks() == count


@torch.no_grad()
def test_cache_continues_a_shared_prefix(target):
    capture = HFCapture(target, [1, 4])
    ids = ids_for(target, (1, 14), seed=1)
    full = capture.capture(ids)
    first, cache = capture.capture_with_cache(ids[:, :9])
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 9
    rest = capture.capture(ids[:, 9:], past_key_values=cache)
    assert cache.get_seq_length() == 14
    torch.testing.assert_close(torch.cat([first.selected, rest.selected], 1), full.selected, **TOL)
    torch.testing.assert_close(torch.cat([first.final_hidden, rest.final_hidden], 1), full.final_hidden, **TOL)
    capture.remove()


@torch.no_grad()
def test_stop_after_last_needed_layer_and_padding():
    target = tiny_llama_target()
    capture = HFCapture(target, [1, 3])
    calls = []
    probe = target.model.layers[5].register_forward_hook(lambda *a: calls.append(1))
    ids = ids_for(target)
    early = capture.capture(ids, with_final=False)
    assert calls == [] and early.final_hidden is None  # layers after 3 never ran
    torch.testing.assert_close(early.selected, capture.capture(ids).selected, atol=0, rtol=0)
    assert calls == [1]
    probe.remove()
    # Right padding: the valid positions of a padded row equal the unpadded sequence's.
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    padded = capture.capture(ids, attention_mask=mask)
    alone = capture.capture(ids[1:, :8])
    torch.testing.assert_close(padded.selected[1:, :8], alone.selected, **TOL)
    capture.remove()


@torch.no_grad()
def test_device_map_target_with_offloaded_layers(tmp_path):
    folder = save_tiny_target("deepseek_v3", tmp_path / "ds")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": ("disk" if i in (2, 4) else "cpu") for i in range(6)})
    dispatched = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=str(tmp_path / "off"),
                                                      dtype=torch.float32).eval()
    assert hasattr(dispatched.model.layers[2], "_hf_hook")  # accelerate really dispatches this layer
    reference = tiny_deepseek_v3_target()
    ids = ids_for(reference)
    got = make_capture("hf", dispatched, [0, 2, 4], output_device="cpu").capture(ids)
    hidden = reference(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got.selected, torch.cat([hidden[1], hidden[3], hidden[5]], -1), **TOL)
    assert got.selected.device.type == "cpu"


def test_bad_layer_ids_and_unknown_backend():
    target = tiny_llama_target()
    with pytest.raises(ValueError, match=r"\[8\].*8 layers"):
        HFCapture(target, [1, 8])
    for backend in ("sglang", "vllm"):  # no in-process capture; the config routes these elsewhere or refuses them
        with pytest.raises(ValueError, match="unknown feature backend"):
            make_capture(backend)
