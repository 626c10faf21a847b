"""Prompt building: chat rendering, tokenization, image placeholder expansion and M-RoPE positions.

Each encoded image of grid (t, h, w) becomes t*h*w copies of the image token. M-RoPE positions
[3, T] follow transformers' Qwen2-VL `get_rope_index`: text has equal t/h/w coordinates; patch
(tt, hh, ww) of an image starting at text cursor c sits at (c+tt, c+hh, c+ww); text resumes at
c + max(t, h, w). rope delta = next text position - physical length.

Placeholder convention (Qwen2-VL's processor): when the checkpoint names vision start/end tokens,
an image becomes `<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>`;
the start/end tokens are text (equal coordinates on all axes). Literal placeholder or vision
tokens typed in user text (or sent as prompt_token_ids) are refused, so they never bind to an image.
"""

from __future__ import annotations

import functools

import jinja2
import jinja2.nodes
import torch
from jinja2.exceptions import TemplateError

from services.common.errors import InvalidArgument
from services.decoder.prefix_cache import rows_digest
from services.decoder.tools import template_tool_calls
from services.decoder.types import (
    ChatMessage,
    ChatTemplateOptions,
    GenerateInput,
    ImagePart,
    ImageSpan,
    Part,
    PromptInputs,
    RawImagePart,
    TextPart,
)

ROLES = ("system", "user", "assistant", "tool")
SENTINEL = "\u2063tessera-image\u2063"


def chat_text_joiner(tokenizer) -> str:
    """What joins a chat message's consecutive text parts, as vLLM renders them
    (vllm/entrypoints/chat_utils.py): a template that takes a message's content as one string gets
    the texts joined by "\n"; one that loops over the content's parts itself (Qwen2-VL's `{% for
    content in message['content'] %}`, vLLM's "openai" content format) puts them side by side, so
    nothing joins them. Images stay where they were among the texts either way."""
    return "" if _loops_over_content(getattr(tokenizer, "chat_template", None)) else "\n"


@functools.lru_cache(maxsize=8)
def _loops_over_content(template: str | None) -> bool:
    """Whether the jinja template has a `for` over some `x['content']` / `x.content` (as vLLM's
    content-format detection looks for)."""
    if not isinstance(template, str):
        return False
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        source = loop.iter
        while isinstance(source, jinja2.nodes.Filter):  # `message['content'] | list` and the like
            source = source.node
        if (isinstance(source, jinja2.nodes.Getitem) and isinstance(source.arg, jinja2.nodes.Const)
                and source.arg.value == "content") or (isinstance(source, jinja2.nodes.Getattr)
                                                        and source.attr == "content"):
            return True
    return False


def template_message(message: ChatMessage, content: str) -> dict:
    """The dict a chat template sees for `message` with its text `content`: role and content, and
    `name`, `tool_call_id` and `tool_calls` (transformers' form: services/decoder/tools.py) when
    the message has them (as vLLM's conversation entries).

    Raises:
        InvalidArgument: tool_calls on a message that is not the assistant's, or tool_call_id on
            one that is not a tool's.
    """
    entry = {"role": message.role, "content": content}
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidArgument(f"tool_calls are the assistant's; this message's role is {message.role!r}")
        entry["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id:
        if message.role != "tool":
            raise InvalidArgument(f"tool_call_id belongs to a message of role 'tool'; this one is {message.role!r}")
        entry["tool_call_id"] = message.tool_call_id
    return entry


def render_chat(tokenizer, messages: list[dict], options: ChatTemplateOptions) -> str:
    """`messages` ({"role", "content"} dicts) rendered with the tokenizer's chat template as
    `tokenizer.apply_chat_template(messages, tools=..., tokenize=False, add_generation_prompt=...,
    continue_final_message=..., **template_kwargs)` (tools None when the options have none);
    tokenized without adding special tokens again, the ids equal apply_chat_template's with
    tokenize=True.

    Raises:
        InvalidArgument: continue_final_message with a last message that is not the assistant's, or
            the template refused the messages (its raise_exception, as vLLM answers 400; a final
            message the template does not render as is; a variable it cannot use).
    """
    if options.continue_final_message and messages[-1]["role"] != "assistant":
        raise InvalidArgument(f"continue_final_message continues the last message, which must be the "
                              f"assistant's; it is {messages[-1]['role']!r}")
    try:
        return tokenizer.apply_chat_template(messages, tools=[dict(tool) for tool in options.tools] or None,
                                             tokenize=False, add_generation_prompt=options.add_generation_prompt,
                                             continue_final_message=options.continue_final_message,
                                             **options.template_kwargs)
    except (TemplateError, ValueError, TypeError) as error:  # the template's (or transformers') answer to this input
        raise InvalidArgument(f"the model's chat template refused the messages: {error}") from None


def check_chat_options(has_messages: bool, options: ChatTemplateOptions) -> None:
    """Chat template options other than the default apply to messages only.

    Raises:
        InvalidArgument: a prompt that is not messages with options that are not the default.
    """
    if not has_messages and not options.is_default:
        raise InvalidArgument("add_generation_prompt, continue_final_message, chat_template_kwargs and tools apply "
                              "to messages only (the chat template); this prompt is not messages")


class PromptBuilder:
    """Turns a GenerateInput into PromptInputs (token ids, image spans, M-RoPE positions)."""

    def __init__(self, tokenizer, vocab_size: int, hidden_size: int,
                 mrope_section: tuple[int, int, int] | None, image_token_id: int | None,
                 vision_start_id: int | None = None, vision_end_id: int | None = None,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        self.tokenizer = tokenizer
        self.compute_dtype = compute_dtype  # image rows must be finite in it
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.mrope_section = mrope_section
        self.image_token_id = image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id) if image_token_id is not None else None
        self.vision_start_id, self.vision_end_id = vision_start_id, vision_end_id
        reserved = [i for i in (image_token_id, vision_start_id, vision_end_id) if i is not None]
        self.reserved_ids = set(reserved)
        self.reserved_tokens = [tokenizer.convert_ids_to_tokens(i) for i in reserved]
        self.text_joiner = chat_text_joiner(tokenizer)

    def build(self, request: GenerateInput) -> PromptInputs:
        """Raises InvalidArgument for an empty or ambiguous prompt, bad images or bad token ids."""
        if request.prompt_token_ids:
            self._check_given(request)
            return self._from_token_ids(list(request.prompt_token_ids))
        pieces, images = self._pieces(request, self._check_image)
        return self._expand(pieces, images)

    def count_text_tokens(self, request: GenerateInput) -> int:
        """The tokens `build` makes of `request` besides its images' placeholder tokens (text, chat
        template, vision start/end), its images not encoded yet (RawImagePart or ImagePart: only
        counted). Raises InvalidArgument as `build`, but for the images' rows."""
        if request.prompt_token_ids:
            self._check_given(request)
            return len(self._from_token_ids(list(request.prompt_token_ids)).token_ids)
        pieces, images = self._pieces(request, self._check_image_place)
        wrap = (self.vision_start_id is not None) + (self.vision_end_id is not None)
        if not images and not any(pieces):
            raise InvalidArgument("the prompt is empty")
        return sum(len(piece) for piece in pieces) + wrap * len(images)

    def _check_given(self, request: GenerateInput) -> None:
        given = [bool(request.prompt), bool(request.messages), bool(request.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidArgument("exactly one of prompt, messages or prompt_token_ids must be set "
                                  f"(got {sum(given)}); an empty prompt is not accepted")
        check_chat_options(bool(request.messages), request.chat)

    def _pieces(self, request: GenerateInput, check_image) -> tuple[list[list[int]], list]:
        """Token ids of the text between images (rendered with the chat template for messages) and
        the images, each checked by `check_image`."""
        self._check_given(request)
        if request.messages:
            pieces, images = self._render_chat(request.messages, request.chat, check_image)
            return self._tokenize(pieces, specials=False), images
        pieces, images = self._split_parts(request.prompt, check_image=check_image)
        return self._tokenize(pieces, specials=True), images

    def _check_tokenized(self, pieces: list[list[int]]) -> list[list[int]]:
        """A tokenizer whose added tokens lie past the model's embedding rows (special tokens added
        without resizing the embeddings) gives ids the model has no row for: refused here, for this
        request, before they reach a batch."""
        for piece in pieces:
            bad = [i for i in piece if not 0 <= i < self.vocab_size]
            if bad:
                token = self.tokenizer.convert_ids_to_tokens(bad[0])
                raise InvalidArgument(f"the prompt tokenizes to id {bad[0]} ({token!r}), outside the model's "
                                      f"vocabulary [0, {self.vocab_size}): the checkpoint's tokenizer has tokens "
                                      "its embeddings do not")
        return pieces

    def _from_token_ids(self, ids: list[int]) -> PromptInputs:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        reserved = sorted(self.reserved_ids.intersection(ids))
        if reserved:
            raise InvalidArgument(f"prompt_token_ids contain the image placeholder token {reserved[0]}; send images as parts")
        return self._expand([ids], [])

    def _split_parts(self, parts: tuple[Part, ...], joiner: str = "",
                     check_image=None) -> tuple[list[str], list[ImagePart]]:
        """Text between images (len(images) + 1 pieces, consecutive text parts joined by `joiner`)
        and the images in order, each checked by `check_image` (default `_check_image`)."""
        check_image = check_image or self._check_image
        pieces, images, current = [], [], []
        for part in parts:
            if isinstance(part, TextPart):
                self._check_text(part.text)
                current.append(part.text)
            else:
                images.append(check_image(part))
                pieces.append(joiner.join(current))
                current = []
        pieces.append(joiner.join(current))
        return pieces, images

    def _render_chat(self, messages: tuple[ChatMessage, ...], options: ChatTemplateOptions,
                     check_image=None) -> tuple[list[str], list[ImagePart]]:
        rendered, images = [], []
        for message in messages:
            if message.role not in ROLES:
                raise InvalidArgument(f"unknown chat role {message.role!r}; expected one of {ROLES}")
            pieces, message_images = self._split_parts(message.content, self.text_joiner, check_image)
            images.extend(message_images)
            rendered.append(template_message(message, SENTINEL.join(pieces)))
        pieces = render_chat(self.tokenizer, rendered, options).split(SENTINEL)
        if len(pieces) != len(images) + 1:
            raise InvalidArgument("the chat template dropped or duplicated image parts")
        return pieces, images

    def _tokenize(self, pieces: list[str], specials: bool) -> list[list[int]]:
        """Token ids per text piece; with `specials`, the tokenizer's own BOS/EOS wrap the whole prompt.
        Raises InvalidArgument for an id past the model's vocabulary."""
        if len(pieces) == 1:
            return self._check_tokenized([self.tokenizer(pieces[0], add_special_tokens=specials)["input_ids"]])
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces]
        if specials:
            prefix, suffix = self._special_wrap()
            ids[0], ids[-1] = prefix + ids[0], ids[-1] + suffix
        return self._check_tokenized(ids)

    def _special_wrap(self) -> tuple[list[int], list[int]]:
        plain = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        return [], []

    def _check_text(self, text: str) -> None:
        for token in self.reserved_tokens:
            if token and token in text:
                what = "the image token" if token == self.image_token else "the image placeholder token"
                raise InvalidArgument(f"text must not contain {what} {token!r}; send images as parts")

    def _check_image_place(self, part: Part) -> Part:
        """An image counted before it is encoded: only this decoder's taking images is checked."""
        if self.mrope_section is None:
            raise InvalidArgument("this decoder is text-only; image parts are not accepted")
        return part

    def _check_image(self, part: Part) -> ImagePart:
        if isinstance(part, RawImagePart):
            raise InvalidArgument("raw image parts are not accepted by the decoder; encode them with the vision service")
        if self.mrope_section is None:
            raise InvalidArgument("this decoder is text-only; image parts are not accepted")
        grid = tuple(part.grid_thw)
        if len(grid) != 3 or min(grid) < 1:
            raise InvalidArgument(f"image grid_thw must be three positive ints, got {grid}")
        rows = part.rows
        if rows.ndim != 2 or rows.shape[1] != self.hidden_size:
            raise InvalidArgument(f"image rows have shape {tuple(rows.shape)}; the decoder's hidden size is {self.hidden_size}")
        if rows.shape[0] != grid[0] * grid[1] * grid[2]:
            raise InvalidArgument(f"image has {rows.shape[0]} rows but grid {grid} needs {grid[0] * grid[1] * grid[2]}")
        peak = float(rows.abs().max()) if rows.numel() else 0.0
        limit = torch.finfo(self.compute_dtype).max
        if not peak <= limit:  # NaN compares false
            raise InvalidArgument(f"image rows hold a value of magnitude {peak:g}; they must be finite in the decoder's "
                                  f"{str(self.compute_dtype).removeprefix('torch.')} (|x| <= {limit:.4g})")
        if tuple(part.mrope_section) != tuple(self.mrope_section):
            raise InvalidArgument(f"image mrope_section {tuple(part.mrope_section)} differs from the "
                                  f"decoder's {tuple(self.mrope_section)}")
        return part

    def _expand(self, pieces: list[list[int]], images: list[ImagePart]) -> PromptInputs:
        ids, spans, axes, cursor = [], [], [], 0
        for index, piece in enumerate(pieces):
            ids.extend(piece)
            axes.append(torch.arange(cursor, cursor + len(piece)).expand(3, -1))
            cursor += len(piece)
            if index < len(images):
                image = images[index]
                t, h, w = image.grid_thw
                if self.vision_start_id is not None:
                    ids.append(self.vision_start_id)
                    axes.append(torch.full((3, 1), cursor))
                    cursor += 1
                rows = image.rows.float().clone()  # [t*h*w, hidden]
                spans.append(ImageSpan(len(ids), rows, image.content_hash, rows_digest(rows, (t, h, w))))
                ids.extend([self.image_token_id] * (t * h * w))
                axes.append(cursor + image_coordinates(t, h, w))
                cursor += max(t, h, w)
                if self.vision_end_id is not None:
                    ids.append(self.vision_end_id)
                    axes.append(torch.full((3, 1), cursor))
                    cursor += 1
        if not ids:
            raise InvalidArgument("the prompt is empty")
        if self.mrope_section is None:
            return PromptInputs(ids)
        positions = torch.cat(axes, dim=1)  # [3, T]
        return PromptInputs(ids, spans, positions, cursor - len(ids))


def image_coordinates(t: int, h: int, w: int) -> torch.Tensor:
    """(t, h, w) offsets of every patch in raster order: int64 [3, t*h*w]."""
    tt = torch.arange(t).repeat_interleave(h * w)
    hh = torch.arange(h).repeat_interleave(w).repeat(t)
    ww = torch.arange(w).repeat(t * h)
    return torch.stack((tt, hh, ww))
