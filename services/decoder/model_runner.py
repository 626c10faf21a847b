"""Executes one scheduler step: flat batch inputs, the attention backend's metadata, forward, sampling.

Flat batch layout (two requests, one decoding, one prefilling a chunk):

    rows:        0   | 1   2   3   4
    request:     A   | B   B   B   B
    position:    37  | 16  17  18  19       (physical; M-RoPE rows use the request's table/delta)
    slot:        A's block_table[37 // bs] * bs + 37 % bs, ...

Only requests whose chunk reaches their last token are sampled (their last row's logits). A
request that asks for prompt logprobs also has its chunk's prompt rows projected to the vocabulary
(the row at position j scores prompt token j + 1), a slice of rows at a time; no other row is.

Inputs and the attention backend's metadata are built on the host, then moved to the cache's
device once per step (`on_device`), so no layer copies between host and device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from services.common.errors import FailedPrecondition, InvalidArgument, TesseraError
from services.decoder.attention import AttentionMetadata, make_attention_backend
from services.decoder.block_manager import BlockManager
from services.decoder.decode_step import attach_decode_step
from services.decoder.grammar import fill_bitmask
from services.decoder.kernels.pointwise import CpuPointwise, attach_pointwise
from services.decoder.kv_cache import KVCache
from services.decoder.linear import attach_gemm, make_linear_backend
from services.decoder.lora import BASE_SLOT, LoRAContext, attach_context
from services.decoder.model_llama import LlamaForCausalLM
from services.decoder.quantized_model import to_triton
from services.decoder.request import Request
from services.decoder.sampler import Sample, SamplingRow, sample
from services.decoder.scheduler import ScheduledRequest, SchedulerOutput

# Prompt rows are projected to the vocabulary this many at a time, so a prefill chunk with prompt
# logprobs holds at most [PROMPT_LOGITS_ROWS, vocab] float32 logits at once, whatever its length.
PROMPT_LOGITS_ROWS = 128


@dataclass
class PromptRows:
    """One request's rows of a step whose prompt logprobs are recorded: `num_rows` consecutive
    positions from `start`, each with `num_alternatives` alternatives."""

    key: str
    start: int
    num_rows: int
    num_alternatives: int


@dataclass
class PromptLogprobsChunk:
    """Entries for prompt positions start, start + 1, ... (`PromptLogprobs.record` takes them)."""

    start: int
    entries: list[Sample]


@dataclass
class RunnerOutput:
    """What a step computed, by request key: a sample (or the error that replaced it) for each
    request whose chunk sampled, prompt logprobs for each that asked and computed prompt rows."""

    samples: dict[str, Sample | TesseraError] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    mask_seconds: float | None = None  # filling the structured-output masks (None: no constrained row)


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
    prompt_rows: torch.Tensor | None = None  # int64 [num_prompt_rows] rows whose prompt logprobs are recorded
    prompt_targets: torch.Tensor | None = None  # int64 [num_prompt_rows] the prompt token each row predicts
    prompt_spans: list[PromptRows] = field(default_factory=list)  # prompt_rows by request, in row order


def in_inference_mode(fn):
    """`fn` under torch.inference_mode(), entered only where the caller is not in it already: inside
    `ModelRunner.execute` (itself under it) its steps skip the context manager's enter and exit, which
    ran cold after the weights streamed through the caches (~10 us apiece at batch 1)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapper


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, block_manager: BlockManager,
                 lora: LoRAContext | None, mrope: bool, attention_backend: str = "torch",
                 linear_backend: str = "torch", decode_step: str = "modules", pointwise: bool | None = None) -> None:
        """`attention_backend`: a name in services/decoder/attention's registry, constructed here;
        `linear_backend`: "torch", "cpu" (the C GEMM on weights packed here, services/decoder/linear.py,
        and the C RMSNorm, rotary and SiLU gate, kernels/pointwise.py) or "triton" (torch for dense
        weights, GGUF blocks moved to the cache's device for the Triton kernels, quantized_model.py
        `to_triton`); `decode_step`: "auto", "fused"
        or "modules" (decode_step.py `attach_decode_step`; the resolved name is `self.decode_step`);
        `pointwise`: the C RMSNorm, rotary and SiLU gate (kernels/pointwise.py) on the modules' path,
        None: with the cpu linear backend only.

        Raises:
            ValueError: an unknown backend, or one that cannot run on this machine.
        """
        self.attention = make_attention_backend(attention_backend)
        self.model = model
        attach_gemm(model, make_linear_backend(linear_backend))
        attach_pointwise(model, CpuPointwise() if (linear_backend == "cpu" if pointwise is None else pointwise) else None)
        if linear_backend == "triton":
            to_triton(model, cache.device, next(p.dtype for p in model.parameters() if p.is_floating_point()))
        self.cache = cache
        self.block_manager = block_manager
        self.lora = lora  # this runner's per-step LoRA state; the model's LoRALinear layers call it
        if lora is not None:
            attach_context(model, lora)
        self.decode_step = attach_decode_step(decode_step, model, cache, attention_backend, lora)
        self.mrope = mrope
        # one worker fills structured-output masks during the forward (execute)
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def prepare(self, out: SchedulerOutput) -> ModelInputs:
        ids, positions, decode_rows, embed_rows, embed_values, slots, counts = [], [], [], [], [], [], []
        sample_rows, sampled = [], []
        prompt_rows, prompt_targets, prompt_spans = [], [], []
        row = 0
        for item in out.scheduled:
            request, start, end = item.request, item.start, item.end
            ids.extend(request.token_ids(start, end))
            if self.mrope:
                positions.append(request.mrope_positions(start, end))
            else:  # ints, one tensor for the step (a decode row's arange cost more than its position)
                positions.extend(request.rope_range(start, end))
            if item.num_new_tokens == 1:
                decode_rows.append(row)
            offsets, blocks = request.image_rows(start, end)
            embed_rows.extend(row + o for o in offsets)
            embed_values.extend(blocks)
            slots.append(BASE_SLOT if request.lora_slot is None else request.lora_slot)
            counts.append(item.num_new_tokens)
            if item.samples:
                sample_rows.append(row + item.num_new_tokens - 1)
                sampled.append(item)
            span = _prompt_rows(item)
            if span is not None:
                prompt_rows.extend(range(row + span.start - start, row + span.start - start + span.num_rows))
                prompt_targets.extend(request.prompt.token_ids[span.start + 1:span.start + span.num_rows + 1])
                prompt_spans.append(span)
            row += item.num_new_tokens
        block_tables = [self.block_manager.block_table(item.request.key) for item in out.scheduled]
        meta = self.attention.build_metadata(out.scheduled, block_tables, self.cache)
        adapters = any(slot != BASE_SLOT for slot in slots)
        one_token_each = all(count == 1 for count in counts)  # then the token slots are the requests'
        device = self.cache.device
        # the step's int64 vectors as slices of one tensor: one op where four ran, each cold at batch 1
        # (after the weights stream through the caches a tensor's creation took 10-30 us)
        num_ids, num_decode, num_sampled = len(ids), len(decode_rows), len(sample_rows)
        flat = torch.tensor(ids + ([] if self.mrope else positions) + decode_rows + sample_rows
                            + (slots if adapters and one_token_each else []), dtype=torch.long)
        at = num_ids if self.mrope else 2 * num_ids  # where decode_rows begin
        # each token's adapter slot, None when every row is the base model's (no tensor work then)
        token_slots = None
        if adapters:
            token_slots = (flat[at + num_decode + num_sampled:] if one_token_each
                           else torch.tensor(slots, dtype=torch.long).repeat_interleave(torch.tensor(counts)))
        return ModelInputs(
            input_ids=on_device(flat[:num_ids], device),
            positions=on_device(torch.cat(positions, dim=-1) if self.mrope else flat[num_ids:at], device),
            meta=on_device(meta, device),
            decode_rows=on_device(flat[at:at + num_decode], device) if decode_rows else None,
            embed_rows=on_device(torch.tensor(embed_rows, dtype=torch.long), device) if embed_rows else None,
            embed_values=on_device(torch.cat(embed_values), device) if embed_values else None,
            token_slots=None if token_slots is None else on_device(token_slots, device),
            sample_rows=on_device(flat[at + num_decode:at + num_decode + num_sampled], device),
            sampled=sampled,
            prompt_rows=on_device(torch.tensor(prompt_rows, dtype=torch.long), device) if prompt_rows else None,
            prompt_targets=on_device(torch.tensor(prompt_targets, dtype=torch.long), device) if prompt_rows else None,
            prompt_spans=prompt_spans,
        )

    @in_inference_mode
    def hidden(self, inputs: ModelInputs) -> torch.Tensor:
        """The forward under this step's adapters: the last layer's residual stream [num_tokens, hidden]."""
        if self.lora is None:
            return self._forward(inputs)
        with self.lora.step(inputs.token_slots, inputs.decode_rows):
            return self._forward(inputs)

    @in_inference_mode
    def logits(self, inputs: ModelInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, list[bool], list[int] | None]:
        """Float32 logits [num_sampled, vocab] for the sampled requests' last rows of `hidden`
        [num_tokens, hidden], whether each row's logits are all finite, and each row's greedy token
        (argmax, the first of equal maxima) where the fused step's logits call found it, else None.

        A row whose hidden state left float32's range reads as NaN: RMSNorm's statistic
        mean(x^2) overflows to inf for finite |x| past ~1e19 and then scales the row to zeros,
        which would give flat, finite logits (garbage tokens served as if fine). The fused decode
        step computes the same in one C call (decode_step.py `FusedDecode.logits`) where it can.
        """
        # [num_sampled, hidden], before the final norm; every row when every row samples (rows ascend)
        residual = hidden if len(inputs.sampled) == hidden.shape[0] else hidden[inputs.sample_rows]
        fused = getattr(self.model, "fused_decode", None)
        done = None if fused is None else fused.logits(self.model, residual)
        if done is not None:
            return done
        logits = self.model.compute_logits(residual)  # [num_sampled, vocab]
        overflow = ~torch.isfinite(residual.float().pow(2).mean(-1))  # [num_sampled], as RMSNorm computes it
        logits.masked_fill_(overflow[:, None], float("nan"))
        return logits, torch.isfinite(logits).all(dim=-1).tolist(), None

    @in_inference_mode
    def prompt_logprobs(self, inputs: ModelInputs, hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        """Prompt logprobs of `inputs.prompt_rows` of `hidden` [num_tokens, hidden], by request key:
        log_softmax of the float32 logits (the raw model distribution, as the sampled logprobs),
        the logprob of the prompt token each row predicts, its rank (the tokens at least as likely,
        as vLLM's batched_count_greater_than) and the request's most likely alternatives (most
        likely first). Logits exist for PROMPT_LOGITS_ROWS rows at a time.
        """
        if inputs.prompt_rows is None:
            return {}
        residual = hidden[inputs.prompt_rows]  # [num_prompt_rows, hidden]
        num_top = max(span.num_alternatives for span in inputs.prompt_spans)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for lo in range(0, residual.shape[0], PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(residual[lo:lo + PROMPT_LOGITS_ROWS])  # [rows, vocab]
            logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
            targets = inputs.prompt_targets[lo:lo + PROMPT_LOGITS_ROWS, None]  # [rows, 1]
            target_logprobs = logprobs.gather(1, targets)  # [rows, 1]
            chosen.append(target_logprobs[:, 0])  # [rows]
            ranks.append((logprobs >= target_logprobs).sum(dim=-1))  # [rows]
            if num_top:
                values, ids = torch.topk(logprobs, num_top, dim=-1)  # [rows, num_top] each
                top_values.append(values)
                top_ids.append(ids)
        chosen_list = torch.cat(chosen).tolist()
        rank_list = torch.cat(ranks).tolist()
        target_list = inputs.prompt_targets.tolist()
        values_list = torch.cat(top_values).tolist() if num_top else [[] for _ in chosen_list]
        ids_list = torch.cat(top_ids).tolist() if num_top else [[] for _ in chosen_list]
        chunks, row = {}, 0
        for span in inputs.prompt_spans:
            k = span.num_alternatives
            entries = [Sample(target_list[r], chosen_list[r], list(zip(ids_list[r][:k], values_list[r][:k])),
                              rank_list[r]) for r in range(row, row + span.num_rows)]
            chunks[span.key] = PromptLogprobsChunk(span.start, entries)
            row += span.num_rows
        return chunks

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.cache, self.attention, inputs.meta,
                          inputs.embed_rows, inputs.embed_values)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step; returns the samples of requests that sampled and the prompt logprobs of
        those that asked (`prompt_logprobs`).

        A request whose hidden state or logits are not all finite (NaN/inf, or past float32's
        range: an adapter with absurd weights, image rows of absurd magnitude) gets an error instead
        of a sample: no token is drawn from meaningless scores, and its NaNs never reach the sampling
        of its neighbours (multinomial would fail the whole step). So does a request whose token
        controls mask every token (sampler.sample).
        """
        inputs = self.prepare(out)
        requests = [item.request for item in inputs.sampled]
        grammars = [r.grammar for r in requests]
        # the constrained rows' masks are filled on a worker thread while the forward runs (xgrammar
        # releases the GIL), as vLLM's and xgrammar's schedulers overlap them
        masks = (self._mask_pool.submit(fill_bitmask, grammars, self.model.spec.vocab_size)
                 if any(g is not None for g in grammars) else None)
        hidden = self.hidden(inputs)
        result = RunnerOutput(prompt_logprobs=self.prompt_logprobs(inputs, hidden))
        if not inputs.sampled:
            return result
        logits, finite, greedy = self.logits(inputs, hidden)
        grammar_mask = None
        if masks is not None:
            *grammar_mask, result.mask_seconds = masks.result()
        kept = [r for r, ok in zip(requests, finite) if ok]
        if len(kept) < len(requests):
            keep = [i for i, ok in enumerate(finite) if ok]
            logits = logits[keep]
            greedy = None if greedy is None else [greedy[i] for i in keep]
            if grammar_mask is not None:
                bitmask, rows_with = grammar_mask
                position = {old: new for new, old in enumerate(keep)}
                grammar_mask = (bitmask[keep], [position[i] for i in rows_with if i in position])
        rows = [SamplingRow(r.sampling, r.generator, r.prompt.token_ids, r.output_token_ids) for r in kept]
        result.samples.update((r.key, s) for r, s in zip(kept, sample(logits, rows, grammar_mask, greedy)))
        result.samples.update((r.key, _non_finite(r)) for r, ok in zip(requests, finite) if not ok)
        return result


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


def _prompt_rows(item: ScheduledRequest) -> PromptRows | None:
    """The positions of `item`'s chunk whose prompt logprobs its request asked for and has not
    recorded (None: none)."""
    record = item.request.prompt_logprobs
    if record is None:
        return None
    positions = record.positions_to_compute(item.start, item.end)
    if not positions:
        return None
    return PromptRows(item.request.key, positions.start, len(positions), record.num_alternatives)


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
