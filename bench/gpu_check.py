"""GPU check: paged and flash against transformers on a ~1B random-weight Llama, then tokens/s per backend,
then each quantizer.

Nothing is downloaded: the model has random weights and the tokenizer is built in
code. Part 1 checks, in float32, that every backend gives model.generate()'s greedy
tokens for 8 prompts of different lengths (joining one running batch). Part 2 times
bfloat16 decoding at batch 1, 32 and 128. Part 3 loads the model through each
quantizer that can run there (GPTQ and AWQ from checkpoints packed here, rounded to
nearest) and reports its weight memory, tokens/s at batch 32 and top-1 agreement with
bfloat16; a quantizer that fails is reported, not fatal. Part 4 serves the model with
``--num-shard 2`` (NCCL) and ``--num-shard 1`` and compares their greedy texts over HTTP.
``--tiny`` runs the same on a small model (on CPU, to check the script itself). Run
through bench/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from engine_helpers import Collector, build_engine  # noqa: E402

from tokenmill.engine.sequence import GenerationRequest, SamplingParams  # noqa: E402
from tokenmill.plugin_manager import PluginError, build_plugin_manager, choose_all  # noqa: E402

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


QUANTIZERS = ("int8", "int4", "gptq", "awq", "fp8", "bitsandbytes", "bitsandbytes-nf4")


def quantizers(config, tokenizer, device, batch: int, new_tokens: int) -> None:
    """Part 3: each quantizer's weight memory, speed and agreement with the unquantized model (bfloat16)."""
    import tempfile

    from tokenmill.model.loading import load_model
    from tokenmill.model.quant_linears import weight_bytes, write_packed_checkpoint
    from tokenmill.model.quantization import choose_quantizer
    from tokenmill.plugin_manager import choose
    from tokenmill_plugins.quantizers import awq, gptq

    pm = build_plugin_manager(autoload=False)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (128,), generator=generator).tolist() for _ in range(batch)]
    probe = torch.tensor([prompts[0][:64]], device=device)
    print(f"\nquantizers, bfloat16 compute, batch {batch}, prompts of 128 tokens, {new_tokens} new tokens")
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "model"
        make_model(config, torch.float32, "cpu").save_pretrained(source)
        tokenizer.save_pretrained(source)
        group = 128 if config.hidden_size % 128 == 0 else 64
        packed = {
            "gptq": write_packed_checkpoint(source, Path(scratch) / "gptq", gptq.pack, {
                "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False}),
            "awq": write_packed_checkpoint(source, Path(scratch) / "awq", awq.pack, {
                "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}),
        }
        reference = None
        for method in (None, *QUANTIZERS):
            name = method or "bfloat16"
            try:
                if method is not None:
                    choose(pm, "quantizer", method)  # unavailable here: say why and go on
                path = packed.get(method, source)
                flag = None if method in packed else method
                loaded = load_model(str(path), None, "bfloat16", "sdpa",
                                    pick_quantizer=lambda p, flag=flag: choose_quantizer(pm, flag, p))
                with torch.no_grad():
                    top = loaded.model(probe).logits[0].argmax(-1)
                reference = top if reference is None else reference
                agreement = (top == reference).float().mean().item()
                engine = build_engine(loaded.model, loaded.tokenizer, backend="paged", ignore_eos=True,
                                      max_batch_total_tokens=batch * (128 + new_tokens + 64),
                                      max_batch_prefill_tokens=8192)
                run_all(engine, [[5] * 16], 2)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                run_all(engine, prompts, new_tokens)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                speed = batch * new_tokens / (time.perf_counter() - started)
                print(f"{name:<18} {weight_bytes(loaded.model) / 2**20:>8.0f} MB {speed:>9.0f} tokens/s  "
                      f"top-1 agreement {agreement:.3f}")
                del engine, loaded
            except Exception as error:  # noqa: BLE001 - report and check the next quantizer
                print(f"{name:<18} failed: {type(error).__name__}: {str(error)[:200]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()


def shards(config, tokenizer) -> None:
    """Part 4: --num-shard 2 through the real server (NCCL on CUDA) against --num-shard 1: greedy text
    over HTTP must match. Two ranks on one GPU may be refused by NCCL; the script says so and goes on."""
    import json
    import os
    import socket
    import subprocess
    import tempfile
    import urllib.request

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    def generate(url: str, prompt: str) -> str:
        body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": 16}}).encode()
        request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=120).read())["generated_text"]

    print("\ntensor parallelism through the server (bfloat16, paged)")
    prompts = [" ".join(f"w{i * 7 + j}" for j in range(20 + 9 * i)) for i in range(4)]
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "model"
        make_model(config, torch.bfloat16, "cpu").save_pretrained(source)
        tokenizer.save_pretrained(source)
        outputs = {}
        for count in (1, 2):
            port = free_port()
            command = [sys.executable, "-m", "tokenmill", "launch", "--model-id", str(source), "--server", "uvicorn",
                       "--port", str(port), "--backend", "paged", "--num-shard", str(count),
                       "--master-port", str(free_port()), "--max-total-tokens", "1024"]
            log_path = Path(scratch) / f"shards-{count}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"})
            url = f"http://127.0.0.1:{port}"
            try:
                for _ in range(240):
                    if process.poll() is not None:
                        break
                    try:
                        if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                            break
                    except Exception:  # noqa: BLE001 - not listening yet
                        time.sleep(0.5)
                if process.poll() is not None:
                    print(f"--num-shard {count}: exited {process.returncode}: "
                          + log_path.read_text()[-600:].replace("\n", " | "))
                    continue
                started = time.perf_counter()
                outputs[count] = [generate(url, p) for p in prompts]
                print(f"--num-shard {count}: {len(prompts)} requests in {time.perf_counter() - started:.1f}s")
            finally:
                process.terminate()
                process.wait(30)
        if len(outputs) == 2:
            same = sum(a == b for a, b in zip(outputs[1], outputs[2]))
            print(f"--num-shard 2 against 1: {same}/{len(prompts)} identical greedy texts (bfloat16)")


def parser() -> argparse.ArgumentParser:
    """``python -m bench.gpu_check``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--tiny", action="store_true", help="a small model, for checking the script on CPU")
    result.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    result.add_argument("--new-tokens", type=int, default=128)
    result.add_argument("--block-size", type=int, default=16)
    return result


def main() -> int:
    args = parser().parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    config = model_config(args.tiny)
    tokenizer = word_tokenizer()
    backends = available_backends()
    started = time.perf_counter()
    ok = check_equality(config, tokenizer, device, backends, args.block_size)
    throughput(config, tokenizer, device, backends, args.block_size, args.batches, args.new_tokens)
    quantizers(config, tokenizer, device, 32, min(args.new_tokens, 64))
    shards(model_config(tiny=True), tokenizer)  # the NCCL path is what is checked: a small model keeps it quick
    print(f"\n{'PASS' if ok else 'FAIL'}: greedy equality; total {time.perf_counter() - started:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
