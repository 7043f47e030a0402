"""The serving export (scripts/export.py): block FP8 and bf16 folders that pass the contract check, load
back within the FP8 error bound, load in z-lab's reference package with equal tensors, and are refused
(naming the tensor, writing nothing) when the source is broken. Real random drafters, real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from configs.schema import DrafterConfig
from drafters.export import contract, fp8
from drafters.drafter.checkpoint import load_drafter, save_drafter
from drafters.export.contract import ContractError
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter
from drafters.export import exporter as export
from scripts.cli import main as cli
from drafters.target.testbed import tiny_llama_target

REPO = Path(__file__).resolve().parents[1]
MASK = 49_151

# The exact quantization_config for a 2-layer drafter of an 8-layer target (see drafters/export/fp8.py for why
# each name is there): SGLang reads `ignored_layers` (or `modules_to_not_convert`), vLLM `ignored_layers`,
# transformers `modules_to_not_convert`.
IGNORED_2_OF_8 = [
    "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj", "layers.0.self_attn.qkv_proj",
    "layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj", "layers.1.self_attn.v_proj", "layers.1.self_attn.qkv_proj",
    "model.layers.8.self_attn.q_proj", "model.layers.8.self_attn.k_proj", "model.layers.8.self_attn.v_proj",
    "model.layers.8.self_attn.qkv_proj",
    "model.layers.9.self_attn.q_proj", "model.layers.9.self_attn.k_proj", "model.layers.9.self_attn.v_proj",
    "model.layers.9.self_attn.qkv_proj",
]
QUANT_2_OF_8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
                "ignored_layers": IGNORED_2_OF_8, "modules_to_not_convert": IGNORED_2_OF_8}


def tiny_config():
    """The tiny Llama test target (hidden 64: not 128-aligned, so only partial FP8 blocks)."""
    return tiny_llama_target().config


def aligned_config():
    """The tiny Llama target widened to SGLang's block-FP8 alignment (every in/out width a multiple of 128)."""
    config = tiny_config()
    config.hidden_size, config.intermediate_size = 128, 256
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 64
    return config


def random_drafter(target_config, seed=0, num_layers=2):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(build_draft_config(DrafterConfig(num_layers=num_layers), target_config, MASK))
    with torch.no_grad():  # norms away from 1, and one outlier row so that block scales differ a lot
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        drafter.fc.weight[3].mul_(50.0)
    return drafter


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {"tiny": save_drafter(random_drafter(tiny_config()), root / "tiny"),
            "aligned": save_drafter(random_drafter(aligned_config(), seed=1), root / "aligned")}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def assert_within_fp8_bound(source: dict, loaded: dict):
    """Quantized weights: |w - dequant| <= 2^-4 |w| + 2^-10 * block scale, per element (e4m3: 3 mantissa
    bits, round to nearest; the second term is the subnormal spacing). Everything else: bf16 rounding."""
    for name, w in source.items():
        got = loaded[name].float()
        if fp8.is_quantized_weight(name):
            q, scale = fp8.quantize_block_fp8(w)
            bound = fp8.error_bound(w, scale) * (1 + 1e-6) + 1e-30
            err = (w - got).abs()
            assert bool((err <= bound).all()), f"{name}: max err/bound {float((err / bound).max()):.3f}"
            # Per block, the error stays under 2^-4 of the block's amax (~0.036 amax measured).
            amax = fp8._blocked(w, fp8.BLOCK).abs().amax(dim=(1, 3))
            block_err = fp8._blocked(err, fp8.BLOCK).amax(dim=(1, 3))
            assert bool((block_err <= amax * 2 ** -4).all()), name
            assert not torch.equal(w, got), f"{name} was not quantized"
        else:
            torch.testing.assert_close(got, w.to(torch.bfloat16).float(), atol=0, rtol=0, msg=name)


def test_fp8_export_passes_the_contract_and_round_trips(sources, tmp_path):
    out = tmp_path / "fp8"
    summary = export.export_drafter(sources["aligned"], out, "fp8")
    assert summary["fp8_alignment_problems"] == []
    assert contract.check_folder(out) == {"format": "fp8", "tensors": summary["tensors"], "bytes": summary["folder_bytes"]}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == QUANT_2_OF_8
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # q/k/v stay bf16 (SGLang slices them)
    assert tensors["layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.mlp.up_proj.weight_scale_inv"].dtype == torch.float32
    assert tensors["layers.1.mlp.up_proj.weight_scale_inv"].shape == (2, 1)  # [256, 128] -> [2, 1] blocks
    assert tensors["fc.weight_scale_inv"].shape == (1, 5)                  # [128, 640] -> [1, 5]
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)
    assert leftovers(tmp_path) == []

    source = load_file(str(sources["aligned"] / "model.safetensors"))
    loaded = fp8.load_fp8_drafter(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(source)
    assert_within_fp8_bound(source, loaded)
    readme = (out / "README.md").read_text()
    assert (f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {out} --speculative-num-draft-tokens 16") in readme
    assert "Tensor-parallel sizes at which every FP8 partition stays 128-aligned: [1]" in readme


def test_reference_package_dequantizes_our_fp8_export_to_our_tensors(sources, tmp_path):
    """transformers' FineGrainedFP8 loader (what the reference package's from_pretrained uses; on a CPU it
    dequantizes) is an independent reader of the format: it must give our loader's weights exactly."""
    from dflash.model import DFlashDraftModel

    out = tmp_path / "fp8"
    export.export_drafter(sources["aligned"], out, "fp8")
    reference = DFlashDraftModel.from_pretrained(out).state_dict()
    ours = fp8.load_fp8_drafter(out, dtype=torch.bfloat16).state_dict()
    assert set(reference) == set(ours)
    for name in ours:
        assert torch.equal(reference[name].to(torch.bfloat16), ours[name]), name


def test_unaligned_fp8_is_refused_unless_allowed_and_partial_blocks_round_trip(sources, tmp_path):
    out = tmp_path / "fp8"
    with pytest.raises(ContractError, match="hidden_size = 64 is not a multiple of 128"):
        export.export_drafter(sources["tiny"], out, "fp8")
    assert not out.exists() and leftovers(tmp_path) == []

    summary = export.export_drafter(sources["tiny"], out, "fp8", allow_unaligned=True)
    assert summary["fp8_alignment_problems"]
    assert "cannot run on SGLang's block-FP8 kernels" in (out / "README.md").read_text()
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight_scale_inv"].shape == (1, 3)  # [64, 320]: one partial row block, 3 column blocks
    assert tensors["layers.0.mlp.gate_proj.weight_scale_inv"].shape == (1, 1)
    source = load_file(str(sources["tiny"] / "model.safetensors"))
    assert_within_fp8_bound(source, fp8.load_fp8_drafter(out, dtype=torch.float32).state_dict())


def test_reference_package_loads_the_bf16_export_with_equal_tensors(sources, tmp_path):
    from dflash.model import DFlashDraftModel

    out = tmp_path / "bf16"
    export.export_drafter(sources["tiny"], out, "bf16")
    assert contract.check_folder(out)["format"] == "bf16"
    ours = load_file(str(out / "model.safetensors"))
    source = load_file(str(sources["tiny"] / "model.safetensors"))
    assert set(ours) == set(source)
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], source[k].to(torch.bfloat16)) for k in ours)

    reference = DFlashDraftModel.from_pretrained(out)
    assert reference.target_layer_ids == [1, 2, 3, 4, 5] and reference.mask_token_id == MASK and reference.block_size == 16
    state = reference.state_dict()
    assert set(state) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(state[name], tensor), name
    ours_loaded = load_drafter(out).state_dict()  # and our own loader reads it back
    assert all(torch.equal(ours_loaded[k], ours[k]) for k in ours)


def _corrupt_missing(state):
    del state["layers.1.mlp.down_proj.weight"]
    return "layers.1.mlp.down_proj.weight: missing"


def _corrupt_nan(state):
    state["layers.0.self_attn.k_proj.weight"][3, 5] = float("nan")
    return "layers.0.self_attn.k_proj.weight: contains NaN"


def _corrupt_inf(state):
    state["fc.weight"][0, 7] = float("-inf")
    return "fc.weight: contains Inf"


def _corrupt_lm_head(state):
    state["lm_head.weight"] = torch.zeros(4, 64)
    return "lm_head.weight: a drafter must not ship"


def _corrupt_shape(state):
    state["norm.weight"] = torch.ones(65)
    return "norm.weight: shape [65] != expected [64]"


@pytest.mark.parametrize("corrupt", [_corrupt_missing, _corrupt_nan, _corrupt_inf, _corrupt_lm_head, _corrupt_shape])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_a_broken_source_is_refused_naming_the_tensor_and_nothing_is_written(sources, tmp_path, corrupt, dtype, capsys):
    src = tmp_path / "broken"
    src.mkdir()
    (src / "config.json").write_text((sources["tiny"] / "config.json").read_text())
    state = load_file(str(sources["tiny"] / "model.safetensors"))
    message = corrupt(state)
    save_file(state, str(src / "model.safetensors"))
    out = tmp_path / "exports" / "out"
    out.parent.mkdir()

    with pytest.raises(ContractError, match=message.split(":")[0].replace(".", r"\.")) as excinfo:
        export.export_drafter(src, out, dtype, allow_unaligned=True)
    assert message in str(excinfo.value)
    assert cli(["export", str(src), str(out), "--dtype", dtype, "--allow-unaligned"]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists() and list(out.parent.iterdir()) == []


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].update(mask_token_id=49_152), "mask_token_id 49152 must be an integer in [0, vocab_size 49152)"),
    (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids must be a non-empty list"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 8]), "target_layer_ids [8] out of range for num_target_layers 8"),
    (lambda c: c.pop("num_target_layers"), "missing key 'num_target_layers'"),
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "must be ['DFlashDraftModel']"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "unexpected quantization_config"),
])
def test_a_bad_source_config_is_refused(sources, tmp_path, edit, message):
    src = tmp_path / "src"
    src.mkdir()
    cfg = json.loads((sources["tiny"] / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").write_bytes((sources["tiny"] / "model.safetensors").read_bytes())
    with pytest.raises(ContractError) as excinfo:
        export.export_drafter(src, tmp_path / "out", "bf16")
    assert message in str(excinfo.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_the_contract_rejects_a_tampered_fp8_folder(sources, tmp_path):
    out = tmp_path / "fp8"
    export.export_drafter(sources["aligned"], out, "fp8")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignored_layers"] = []
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ContractError, match="quantization_config"):
        contract.check_folder(out)
    export.export_drafter(sources["aligned"], out, "fp8", overwrite=True)  # an export is replaced atomically
    tensors = load_file(str(out / "model.safetensors"))
    tensors["fc.weight_scale_inv"] = tensors["fc.weight_scale_inv"][:, :2].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ContractError, match=r"fc\.weight_scale_inv: shape \[1, 2\] != expected \[1, 5\]"):
        contract.check_folder(out)


def test_cli_on_a_training_checkpoint_writes_the_model_card(sources, tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-000120"
    (ckpt / "drafter").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (ckpt / "drafter" / name).write_bytes((sources["aligned"] / name).read_bytes())
    info = {"target": "moonshotai/Kimi-K2-Instruct", "data": "regenerated chat and agent trajectories",
            "tau": {"code": 5.84, "prose": 3.1}}
    out = tmp_path / "serve" / "kimi-dflash-fp8"
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "keep.txt").write_text("untouched")
    run = subprocess.run([sys.executable, "-m", "scripts.cli", "export", str(ckpt), str(out), "--dtype", "fp8",
                          "--model-card-info", json.dumps(info)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["source"] == str(ckpt / "drafter")
    readme = (out / "README.md").read_text()
    assert "# DFlash drafter for moonshotai/Kimi-K2-Instruct" in readme
    assert "regenerated chat and agent trajectories" in readme
    assert "| code | 5.84 |" in readme and "| prose | 3.10 |" in readme
    assert (f"python -m sglang.launch_server --model-path moonshotai/Kimi-K2-Instruct --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {out} --speculative-num-draft-tokens 16") in readme
    assert sorted(p.name for p in (tmp_path / "serve").iterdir()) == ["keep.txt", "kimi-dflash-fp8"]
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    # An existing folder is never replaced without --overwrite.
    with pytest.raises(FileExistsError):
        export.export_drafter(ckpt, out, "bf16")


def test_fp8_is_about_half_the_bf16_size_at_the_testbed_shape(tmp_path):
    """SmolLM2 shape (hidden 576, intermediate 1536, 2 draft layers, 5 target layers). The bf16 q/k/v and
    norms put the ratio above one half: ratio = 1/2 + (bf16 share of the parameters) / 2."""
    from drafters.target.testbed import prepare_testbed_target

    target_config = AutoConfig.from_pretrained(prepare_testbed_target())
    src = save_drafter(random_drafter(target_config), tmp_path / "src")
    fp8_bytes = export.export_drafter(src, tmp_path / "fp8", "fp8", allow_unaligned=True)["weights_bytes"]
    bf16_bytes = export.export_drafter(src, tmp_path / "bf16", "bf16")["weights_bytes"]
    ratio = fp8_bytes / bf16_bytes
    cfg = json.loads((src / "config.json").read_text())
    params = {n: torch.Size(s).numel() for n, (s, _) in contract.expected_tensors(cfg, "source").items()}
    bf16_share = sum(v for n, v in params.items() if not fp8.is_quantized_weight(n)) / sum(params.values())
    print(f"\nFP8 {fp8_bytes:,} B / bf16 {bf16_bytes:,} B = {ratio:.3f} (bf16 share of params {bf16_share:.3f})")
    assert ratio == pytest.approx(0.5 + bf16_share / 2, abs=0.005)
    assert 0.5 < ratio < 0.6
