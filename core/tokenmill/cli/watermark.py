"""``tokenmill watermark-detect``: test text for the green-list watermark ``launch`` adds; prints one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.config import Config
from tokenmill.model.loading import ModelLoadError, checkpoint_config


class UsageError(Exception):
    """A command line that cannot run; the message is one line for the user."""


def watermark_parser() -> argparse.ArgumentParser:
    from tokenmill.sampling.watermark import DETECTION_THRESHOLD

    parser = argparse.ArgumentParser(
        prog="tokenmill watermark-detect",
        description="Test text for the green-list watermark (Kirchenbauer et al. 2023) that "
                    "`launch` adds to requests asking for `watermark`. Prints one JSON object.")
    parser.add_argument("text", nargs="?", help="the text to test (default: --file, else stdin)")
    parser.add_argument("--file", type=Path, help="read the text from this file")
    parser.add_argument("--model-id", default=os.environ.get("MODEL_ID") or None,
                        help="the model that generated the text, as `launch --model-id` takes it [env MODEL_ID]")
    parser.add_argument("--revision", default=os.environ.get("REVISION") or None,
                        help="hub revision of --model-id [env REVISION]")
    parser.add_argument("--watermark-gamma", type=float, default=None,
                        help="the server's --watermark-gamma (default 0.5) [env WATERMARK_GAMMA]")
    parser.add_argument("--prompt", help="the prompt the text continues; its last token seeds the first green list")
    parser.add_argument("--ignore-repeated-bigrams", action="store_true",
                        help="score each (previous, token) pair once, so repetitive text (code, lists) "
                             "cannot pass for watermarked")
    parser.add_argument("--threshold", type=float, default=DETECTION_THRESHOLD,
                        help=f"z-score above which the text counts as watermarked (default {DETECTION_THRESHOLD:g})")
    return parser


def watermark_gamma(flag: float | None) -> float:
    """The flag, else WATERMARK_GAMMA, else 0.5: the same default the server's flag has."""
    gamma: float
    if flag is not None:
        gamma = flag
    else:
        raw = os.environ.get("WATERMARK_GAMMA", "")
        try:
            gamma = float(raw) if raw else Config.watermark_gamma
        except ValueError:
            raise UsageError(f"environment variable WATERMARK_GAMMA={raw!r} is not a number") from None
    if not 0 < gamma < 1:
        raise UsageError(f"--watermark-gamma must be in (0, 1) (got {gamma})")
    return gamma


def text_to_test(text: str | None, file: Path | None) -> str:
    if text is not None and file is not None:
        raise UsageError("give the text as an argument or --file, not both")
    if file is not None:
        try:
            text = file.read_text()
        except OSError as error:
            raise UsageError(f"cannot read --file: {error}") from None
    elif text is None:
        text = sys.stdin.read()
    if not text:
        raise UsageError("no text to test: pass it as an argument, with --file, or on stdin")
    return text


def load_tokenizer_and_vocab_size(model_id: str | None, revision: str | None) -> tuple[Any, int]:
    """The model's tokenizer and logits width, found as ``launch`` finds the model, without its weights.

    The vocabulary size comes from the model's config, not the tokenizer: the green
    lists were drawn over the logits, which are often wider than the tokenizer.
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        path, config = checkpoint_config(model_id, revision)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"cannot load the tokenizer or config of {model_id or 'the default model'}: {error}"
        ) from None
    return tokenizer, config.vocab_size


def watermark_detect(argv: Sequence[str]) -> int:
    from tokenmill.sampling.watermark import detect_text

    try:
        args = watermark_parser().parse_args(list(argv))
    except SystemExit as stop:  # --help, or a flag argparse rejected (it printed why)
        return int(stop.code or 0)
    try:
        gamma = watermark_gamma(args.watermark_gamma)
        text = text_to_test(args.text, args.file)
        tokenizer, vocab_size = load_tokenizer_and_vocab_size(args.model_id, args.revision)
        score = detect_text(text, tokenizer, vocab_size, gamma, prompt=args.prompt,
                            ignore_repeated_bigrams=args.ignore_repeated_bigrams)
    except (UsageError, ModelLoadError, ValueError) as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({
        "z_score": score.z_score,
        "p_value": score.p_value,
        "green_tokens": score.green_tokens,
        "scored_tokens": score.scored_tokens,
        "green_fraction": score.green_fraction,
        "gamma": gamma,
        "watermarked": score.z_score > args.threshold,
    }))
    return 0
