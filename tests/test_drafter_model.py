"""The DFlash drafter's mask, labels and cache semantics, on a small random drafter (fp32, CPU)."""

import pytest
import torch
from transformers import LlamaConfig

from configs.schema import DrafterConfig
from drafters.drafter.blocks import BlockAttention, block_input_ids, block_positions, sample_anchors, training_attention_mask
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter, DraftCache
from drafters.drafter.objective import block_targets

H, K, B, VOCAB, MASK = 64, 3, 4, 300, 299
TOL = 1e-5  # fp32: the training and inference paths run the same ops in a different batching


def tiny_target_config():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    cfg = build_draft_config(DrafterConfig(num_layers=2, block_size=B, num_target_features=K), tiny_target_config(), MASK)
    drafter = DFlashDrafter(cfg).eval()
    embed = torch.nn.Embedding(VOCAB, H)
    embed.requires_grad_(False)
    # Larger weights than the default init, so that every path visibly moves the output.
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return drafter, embed


def inputs(bsz=2, t=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(bsz, t, K * H, generator=g)
    ids = torch.randint(0, VOCAB - 1, (bsz, t), generator=g)
    return feats, ids


def single_block(drafter, embed, feats, ids, a):
    """Inference-style draft of the block at anchor a, context = features[:a], fresh cache."""
    block = block_input_ids(ids[None], torch.tensor([[a]]), B, MASK)[0]
    return drafter.step(feats[None, :a], embed(block), a, DraftCache())[0]


@pytest.mark.parametrize("group_blocks", [3, 16])
@torch.no_grad()
def test_training_forward_equals_separate_inference_forwards(parts, group_blocks):
    drafter, embed = parts
    feats, ids = inputs()
    # Any order, duplicates, first and last; one group of blocks or several (drafters.drafter.blocks.BlockAttention).
    anchors = torch.tensor([[0, 5, 23, 5, 11, 2, 19, 8, 14, 3, 22], [17, 1, 2, 20, 9, 9, 4, 12, 6, 23, 0]])
    drafter.attention_group_blocks = group_blocks
    try:
        out = drafter(feats, ids, anchors, embed)
    finally:
        del drafter.attention_group_blocks  # back to the class default for the other tests
    assert out.shape == (2, 11, B, H)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            expected = single_block(drafter, embed, feats[b], ids[b], a)
            torch.testing.assert_close(out[b, n], expected, atol=TOL, rtol=TOL)


@torch.no_grad()
def test_block_sees_context_strictly_before_its_anchor(parts):
    drafter, embed = parts
    feats, ids = inputs(bsz=1)
    a, later = 10, 20  # the later anchor keeps positions >= a inside the computed context
    anchors = torch.tensor([[a, later]])
    base = drafter(feats, ids, anchors, embed)
    for pos in (a, a + 1, 15):
        changed = feats.clone()
        changed[0, pos] += 5.0
        out = drafter(changed, ids, anchors, embed)
        torch.testing.assert_close(out[0, 0], base[0, 0], atol=1e-6, rtol=0)  # invisible to block a
        assert (out[0, 1] - base[0, 1]).abs().max() > 1e-3  # visible to the later block
    changed = feats.clone()
    changed[0, a - 1] += 5.0
    out = drafter(changed, ids, anchors, embed)
    assert (out[0, 0] - base[0, 0]).abs().max() > 1e-3, "block a must see the feature at a - 1"


@torch.no_grad()
def test_blocks_are_independent_and_bidirectional_inside(parts):
    drafter, embed = parts
    feats, ids = inputs(bsz=1)
    anchors = torch.tensor([[6, 12, 18]])
    base = drafter(feats, ids, anchors, embed)
    changed = ids.clone()
    changed[0, 12] = (ids[0, 12] + 1) % (VOCAB - 1)  # the anchor token of block 1 only
    out = drafter(feats, changed, anchors, embed)
    torch.testing.assert_close(out[0, [0, 2]], base[0, [0, 2]], atol=1e-6, rtol=0)
    assert ((out[0, 1] - base[0, 1]).abs().amax(-1) > 1e-3).all(), "every slot of block 1 sees its anchor"

    # Inside a block attention is bidirectional: slot 0 sees the last slot.
    block = embed(block_input_ids(ids, torch.tensor([[6]]), B, MASK)[:, 0])
    h0 = drafter.step(feats[:, :6], block, 6, DraftCache())
    block[0, -1] += 1.0
    h1 = drafter.step(feats[:, :6], block, 6, DraftCache())
    assert (h1[0, 0] - h0[0, 0]).abs().max() > 1e-3


def test_mask_matches_the_dflash_rule():
    anchors = torch.tensor([[3, 1]])
    mask = training_attention_mask(anchors, context_len=4, block_size=2)[0, 0]
    expected = torch.tensor([
        # ctx 0 1 2 3 | blk0 blk0 blk1 blk1
        [1, 1, 1, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 1],
        [1, 0, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("group_blocks", [1, 3, 8, 64])
def test_grouped_block_attention_equals_one_masked_attention(group_blocks):
    """Groups of blocks give the output and gradients of one SDPA over [context ; all blocks] with the full mask,
    for anchors in any order, with duplicates, at the sequence's ends and padding anchors (0)."""
    g = torch.Generator().manual_seed(3)
    bsz, heads, kv, d, ctx, n = 2, 4, 2, 8, 30, 13
    anchors = torch.randint(0, ctx + 1, (bsz, n), generator=g)
    anchors[0, :4] = torch.tensor([0, ctx, 7, 7])
    q = torch.randn(bsz, heads, n * B, d, generator=g, requires_grad=True)
    context_k, context_v, block_k, block_v = (torch.randn(bsz, kv, length, d, generator=g, requires_grad=True)
                                              for length in (ctx, ctx, n * B, n * B))
    inputs = (q, context_k, context_v, block_k, block_v)
    grouped = BlockAttention(anchors, ctx, B, group_blocks)(*inputs, enable_gqa=True)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([context_k, block_k], 2), torch.cat([context_v, block_v], 2),
        attn_mask=training_attention_mask(anchors, ctx, B), enable_gqa=True)
    torch.testing.assert_close(grouped, dense, atol=TOL, rtol=TOL)
    weights = torch.randn(dense.shape, generator=g)
    grads = [torch.autograd.grad((out * weights).sum(), inputs) for out in (grouped, dense)]
    for grouped_grad, dense_grad in zip(*grads):
        torch.testing.assert_close(grouped_grad, dense_grad, atol=TOL, rtol=TOL)


def test_block_ids_positions_and_same_position_labels():
    ids = torch.arange(100, 120)[None]
    anchors = torch.tensor([[3, 17]])
    blocks = block_input_ids(ids, anchors, B, MASK)
    assert blocks.tolist() == [[[103, MASK, MASK, MASK], [117, MASK, MASK, MASK]]]
    positions = block_positions(anchors, B)
    assert positions.tolist() == [[[3, 4, 5, 6], [17, 18, 19, 20]]]
    # The loss module's labels line up with the positions the model uses: slot k -> token a + k,
    # slot 0 has no label, positions past the sequence are not supervised.
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    targets = block_targets(anchors, torch.ones_like(anchors, dtype=torch.bool), loss_mask, B)
    assert torch.equal(targets.positions[0, 0], positions[0, 0, 1:])
    assert targets.valid[0, 1].tolist() == [True, True, False]  # 18, 19 inside; 20 past T = 20
    assert ids[0, targets.positions[0, 0]].tolist() == [104, 105, 106]


def test_sample_anchors_respects_the_loss_mask():
    loss_mask = torch.zeros(2, 30, dtype=torch.bool)
    loss_mask[0, 10:25] = True
    loss_mask[1, 28:] = True  # only position 28 is eligible (needs t and t + 1)
    anchors, valid = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (2, 8)
    row = anchors[0][valid[0]].tolist()
    assert len(row) == 8 and len(set(row)) == 8 and row == sorted(row)
    assert all(10 <= a <= 23 for a in row)
    assert anchors[1][valid[1]].tolist() == [28] and valid[1].sum() == 1


@torch.no_grad()
def test_inference_cache_holds_context_only(parts):
    drafter, embed = parts
    feats, ids = inputs(bsz=1)
    cache = DraftCache()
    drafter.step(feats[:, :5], embed(block_input_ids(ids, torch.tensor([[5]]), B, MASK)[:, 0]), 5, cache)
    assert cache.length == 5  # the block's K/V were not kept
    block = embed(block_input_ids(ids, torch.tensor([[9]]), B, MASK)[:, 0])
    incremental = drafter.step(feats[:, 5:9], block, 9, cache)
    assert cache.length == 9
    one_shot = drafter.step(feats[:, :9], block, 9, DraftCache())
    torch.testing.assert_close(incremental, one_shot, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="9 \\+ 2"):
        drafter.step(feats[:, 9:11], block, 12, cache)


@torch.no_grad()
def test_windowed_cache_forgets_and_matches_a_fresh_step():
    """Window 7 (block 4): a decode that commits 3 tokens a step for 40 steps drops the positions no query sees
    (the buffers stay small) and every step equals a fresh step over the whole context."""
    torch.manual_seed(0)
    cfg = build_draft_config(DrafterConfig(num_layers=2, block_size=B, num_target_features=K, sliding_window=7),
                             tiny_target_config(), MASK)
    drafter = DFlashDrafter(cfg).eval()
    embed = torch.nn.Embedding(VOCAB, H)
    feats, ids = inputs(bsz=1, t=130)
    cache = DraftCache()
    start = 5
    drafter.step(feats[:, :start], embed(block_input_ids(ids, torch.tensor([[start]]), B, MASK)[:, 0]), start, cache)
    for _ in range(40):
        block = embed(block_input_ids(ids, torch.tensor([[start + 3]]), B, MASK)[:, 0])
        incremental = drafter.step(feats[:, start:start + 3], block, start + 3, cache)
        start += 3
        fresh = drafter.step(feats[:, :start], block, start, DraftCache())
        torch.testing.assert_close(incremental, fresh, atol=TOL, rtol=TOL)
    assert cache.length == start and cache.first == start - 7 + 1
    assert cache.keys[0].shape[2] <= 64 and cache.base > 0  # forgotten positions were reclaimed
    with pytest.raises(ValueError, match="forgotten"):
        cache.crop(cache.first - 1)


def test_training_forward_backward_and_bf16(parts):
    drafter, embed = parts
    feats, ids = inputs()
    anchors = torch.tensor([[2, 9], [4, 15]])
    out = drafter(feats, ids, anchors, embed)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["fc.weight"].abs().sum() > 0 and grads["layers.0.self_attn.k_norm.weight"].abs().sum() > 0
    drafter.zero_grad(set_to_none=True)
    bf16 = DFlashDrafter(drafter.config)
    bf16.load_state_dict(drafter.state_dict())
    bf16.to(torch.bfloat16)
    assert bf16._rotary.inv_freq.dtype == torch.float32  # RoPE frequencies are not rounded
    with torch.no_grad():
        low = bf16(feats.bfloat16(), ids, anchors, lambda x: embed(x).bfloat16())
        high = drafter(feats, ids, anchors, embed)
    assert low.dtype == torch.bfloat16
    assert (low.float() - high).abs().max() < 0.1 * high.abs().max()


@pytest.mark.parametrize("copy_query", ["anchor", "slot"])
@torch.no_grad()
def test_copy_attention_is_the_layers_own_attention(parts, copy_query):
    """copy_logp equals softmax(q k / sqrt(d)) of one block drafted alone, over [context < a ; its own block]:
    slot 0 in the first layer ("anchor"), slot m + 1 in the last layer ("slot")."""
    import math

    from drafters.drafter.model import apply_rope

    drafter, embed = parts
    feats, ids = inputs()
    anchors = torch.tensor([[3, 11, 20, 5, 17, 8, 1, 22, 14, 9], [20, 1, 9, 9, 15, 3, 23, 6, 12, 18]])
    hidden, copy_logp = drafter(feats, ids, anchors, embed, copy_heads=2, copy_query=copy_query)
    torch.testing.assert_close(hidden, drafter(feats, ids, anchors, embed), atol=TOL, rtol=TOL)
    heads = drafter.copy_head_ids(2)
    group = drafter.layers[0].self_attn.n_heads // drafter.layers[0].self_attn.n_kv_heads
    assert heads == [0, group]  # one head per key/value group first
    slots = [0, 0] if copy_query == "anchor" else [1, 2]
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            context = drafter.fuse(feats[b : b + 1, :a])
            x = embed(block_input_ids(ids[b : b + 1], torch.tensor([[a]]), B, MASK)[0])
            ctx_rope = drafter._rope(context, torch.arange(a)[None])
            blk_rope = drafter._rope(x, torch.arange(a, a + B)[None])
            layers = list(drafter.layers)
            for layer in layers[: 0 if copy_query == "anchor" else -1]:
                x = layer(x, blk_rope, *layer.self_attn.keys_values(context, ctx_rope))
            layer = layers[0 if copy_query == "anchor" else -1]
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q = apply_rope(attn.q_norm(attn._heads(attn.q_proj(h), attn.n_heads)).transpose(1, 2), *blk_rope)
            k = torch.cat([attn.keys_values(context, ctx_rope)[0], attn.keys_values(h, blk_rope)[0]], 2)
            k = k.repeat_interleave(group, 1)
            probs = torch.softmax(q[0] @ k[0].transpose(-1, -2) / math.sqrt(attn.head_dim), -1)  # [heads, B, a + B]
            for m, (head, slot) in enumerate(zip(heads, slots)):
                torch.testing.assert_close(copy_logp[b, n, m, :a].exp(), probs[head, slot, :a], atol=TOL, rtol=TOL)
            assert torch.isneginf(copy_logp[b, n, :, a:]).all()  # context at or after the anchor is not visible


def test_copy_sources_mark_earlier_occurrences_whose_continuation_is_right():
    from drafters.drafter.objective import copy_loss, copy_sources

    #          0  1  2  3  4  5  6  7  8  9 10 11
    ids = torch.tensor([[5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 0]])
    attention = torch.ones_like(ids)
    attention[0, 11] = 0  # padding
    anchors, valid = torch.tensor([[8, 4, 10]]), torch.tensor([[True, True, True]])
    src = copy_sources(ids, attention, anchors, valid, num_offsets=2, context_len=11)
    # Anchor 8 (token 5) continues 6, 7: offset 1 copies from 1 and 5 (5 -> 6), offset 2 only from 2 (5 6 -> 7).
    assert src[0, 0, 0].nonzero().flatten().tolist() == [1, 5]
    assert src[0, 0, 1].nonzero().flatten().tolist() == [2]
    # Anchor 4 (token 5) continues 6, 8: offset 1 from 1; offset 2 has no earlier 8.
    assert src[0, 1, 0].nonzero().flatten().tolist() == [1]
    assert not src[0, 1, 1].any()
    # Anchor 10: offset 2 lands on padding, and no earlier 7 is followed by 0.
    assert not src[0, 2].any()
    logp = torch.full((1, 3, 2, 11), -100.0)
    logp[0, 0, 0, 1] = logp[0, 0, 0, 5] = torch.tensor(0.25).log()
    logp[0, 0, 1, 2] = torch.tensor(0.5).log()
    logp[0, 1, 0, 1] = torch.tensor(0.1).log()
    out = copy_loss(logp, src)
    assert out.lookups == 3
    expected = -(torch.tensor(0.5).log() + torch.tensor(0.5).log() + torch.tensor(0.1).log()) / 3
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.mass, torch.tensor((0.5 + 0.5 + 0.1) / 3))


def test_copy_loss_is_finite_without_sources_and_where_rows_have_none():
    """Attention log-probabilities hold -inf where the mask hides the context; neither a batch without any
    copy source (random tokens) nor rows without one may turn the loss or its gradient non-finite."""
    from drafters.drafter.objective import copy_loss

    logp = torch.full((1, 2, 2, 6), float("-inf"))
    logp[..., :3] = torch.tensor([0.5, 0.25, 0.25]).log()
    logp.requires_grad_(True)
    none = copy_loss(logp, torch.zeros(1, 2, 2, 6, dtype=torch.bool))
    assert none.lookups == 0 and none.loss.item() == 0.0 and torch.isfinite(none.loss)
    sources = torch.zeros(1, 2, 2, 6, dtype=torch.bool)
    sources[0, 0, 0, 1] = True  # one lookup has a source; the other three rows have none
    some = copy_loss(logp, sources)
    some.loss.backward()
    torch.testing.assert_close(some.loss, -torch.tensor(0.25).log())
    assert torch.isfinite(logp.grad).all()


@torch.no_grad()
def test_head_writes_are_what_a_head_adds_from_the_position_it_attends_to(parts):
    """A query head whose attention is all on context position p adds o_proj([0 .. v_p .. 0]) to the residual;
    head_writes returns that through the final norm, for the copy heads, and forward returns it at copy_reads."""
    drafter, embed = parts
    feats, ids = inputs()
    anchors = torch.tensor([[20, 9], [23, 6]])
    heads = drafter.copy_head_ids(2)
    attn = drafter.layers[-1].self_attn
    group = attn.n_heads // attn.n_kv_heads
    rows, positions = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 17])
    _, _, writes = drafter(feats, ids, anchors, embed, copy_heads=2, copy_reads=(rows, positions))
    assert writes.shape == (3, 2, H)
    for r, (b, p) in enumerate(zip(rows.tolist(), positions.tolist())):
        rope = drafter._rope(feats, torch.tensor([[p]]))
        values = attn.keys_values(drafter.fuse(feats[b : b + 1, p : p + 1]), rope)[1][0, :, 0]  # [kv_heads, d]
        for m, head in enumerate(heads):
            concat = torch.zeros(attn.n_heads, attn.head_dim)
            concat[head] = values[head // group]
            torch.testing.assert_close(writes[r, m], drafter.norm(attn.o_proj(concat.flatten())), atol=TOL, rtol=TOL)


def test_copy_value_loss_teaches_the_copy_heads_to_write_the_token_they_read():
    """The diagnosis's failure: a head pointed at the source writes something that does not decode to its token.
    A few steps of copy_value_loss on the sources copy_reads picks make the readout name the token there."""
    from drafters.drafter.objective import HeadVocabulary, copy_reads, copy_sources, copy_value_loss

    torch.manual_seed(0)
    cfg = build_draft_config(DrafterConfig(num_layers=2, block_size=B, num_target_features=K, num_key_value_heads=4),
                             tiny_target_config(), MASK)
    drafter = DFlashDrafter(cfg)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (2, 12), generator=g).repeat(1, 4)  # a phrase said 4 times: many copy sources
    table = torch.randn(VOCAB, K * H, generator=g)
    feats = table[ids] + 0.1 * torch.randn(2, 48, K * H, generator=g)  # features that carry the token
    lm_head = torch.randn(VOCAB, H, generator=g)
    anchors = torch.tensor([[40, 30, 45, 20], [44, 35, 25, 47]])
    sources = copy_sources(ids, torch.ones_like(ids), anchors, torch.ones_like(anchors, dtype=torch.bool), 2, 47)
    rows, positions, heads = copy_reads(sources, max_rows=64, generator=torch.Generator().manual_seed(0))
    assert 0 < len(rows) <= 64 and sources.any(1)[rows, heads, positions].all()
    tokens = ids[rows, positions]
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)

    def readout():
        writes = drafter.head_writes(drafter.fuse(feats[rows, positions]), drafter.copy_head_ids(2), len(drafter.layers) - 1)
        return writes[torch.arange(len(heads)), heads]

    with torch.no_grad():
        before = ((readout() @ lm_head.T).argmax(-1) == tokens).float().mean()
    for _ in range(60):
        optimizer.zero_grad()
        loss = copy_value_loss(readout(), tokens, HeadVocabulary(lm_head))
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = ((readout() @ lm_head.T).argmax(-1) == tokens).float().mean()
    assert before < 0.2 and after > 0.9, (before, after)
