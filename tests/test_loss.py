import pytest
import torch
import torch.nn.functional as F

from drafters.drafter.objective import (HeadVocabulary, acceptance_stats, block_loss, block_targets, default_gamma, greedy_path,
                        most_frequent_tokens, slot_weights, target_choices)


def _setup(seed=0, bsz=2, seq=40, n=5, block=8, hidden=16, vocab=97):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    loss_mask = torch.ones(bsz, seq, dtype=torch.bool)
    loss_mask[:, :10] = False  # prompt
    anchors = torch.randint(10, seq - 1, (bsz, n), generator=g)
    anchor_valid = torch.ones(bsz, n, dtype=torch.bool)
    draft = torch.randn(bsz, n, block, hidden, generator=g, requires_grad=True)
    target = torch.randn(bsz, seq, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g)
    return input_ids, loss_mask, anchors, anchor_valid, draft, target, head


def test_same_position_labels_and_slot_zero_unused():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup(block=4)
    t = block_targets(anchors, anchor_valid, loss_mask, 4)
    # slot k (index k-1) of block a is token a + k; slot 0 is never supervised
    assert t.positions.shape[-1] == 3
    assert torch.equal(t.positions[..., 0], (anchors + 1).clamp(max=39))
    assert torch.equal(t.positions[..., 2], (anchors + 3).clamp(max=39))
    unclamped = anchors[..., None] + torch.arange(1, 4)
    assert torch.equal(t.valid, unclamped < 40)  # loss mask is all ones after the prompt


def test_kl_matches_naive_full_vocab_and_chunking_is_exact():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup()
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    gamma = default_gamma(8)
    out = block_loss(draft, t, target, input_ids, head, gamma=gamma, chunk_rows=7)
    out.loss.backward()
    grad_chunked = draft.grad.clone()
    draft.grad = None
    # Naive reference: all logits at once.
    b, n, k = t.valid.nonzero(as_tuple=True)
    pos = t.positions[b, n, k]
    d_logp = F.log_softmax(draft[b, n, k + 1] @ head.T, -1)
    t_logp = F.log_softmax(target[b, pos - 1] @ head.T, -1)
    w = slot_weights(8, gamma)[k]
    kl = (t_logp.exp() * (t_logp - d_logp)).sum(-1)
    naive = (kl * w).sum() / w.sum()
    naive.backward()
    assert torch.allclose(out.loss, naive, atol=1e-5)
    assert torch.allclose(grad_chunked, draft.grad, atol=1e-6)
    assert draft.grad[:, :, 0].abs().sum() == 0  # slot 0 has no loss
    assert torch.equal(out.slot_correct[b, n, k], (d_logp.argmax(-1) == t_logp.argmax(-1)))


def test_ce_loss_and_invalid_slots():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup()
    anchor_valid[0, 0] = False
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    assert not t.valid[0, 0].any()
    out = block_loss(draft, t, None, input_ids, head, gamma=7.0, kind="ce")
    b, n, k = t.valid.nonzero(as_tuple=True)
    logp = F.log_softmax(draft[b, n, k + 1] @ head.T, -1)
    nll = -logp.gather(-1, input_ids[b, t.positions[b, n, k]][:, None])[:, 0]
    w = slot_weights(8, 7.0)[k]
    assert torch.allclose(out.loss, (nll * w).sum() / w.sum(), atol=1e-5)


def test_simulated_acceptance_counts_leading_correct_slots():
    correct = torch.tensor([[[True, True, False, True]], [[False, True, True, True]]])
    valid = torch.ones_like(correct)
    stats = acceptance_stats(correct, valid)
    assert stats["sim_tau"] == 1.0 + (2 + 0) / 2
    assert stats["slot_accuracy"] == [0.5, 1.0, 0.5, 1.0]


def test_greedy_path_marks_tokens_equal_to_the_targets_argmax():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 16, generator=g)
    head = torch.randn(50, 16, generator=g)
    greedy = (hidden @ head.T).argmax(-1)  # the target's choice for the next token
    input_ids = torch.randint(0, 50, (2, 9), generator=g)
    input_ids[:, 1:5] = greedy[:, 0:4]  # tokens 1..4 follow the target, the rest are random
    input_ids[:, 5] = (greedy[:, 4] + 1) % 50  # token 5 is off the path
    choices = target_choices(hidden, head, chunk_rows=5)
    assert torch.equal(choices, greedy)
    on_path = greedy_path(input_ids, choices)
    assert not on_path[:, 0].any()
    assert on_path[:, 1:5].all() and not on_path[:, 5].any()
    assert torch.equal(on_path[:, 6:], input_ids[:, 6:] == greedy[:, 5:8])


def test_slots_after_an_off_greedy_token_are_not_supervised():
    # Text the target did not write: slot k is supervised only while tokens a+1 .. a+k-1 are on the
    # target's greedy path; slot 1 always is (its label is the target's distribution after the anchor).
    seq, block = 20, 6
    anchors, anchor_valid = torch.tensor([[2, 10]]), torch.ones(1, 2, dtype=torch.bool)
    everywhere = torch.ones(1, seq, dtype=torch.bool)
    on_path = torch.ones(1, seq, dtype=torch.bool)
    on_path[0, 5] = False  # token 5 is not what the target would have written
    t = block_targets(anchors, anchor_valid, everywhere, block, on_path)
    # block at 2: slots 1..3 (tokens 3, 4, 5) are supervised; slot 4 (token 6) follows the off-path token 5
    assert t.valid[0, 0].tolist() == [True, True, True, False, False]
    assert t.valid[0, 1].all()  # block at 10 never crosses token 5
    assert torch.equal(block_targets(anchors, anchor_valid, everywhere, block).valid[0, 0], torch.ones(5, dtype=torch.bool))


def test_sampled_slots_keep_a_prefix_and_match_the_weighted_loss_in_expectation():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup(n=6)
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    gamma = 2.0
    full = block_loss(draft, t, target, input_ids, head, gamma=gamma)
    (full_grad,) = torch.autograd.grad(full.loss, draft)
    g = torch.Generator().manual_seed(0)
    draws = 3000
    mean_loss, mean_grad, kept_rows = 0.0, torch.zeros_like(draft), 0
    for _ in range(draws):
        out = block_loss(draft, t, target, input_ids, head, gamma=gamma, sample_slots=g)
        kept = out.slot_valid
        # a prefix of each block's supervised slots
        assert torch.equal(kept, kept & torch.cumprod(kept.long(), -1).bool())
        (grad,) = torch.autograd.grad(out.loss, draft)
        mean_loss += out.loss.item() / draws
        mean_grad += grad / draws
        kept_rows += int(kept.sum())
    assert abs(mean_loss - full.loss.item()) < 0.02 * full.loss.item()
    assert torch.allclose(mean_grad, full_grad, atol=0.1 * full_grad.abs().max().item())
    expected_rows = (slot_weights(8, gamma) * t.valid).sum().item()
    assert abs(kept_rows / draws - expected_rows) < 0.05 * expected_rows
    # per-slot accuracy and the simulated tau stay unbiased with the keep probabilities: a draft that
    # is the target's own hidden state plus noise, right about half the time
    b = torch.arange(draft.shape[0])[:, None, None]
    draft = target[b, t.positions - 1] + 0.4 * torch.randn(t.positions.shape + (target.shape[-1],), generator=g)
    draft = torch.cat([draft[:, :, :1], draft], dim=2)  # slot 0 (unused) in front
    full = block_loss(draft, t, target, input_ids, head, gamma=gamma)
    stats_full = acceptance_stats(full.slot_correct, full.slot_valid)
    assert 1.5 < stats_full["sim_tau"] < 4
    both = [block_loss(draft, t, target, input_ids, head, gamma=gamma, sample_slots=g) for _ in range(400)]
    stats = acceptance_stats(torch.cat([o.slot_correct for o in both]), torch.cat([o.slot_valid for o in both]),
                             keep_prob=slot_weights(8, gamma))
    assert abs(stats["sim_tau"] - stats_full["sim_tau"]) < 0.05


def test_ce_target_trains_toward_the_targets_greedy_token_not_the_data_token():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup()
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    choices = target_choices(target, head)
    out = block_loss(draft, t, target, input_ids, head, gamma=7.0, kind="ce_target", choices=choices)
    b, n, k = t.valid.nonzero(as_tuple=True)
    pos = t.positions[b, n, k]
    logp = F.log_softmax(draft[b, n, k + 1] @ head.T, -1)
    nll = -logp.gather(-1, choices[b, pos - 1][:, None])[:, 0]
    w = slot_weights(8, 7.0)[k]
    assert torch.allclose(out.loss, (nll * w).sum() / w.sum(), atol=1e-5)
    # the data tokens give a different loss: the labels really are the target's choices
    data = block_loss(draft, t, target, input_ids, head, gamma=7.0, kind="ce")
    assert not torch.allclose(out.loss, data.loss)


def test_the_tv_blend_is_its_formula_and_moves_the_step_to_rows_the_drafter_can_win():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup()
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    choices = target_choices(target, head)
    ours = draft.detach().clone().requires_grad_(True)
    out = block_loss(ours, t, target, input_ids, head, gamma=7.0, kind="ce_target", choices=choices, tv_eta=3.0,
                     chunk_rows=1 << 20)
    out.loss.backward()
    # the same loss written out for autograd: lam * CE + (1 - lam) * (1 - q(y)), lam from the mean q(y)
    ref = draft.detach().clone().requires_grad_(True)
    b, n, k = t.valid.nonzero(as_tuple=True)
    label = choices[b, t.positions[b, n, k] - 1]
    label_logp = F.log_softmax(ref[b, n, k + 1] @ head.T, -1).gather(-1, label[:, None])[:, 0]
    q, w = label_logp.exp(), slot_weights(8, 7.0)[k]
    lam = torch.exp(-3.0 * (q.detach() * w).sum() / w.sum())
    expected = (w * (lam * -label_logp + (1 - lam) * (1 - q))).sum() / w.sum()
    expected.backward()
    assert 0 < float(lam) < 1
    assert torch.allclose(out.loss, expected, atol=1e-5)
    assert torch.allclose(ours.grad, ref.grad, atol=1e-6)
    # against plain CE, the rows with the lowest q(y) get a smaller share of the gradient
    ce = draft.detach().clone().requires_grad_(True)
    block_loss(ce, t, target, input_ids, head, gamma=7.0, kind="ce_target", choices=choices).loss.backward()
    hard = q.detach() < q.detach().median()
    share = lambda grad: (grad[b, n, k + 1].norm(dim=-1)[hard].sum() / grad[b, n, k + 1].norm(dim=-1).sum()).item()
    assert share(ours.grad) < share(ce.grad)


def test_the_tv_blend_is_refused_with_the_kl_loss():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup()
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    with pytest.raises(ValueError, match="tv_eta"):
        block_loss(draft, t, target, input_ids, head, gamma=7.0, kind="kl", tv_eta=3.0)


def test_a_reduced_head_is_the_full_softmax_over_its_rows_and_misses_labels_outside_it():
    input_ids, loss_mask, anchors, anchor_valid, draft, target, head = _setup()
    t = block_targets(anchors, anchor_valid, loss_mask, 8)
    b, n, k = t.valid.nonzero(as_tuple=True)
    labels = input_ids[b, t.positions[b, n, k]]
    inside = torch.unique(labels)[: max(2, len(torch.unique(labels)) // 2)]
    rows = torch.cat([inside, torch.tensor([head.shape[0] - 1])])
    reduced = HeadVocabulary(head, rows)
    draft = draft.detach().requires_grad_(True)
    out = block_loss(draft, t, target, input_ids, reduced, gamma=7.0, kind="ce")
    keep = torch.isin(labels, inside)
    sub = torch.unique(rows)
    logp = F.log_softmax(draft[b, n, k + 1] @ head[sub].T, -1)
    local = torch.searchsorted(sub, labels.clamp(max=int(sub[-1])))
    nll = -logp.gather(-1, local[:, None])[:, 0]
    w = slot_weights(8, 7.0)[k]
    expected = (nll * w * keep).sum() / w.sum()
    assert torch.allclose(out.loss, expected, atol=1e-5)
    # a label outside the head is a miss and carries no gradient
    assert not out.slot_correct[b[~keep], n[~keep], k[~keep]].any()
    (grad,) = torch.autograd.grad(out.loss, draft)
    (ref,) = torch.autograd.grad(expected, draft)
    assert torch.allclose(grad, ref, atol=1e-5)


def test_most_frequent_tokens_ranks_by_count():
    counts = torch.bincount(torch.tensor([5, 5, 5, 2, 2, 9, 2, 5, 7]), minlength=10)
    assert sorted(most_frequent_tokens(counts, 2).tolist()) == [2, 5]
    assert sorted(most_frequent_tokens(torch.bincount(torch.tensor([1, 1, 3]), minlength=10), 8).tolist()) == [1, 3]
