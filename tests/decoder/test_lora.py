"""Torch multi-LoRA path: greedy ids equal PEFT; base rows in the same batch equal the base model."""

import asyncio

import pytest
import torch
from decoder_testing import hf_greedy
from family_conformance import peft_weights
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from services.common.errors import InvalidArgument
from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.lora import AdapterSlots, LoRAWeights
from services.decoder.types import GenerateInput, SamplingParams

PROMPTS = [[1, 5, 77, 300, 12], list(range(100, 130))]
NEW_TOKENS = 24


def _peft_model(model_dir, seed):
    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir).eval()
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():  # make the adapter change greedy choices decisively
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return model


def _peft_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_lora_and_base_in_one_batch_equal_peft_and_base(tiny_llama):
    peft_a, peft_b = _peft_model(tiny_llama, 1), _peft_model(tiny_llama, 2)
    refs_a = [_peft_greedy(peft_a, p) for p in PROMPTS]
    refs_b = [_peft_greedy(peft_b, p) for p in PROMPTS]
    refs_base = [hf_greedy(tiny_llama, p, NEW_TOKENS) for p in PROMPTS]
    assert refs_a != refs_base and refs_b != refs_base

    adapters = InMemoryAdapterSource()
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512, adapter_slots=2,
                                        max_lora_rank=16), adapters)
    try:
        weights_a, weights_b = peft_weights(peft_a, "digest-a"), peft_weights(peft_b, "digest-b")
        slot_a = engine.parts.bank.load(weights_a)
        slot_b = engine.parts.bank.load(weights_b)
        adapters.add("a", weights_a)
        adapters.add("b", weights_b)
        assert (slot_a, slot_b) == (0, 1)
        requests = []
        for prompt in PROMPTS:
            for name in ("a", "", "b"):  # a leased slot per adapter request
                requests.append(GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), prompt_token_ids=tuple(prompt),
                                              lora=name))

        async def collect(request):
            return [t async for out in engine.generate(request) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(collect(r) for r in requests))

        results = asyncio.run(main())
        expected = [ref for triple in zip(refs_a, refs_base, refs_b) for ref in triple]
        assert results == expected
        assert engine.parts.bank.num_leases(slot_a) == 0 and engine.parts.bank.num_leases(slot_b) == 0
    finally:
        engine.shutdown()


class _LeaseLog(InMemoryAdapterSource):
    """An in-memory source that records every lease it hands out and takes back."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, str]] = []

    async def acquire(self, name: str) -> int:
        slot = await super().acquire(name)
        self.events.append(("acquire", slot, name))
        return slot

    def share(self, slot: int, name: str) -> int:
        self.events.append(("share", slot, name))
        return super().share(slot, name)

    def release(self, slot: int, name: str) -> None:
        self.events.append(("release", slot, name))
        super().release(slot, name)


def test_each_choice_of_n_holds_a_lease_from_the_source_until_it_ends(tiny_llama):
    """n = 3 with an adapter: the source leases the first choice's slot and shares it with the other
    two; all three leases come back through the source (none taken from the slots behind its back)."""
    adapters = _LeaseLog()
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512, adapter_slots=2,
                                        max_lora_rank=16), adapters)
    try:
        adapters.add("a", peft_weights(_peft_model(tiny_llama, 1), "digest-a"))
        request = GenerateInput(SamplingParams(max_tokens=NEW_TOKENS, n=3, temperature=1.0, seed=3),
                                prompt_token_ids=tuple(PROMPTS[0]), lora="a")

        async def main():
            return {out.index async for out in engine.generate(request)}

        assert asyncio.run(main()) == {0, 1, 2}
        slot = engine.parts.bank.slot_of("digest-a")
        assert adapters.events[:3] == [("acquire", slot, "a"), ("share", slot, "a"), ("share", slot, "a")]
        assert sorted(adapters.events[3:]) == [("release", slot, "a")] * 3
        assert engine.parts.bank.num_leases(slot) == 0 and engine.parts.bank.leases_by_name() == {}
    finally:
        engine.shutdown()


def test_bank_leases_lru_and_slot_rewrite():
    shapes = {"m.q": (4, 4), "m.v": (4, 2)}
    bank = AdapterSlots(num_slots=2, max_rank=4, module_shapes=shapes)
    w = lambda d, name, val: LoRAWeights(d, {name: (torch.full((2, shapes[name][0]), val), torch.full((shapes[name][1], 2), val))})
    assert bank.load(w("a", "m.q", 1.0)) == 0
    assert bank.load(w("b", "m.v", 2.0)) == 1
    assert bank.acquire("a") == 0          # a leased; b idle
    assert bank.load(w("c", "m.v", 3.0)) == 1  # evicts idle b, never leased a
    assert bank.slot_of("b") is None
    assert bank.acquire("c") == 1
    assert bank.load(w("d", "m.q", 4.0)) is None  # every slot leased
    bank.release(0)
    assert bank.load(w("d", "m.v", 5.0)) == 0
    assert float(bank.factors("m.q")[0][0].abs().sum()) == 0.0  # reusing a slot rewrote every target
    with pytest.raises(InvalidArgument, match="exceeds max_lora_rank 4"):
        bank.load(LoRAWeights("e", {"m.q": (torch.zeros(8, 4), torch.zeros(4, 8))}))


def test_a_resident_digest_is_leased_from_its_slot_without_reading_the_weights_again():
    """Every request's lease of a resident adapter goes through `load`: it returns the slot at once,
    the factors in the slot stay those checked when they were loaded; a digest not resident is
    still checked in full."""
    shapes = {"m.q": (4, 4)}
    bank = AdapterSlots(num_slots=1, max_rank=2, module_shapes=shapes)
    assert bank.load(LoRAWeights("a", {"m.q": (torch.ones(2, 4), torch.ones(4, 2))})) == 0
    again = LoRAWeights("a", {"m.q": (torch.full((2, 4), float("nan")), torch.ones(4, 2))})
    assert bank.load_and_acquire(again, "a") == 0 and bank.num_leases(0) == 1
    assert torch.equal(bank.factors("m.q")[0][0], torch.ones(2, 4))
    bank.release(0, "a")
    with pytest.raises(InvalidArgument, match="not finite"):
        bank.load(LoRAWeights("b", {"m.q": (torch.full((2, 4), float("nan")), torch.ones(4, 2))}))
    assert bank.slot_of("a") == 0

def test_expert_targets_share_a_stacked_buffer_row_per_slot_and_expert():
    """Per-expert targets "<layer>.mlp.experts.<e>.<part>" live in one buffer per part, row
    slot * experts + e; reusing a slot zeroes all of its experts' rows."""
    shapes = {f"m.experts.{e}.down_proj": (3, 4) for e in range(3)} | {"m.experts.5.gate_up_proj": (4, 4)}
    bank = AdapterSlots(num_slots=2, max_rank=2, module_shapes=shapes, expert_parts={"m.experts.down_proj": 3})
    factors = lambda value: (torch.full((2, 3), value), torch.full((4, 2), value))
    assert bank.load(LoRAWeights("a", {"m.experts.1.down_proj": factors(1.0), "m.experts.2.down_proj": factors(2.0)})) == 0
    assert bank.load(LoRAWeights("b", {"m.experts.0.down_proj": factors(3.0)})) == 1
    a, b = bank.factors("m.experts.down_proj")
    assert a.shape == (6, 2, 3) and b.shape == (6, 4, 2)
    assert [float(a[row, 0, 0]) for row in range(6)] == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]
    assert float(b[4, 0, 0]) == 0.0 and float(b[2, 3, 1]) == 2.0
    assert bank.factors("m.experts.5.gate_up_proj") is None  # not a stacked part: its own name, unused yet
    bank.unload("a")
    assert bank.load(LoRAWeights("c", {"m.experts.5.gate_up_proj": (torch.ones(1, 4), torch.ones(4, 1))})) == 0
    assert float(bank.factors("m.experts.down_proj")[0][:3].abs().sum()) == 0.0  # slot 0's expert rows zeroed
    assert float(bank.factors("m.experts.down_proj")[0][3].abs().sum()) == 18.0  # slot 1's untouched


def test_tiled_slots_hold_the_factors_of_the_row_layout():
    """`tiled_bt` (the cpu backend's layout) stores each slot's B^T in 64-output tiles then the tail:
    read back as B it equals the [out, rank] view a bank without tiles holds, through loads of
    ranks below the max, stacked experts, a slot reused and an unload (values distinct per element,
    so a misplaced one shows)."""
    from services.decoder.lora.slots import untile_b

    shapes = {"m.q": (5, 131), "m.v": (5, 64), "m.k": (5, 7)} | {f"m.experts.{e}.down_proj": (3, 70) for e in range(2)}
    banks = [AdapterSlots(num_slots=2, max_rank=4, module_shapes=shapes, expert_parts={"m.experts.down_proj": 2},
                          tiled_bt=tiled) for tiled in (False, True)]
    torch.manual_seed(3)

    def weights(digest, rank, names):
        return LoRAWeights(digest, {n: (torch.randn(rank, shapes[n][0]), torch.randn(shapes[n][1], rank)) for n in names})

    loads = [weights("a", 3, ["m.q", "m.k", "m.experts.1.down_proj"]), weights("b", 4, list(shapes)),
             weights("c", 1, ["m.v", "m.experts.0.down_proj"])]
    for step, w in enumerate(loads):
        for bank in banks:
            if step == 2:
                bank.unload("a")
            assert bank.load(w) == [0, 1, 0][step]
        for key, out in (("m.q", 131), ("m.v", 64), ("m.k", 7), ("m.experts.down_proj", 70)):
            rows, tiled = banks[0].factors(key), banks[1].factors(key)
            if rows is None:  # no adapter has targeted it yet
                assert tiled is None and step == 0
                continue
            assert torch.equal(rows[0], tiled[0])
            assert tiled[1].shape == (rows[1].shape[0], 4 * out) and tiled[1].is_contiguous()
            assert torch.equal(untile_b(tiled[1], out), rows[1]), (step, key)
    assert float(banks[1].factors("m.q")[1][0].abs().sum()) == 0.0  # c does not target m.q: slot 0 rewritten


def test_a_slot_buffer_the_device_cannot_hold_is_refused_and_evicts_nothing():
    """Stacked expert buffers hold slots x experts x max_rank x (in + out) values, allocated on the
    first expert adapter: past the device, that load is refused naming the size; resident
    adapters stay."""
    from services.common.errors import ResourceExhausted

    shapes = {"m.q": (4, 4), "m.experts.0.down_proj": (2**22, 2**22)}
    bank = AdapterSlots(num_slots=1, max_rank=64, module_shapes=shapes, expert_parts={"m.experts.down_proj": 2**12})
    assert bank.load(LoRAWeights("a", {"m.q": (torch.ones(1, 4), torch.ones(4, 1))})) == 0
    huge = LoRAWeights("huge", {"m.experts.0.down_proj": (torch.zeros(1, 2**22), torch.zeros(2**22, 1))})
    with pytest.raises(ResourceExhausted, match=r"LoRA slots for m.experts.down_proj need 8192.00 GiB .*lower "
                                                r"--adapter-slots or --max-lora-rank"):
        bank.load(huge)
    assert bank.slot_of("a") == 0 and bank.factors("m.experts.down_proj") is None


def test_non_finite_logits_fail_only_their_request(tiny_llama):
    """An adapter whose (finite) weights overflow the model gives NaN/inf logits: that request ends
    with FAILED_PRECONDITION naming it, and a sampled neighbour in the same batch is unharmed (NaN
    probabilities used to fail multinomial, and with it every request of the step)."""
    from services.common.errors import FailedPrecondition

    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512, adapter_slots=2,
                                        max_lora_rank=16), InMemoryAdapterSource())
    shapes = engine.parts.bank.module_shapes
    huge = LoRAWeights("huge", {name: (torch.full((4, i), 1e30), torch.full((o, 4), 1e30))
                                for name, (i, o) in shapes.items() if name.endswith(("o_proj", "down_proj"))})
    slot = engine.parts.bank.load(huge)
    engine.adapters.add("huge", huge)

    async def sampled(lora):
        request = GenerateInput(SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True),
                                prompt_token_ids=tuple(PROMPTS[1]), lora=lora)
        return [t async for out in engine.generate(request) for t in out.token_ids]

    async def main():
        alone = await sampled("")
        together = await asyncio.gather(sampled("huge"), sampled(""), return_exceptions=True)
        return alone, together

    try:
        alone, (bad, neighbour) = asyncio.run(main())
        assert isinstance(bad, FailedPrecondition) and "not finite" in str(bad), bad
        assert neighbour == alone and len(alone) == 8
        assert engine.parts.bank.num_leases(slot) == 0 and engine.stats().num_free_blocks == 64
    finally:
        engine.shutdown()


def test_an_overflowing_request_leaves_no_poison_in_reused_blocks(tiny_llama):
    """Its blocks go back to the pool and are reused; a later request's padded and stale slots are
    multiplied by probability 0 in attention, so a NaN or inf left there would turn unrelated base
    requests into NaN. They must match a fresh engine exactly."""
    from services.common.errors import FailedPrecondition

    def engine_():
        return start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=6, block_size=16, max_model_len=96,
                                          adapter_slots=2, max_lora_rank=16, enable_prefix_caching=False),
                            InMemoryAdapterSource())

    def run(engine, prompt, lora=""):
        async def go():
            request = GenerateInput(SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=tuple(prompt),
                                    lora=lora)
            return [t async for out in engine.generate(request) for t in out.token_ids]
        return asyncio.run(go())

    prompts = [list(range(10 + i, 10 + i + 5 + 7 * i)) for i in range(5)]
    fresh = engine_()
    try:
        expected = [run(fresh, p) for p in prompts]
    finally:
        fresh.shutdown()
    engine = engine_()
    try:
        huge = LoRAWeights("huge", {name: (torch.full((4, i), 1e30), torch.full((o, 4), 1e30))
                                    for name, (i, o) in engine.parts.bank.module_shapes.items()})
        engine.parts.bank.load(huge)
        engine.adapters.add("huge", huge)
        for _ in range(3):
            with pytest.raises(FailedPrecondition, match="not finite"):
                run(engine, list(range(200, 260)), "huge")
        assert [run(engine, p) for p in prompts] == expected
        assert all(bool(torch.isfinite(v).all()) for v in engine.parts.cache.value)
    finally:
        engine.shutdown()


def test_hidden_states_past_float32_range_fail_the_request(tiny_llama):
    """An adapter that slips past the registry's checks (loaded straight into the bank) and drives the
    residual stream to ~1e21: finite, but RMSNorm's mean(x^2) overflows, scaling rows to zeros, so the
    logits were flat and finite and greedy served token 0 forever. The request must fail instead."""
    from services.common.errors import FailedPrecondition

    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512, adapter_slots=2,
                                        max_lora_rank=16), InMemoryAdapterSource())
    name = "model.layers.0.self_attn.o_proj"
    in_f, out_f = engine.parts.bank.module_shapes[name]
    loud = LoRAWeights("loud", {name: (torch.full((4, in_f), 1.0), torch.full((out_f, 4), 1e20))})
    slot = engine.parts.bank.load(loud)
    engine.adapters.add("loud", loud)

    async def run(lora):
        request = GenerateInput(SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True),
                                prompt_token_ids=tuple(PROMPTS[1]), lora=lora)
        return [out async for out in engine.generate(request)]

    try:
        with pytest.raises(FailedPrecondition, match="hidden states or logits of this request are not finite"):
            asyncio.run(run("loud"))
        base = asyncio.run(run(""))  # the base model is unharmed
        assert sum(len(out.token_ids) for out in base) == 4
        assert engine.parts.bank.num_leases(slot) == 0 and engine.stats().num_free_blocks == 64
    finally:
        engine.shutdown()
