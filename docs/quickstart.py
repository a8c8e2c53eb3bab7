"""Quick start: build a Fiber Bundle model, publish-ready folder, reload it with trust_remote_code in a fresh process.

    .venv/bin/python docs/quickstart.py --out out/quickstart

What it shows, on a small randomly initialised model (no download):
1. a LLaMA backbone and the same weights in FiberBundleForCausalLM: with every gate at its graft value the logits are
   the backbone's (the geometry is present but neutral);
2. moving the gates changes the function, and ``output_geometry=True`` reports curvature / torsion / anisotropy;
3. ``save_pretrained`` writes a Hub folder (config with auto_map, the modeling files, safetensors) which a fresh
   Python process, where this project cannot be imported, loads with
   ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` and generates from.
"""

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM

BACKBONE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
)

FRESH_PROCESS = textwrap.dedent(
    """
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "modeling_fiber_bundle":
                raise ImportError(name)
    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    ids = torch.tensor([[1, 17, 42, 99, 7]])
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "tokens": out[0].tolist()}))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/quickstart"), help="folder to write the Hub folder to")
    parser.add_argument("--metric-rank", type=int, default=2, help="rank r of each token's attention metric")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty; choose another folder or remove it first")

    torch.manual_seed(args.seed)
    backbone = LlamaForCausalLM(LlamaConfig(**BACKBONE)).eval()
    config = FiberBundleConfig(**BACKBONE, metric_rank=args.metric_rank, ffn_metric_rank=args.metric_rank)
    model = FiberBundleForCausalLM(config).eval()
    missing = model.load_state_dict(backbone.state_dict(), strict=False).missing_keys
    ids = torch.randint(3, BACKBONE["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        graft_gap = (model(ids).logits - backbone(ids).logits).abs().max().item()
    print(f"new parameters: {len(missing)} tensors, {sum(p.numel() for p in model.geometry_parameters()):,} values "
          f"({100 * sum(p.numel() for p in model.geometry_parameters()) / backbone.num_parameters():.1f}% of the "
          f"backbone)")
    print(f"graft: max |logits - LLaMA logits| = {graft_gap:.2e} (gates at 0: the backbone's function)")

    with torch.no_grad():  # a 'learned' geometry: open every gate a little
        for layer in model.model.layers:
            layer.fiber.attn_gate.fill_(0.5)
            layer.fiber.flatness_gate.fill_(1.0)
            layer.fiber.ffn_gate.fill_(0.3)
        out = model(ids, output_geometry=True)
        moved = (out.logits - backbone(ids).logits).abs().max().item()
    print(f"gates open: max |logits - LLaMA logits| = {moved:.3f}")
    for name, values in out.geometry.items():
        print(f"  {name:>10} per layer: " + " ".join(f"{v:.4f}" for v in values.tolist()))

    model.save_pretrained(args.out)
    files = sorted(p.name for p in args.out.iterdir())
    print(f"saved {args.out}: {', '.join(files)}")
    print(f"auto_map: {json.loads((args.out / 'config.json').read_text())['auto_map']}")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(args.out.resolve().parent / ".hf_home"))
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(args.out.resolve())], capture_output=True,
                            text=True, cwd=args.out, env=env)
    if result.returncode != 0:
        sys.exit(f"fresh-process load failed:\n{result.stderr[-3000:]}")
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    expected = model.generate(torch.tensor([[1, 17, 42, 99, 7]]), max_new_tokens=8, do_sample=False)[0].tolist()
    print(f"fresh process (project not importable) loaded {loaded['class']}")
    print(f"  greedy tokens {loaded['tokens']} {'== in-process' if loaded['tokens'] == expected else '!= in-process'}")
    if loaded["tokens"] != expected:
        sys.exit("the reloaded model does not reproduce the in-process generation")


if __name__ == "__main__":
    main()
