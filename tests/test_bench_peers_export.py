"""The peers' copies of our prepared data (bench/peers/export.py) hold exactly our rows and target features.

Real tiny Llama target (random weights, a random final-norm weight), a real bf16 feature cache, no mocks.
"""

import datasets
import pytest
import torch

from bench.peers.export import export_specforge, export_speculators, speculators_train_ratio
from data.feature_cache import FeatureCacheReader, write_feature_cache
from drafters.target.capture import HFCapture
from drafters.target.testbed import tiny_llama_target

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    torch.set_num_threads(1)
    target = tiny_llama_target()
    with torch.no_grad():  # a final norm of ones would make the pre-norm recovery trivially right
        target.model.norm.weight.copy_(torch.linspace(-1.5, 2.0, target.config.hidden_size))
    rows = [list(range(5, 5 + n)) for n in (12, 7, 20, 9)]
    masks = [[0] * 4 + [1] * 8, [1, 0, 1, 0, 1, 0, 1], [0] * 5 + [1] * 15, [1] * 9]  # row 1: no two in a row
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": masks})
    capture = HFCapture(target, LAYERS)
    out = tmp_path_factory.mktemp("cache")
    write_feature_cache(dataset, capture, out, max_seq_len=16, progress=False)
    capture.remove()
    return target, dataset, FeatureCacheReader(out, dataset), tmp_path_factory.mktemp("peers")


def test_specforge_files_hold_our_rows_and_features(cached):
    _, dataset, reader, root = cached
    summary = export_specforge(dataset, reader, 16, root / "specforge")
    assert summary == {"format": "specforge_hidden_states_v1", "samples": 3, "skipped": 1, "tokens": 12 + 16 + 9}
    for i in (0, 2, 3):
        sample = torch.load(root / "specforge" / f"data_{i:06d}.ckpt", weights_only=True)
        assert sample["input_ids"].tolist() == dataset[i]["input_ids"][:16]
        assert sample["loss_mask"].tolist() == dataset[i]["loss_mask"][:16]
        assert torch.equal(sample["hidden_states"], reader.get_row(i)[0])
        # a file holds its own row, not the cache shard the row is a view of
        own = sum(t.numel() * t.element_size() for t in sample.values())
        assert (root / "specforge" / f"data_{i:06d}.ckpt").stat().st_size < own + 4096
    assert not (root / "specforge" / "data_000001.ckpt").exists()


def test_speculators_last_layer_gives_the_targets_normed_state_back(cached):
    from safetensors.torch import load_file

    target, dataset, reader, root = cached
    summary = export_speculators(dataset, reader, 16, target.model.norm.weight.detach(), root / "speculators")
    assert (summary["samples"], summary["skipped"], summary["validation_rows"]) == (3, 1, 1)
    exported = datasets.load_from_disk(str(root / "speculators"))
    assert len(exported) == 4 and int(len(exported) * speculators_train_ratio(3)) == 3  # all 3 samples train
    for k, i in enumerate((0, 2, 3)):
        states = load_file(str(root / "speculators" / "hidden_states" / f"hs_{k}.safetensors"))
        selected, final = reader.get_row(i)
        assert states["token_ids"].tolist() == exported[k]["input_ids"].tolist() == dataset[i]["input_ids"][:16]
        assert torch.equal(states["hidden_states"][:, :-1].flatten(1), selected)
        with torch.no_grad():  # what speculators does with it: the verifier's own final norm
            renormed = target.model.norm(states["hidden_states"][:, -1].float())
        torch.testing.assert_close(renormed, final.float(), atol=0.03, rtol=0.02)
    assert torch.equal(load_file(str(root / "speculators" / "hidden_states" / "hs_3.safetensors"))["hidden_states"],
                       load_file(str(root / "speculators" / "hidden_states" / "hs_0.safetensors"))["hidden_states"])
