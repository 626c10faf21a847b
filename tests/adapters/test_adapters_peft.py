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
    # patterns that backtrack without end in Python's re (which held the registry's thread for ever):
    # stopped after MATCH_TIMEOUT_S, or answered at once by the regex package's matcher
    ({"target_modules": r"(\w|.)*\d"}, r"target_modules pattern .* took more than 50 ms to match module name"),
    ({"target_modules": "(.*)*Q"}, "the weights adapt a module that adapter_config.json's target_modules does not name"),
    ({"rank_pattern": {r"(\w|.)*\d": 4}}, r"rank_pattern pattern .* took more than 50 ms"),
    # lists and objects past any model's module count: refused before they are matched
    ({"target_modules": ["q_proj"] * 5000}, "target_modules has 5000 entries; the limit is 4096"),
    ({"target_parameters": ["mlp.experts.down_proj"] * 5000}, "target_parameters has 5000 entries; the limit is 4096"),
    ({"rank_pattern": {f"m{i}": 4 for i in range(5000)}}, "rank_pattern has 5000 entries; the limit is 4096"),
    ({"target_parameters": 0}, "target_parameters=0 must be a list of weight names"),
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


def test_factors_past_the_wire_limit_are_refused(root, adapter_in_root, monkeypatch):
    """Factors go to a decoder as float32 in one gRPC message: an adapter past its limit is refused
    at load, not at every request's fetch."""
    monkeypatch.setattr("services.adapters.peft_format.MAX_MESSAGE_BYTES", 4096)
    with pytest.raises(InvalidArgument, match=r"MiB as float32 on the wire to a decoder; the limit is 0 MiB"):
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


# --- config and weights agree (PEFT refuses target_modules that match nothing in the base model) ---------------


def _base_with_weights(directory) -> BaseModelShapes:
    from tests.adapters.conftest import tiny_llama
    tiny_llama(seed=3).save_pretrained(str(directory))
    return BaseModelShapes.from_model_dir(directory)


@pytest.mark.parametrize("changes, message", [
    ({"target_modules": ["nonexistent_proj"]}, "target_modules entry 'nonexistent_proj' matches no linear module"),
    ({"target_modules": ["q_proj", "nonexistent_proj"]}, "entry 'nonexistent_proj' matches no linear"),
    ({"target_modules": r".*\.mlp\.fc1"}, r"entry '.*\\\\.mlp\\\\.fc1' matches no linear"),
    ({"target_modules": ["q_proj"]}, "layers.0.self_attn.v_proj: the weights adapt a module that "
                                     "adapter_config.json's target_modules does not name"),
    ({"exclude_modules": ["v_proj"]}, "entry 'v_proj' matches no linear"),  # every v_proj excluded
    ({"exclude_modules": ["layers.1.self_attn.v_proj"]}, "layers.1.self_attn.v_proj: the weights adapt a module"),
    ({"layers_to_transform": [1]}, "layers.0.self_attn.q_proj: the weights adapt a module"),
    ({"target_modules": []}, "target_modules is missing or empty"),
    ({"target_modules": "(unclosed"}, "target_modules='\\(unclosed' is not a valid regular expression"),
])
def test_config_and_weights_must_agree(root, adapter_in_root, edit_adapter_config, base_model_dir, changes, message):
    edit_adapter_config(adapter_in_root, **changes)
    with pytest.raises(InvalidArgument, match=message):
        _read(adapter_in_root, root, base=BaseModelShapes.from_model_dir(base_model_dir))


def test_weights_for_unnamed_targets_are_refused_without_a_base_model(root, adapter_in_root, edit_adapter_config):
    """The observed failure: target_modules ["nonexistent_proj"] over q_proj/v_proj weights loaded."""
    edit_adapter_config(adapter_in_root, target_modules=["nonexistent_proj"])
    with pytest.raises(InvalidArgument, match="layers.0.self_attn.q_proj: the weights adapt a module"):
        _read(adapter_in_root, root)


@pytest.mark.parametrize("changes", [
    {"target_modules": r"model\.layers\.\d+\.self_attn\.(q|v)_proj"},      # PEFT's regex form
    {"target_modules": ["self_attn.q_proj", "v_proj", "k_proj"]},          # dotted suffix; k_proj untrained is fine
    {"target_modules": "all-linear"},
    {"layers_to_transform": [0, 1], "exclude_modules": ["o_proj"]},
])
def test_agreeing_forms_of_target_modules_load(root, adapter_in_root, edit_adapter_config, base_model_dir,
                                               plain_adapter, changes):
    edit_adapter_config(adapter_in_root, **changes)
    _assert_matches_peft(_read(adapter_in_root, root, base=BaseModelShapes.from_model_dir(base_model_dir)),
                         plain_adapter[1])


def test_wrong_shape_weight_is_refused(root, adapter_in_root, base_model_dir):
    def widen(tensors):  # a consistent pair, but for a 48-feature input where the base layer has 32
        tensors[f"{Q0}.lora_A.weight"] = torch.ones(4, 48)
    _edit_tensors(adapter_in_root, widen)
    with pytest.raises(InvalidArgument, match="q_proj: LoRA maps 48 -> 32 features but the base model's layer is "
                                              "32 -> 32"):
        _read(adapter_in_root, root, base=BaseModelShapes.from_model_dir(base_model_dir))


def test_rank_pattern_must_match_the_weights(root, adapter_in_root, edit_adapter_config):
    edit_adapter_config(adapter_in_root, rank_pattern={"layers.1.self_attn.v_proj": 2})
    with pytest.raises(InvalidArgument, match="layers.1.self_attn.v_proj: tensors have rank 4 but "
                                              r"adapter_config.json \(r/rank_pattern\) says 2"):
        _read(adapter_in_root, root)


# --- effective delta bound ------------------------------------------------------------------------------------


def test_overflowing_delta_is_refused(root, adapter_in_root, tmp_path):
    """lora_B x 1e37 is finite in float32, but scale * B @ A is far past any layer's range."""
    _edit_tensors(adapter_in_root, lambda t: t.__setitem__(f"{Q0}.lora_B.weight", t[f"{Q0}.lora_B.weight"] * 1e37))
    assert torch.isfinite(load_file(str(adapter_in_root / "adapter_model.safetensors"))[f"{Q0}.lora_B.weight"]).all()
    with pytest.raises(InvalidArgument, match=r"layers.0.self_attn.q_proj: the effective LoRA delta \(scale \* B @ A\) "
                                              r"reaches up to .*e\+3\d; the limit is 1e\+03"):
        _read(adapter_in_root, root)
    base = _base_with_weights(tmp_path / "weights")
    with pytest.raises(InvalidArgument, match="the base layer's max |W|"):
        _read(adapter_in_root, root, base=base)


def test_a_huge_factor_beside_a_tiny_one_is_refused(root, adapter_in_root):
    """A x 3e37 and B x 1e-38: the product stays small (under the delta bound), but x @ A^T, which
    the decoder computes first, leaves float32's range; refused at load, not at a request."""
    _edit_tensors(adapter_in_root, lambda t: (t.__setitem__(f"{Q0}.lora_A.weight", t[f"{Q0}.lora_A.weight"] * 3e37),
                                              t.__setitem__(f"{Q0}.lora_B.weight", t[f"{Q0}.lora_B.weight"] * 1e-38)))
    with pytest.raises(InvalidArgument, match=r"q_proj: lora_A reaches .*e\+3[67]; the limit is 1e\+20 per value"):
        _read(adapter_in_root, root)


def test_delta_bound_is_relative_to_the_base_layer(root, adapter_in_root, tmp_path):
    """The bound is 1e3 x max |W| of the base layer: an adapter within it loads, one past it is refused."""
    base = _base_with_weights(tmp_path / "weights")
    module = "model.layers.0.self_attn.q_proj"
    scale = base.weight_scale(module)
    weights = load_file(str(tmp_path / "weights" / "model.safetensors"))
    assert scale == float(weights[f"{module}.weight"].abs().max()) and 0 < scale < 1
    adapter = _read(adapter_in_root, root, base=base)  # the trained-like adapter is far inside
    target = adapter.targets[module]
    bound = float((target.lora_b.double().abs() @ target.lora_a.double().abs().amax(dim=1)).max())
    assert bound >= float((target.lora_b @ target.lora_a).abs().max())
    factor = 1.5 * 1e3 * scale / bound  # past the base-relative limit, inside the 1e3 fallback
    assert factor * bound < 1e3
    _edit_tensors(adapter_in_root, lambda t: t.__setitem__(f"{Q0}.lora_B.weight", t[f"{Q0}.lora_B.weight"] * factor))
    _read(adapter_in_root, root)
    with pytest.raises(InvalidArgument, match=rf"the limit is {1e3 * scale:.3g} \(1000 x the base layer's max"):
        _read(adapter_in_root, root, base=base)
