"""The frozen target head reads only the embedding and lm_head tensors, tied or not, sharded or not."""

import json

import torch

from drafters.target.frozen import FrozenTargetHead
from drafters.target.testbed import prepare_testbed_target, tiny_deepseek_v3_target, tiny_llama_target


def save_sharded_keeping_only_head_shards(model, folder):
    """Save sharded, then delete every shard without the embedding or lm_head: only those may be read."""
    model.save_pretrained(folder, max_shard_size="1MB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map[n] for n in ("model.embed_tokens.weight", "lm_head.weight") if n in weight_map}
    deleted = [f for f in set(weight_map.values()) - needed]
    for name in deleted:
        (folder / name).unlink()
    assert deleted, "the test needs shards that hold other tensors"


@torch.no_grad()
def test_untied_sharded_target_deepseek_v3(tmp_path):
    model = tiny_deepseek_v3_target()
    save_sharded_keeping_only_head_shards(model, tmp_path)
    head = FrozenTargetHead.from_pretrained(tmp_path)
    assert not head.tied
    assert {n for n, _ in head.named_parameters()} == {"embed_tokens.weight", "lm_head.weight"}
    assert all(not p.requires_grad for p in head.parameters())
    assert torch.equal(head.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(head.lm_head.weight, head.embed_tokens.weight)
    ids = torch.tensor([[3, 7, 11]])
    final = model.model(ids).last_hidden_state
    torch.testing.assert_close(head.logits(final), model(ids).logits, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tied_sharded_target_llama(tmp_path):
    model = tiny_llama_target()
    save_sharded_keeping_only_head_shards(model, tmp_path)
    head = FrozenTargetHead.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert head.tied
    assert [n for n, _ in head.named_parameters()] == ["embed_tokens.weight"]  # one tensor for both
    assert head.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(head.embed(torch.tensor([5])).float(), model.model.embed_tokens.weight[5:6].bfloat16().float())


def test_single_file_testbed_target_and_from_model():
    head = FrozenTargetHead.from_pretrained(prepare_testbed_target())
    assert head.tied and (head.vocab_size, head.hidden_size) == (49152, 576)
    assert head.embed_tokens.weight.dtype == torch.bfloat16  # as stored
    model = tiny_deepseek_v3_target()
    shared = FrozenTargetHead.from_model(model)
    assert shared.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()  # no copy
