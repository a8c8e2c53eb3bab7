"""Cost of a training step under each optimiser, side by side in one run, on a converted SmolLM2-135M-Instruct in
metric-only training (the comparison's task):

    .venv/bin/python benchmarks/bench_optimizers.py [--converted out/smollm2-fbt] [--rounds 4]

One model, one fixed batch (pydoc topics); every round times, for each optimiser in turn, the forward + backward pass
and the optimiser's ``step`` (interleaved, so drifts of the machine's speed touch every optimiser alike). Printed:
the median times, the ratio of each optimiser's step to AdamW's, and of a training step (AdamW's forward + backward
plus the optimiser's step) to AdamW's. The model's weights
drift as the optimisers take turns stepping it; that changes no cost. Results are appended to
benchmarks/results_optimizers.json.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--converted", default="out/smollm2-fbt", help="a converted Fiber Bundle folder")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    parser.add_argument("--batch-size", type=int, default=4, help="blocks per step")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block")
    parser.add_argument("--record", default=str(Path(__file__).with_name("results_optimizers.json")),
                        help="JSON file the results are appended to")
    args = parser.parse_args()

    import torch

    from fiber_bundle.analysis.compare import corpus
    from fiber_bundle.analysis.models import load_causal_lm
    from fiber_bundle.training.modes import prepare_for_training
    from fiber_bundle.training.riemannian import GEOMETRIES, build_optimizer

    model, tokenizer = load_causal_lm(args.converted)
    model = prepare_for_training(model, "metric-only").train()
    train_set, _, _ = corpus(tokenizer, args.block_size, args.batch_size)
    ids = torch.tensor(train_set[: args.batch_size]["input_ids"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizers = {"adamw": torch.optim.AdamW(trainable, lr=1e-6)}
    for geometry in GEOMETRIES:  # tiny rates: the weights barely move, the cost is what is measured
        optimizers[geometry] = build_optimizer(model, geometry, lr=1e-6, riemannian_lr=1e-6)
        if geometry not in ("riemannian-quotient", "riemannian-embedded"):
            optimizers[f"{geometry} (block)"] = build_optimizer(model, geometry, lr=1e-6, riemannian_lr=1e-6,
                                                                block=True)
    times = {name: {"forward_backward": [], "step": []} for name in optimizers}
    for round_ in range(args.rounds + 1):
        for name, optimizer in optimizers.items():
            optimizer.zero_grad(set_to_none=True)
            started = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            middle = time.perf_counter()
            optimizer.step()
            ended = time.perf_counter()
            if round_ > 0:  # round 0 warms up
                times[name]["forward_backward"].append(middle - started)
                times[name]["step"].append(ended - middle)
    medians = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    reference = medians["adamw"]
    print(f"{args.converted}, metric-only, {args.batch_size} x {args.block_size} tokens, {args.rounds} rounds; "
          f"{os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}")
    print(f"  {'optimizer':32s} {'fwd+bwd s':>9s} {'step ms':>8s} {'step / AdamW':>12s} {'total / AdamW':>13s}")
    for name, m in medians.items():
        m["step_vs_adamw"] = m["step"] / reference["step"]
        # why AdamW's forward + backward for every row: the pass is the same computation whatever steps afterwards,
        # and its per-optimiser medians differ only by the machine's noise (about 2 %)
        m["total_vs_adamw"] = (reference["forward_backward"] + m["step"]) / (reference["forward_backward"]
                                                                            + reference["step"])
        print(f"  {name:32s} {m['forward_backward']:9.2f} {1e3 * m['step']:8.1f} {m['step_vs_adamw']:12.1f} "
              f"{m['total_vs_adamw']:13.3f}")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": args.converted, "batch_size": args.batch_size, "block_size": args.block_size, "rounds": args.rounds,
        "median_seconds": medians,
    }
    path = Path(args.record)
    history = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(history + [record], indent=2) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
