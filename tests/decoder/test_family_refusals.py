"""A config.json the family cannot serve is refused when the decoder's config is built (before the
tokenizer or any weight loads), in one line naming the field: values that would empty a window,
divide by zero or put NaN in every logit, windows and sparse steps transformers cannot build a model from, fields transformers' own config class rejects (which
AutoTokenizer would otherwise raise as a traceback), and Mistral's foreign `layer_types`."""

import json
import math

import pytest
from decoder_testing import make_tiny_llama

from services.decoder.config import DecoderConfig

GEMMA2 = dict(head_dim=64, sliding_window=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              query_pre_attn_scalar=64)
CASES = {
    "gemma2-final-cap-0": ("gemma2", GEMMA2, dict(final_logit_softcapping=0.0),
                           "final_logit_softcapping must be a positive finite number or null, got 0.0"),
    "gemma2-attn-cap-nan": ("gemma2", GEMMA2, dict(attn_logit_softcapping=math.nan),
                            "attn_logit_softcapping must be a positive finite number or null, got nan"),
    "gemma2-scalar-0": ("gemma2", GEMMA2, dict(query_pre_attn_scalar=0),
                        "query_pre_attn_scalar must be a positive finite number or null, got 0"),
    "gemma2-scalar-negative": ("gemma2", GEMMA2, dict(query_pre_attn_scalar=-4),
                               "query_pre_attn_scalar must be a positive finite number or null, got -4"),
    "gemma2-window-0": ("gemma2", GEMMA2, dict(sliding_window=0),
                        "sliding_window must be a positive integer or null, got 0"),
    "phi3-window-negative": ("phi3", dict(head_dim=64, sliding_window=48), dict(sliding_window=-1),
                             "sliding_window must be a positive integer or null, got -1"),
    "mistral-window-float": ("mistral", dict(head_dim=64, sliding_window=24), dict(sliding_window=24.0),
                             "config.json is not a mistral config transformers reads"),
    "gemma2-window-null": ("gemma2", GEMMA2, dict(sliding_window=None),
                           "sliding_window is null but layer_types has 'sliding_attention' layers"),
    "qwen3-moe-sparse-step-0": ("qwen3_moe", dict(head_dim=64, moe_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2), dict(decoder_sparse_step=0),
                                "decoder_sparse_step must be a positive integer, got 0"),
    "mistral-layer-types": ("mistral", dict(head_dim=64, sliding_window=24),
                            dict(layer_types=["full_attention", "full_attention"]),
                            "config.json's layer_types is not a MistralConfig field"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_in_one_line_naming_the_field(tmp_path, case):
    family, options, edits, message = CASES[case]
    model_dir = make_tiny_llama(tmp_path / case, seed=1, family=family, **options)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(edits)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        DecoderConfig(model_dir=str(model_dir))
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
