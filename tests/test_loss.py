import torch
import torch.nn.functional as F

from train.loss import acceptance_stats, block_loss, block_targets, default_gamma, slot_weights


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
