"""Executes one scheduler step: flat batch inputs, the attention backend's metadata, forward, sampling.

Flat batch layout (two requests, one decoding, one prefilling a chunk):

    rows:        0   | 1   2   3   4
    request:     A   | B   B   B   B
    position:    37  | 16  17  18  19       (physical; M-RoPE rows use the request's table/delta)
    slot:        A's block_table[37 // bs] * bs + 37 % bs, ...

Only requests whose chunk reaches their last token are sampled (their last row's logits).

Inputs and the attention backend's metadata are built on the host, then moved to the cache's
device once per step (`on_device`), so no layer copies between host and device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tessera.common.errors import FailedPrecondition, InvalidArgument, TesseraError
from tessera.decoder.attention import AttentionMetadata, make_attention_backend
from tessera.decoder.block_manager import BlockManager
from tessera.decoder.kernels.pointwise import CpuPointwise, attach_pointwise
from tessera.decoder.kv_cache import KVCache
from tessera.decoder.linear import attach_gemm, make_linear_backend
from tessera.decoder.lora import BASE_SLOT, LoRAContext, attach_context
from tessera.decoder.model_llama import LlamaForCausalLM
from tessera.decoder.request import Request
from tessera.decoder.sampler import Sample, SamplingRow, sample
from tessera.decoder.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # int64 [num_tokens]
    positions: torch.Tensor        # int64 [num_tokens] or [3, num_tokens]
    meta: AttentionMetadata         # the attention backend's own metadata type
    decode_rows: torch.Tensor | None  # int64 [num_decodes] rows of single-token (decode) requests; None: none
    embed_rows: torch.Tensor | None  # int64 [n] rows replaced by image rows
    embed_values: torch.Tensor | None  # [n, hidden]
    token_slots: torch.Tensor | None  # int64 [num_tokens] adapter slot per row (-1 = base)
    sample_rows: torch.Tensor       # int64 [num_sampled] last row of each sampled request
    sampled: list[ScheduledRequest]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, block_manager: BlockManager,
                 lora: LoRAContext | None, mrope: bool, attention_backend: str = "torch",
                 linear_backend: str = "torch") -> None:
        """`attention_backend`: a name in tessera/decoder/attention's registry, constructed here;
        `linear_backend`: "torch" or "cpu" (the C GEMM on weights packed here, tessera/decoder/linear.py,
        and the C RMSNorm, rotary and SiLU gate, kernels/pointwise.py).

        Raises:
            ValueError: an unknown backend, or one that cannot run on this machine.
        """
        self.attention = make_attention_backend(attention_backend)
        self.model = model
        attach_gemm(model, make_linear_backend(linear_backend))
        attach_pointwise(model, CpuPointwise() if linear_backend == "cpu" else None)
        self.cache = cache
        self.block_manager = block_manager
        self.lora = lora  # this runner's per-step LoRA state; the model's LoRALinear layers call it
        if lora is not None:
            attach_context(model, lora)
        self.mrope = mrope

    def prepare(self, out: SchedulerOutput) -> ModelInputs:
        ids, positions, decode_rows, embed_rows, embed_values, token_slots = [], [], [], [], [], []
        sample_rows, sampled = [], []
        row = 0
        for item in out.scheduled:
            request, start, end = item.request, item.start, item.end
            ids.extend(request.token_ids(start, end))
            positions.append(request.rope_positions(start, end, self.mrope))
            if item.num_new_tokens == 1:
                decode_rows.append(row)
            offsets, blocks = request.image_rows(start, end)
            embed_rows.extend(row + o for o in offsets)
            embed_values.extend(blocks)
            slot = BASE_SLOT if request.lora_slot is None else request.lora_slot
            token_slots.append(torch.full((item.num_new_tokens,), slot, dtype=torch.long))
            if item.samples:
                sample_rows.append(row + item.num_new_tokens - 1)
                sampled.append(item)
            row += item.num_new_tokens
        block_tables = [self.block_manager.block_table(item.request.key) for item in out.scheduled]
        meta = self.attention.build_metadata(out.scheduled, block_tables, self.cache)
        slot_tensor = torch.cat(token_slots)
        device = self.cache.device
        return ModelInputs(
            input_ids=on_device(torch.tensor(ids, dtype=torch.long), device),
            positions=on_device(torch.cat(positions, dim=-1), device),
            meta=on_device(meta, device),
            decode_rows=on_device(torch.tensor(decode_rows, dtype=torch.long), device) if decode_rows else None,
            embed_rows=on_device(torch.tensor(embed_rows, dtype=torch.long), device) if embed_rows else None,
            embed_values=on_device(torch.cat(embed_values), device) if embed_values else None,
            token_slots=on_device(slot_tensor, device) if bool((slot_tensor != BASE_SLOT).any()) else None,
            sample_rows=on_device(torch.tensor(sample_rows, dtype=torch.long), device),
            sampled=sampled,
        )

    @torch.inference_mode()
    def logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Float32 logits [num_sampled, vocab] for the sampled requests' last rows.

        A row whose hidden state left float32's range reads as NaN: RMSNorm's statistic
        mean(x^2) overflows to inf for finite |x| past ~1e19 and then scales the row to zeros,
        which would give flat, finite logits (garbage tokens served as if fine).
        """
        if self.lora is None:
            hidden = self._forward(inputs)
        else:
            with self.lora.step(inputs.token_slots, inputs.decode_rows):
                hidden = self._forward(inputs)
        residual = hidden[inputs.sample_rows]  # [num_sampled, hidden], before the final norm
        logits = self.model.compute_logits(residual)  # [num_sampled, vocab]
        overflow = ~torch.isfinite(residual.float().pow(2).mean(-1))  # [num_sampled], as RMSNorm computes it
        return logits.masked_fill_(overflow[:, None], float("nan"))

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.cache, self.attention, inputs.meta,
                          inputs.embed_rows, inputs.embed_values)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, Sample | TesseraError]:
        """Run the step; returns {request key: sample} for requests that sampled.

        A request whose hidden state or logits are not all finite (NaN/inf, or past float32's
        range: an adapter with absurd weights, image rows of absurd magnitude) gets an error instead
        of a sample: no token is drawn from meaningless scores, and its NaNs never reach the sampling
        of its neighbours (multinomial would fail the whole step).
        """
        inputs = self.prepare(out)
        if not inputs.sampled:
            self.logits(inputs)
            return {}
        logits = self.logits(inputs)
        requests = [item.request for item in inputs.sampled]
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        kept = [r for r, ok in zip(requests, finite) if ok]
        if len(kept) < len(requests):
            logits = logits[[i for i, ok in enumerate(finite) if ok]]
        rows = [SamplingRow(r.sampling, r.generator, r.prompt.token_ids, r.output_token_ids) for r in kept]
        results: dict[str, Sample | TesseraError] = {r.key: s for r, s in zip(kept, sample(logits, rows))}
        results.update((r.key, _non_finite(r)) for r, ok in zip(requests, finite) if not ok)
        return results


def on_device(value, device: torch.device):
    """`value` with every tensor it holds (dataclass fields, lists, tuples, nested) on `device`; a
    dataclass is changed in place. Anything else is returned as it is. The CPU path is untouched."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list | tuple):
        return type(value)(on_device(item, device) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            object.__setattr__(value, field.name, on_device(getattr(value, field.name), device))
    return value


def _non_finite(request: Request) -> TesseraError:
    """The error for a request whose hidden state or logits are not finite: FAILED_PRECONDITION
    when its adapter is the likely cause, INVALID_ARGUMENT when its image rows are, else INTERNAL."""
    what = "the hidden states or logits of this request are not finite (NaN, inf, or past float32's range)"
    if request.lora_slot is not None:
        adapter = request.lora_name or f"slot {request.lora_slot}"
        return FailedPrecondition(f"{what} under adapter {adapter!r}; its weights overflow the model, so no token "
                                  "can be drawn")
    if request.prompt.image_spans:
        return InvalidArgument(f"{what}; its image rows drive the model out of range, so no token can be drawn")
    return TesseraError(what)
