"""What keeping bitsandbytes' in-place CPU repack off costs (docs/quantization.md): a Fiber Bundle folder loaded in 4-bit
NF4 twice, once as the model loads it (the repack kept off: dequantise and matmul in float32) and once with the repack
switched back on by hand (bitsandbytes' fused bfloat16 kernel, on a CPU with AVX-512 BF16 only), greedy decoding timed
side by side, interleaved; and the cost of the check on a mode change (``model.train(); model.eval()``) against
``nn.Module.train`` alone.

    .venv/bin/python benchmarks/bench_quantized.py out/smollm2-fbt [--new-tokens 32] [--repeats 3] [--json FILE]
    .venv/bin/python benchmarks/bench_quantized.py --quick          # a tiny model: the smoke run of the tests
"""

import argparse
import statistics
import sys
import tempfile
import timeit

import torch
from torch import nn
from transformers import BitsAndBytesConfig

from common import environment, finish, interleaved_runs, prompt

from modeling_fiber_bundle import FiberBundleForCausalLM


def load(folder) -> FiberBundleForCausalLM:
    return FiberBundleForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))


def four_bit_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]


def quick_folder() -> str:
    from modeling_fiber_bundle import FiberBundleConfig

    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    FiberBundleForCausalLM(FiberBundleConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=32)).save_pretrained(folder)
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="a Fiber Bundle folder (e.g. the converted SmolLM2, out/smollm2-fbt)")
    parser.add_argument("--quick", action="store_true", help="a tiny model built here instead of MODEL (smoke run)")
    parser.add_argument("--prompt-length", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedily decoded tokens per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per arm, interleaved")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if (args.model is None) == (not args.quick):
        parser.error("give MODEL or --quick, not both")
    import bitsandbytes

    folder = quick_folder() if args.quick else args.model
    kept_off, repacking = load(folder), load(folder)
    for layer in four_bit_layers(repacking):  # back on by hand: only an inference-only user could
        layer.support_avx512bf16_for_cpu = True
    native = bool(bitsandbytes.functional.has_avx512bf16())
    vocab = kept_off.config.vocab_size
    ids = prompt({"vocab_size": vocab}, args.prompt_length)
    n = 4 if args.quick else args.new_tokens
    generate = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    arms = {"kept off (float32 dequantise + matmul)": kept_off}
    if native:  # elsewhere bitsandbytes' generic kernel would read the repacked layout as the plain one
        arms["repacked (bitsandbytes' fused bfloat16 kernel)"] = repacking
    with torch.no_grad():
        tokens = {name: model.generate(ids, **generate) for name, model in arms.items()}  # also the warm-up
        times = interleaved_runs([lambda m=m: m.generate(ids, **generate) for m in arms.values()], args.repeats,
                                 warmup=False)
    repacked = sum(getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
                   for layer in four_bit_layers(repacking))

    def switch():
        kept_off.train()
        kept_off.eval()

    def plain_switch():
        nn.Module.train(kept_off, True)
        nn.Module.train(kept_off, False)

    calls = 20 if args.quick else 200
    switch_s = min(timeit.repeat(switch, number=calls, repeat=3)) / calls
    plain_s = min(timeit.repeat(plain_switch, number=calls, repeat=3)) / calls
    env = environment(args.quick)
    env.update(shape="quick (tiny, 2 layers)" if args.quick else str(folder), quantisation="4-bit NF4 (bitsandbytes "
               f"{bitsandbytes.__version__})", avx512_bf16=native)
    result = {
        "new_tokens": n, "prompt_length": args.prompt_length,
        "tokens_per_s": {name: n / statistics.median(t) for name, t in zip(arms, times, strict=True)},
        "same_greedy_tokens": (len(tokens) == 1 or all(torch.equal(t, next(iter(tokens.values())))
                                                        for t in tokens.values())),
        "layers_repacked_in_the_repacking_arm": f"{repacked} of {len(four_bit_layers(repacking))}",
        "mode_switch_us": {"with the check": switch_s * 1e6, "nn.Module.train alone": plain_s * 1e6},
    }

    def report(env, result):
        print(f"{env['cpu']}, {env['torch_threads']} threads, {env['quantisation']}, AVX-512 BF16: "
              f"{env['avx512_bf16']}; {env['shape']}")
        print(f"greedy decoding, {result['prompt_length']}-token prompt, {result['new_tokens']} new tokens:")
        speeds = result["tokens_per_s"]
        for name, speed in speeds.items():
            print(f"  {name}: {speed:.2f} tokens/s")
        if len(speeds) == 2:
            off, on = speeds.values()
            print(f"  kept off / repacked: {off / on:.3f}x; same greedy tokens: {result['same_greedy_tokens']}; "
                  f"repacked layers: {result['layers_repacked_in_the_repacking_arm']}")
        else:
            print("  repacked: n/a (this CPU has no AVX-512 BF16, bitsandbytes' fused kernel is not there)")
        switch = result["mode_switch_us"]
        print(f"train() + eval(): {switch['with the check']:.0f} us with the check, "
              f"{switch['nn.Module.train alone']:.0f} us for nn.Module.train alone")

    finish(env, result, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
