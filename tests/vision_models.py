"""Tiny random vision-language checkpoints (LLaVA, Idefics3, Gemma 3, Qwen2-VL) with SmolLM2's tokenizer, built with
``save_pretrained``, and what transformers' own ``generate`` answers with them."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import torch

from tokenmill.model.loading import DEFAULT_MODEL_FILE, default_gguf

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, with image parts as ``<image>``, as the families' own templates write them."""


def _tokenizer(*special: str) -> Any:
    from transformers import AutoTokenizer

    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def _text_config(vocab_size: int) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": True, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 2}


def _randomized(model: Any) -> Any:
    torch.manual_seed(0)
    with torch.no_grad():  # wide weights: greedy tokens that differ from position to position and image to image
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    return model


def save_tiny_llava(target: Path) -> Path:
    """LLaVA: a CLIP tower on 32×32 pixels in 8×8 patches, so 16 image tokens an image."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=_text_config(len(tokenizer)),
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    _randomized(LlavaForConditionalGeneration(config)).save_pretrained(target)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(target)
    return target


def save_tiny_idefics3(target: Path) -> Path:
    """Idefics3 (SmolVLM's architecture): a SigLIP tower whose images are split into 32×32 crops plus the
    whole image, each crop 4 image tokens between its row/column markers."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = _tokenizer("<image>", "<fake_token_around_image>", "<global-img>")
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    config = Idefics3Config(vision_config=vision, text_config=_text_config(len(tokenizer)), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    _randomized(Idefics3ForConditionalGeneration(config)).save_pretrained(target)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                      chat_template=CHAT_TEMPLATE).save_pretrained(target)
    return target


def save_tiny_gemma3(target: Path) -> Path:
    """Gemma 3: a SigLIP tower pooled to 4 image tokens an image, which attend to each other both ways."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    gguf = default_gguf()  # Gemma's processor reads its tokens from the tokenizer's named special tokens
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    text = {**_text_config(len(tokenizer)), "model_type": "gemma3_text", "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
                          boi_token_id=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                          eoi_token_id=tokenizer.convert_tokens_to_ids("<end_of_image>"))
    model = Gemma3ForConditionalGeneration(config)
    torch.manual_seed(0)
    with torch.no_grad():  # Gemma's norms scale by 1 + weight: zero keeps them neutral; small weights vary the tokens
        for name, parameter in model.named_parameters():
            parameter.zero_() if "norm" in name else parameter.normal_(0, 0.02)
    model.save_pretrained(target)
    template = CHAT_TEMPLATE.replace("<image>", "<start_of_image>")
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                    image_seq_length=4, chat_template=template).save_pretrained(target)
    return target


QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
"""How Qwen2-VL's template writes an image."""


def random_image(seed: int, size: tuple[int, int] = (50, 40)) -> Any:
    """A ``size`` image of one random colour with noise over it (noise alone looks alike to a tiny tower)."""
    import numpy as np
    from PIL import Image

    random = np.random.RandomState(seed)
    colour = random.randint(0, 255, 3)
    pixels = np.clip(colour + random.randint(-40, 40, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def data_url(image: Any, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def reference_tokens(model_dir: Path, text: str, images: list[Any], max_new_tokens: int) -> list[int]:
    """Greedy tokens of transformers' ``generate`` for ``text`` (``<image>`` where each image goes)."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.model.vision import load_processor

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = processor(text=[text], images=[images], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def save_tiny_qwen2_vl(target: Path, generation: str = "2") -> Path:
    """Qwen2-VL (``generation`` "2"; "2.5": Qwen2.5-VL, its vision tower attending in windows): a ViT over 8×8
    patches whose 2×2 neighbours merge into one image token, placed with multimodal rotary positions (M-RoPE:
    temporal, height and width). Its processor is saved in parts (its tokenizer, image processor and class
    name): built whole, it needs torchvision for its video processor."""
    import json

    import transformers
    from transformers import Qwen2VLImageProcessorPil

    family = {"2": "Qwen2VL", "2.5": "Qwen2_5_VL"}[generation]
    tokenizer = _tokenizer("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
    text = {**_text_config(len(tokenizer)), "model_type": {"2": "qwen2_vl_text", "2.5": "qwen2_5_vl_text"}[generation],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision: dict[str, Any] = {"depth": 2, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2,
                              "temporal_patch_size": 2}
    if generation == "2":
        vision |= {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
    else:
        vision |= {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 32,
                   "fullatt_block_indexes": [1]}
    config = getattr(transformers, f"{family}Config")(
        text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    _randomized(getattr(transformers, f"{family}ForConditionalGeneration")(config)).save_pretrained(target)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", QWEN2_VL_IMAGE)
    tokenizer.save_pretrained(target)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                             max_pixels=64 * 64).save_pretrained(target)
    (target / "processor_config.json").write_text(json.dumps({"processor_class": f"{family}Processor"}))
    return target
