"""PEFT LoRA parsing: effective weights equal PEFT's delta; every unsupported feature is refused."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.adapters.base_model import BaseModelShapes
from services.adapters.peft_format import read_peft_adapter
from services.common.errors import InvalidArgument

MODULES = sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in ("q", "v"))


def _read(directory, root, max_rank=64, base=None):
    return read_peft_adapter(directory, root, "t", max_rank, base)


def _assert_matches_peft(adapter, peft_model):
    assert sorted(adapter.targets) == MODULES
    for module, target in adapter.targets.items():
        expected = peft_model.get_submodule(f"base_model.model.{module}").get_delta_weight("default")
        assert target.lora_a.dtype == target.lora_b.dtype == torch.float32
        torch.testing.assert_close(target.lora_b @ target.lora_a, expected, atol=1e-6, rtol=1e-6)


def test_plain_lora_reproduces_peft_delta(root, adapter_in_root, plain_adapter, base_model_dir):
    adapter = _read(adapter_in_root, root, base=BaseModelShapes.from_model_dir(base_model_dir))
    assert (adapter.rank, adapter.alpha, adapter.use_rslora) == (4, 8.0, False)
    _assert_matches_peft(adapter, plain_adapter[1])
    raw = load_file(str(adapter_in_root / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.targets[MODULES[0]].lora_b, b * 2.0)  # alpha/r = 8/4


def test_rslora_scale_is_alpha_over_sqrt_rank(root, make_adapter):
    peft_model = make_adapter(root / "rs", use_rslora=True)
    adapter = _read(root / "rs", root)
    assert adapter.use_rslora
    _assert_matches_peft(adapter, peft_model)
    raw = load_file(str(root / "rs" / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.targets["model.layers.1.self_attn.v_proj"].lora_b, b * (8 / math.sqrt(4)))


def test_rank_and_alpha_patterns_apply_per_module(root, make_adapter):
    peft_model = make_adapter(root / "pat", rank_pattern={"v_proj": 2},
                                   alpha_pattern={"layers.1.self_attn.q_proj": 32})
    adapter = _read(root / "pat", root)
    ranks = {m: t.rank for m, t in adapter.targets.items()}
    assert ranks == {MODULES[0]: 4, MODULES[1]: 2, MODULES[2]: 4, MODULES[3]: 2}
    assert adapter.targets["model.layers.1.self_attn.q_proj"].alpha == 32
    assert adapter.targets["model.layers.0.self_attn.q_proj"].alpha == 8
    assert adapter.rank == 4
    _assert_matches_peft(adapter, peft_model)


@pytest.mark.parametrize("changes, field", [
    ({"peft_type": "IA3"}, "peft_type"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"target_modules": ["lm_head"]}, "target_modules"),
    ({"r": 8}, "rank_pattern"),
    # malformed values are INVALID_ARGUMENT naming the field, never an internal error
    ({"rank_pattern": {"(": 4}}, "rank_pattern key"),
    ({"rank_pattern": {"q_proj": "four"}}, "rank_pattern"),
    ({"rank_pattern": {"q_proj": None}}, "rank_pattern"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
    ({"alpha_pattern": [1]}, "alpha_pattern"),
    ({"target_modules": [1, 2]}, "target_modules"),
    ({"target_modules": {"q_proj": 1}}, "target_modules"),
    ({"lora_alpha": "x" * 100_000}, "lora_alpha"),
])
def test_config_refusals_name_the_field(root, adapter_in_root, edit_adapter_config, changes, field):
    edit_adapter_config(adapter_in_root, **changes)
    with pytest.raises(InvalidArgument, match=field) as refusal:
        _read(adapter_in_root, root)
    assert len(str(refusal.value)) < 400  # client-supplied values are clipped, not echoed whole


def _edit_tensors(directory, edit):
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t[f"{Q0}.lora_A.weight"].__setitem__((0, 0), float("nan")), "non-finite"),
    (lambda t: t[f"{Q0}.lora_B.weight"].__setitem__((1, 1), float("inf")), "non-finite"),
    (lambda t: t.pop(f"{Q0}.lora_B.weight"), "lora_B.weight is missing"),
    (lambda t: t.pop(f"{Q0}.lora_A.weight"), "lora_A.weight is missing"),
    (lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.ones(32)), "unexpected tensors"),
    (lambda t: t.__setitem__(f"{Q0}.lora_magnitude_vector", torch.ones(32)), "unexpected tensors"),
    (lambda t: t.__setitem__("base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(4, 64)),
     "embedding"),
    (lambda t: t.__setitem__(f"{Q0}.lora_B.weight", torch.ones(32, 3)), "ranks differ"),
])
def test_tensor_refusals(root, adapter_in_root, edit, message):
    _edit_tensors(adapter_in_root, edit)
    with pytest.raises(InvalidArgument, match=message):
        _read(adapter_in_root, root)


def test_rank_above_max_rank_is_refused(root, adapter_in_root):
    with pytest.raises(InvalidArgument, match="rank 4 exceeds the registry's max_rank 2"):
        _read(adapter_in_root, root, max_rank=2)


def test_targets_checked_against_base_model(root, adapter_in_root, base_model_dir, tmp_path):
    base = BaseModelShapes.from_model_dir(base_model_dir)

    def rename(tensors):
        for part in ("A", "B"):
            tensors[f"base_model.model.model.layers.7.self_attn.q_proj.lora_{part}.weight"] = \
                tensors.pop(f"{Q0}.lora_{part}.weight")

    _edit_tensors(adapter_in_root, rename)
    _read(adapter_in_root, root)  # without a base model, any consistent pair is accepted
    with pytest.raises(InvalidArgument, match="layers.7.self_attn.q_proj matches no linear module"):
        _read(adapter_in_root, root, base=base)

    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "config.json").write_text((base_model_dir / "config.json").read_text().replace(
        '"hidden_size": 32', '"hidden_size": 64'))
    wider_base = BaseModelShapes.from_model_dir(wider)
    with pytest.raises(InvalidArgument, match="base model's layer is 64 ->"):
        _read(adapter_in_root, root, base=wider_base)
