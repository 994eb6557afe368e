"""The ``transformers`` backend: the model's own forward and cache, in a left-padded batch.

Rows are sequences. Newcomers are prefilled together as their own left-padded
batch, then their cache is concatenated to the running one (the shorter side
padded on the left). A decode step feeds every row its last token. Rows leave
the step they finish; columns that became padding for all rows are trimmed.
Works for any ``AutoModelForCausalLM``.
"""

from __future__ import annotations

from typing import Any

import torch

import tokenmill
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import AttentionKernel, Backend, BackendRunner, PaddedKVCache, PrefillOutput, StepOutput
from tokenmill.model.lora import adapter_rows
from tokenmill.model.vision import encode_sequences, place_rotary


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _token_types(seqs: list[Sequence], width: int) -> torch.Tensor | None:
    """The left-padded ``token_type_ids`` of prompts whose model masks image tokens by them (Gemma 3: they
    attend to each other both ways), or None where none has them."""
    if all(seq.images is None or seq.images.token_types is None for seq in seqs):
        return None
    types = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq.images is not None and seq.images.token_types is not None:
            types[row, width - seq.total_len : width - seq.total_len + len(seq.images.token_types)] = torch.tensor(
                seq.images.token_types)
    return types


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _prefill_positions(seqs: list[Sequence], mask: torch.Tensor) -> torch.Tensor:
    """The left-padded prompts' positions: ``[3, rows, width]`` where one holds image tokens placed with
    multimodal rotary positions (Qwen2-VL), else one per token."""
    positions = _positions(mask)
    if all(seq.rotary_positions is None for seq in seqs):
        return positions
    axes = positions.unsqueeze(0).repeat(3, 1, 1)
    width = mask.shape[1]
    for row, seq in enumerate(seqs):
        if seq.rotary_positions is not None:
            axes[:, row, width - seq.total_len :] = seq.rotary_positions.at(0, seq.total_len).to(axes.device)
    return axes


def _rotary_delta(seq: Sequence) -> int:
    """How far a sequence's positions past its prompt lie from their indexes (multimodal rotary positions)."""
    return seq.rotary_positions.delta if seq.rotary_positions is not None else 0


class TransformersRunner(BackendRunner):
    chunked_prefill = False
    pausable = False
    kv_block_size = 1
    takes_images = True

    def __init__(self, model: Any, kv: PaddedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = next(model.parameters()).device
        self.rows: list[int] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0

    def reset(self) -> None:
        self.rows, self.cache, self.mask = [], None, None

    def kv_usage(self) -> dict[str, int]:
        return {"bytes": self.kv.nbytes(self.cache)}

    def kv_free_tokens(self) -> None:
        return None  # memory follows --max-batch-total-tokens, reserved at admission

    def can_decode(self, seqs: list[Sequence]) -> bool:
        return True

    def step(self, prefill: list[Sequence], chunks: list[int], want_prompt_logits: list[bool],
             decode: list[Sequence]) -> StepOutput:
        """Decode the running rows, then prefill newcomers as their own padded batch and join them."""
        decode_logits = self.decode(decode) if decode else None
        if not prefill:
            return StepOutput(None, decode_logits)
        assert all(chunk == s.pending_len == s.total_len for s, chunk in zip(prefill, chunks)), "whole prompts only"
        # Prompt details need the logits of every padded position: prefill those alone so that one
        # request's option never multiplies the memory of the others' prefill.
        plain = [row for row, want in enumerate(want_prompt_logits) if not want]
        groups = ([plain] if plain else []) + [[row] for row, want in enumerate(want_prompt_logits) if want]
        last_logits: list[torch.Tensor] = [torch.empty(0)] * len(prefill)
        prompt_logits: list[torch.Tensor | None] = [None] * len(prefill)
        try:
            for rows in groups:
                out = self.prefill([prefill[r] for r in rows], [want_prompt_logits[r] for r in rows])
                for index, row in enumerate(rows):
                    last_logits[row] = out.last_logits[index]
                    prompt_logits[row] = out.prompt_logits[index]
        except Exception as error:  # noqa: BLE001 - the running rows already decoded: keep their step
            self.release(prefill)
            return StepOutput(None, decode_logits, prefill_error=error)
        return StepOutput(PrefillOutput(torch.stack(last_logits), prompt_logits), decode_logits)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], want_prompt_logits: list[bool]) -> PrefillOutput:
        ids, mask = _left_padded([s.token_ids for s in seqs], self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self.kv.new_cache(self.model.config)
        keep_all = any(want_prompt_logits)
        embeds = self._with_images(ids, seqs)
        place_rotary(self.model, seqs)
        types = _token_types(seqs, ids.shape[1])
        extra = {"token_type_ids": types.to(self.device)} if types is not None else {}
        with adapter_rows(self.model, seqs, [ids.shape[1]] * len(seqs)):  # each row, padding included
            out = self.model(
                input_ids=ids if embeds is None else None,
                inputs_embeds=embeds,
                **extra,
                attention_mask=mask,
                position_ids=_prefill_positions(seqs, mask),
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if keep_all else 1,
            )
        logits = out.logits
        result = PrefillOutput(
            last_logits=logits[:, -1, :].float().cpu(),
            prompt_logits=[
                logits[row, -seq.total_len :].float().cpu() if want_prompt_logits[row] else None
                for row, seq in enumerate(seqs)
            ],
        )
        self._join(seqs, cache, mask)  # last: a failure above leaves the running batch as it was
        return result

    def _with_images(self, ids: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """The prompts' input embeddings with their image embeddings at the image tokens' positions; None
        when none of them has images."""
        if all(seq.images is None for seq in seqs):
            return None
        encode_sequences(self.model, seqs)
        embeds = self.model.get_input_embeddings()(ids)
        for row, seq in enumerate(seqs):
            if seq.images is not None:
                offset = ids.shape[1] - seq.total_len  # left padding
                rows = [offset + position for position in seq.images.positions]
                embeds[row, rows] = seq.image_embeddings.to(embeds.dtype)
        return embeds

    def _join(self, seqs: list[Sequence], cache: Any, mask: torch.Tensor) -> None:
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            assert self.mask is not None
            old_len, new_len = self.mask.shape[1], mask.shape[1]
            width = max(old_len, new_len)
            joined_mask = torch.cat(
                [
                    torch.nn.functional.pad(self.mask, (width - old_len, 0)),
                    torch.nn.functional.pad(mask, (width - new_len, 0)),
                ]
            )
            self.cache = self.kv.concat(self.cache, cache, old_len, new_len)
            self.mask = joined_mask
        self.rows.extend(s.id for s in seqs)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        assert self.mask is not None and len(seqs) == len(self.rows)
        by_id = {s.id: s for s in seqs}
        last = torch.tensor([[by_id[row].last_token] for row in self.rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        deltas = torch.tensor([[_rotary_delta(by_id[row])] for row in self.rows], device=self.device)
        with adapter_rows(self.model, [by_id[row] for row in self.rows], [1] * len(self.rows)):
            out = self.model(
                input_ids=last,
                attention_mask=mask,
                position_ids=mask.sum(-1, keepdim=True) - 1 + deltas,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self.mask = mask
        logits = out.logits[:, -1, :].float().cpu()
        order = torch.tensor([self.rows.index(s.id) for s in seqs], dtype=torch.long)
        return logits.index_select(0, order)

    def release(self, seqs: list[Sequence]) -> None:
        leaving = {s.id for s in seqs}  # ids that never joined are ignored
        keep = [row for row, seq_id in enumerate(self.rows) if seq_id not in leaving]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[row] for row in keep]
        if not keep:
            self.cache, self.mask = None, None
            return
        assert self.mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache = self.kv.select_rows(self.cache, index)
        self.mask = self.mask.index_select(0, index)
        padding_columns = int(self.mask.any(dim=0).long().argmax().item())
        self.cache = self.kv.trim_left(self.cache, padding_columns)
        self.mask = self.mask[:, padding_columns:]


class TransformersBackend(Backend):
    name = "transformers"
    kv_layout = "padded"
    description = "the model's own forward and cache in a left-padded batch (any AutoModelForCausalLM)"

    default_attention = "sdpa"
    default_kv_allocator = "dynamic"

    def create(self, model: Any, kv_store: PaddedKVCache, attention: AttentionKernel) -> BackendRunner:
        return TransformersRunner(model, kv_store)


@tokenmill.hookimpl
def tokenmill_backends() -> list[Backend]:
    return [TransformersBackend()]
