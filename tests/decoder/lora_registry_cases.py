"""Helpers for multi-LoRA tests against a real registry process: adapter directories, the
registry subprocess, PEFT references and engine requests (imported by tests/decoder/test_lora_*).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import torch
from decoder_testing import hf_reference
from lora_mixed_cases import MAX_RANK, save_adapters
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from services.common.launch import ServiceProcess
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine, start_engine
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import adapters_pb2

PROMPT = [1, 5, 77, 300, 12, 9, 44, 8, 19]
NEW_TOKENS = 6
WEIGHTS_FILE = "adapter_model.safetensors"


def save_all_adapters(model_dir: Path, root: Path) -> None:
    """plain4 / rs8 / pattern16 (lora_mixed_cases) plus "qv8": rank 8 on q_proj and v_proj only."""
    save_adapters(model_dir, root)
    torch.manual_seed(7)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir).eval(),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(root / "qv8")


def save_variant(root: Path, source: str, name: str, factor: float) -> None:
    """root/name: a copy of root/source with every LoRA tensor scaled by `factor` (a new digest)."""
    shutil.copytree(root / source, root / name)
    tensors = {k: v * factor for k, v in load_file(root / source / WEIGHTS_FILE).items()}
    save_file(tensors, root / name / WEIGHTS_FILE)


def start_registry(model_dir: Path, root: Path, db: Path, address: str | None = None) -> ServiceProcess:
    """The registry as an OS process (no admin token) on `address` (default: a free port)."""
    service = ServiceProcess("services.adapters", ["--root", str(root), "--db", str(db), "--base-model-dir",
                                                   str(model_dir), "--max-rank", str(MAX_RANK)],
                             env={"TESSERA_ADMIN_TOKEN": ""})
    if address is not None:
        service.address = address
    return service.start()


def peft_ids(model_dir: Path, adapter_dir: Path | None, prompt=PROMPT, new_tokens=NEW_TOKENS) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return hf_reference(model, prompt, new_tokens)[0]


def make_engine(model_dir: Path, address: str, slots: int) -> LLMEngine:
    config = DecoderConfig(model_dir=str(model_dir), num_blocks=64, max_model_len=256, adapter_slots=slots,
                           max_lora_rank=MAX_RANK, adapters_address=address)
    engine = start_engine(config, RegistryAdapterSource.from_config(config))
    engine.adapters.report_interval_s = 0.05
    engine.adapters.slot_wait_poll_s = 0.2
    return engine


async def generate(engine: LLMEngine, lora: str | None, prompt=PROMPT, new_tokens=NEW_TOKENS,
                   request_id: str = "") -> list[int]:
    request = GenerateInput(SamplingParams(max_tokens=new_tokens, ignore_eos=True), request_id=request_id,
                            prompt_token_ids=tuple(prompt), lora=lora)
    return [t async for out in engine.generate(request) for t in out.token_ids]


def load_request(name: str, path: str, replace: bool = False) -> adapters_pb2.LoadAdapterRequest:
    return adapters_pb2.LoadAdapterRequest(name=name, path=path, replace=replace)


def assert_nothing_leaked(engine: LLMEngine) -> None:
    """No lease, waiter, running or waiting request is left; every slot is reusable."""
    bank = engine.parts.bank
    assert all(bank.num_leases(s) == 0 for s in range(bank.num_slots))
    assert set(bank.residency().values()) <= {0}
    assert bank.num_idle() == bank.num_slots
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert engine.adapters.host_cache.num_bytes <= engine.adapters.host_cache.max_bytes


def run(coro):
    return asyncio.run(coro)
