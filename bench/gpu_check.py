"""GPU check: paged and flash against transformers on a ~1B random-weight Llama, then tokens/s per backend.

Nothing is downloaded: the model has random weights and the tokenizer is built in
code. Part 1 checks, in float32, that every backend gives model.generate()'s greedy
tokens for 8 prompts of different lengths (joining one running batch). Part 2 times
bfloat16 decoding at batch 1, 32 and 128. ``--tiny`` runs the same on a small model
(on CPU, to check the script itself). Run through bench/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from engine_helpers import Collector, build_engine  # noqa: E402

from tokenmill.plugins import PluginError, build_plugin_manager, choose_all  # noqa: E402
from tokenmill.sequence import GenerationRequest, SamplingParams  # noqa: E402

VOCAB = 32000


def word_tokenizer():
    """A word-level tokenizer over VOCAB made-up words: enough to decode ids, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
                           max_position_embeddings=4096)
    # Llama-3.2-1B's shape with a 32k vocabulary: ~1.1B parameters.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, initializer_range=0.05,
                       max_position_embeddings=4096, rope_theta=500000.0)


def make_model(config, dtype, device, state=None):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config.__class__.from_dict(config.to_dict()))
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).eval()


def available_backends() -> list[str]:
    pm = build_plugin_manager(autoload=False)
    names = []
    for name in ("transformers", "paged", "flash"):
        try:
            choose_all(pm, name, None, None, "fifo", 256 if name == "flash" else None)
        except PluginError as error:
            print(f"backend {name}: {error}")
            continue
        print(f"backend {name}: available")
        names.append(name)
    return names


def run_all(engine, prompts: list[list[int]], new_tokens: int, join_after: int = 0) -> list[list[int]]:
    sinks = [Collector() for _ in prompts]
    for index, (ids, sink) in enumerate(zip(prompts, sinks)):
        engine.submit(GenerationRequest("", ids, new_tokens, SamplingParams()), sink)
        if join_after and index == join_after - 1:
            engine.run_once()
    while not all(s.done for s in sinks):
        engine.run_once()
    errors = [e for s in sinks for e in s.events if not hasattr(e, "token")]
    assert not errors, errors
    return [s.token_ids for s in sinks]


def check_equality(config, tokenizer, device, backends, block_size: int) -> bool:
    generator = torch.Generator().manual_seed(1)
    lengths = [16, 40, 75, 120, 9, 200, 33, 150]
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    reference_model = make_model(config, torch.float32, device)
    state = reference_model.state_dict()
    expected = []
    for ids in prompts:
        out = reference_model.generate(torch.tensor([ids], device=device), max_new_tokens=24, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    ok = True
    for backend in [b for b in backends if b != "flash"]:  # flash-attn has no float32 kernels
        model = make_model(config, torch.float32, device, state)
        engine = build_engine(model, tokenizer, backend=backend, ignore_eos=True, block_size=block_size,
                              max_batch_total_tokens=16384)
        got = run_all(engine, prompts, 24, join_after=4)
        same = sum(g == e for g, e in zip(got, expected))
        print(f"equality {backend:<12}: {same}/{len(prompts)} prompts give generate()'s greedy tokens (float32)")
        ok &= same == len(prompts)
        del engine, model
    if "flash" in backends:
        # bfloat16 rounding differs between kernels, so this compares and reports rather than gates.
        bf16_state = {k: v.to(torch.bfloat16) for k, v in state.items()}
        runs = {}
        for backend, size in (("paged", block_size), ("flash", 256)):
            model = make_model(config, torch.bfloat16, device, bf16_state)
            engine = build_engine(model, tokenizer, backend=backend, ignore_eos=True, block_size=size,
                                  max_batch_total_tokens=16384)
            runs[backend] = run_all(engine, prompts, 24, join_after=4)
            del engine, model
        same = sum(a == b for a, b in zip(runs["paged"], runs["flash"]))
        first = sum(a[0] == b[0] for a, b in zip(runs["paged"], runs["flash"]))
        print(f"flash against paged in bfloat16: {same}/{len(prompts)} identical sequences, "
              f"{first}/{len(prompts)} identical first tokens")
    return ok


def throughput(config, tokenizer, device, backends, block_size: int, batches: list[int], new_tokens: int) -> None:
    generator = torch.Generator().manual_seed(2)
    print(f"\ntokens/s, bfloat16, prompts of 128 tokens, {new_tokens} new tokens")
    print(f"{'batch':>6} " + " ".join(f"{b:>13}" for b in backends))
    state = make_model(config, torch.bfloat16, device).state_dict()
    engines = {}
    for backend in backends:
        model = make_model(config, torch.bfloat16, device, state)
        sizes = 256 if backend == "flash" else block_size
        engines[backend] = build_engine(model, tokenizer, backend=backend, ignore_eos=True, block_size=sizes,
                                        max_batch_total_tokens=max(batches) * (128 + new_tokens + 256),
                                        max_batch_prefill_tokens=8192)
        run_all(engines[backend], [[5] * 16], 4)  # warm up
    for batch in batches:
        prompts = [torch.randint(3, VOCAB, (128,), generator=generator).tolist() for _ in range(batch)]
        row = []
        for backend in backends:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            run_all(engines[backend], prompts, new_tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
            row.append(batch * new_tokens / (time.perf_counter() - started))
        print(f"{batch:>6} " + " ".join(f"{v:>13.0f}" for v in row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model, for checking the script on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    config = model_config(args.tiny)
    tokenizer = word_tokenizer()
    backends = available_backends()
    started = time.perf_counter()
    ok = check_equality(config, tokenizer, device, backends, args.block_size)
    throughput(config, tokenizer, device, backends, args.block_size, args.batches, args.new_tokens)
    print(f"\n{'PASS' if ok else 'FAIL'}: greedy equality; total {time.perf_counter() - started:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
