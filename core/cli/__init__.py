"""The ``tokenmill`` command: ``launch`` serves a model, ``plugins`` lists what is installed,
``watermark-detect`` tests text for the green-list watermark."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from tokenmill import __version__
from tokenmill.config import Config, ConfigError, parse_config
from tokenmill.model.loading import ModelLoadError, checkpoint_config, resolve
from tokenmill.observability.logs import setup_logging
from tokenmill.plugin_manager import PluginError, build_plugin_manager, choose, choose_all, list_all
from tokenmill.model.sharding import ShardingError
from tokenmill.observability.tracing import TracingUnavailable

PREFLIGHT_ERRORS = (ConfigError, PluginError, ModelLoadError, ShardingError, TracingUnavailable)
"""What :func:`preflight` raises: each a one-line reason not to start."""


def preflight(config: Config) -> None:
    """Fail before serving on what can be known without loading: plugin choices, model path."""
    # This process may fork the server afterwards (gunicorn): ask NVML, not the CUDA runtime,
    # whether there are GPUs, so that CUDA is not initialised before the fork.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    pm = build_plugin_manager()
    chosen = choose_all(pm, config.backend, config.attention, config.kv_allocator, config.scheduler, config.block_size)
    if config.quantize:
        choose(pm, "quantizer", config.quantize)
    if config.num_shard > 1:
        from tokenmill.model.sharding import plan_slice

        _, model_config = checkpoint_config(config.model_id, config.revision)
        plan_slice(model_config, 0, config.num_shard)
        method = (getattr(model_config, "quantization_config", None) or {}).get("quant_method")
        if method:
            raise ConfigError(f"the checkpoint is quantized with {method}, and quantized models cannot shard yet: "
                              "run it with --num-shard 1")
        if torch.cuda.is_available() and "LOCAL_RANK" not in os.environ and torch.cuda.device_count() < config.num_shard:
            raise ConfigError(f"--num-shard {config.num_shard} needs a GPU per shard; this machine has "
                              f"{torch.cuda.device_count()}")
    from tokenmill.engine.startup import settings_refusal

    refusal = settings_refusal(config, chosen, "cuda" if torch.cuda.is_available() else "cpu")
    if refusal:
        raise ConfigError(refusal)
    if config.otlp_endpoint:
        from tokenmill.observability.tracing import require_packages

        require_packages()
    resolve(config.model_id, config.revision)


def run_shard(rank: int, config: Config) -> int:
    """Ranks 1..N-1: no server, only their slice of the model and the forward rank 0 asks for."""
    from tokenmill.model import sharding

    try:
        return sharding.run_shard(rank, config.num_shard, config)
    except (ShardingError, ModelLoadError) as error:
        print(f"tokenmill: shard {rank}: error: {error}", file=sys.stderr)
        return 2


def launch(argv: Sequence[str]) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    setup_logging(config.json_output)
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:  # started by torchrun (or by rank 0): the group's size wins
        config.num_shard = int(os.environ["WORLD_SIZE"])
        try:
            config.check()
        except ConfigError as error:
            print(f"tokenmill: error: {error}", file=sys.stderr)
            return 2
    if rank > 0:
        return run_shard(rank, config)
    try:
        preflight(config)
    except PREFLIGHT_ERRORS as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    from tokenmill.http.serve import serve

    return serve(config)


def plugins(argv: Sequence[str]) -> int:
    pm = build_plugin_manager()
    rows = list_all(pm)
    width = max((len(r.name) for r in rows), default=4)
    print(f"{'kind':<13} {'name':<{width}}  {'status':<40} source")
    for row in rows:
        status = "available" if row.unavailable_reason is None else f"unavailable: {row.unavailable_reason}"
        print(f"{row.kind:<13} {row.name:<{width}}  {status:<40} {row.source}")
    for name, why in pm.problems.items():
        print(f"{'plugin':<13} {name:<{width}}  broken: {why}")
    return 0


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
        raise ModelLoadError(f"cannot load the tokenizer or config of {model_id or 'the default model'}: {error}") from None
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


USAGE = """usage: tokenmill {launch,plugins,watermark-detect,version} [options]

  launch            serve a model over TGI's HTTP API (tokenmill launch --help)
  plugins           list the registered backends, attention kernels, schedulers and KV allocators
  watermark-detect  test text for the watermark `launch` adds (tokenmill watermark-detect --help)
  version           print the version
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "launch":
        return launch(rest)
    if command == "plugins":
        return plugins(rest)
    if command == "watermark-detect":
        return watermark_detect(rest)
    if command in ("version", "--version"):
        print(__version__)
        return 0
    print(f"tokenmill: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
