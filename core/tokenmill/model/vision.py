"""Vision-language checkpoints: their processor, a prompt's images as the model takes them, and the encoder.

A checkpoint whose config has a ``vision_config`` loads with ``AutoModelForImageTextToText`` and its
``AutoProcessor``. A prompt names each image with the processor's placeholder (``<image>``); the processor
expands each into the image's tokens and makes its pixels. The vision encoder turns the pixels into one
embedding per image token (:func:`encode_images`), once per request; the language model then takes those
embeddings at the image tokens' positions in place of the token embeddings.
"""

from __future__ import annotations

import bisect
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_IMAGE_PIXELS = 40_000_000
"""The most pixels an image may decode to (width × height): a small compressed file can claim far more
(a decompression bomb); it is refused from its header, before any pixel is decoded."""


class ImageError(ValueError):
    """An image that cannot be read (answered with 422)."""


def takes_images(model_config: Any) -> bool:
    """Whether ``model_config`` is a vision-language model's (a vision tower beside its language model)."""
    return getattr(model_config, "vision_config", None) is not None


BIDIRECTIONAL_IMAGE_ATTENTION = frozenset({"gemma3", "gemma3n", "paligemma"})
"""Families whose image tokens attend to each other both ways (a causal step over them would be wrong)."""


ROTARY_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Families whose image tokens take multimodal rotary positions (M-RoPE) from the model's own
``get_rope_index``, their language model otherwise taking the image embeddings in place of token embeddings
(later Qwen-VL generations also add image features inside the decoder layers, which tokenmill does not)."""


def vision_unavailable_reason(model: Any) -> str | None:
    """Why tokenmill cannot run the vision-language ``model`` (its steps feed the language model image
    embeddings at the image tokens' positions, with plain positions or, for :data:`ROTARY_FAMILIES`, the
    multimodal rotary positions the model computes), or None."""
    name, config = type(model).__name__, model.config
    if _rope_index(model) is not None and config.model_type not in ROTARY_FAMILIES:
        return f"{name} places image tokens with multimodal rotary positions (M-RoPE) tokenmill does not compute"
    if getattr(config.get_text_config(), "cross_attention_layers", None):
        return f"{name} reads images through cross-attention layers, which tokenmill does not run"
    if not hasattr(model, "get_image_features"):
        return f"{name} has no get_image_features (its vision encoder cannot run apart from its language model)"
    return None


def causal_unavailable_reason(model: Any) -> str | None:
    """Why ``model`` cannot run with causal attention over its image tokens (what packed paged steps
    compute), or None: its image tokens attend to each other both ways (the transformers backend runs it,
    with the mask the model makes from ``token_type_ids``)."""
    if takes_images(model.config) and model.config.model_type in BIDIRECTIONAL_IMAGE_ATTENTION:
        return (f"{type(model).__name__} lets image tokens attend to each other both ways, which packed causal "
                "steps do not; use --backend transformers")
    return None


def image_token_id(model_config: Any) -> int:
    """The token id the model's image embeddings replace (``image_token_id``, LLaVA's older ``image_token_index``)."""
    token_id = getattr(model_config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(model_config, "image_token_index", None)
    if token_id is None:
        raise ValueError(f"{type(model_config).__name__} names no image token (image_token_id)")
    return int(token_id)


@dataclass(frozen=True)
class DecodedImage:
    """An image a request sent, decoded, and the digest of its bytes (what the prefix cache keys it by)."""

    image: Any
    """A ``PIL.Image.Image`` in RGB."""
    digest: bytes


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> DecodedImage:
    """Pillow's reading of ``data``, or :class:`ImageError` when it is no image or claims over ``max_pixels``."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"an image of {width}×{height} pixels is over the {max_pixels:,} pixels allowed")
        image = image.convert("RGB")  # decodes it (and the first frame of an animation)
    except ImageError:
        raise
    except Exception as error:  # noqa: BLE001 - Pillow raises many kinds for damaged or unknown data
        raise ImageError(f"the image cannot be decoded ({type(error).__name__}: {error})") from None
    return DecodedImage(image, hashlib.blake2b(data, digest_size=16).digest())


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's images as its model takes them."""

    pixels: dict[str, torch.Tensor]
    """What the processor made of the images besides the text: ``pixel_values`` and the family's extras
    (``pixel_attention_mask``, ``image_sizes``...), each with the request's images as its first axis
    (or in a batch of one, as the family's ``get_image_features`` takes them)."""
    token_id: int
    """The placeholder token whose positions take the image embeddings."""
    positions: tuple[int, ...]
    """The prompt positions holding ``token_id``, in order: the i-th takes the i-th embedding."""
    starts: tuple[int, ...]
    """Per image, the position of its first token."""
    digests: tuple[bytes, ...]
    """Per image, the digest of its bytes."""
    token_types: tuple[int, ...] | None = None
    """The processor's ``token_type_ids`` (1 at image tokens) for a family whose mask reads them (Gemma 3)."""

    def placed_before(self, position: int) -> int:
        """How many image embeddings go to positions before ``position``."""
        return bisect.bisect_left(self.positions, position)

    def block_digest(self, block: int, block_size: int) -> bytes:
        """The digests of the images whose first token is in block ``block`` (b"" for none): what names that
        block in the prefix cache besides its tokens, as the pixels, not the tokens, tell two images apart."""
        return b"".join(digest for start, digest in zip(self.starts, self.digests) if start // block_size == block)


class Vision:
    """A vision-language model's processor, used to turn a prompt and its images into token ids and pixels.
    Not thread-safe (its tokenizer): each validation worker holds its own."""

    def __init__(self, processor: Any, model_config: Any) -> None:
        self.processor = processor
        self.token_id = image_token_id(model_config)
        self.placeholder: str = getattr(processor, "image_token", None) or "<image>"
        """The text that names an image in a prompt; the processor expands each into the image's tokens."""
        self.bidirectional = model_config.model_type in BIDIRECTIONAL_IMAGE_ATTENTION
        start, end = (getattr(model_config, f"vision_{edge}_token_id", None) for edge in ("start", "end"))
        self.inline = self.placeholder
        """How an image stands in a prompt written without the chat template (TGI's markdown images): the
        placeholder, between the family's start and end tokens where it has them (Qwen2-VL)."""
        if start is not None and end is not None:
            start_text, end_text = processor.tokenizer.convert_ids_to_tokens([start, end])
            self.inline = f"{start_text}{self.placeholder}{end_text}"

    def prompt(self, text: str, images: Sequence[DecodedImage],
               add_special_tokens: bool = True) -> tuple[list[int], ImagePrompt]:
        """``text``'s token ids with each placeholder expanded, and its images' pixels. ``text`` must hold
        one placeholder per image (:class:`ImageError` otherwise)."""
        named = text.count(self.placeholder)
        if named != len(images):
            raise ImageError(f"the prompt names {named} image{'s' * (named != 1)} ({self.placeholder}) "
                             f"for {len(images)} sent")
        try:
            batch = self.processor(text=[text], images=[[decoded.image for decoded in images]],
                                   add_special_tokens=add_special_tokens, return_tensors="pt")
        except Exception as error:  # noqa: BLE001 - processors raise many kinds on images they cannot take
            raise ImageError(f"the model's processor refused the images ({type(error).__name__}: {error})") from None
        ids = batch["input_ids"][0].tolist()
        pixels = {key: value for key, value in batch.items()
                  if key not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
                  and isinstance(value, torch.Tensor)}
        positions = tuple(i for i, token in enumerate(ids) if token == self.token_id)
        digests = tuple(decoded.digest for decoded in images)
        types = batch.get("token_type_ids", batch.get("mm_token_type_ids"))
        token_types = tuple(types[0].tolist()) if self.bidirectional and types is not None else None
        return ids, ImagePrompt(pixels, self.token_id, positions, self._starts(images, positions), digests, token_types)

    def _starts(self, images: Sequence[DecodedImage], positions: tuple[int, ...]) -> tuple[int, ...]:
        """Each image's first token position. With several images, each image's token count comes from the
        processor on it alone; where those counts do not add up, every image is taken to start at the first
        image token (its blocks then cached under all the images)."""
        if not positions:
            return (0,) * len(images)
        if len(images) == 1:
            return (positions[0],)
        counts = []
        for decoded in images:
            alone = self.processor(text=[self.placeholder], images=[[decoded.image]], add_special_tokens=False,
                                   return_tensors="pt")
            counts.append(int((alone["input_ids"][0] == self.token_id).sum()))
        if sum(counts) != len(positions):
            return (positions[0],) * len(images)
        firsts = [sum(counts[:k]) for k in range(len(images))]
        return tuple(positions[first] for first in firsts)


@dataclass(frozen=True)
class RotaryPositions:
    """A prompt's multimodal rotary positions (M-RoPE): each token's temporal, height and width positions.
    Past the prompt, each of the three is the token's index plus :attr:`delta`."""

    prompt: torch.Tensor
    """``[3, prompt length]``."""
    delta: int

    def at(self, start: int, length: int) -> torch.Tensor:
        """``[3, length]``: the positions of the tokens at indexes ``start`` to ``start + length - 1``."""
        inside = self.prompt[:, start : start + length]
        beyond = torch.arange(max(start, min(self.prompt.shape[1], start + length)), start + length) + self.delta
        return torch.cat([inside, beyond.expand(3, -1)], dim=1)


def _rope_index(model: Any) -> Any:
    for module in (model, getattr(model, "model", None)):
        if module is not None and hasattr(module, "get_rope_index"):
            return module.get_rope_index
    return None


def place_rotary(model: Any, seqs: Sequence[Any]) -> None:
    """Set ``rotary_positions`` on each of ``seqs`` with images that has none yet, where ``model`` places its
    image tokens with multimodal rotary positions (the model's own ``get_rope_index`` over the prompt)."""
    rope_index = _rope_index(model)
    if rope_index is None:
        return
    for seq in seqs:
        images = seq.images
        if images is None or seq.rotary_positions is not None:
            continue
        ids = torch.tensor([seq.prompt_ids], dtype=torch.long)
        positions, delta = rope_index(ids, mm_token_type_ids=(ids == images.token_id).int(),
                                      image_grid_thw=images.pixels.get("image_grid_thw"))
        seq.rotary_positions = RotaryPositions(positions[:, 0].cpu(), int(delta.reshape(-1)[0]))


def worker_vision(processor: Any, tokenizer: Any, model_config: Any) -> Vision:
    """A :class:`Vision` for one validation worker: ``processor`` with that worker's own copy of the tokenizer
    (the image preprocessing, which keeps no state, is shared)."""
    import copy

    own = copy.copy(processor)
    own.tokenizer = tokenizer
    return Vision(own, model_config)


def load_processor(path: Any, trust_remote_code: bool = False) -> Any:
    """The checkpoint's processor (image preprocessing and the tokenizer that expands image placeholders).
    Where the family's video processor needs torchvision and it is not installed, the processor without it
    (tokenmill takes no videos)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ImportError as error:
        if "torchvision" not in str(error).lower():
            raise
        return _images_only_processor(Path(path), trust_remote_code)


def _images_only_processor(path: Path, trust_remote_code: bool) -> Any:
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    config: dict[str, Any] = {}
    for name in ("processor_config.json", "preprocessor_config.json"):  # where each transformers version names it
        if (path / name).is_file() and "processor_class" in (found := json.loads((path / name).read_text())):
            config = found if name == "processor_config.json" else {"processor_class": found["processor_class"]}
            break
    family = getattr(transformers, config.pop("processor_class", ""), None)
    if family is None:
        raise ImportError(f"{path}'s processor needs torchvision, and names no processor class to load without it")

    class ImagesOnly(family):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    images = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    template = tokenizer.chat_template
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "chat_template.json").is_file():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template", template)
    config = {key: value for key, value in config.items() if not isinstance(value, dict)}  # sub-processors' own
    return ImagesOnly(image_processor=images, tokenizer=tokenizer, chat_template=template, **config)


def encode_images(model: Any, prompts: list[ImagePrompt]) -> list[torch.Tensor]:
    """Per prompt, ``[len(prompt.positions), hidden]``: the language model's input embeddings for its image
    tokens, from the model's vision tower and projector. Prompts whose pixels have the same shapes (beyond the
    first axis) are encoded together, in one call. ValueError when the counts do not match the tokens."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        shapes = tuple((name, tuple(value.shape[1:]), value.dtype) for name, value in sorted(prompt.pixels.items()))
        groups.setdefault(shapes, []).append(index)
    encoded: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for indices in groups.values():
        pixels = {name: torch.cat([prompts[i].pixels[name] for i in indices]) for name in prompts[indices[0]].pixels}
        counts = [len(prompts[i].positions) for i in indices]
        features = _image_features(model, pixels)
        if len(features) != sum(counts):
            raise ValueError(f"the vision encoder made {len(features)} embeddings for {sum(counts)} image tokens")
        for index, part in zip(indices, features.split(counts)):
            encoded[index] = part
    return encoded


def _image_features(model: Any, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    device, dtype = model.device, model.get_input_embeddings().weight.dtype
    pixels = {key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
              for key, value in pixels.items()}
    output = model.get_image_features(**pixels, return_dict=True)
    features = getattr(output, "pooler_output", output)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1]).to(dtype)


def encode_sequences(model: Any, seqs: list[Any]) -> None:
    """Set ``image_embeddings`` on each of ``seqs`` with images that has none yet, encoding their images
    together (:func:`encode_images`). A preemption keeps them: a recompute does not encode the images again."""
    new = [seq for seq in seqs if seq.images is not None and seq.image_embeddings is None]
    for seq, embeddings in zip(new, encode_images(model, [seq.images for seq in new]) if new else []):
        seq.image_embeddings = embeddings
