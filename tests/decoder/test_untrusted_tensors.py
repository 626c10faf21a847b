"""Tensors that reach the decoder from another service are checked on arrival, and its prefix cache
keys an image on the rows it received, not on the content hash a caller claims.

Driven through a real decoder service (gRPC, tiny seeded Qwen2-VL) with rows from the vision engine
in process, and through an adapter client fed by an in-process Adapters server that answers with
tampered factors.
"""

from __future__ import annotations

import asyncio
import copy
import io

import grpc
import numpy as np
import pytest
import torch
from decoder_testing import with_decoder_server
from PIL import Image

from services.common.errors import InvalidArgument
from services.common.server import create_server
from services.common.tensor import to_pb
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.lora import AdapterSlots
from services.decoder.types import GenerateInput, ImagePart, SamplingParams
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.processor import ImageSource
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
from tessera.v1 import adapters_pb2, adapters_pb2_grpc, decoder_pb2, tensor_pb2, vision_pb2
from tests.vision.qwen2_vl_tiny import build_tiny_qwen2_vl

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-vl-untrusted")
    build_tiny_qwen2_vl(directory)
    vision = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))
    pixels = np.random.default_rng(4).integers(0, 256, (84, 112, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    encoded = vision.encode(vision.process([ImageSource(data=png.getvalue())]))[0]
    return directory, encoded


def _config(directory) -> DecoderConfig:
    return DecoderConfig(model_dir=str(directory), num_blocks=64, block_size=4, max_model_len=512)


def _image(encoded, rows: tensor_pb2.Tensor | None = None) -> vision_pb2.EncodedImage:
    return vision_pb2.EncodedImage(rows=rows if rows is not None else to_pb(encoded.rows),
                                   grid_thw=list(encoded.grid_thw), mrope_section=list(encoded.mrope_section),
                                   content_hash=encoded.content_hash)


def _request(image: vision_pb2.EncodedImage) -> decoder_pb2.GenerateRequest:
    content = [decoder_pb2.ContentPart(text="Describe "), decoder_pb2.ContentPart(encoded_image=image),
               decoder_pb2.ContentPart(text=" briefly.")]
    return decoder_pb2.GenerateRequest(messages=[decoder_pb2.ChatMessage(role="user", content=content)],
                                       sampling=decoder_pb2.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))


async def _generate(stub, request) -> tuple[list[int], int]:
    """(token ids, cached prompt tokens) of one Generate."""
    ids, cached = [], -1
    async for response in stub.Generate(request):
        ids.extend(response.token_ids)
        if response.HasField("usage"):
            cached = response.usage.cached_prompt_tokens
    return ids, cached


def test_image_rows_are_checked_on_arrival(tiny):
    """Observed: all-NaN rows sent to the decoder port ended INTERNAL "logits not finite"."""
    directory, encoded = tiny
    rows = encoded.rows  # [t*h*w, hidden] float32
    nan = torch.full_like(rows, float("nan"))
    one_inf = rows.clone()
    one_inf[3, 5] = float("inf")
    bad = [
        (to_pb(nan), f"non-finite value(s) (NaN or inf) of {rows.numel()}"),
        (to_pb(one_inf), "holds 1 non-finite value(s)"),
        (to_pb(rows.to(torch.int32)), "tensor dtype int32 is not accepted here"),
        (to_pb(rows.flatten()), f"tensor has shape [{rows.numel()}]; expected [*, *]"),
        (tensor_pb2.Tensor(shape=list(rows.shape), dtype="float32", data=b"\0" * 12), "needs"),
        (to_pb(rows[:, :-1]), "the decoder's hidden size is"),
    ]

    async def body(stub, servicer):
        found = []
        for rows_pb, _ in bad:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await _generate(stub, _request(_image(encoded, rows_pb)))
            found.append((error.value.code(), error.value.details()))
        good, _ = await _generate(stub, _request(_image(encoded)))
        return found, good, servicer.engine.stats().num_free_blocks

    found, good, free = asyncio.run(with_decoder_server(_config(directory), body))
    for (code, details), (_, needle) in zip(found, bad):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert needle in details, details
    assert found[0][1].startswith("messages[0].content[1].encoded_image.rows:")
    assert len(good) == NEW_TOKENS and free == 64


def test_image_rows_must_be_finite_in_the_compute_dtype(tiny):
    """Rows are cast to the model's dtype: a float16 decoder refuses rows past 65504 (inf there)."""
    from services.decoder.engine import start_engine

    directory, encoded = tiny
    engine = start_engine(_config(directory))
    try:
        half = copy.copy(engine.parts.prompts)
        half.compute_dtype = torch.float16
        loud = ImagePart(encoded.rows * 1e6, encoded.grid_thw, encoded.mrope_section, encoded.content_hash)
        request = GenerateInput(SamplingParams(max_tokens=1), prompt=(loud,))
        with pytest.raises(InvalidArgument, match=r"must be finite in the decoder's float16 \(\|x\| <= 6.55e\+04\)"):
            half.build(request)
        assert engine.parts.prompts.build(request).num_image_tokens == encoded.rows.shape[0]  # float32 holds them
    finally:
        engine.shutdown()


def test_forged_rows_under_a_real_hash_never_share_the_images_kv(tiny):
    """Observed: rows x -3 sent with image X's real content hash were cached under X's key, and a
    later user of X was served that forged prefix. The key now digests the rows received."""
    from services.decoder.convert import generate_from_pb

    directory, encoded = tiny
    genuine = _request(_image(encoded))
    forged = _request(_image(encoded, to_pb(encoded.rows * -3)))

    async def genuine_forged_genuine(stub, servicer):
        span = servicer.engine.parts.prompts.build(generate_from_pb(genuine)).image_spans[0]
        return (span.start, span.end), [await _generate(stub, r) for r in (genuine, forged, genuine)]

    async def forged_then_genuine(stub, servicer):
        return [await _generate(stub, r) for r in (forged, genuine)]

    (start, end), [(ids1, cached1), (ids2, cached2), (ids3, cached3)] = asyncio.run(
        with_decoder_server(_config(directory), genuine_forged_genuine))
    first_image_block = start // 4 * 4  # text before it (chat header, vision start) may be shared
    assert cached1 == 0
    assert cached2 <= first_image_block < end  # none of the image's blocks
    assert ids2 != ids1  # the forged rows really change the answer
    assert cached3 >= end and ids3 == ids1  # the genuine image still reuses its own blocks

    # the order of the report: the forged request caches first, then a genuine user arrives
    [(forged_ids, _), (later_ids, later_cached)] = asyncio.run(
        with_decoder_server(_config(directory), forged_then_genuine))
    assert forged_ids == ids2
    assert later_cached <= first_image_block and later_ids == ids1


class _TamperedRegistry(adapters_pb2_grpc.AdaptersServicer):
    """Answers GetAdapter for any name with one q_proj pair whose lora_b is `lora_b`."""

    def __init__(self, lora_b: tensor_pb2.Tensor) -> None:
        self.lora_b = lora_b

    async def GetAdapter(self, request, context):
        info = adapters_pb2.AdapterInfo(name=request.name, digest="d" * 64, rank=2, state="ready")
        if not request.include_weights:
            return adapters_pb2.AdapterWeights(info=info)
        tensor = adapters_pb2.AdapterTensor(module="m.q_proj", lora_a=to_pb(torch.ones(2, 4)), lora_b=self.lora_b)
        return adapters_pb2.AdapterWeights(info=info, tensors=[tensor])

    async def ReportResidency(self, request, context):
        return adapters_pb2.ResidencyAck()


@pytest.mark.parametrize("lora_b, needle", [
    (to_pb(torch.full((4, 2), float("nan"))), "m.q_proj.lora_b: tensor holds 8 non-finite value(s)"),
    (to_pb(torch.ones(4, 2, dtype=torch.float64)), "m.q_proj.lora_b: tensor dtype float64 is not accepted here"),
    (to_pb(torch.ones(8)), "m.q_proj.lora_b: tensor has shape [8]; expected [*, *]"),
    (to_pb(torch.ones(5, 2)), "adapter factors at m.q_proj have shapes (2, 4), (5, 2)"),
])
def test_adapter_weights_from_the_registry_are_checked_on_arrival(lora_b, needle):
    async def main():
        server = create_server()
        adapters_pb2_grpc.add_AdaptersServicer_to_server(_TamperedRegistry(lora_b), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        bank = AdapterSlots(num_slots=1, max_rank=4, module_shapes={"m.q_proj": (4, 4)})
        client = RegistryAdapterSource(f"127.0.0.1:{port}", timeout_s=5.0)
        await client.start(bank)
        try:
            with pytest.raises(InvalidArgument) as refusal:
                await client.acquire("support")
            return str(refusal.value), bank.residency()
        finally:
            await client.close()
            await server.stop(0)

    message, residency = asyncio.run(main())
    assert needle in message, message
    assert residency == {}  # nothing reached the bank
