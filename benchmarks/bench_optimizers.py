"""Cost of a training step under each optimiser, side by side in one run, on a converted SmolLM2-135M-Instruct in
metric-only training (the comparison's task of docs/results.md section 6), or on a model trained from scratch with the
geometry on its W_Q / W_K pairs (``--from-scratch ARM``: the optimiser abstract's setting of section 8):

    .venv/bin/python benchmarks/bench_optimizers.py [--converted out/smollm2-fbt] [--rounds 4]
    .venv/bin/python benchmarks/bench_optimizers.py --from-scratch euclidean --compile [--rounds 20]

One model, one fixed batch (pydoc topics, or 16 x 128 bytes of the standard library's source from scratch); every
round times, for each optimiser in turn, the forward + backward pass and the optimiser's ``step`` (interleaved, so
drifts of the machine's speed touch every optimiser alike). ``--compile``: the forward + backward pass runs through
``torch.compile``, each decoder layer compiled alone as ``--torch-compile`` trains (accelerate's ``compile_regions``,
fullgraph; the optimisers' steps stay eager, as in training). Printed: the median times, the ratio of each
optimiser's step to AdamW's, and of a training step (AdamW's forward + backward plus the optimiser's step) to AdamW's.
The model's weights drift as the optimisers take turns stepping it (a partial-isometry optimiser first makes W_Q / W_K
orthonormal); that changes no cost. Results are appended to benchmarks/results_optimizers.json.
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
    parser.add_argument("--from-scratch", default=None, metavar="ARM",
                        help="instead: a fresh small model of this analyze scratch arm (euclidean, strong-1, ...) in "
                             "full training, the geometries on its W_Q / W_K pairs")
    parser.add_argument("--corpus-root", default=None,
                        help="with --from-scratch: a folder of .py files standing in for the standard library")
    parser.add_argument("--compile", action="store_true",
                        help="run the forward + backward pass through torch.compile, each decoder layer alone")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    parser.add_argument("--batch-size", type=int, default=None, help="blocks per step (default 4; from scratch 16)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block (default 256; from scratch 128)")
    parser.add_argument("--record", default=str(Path(__file__).with_name("results_optimizers.json")),
                        help="JSON file the results are appended to")
    args = parser.parse_args()

    import torch

    from accelerate.utils import compile_regions

    from fiber_bundle.analysis.compare import corpus
    from fiber_bundle.analysis.models import load_causal_lm
    from fiber_bundle.training.modes import prepare_for_training
    from fiber_bundle.training.riemannian import GEOMETRIES, build_optimizer

    if args.from_scratch:
        model, ids = scratch_setup(args.from_scratch, args.batch_size or 16, args.block_size or 128, args.corpus_root)
        task = f"from scratch ({args.from_scratch}), full, geometry on W_Q / W_K"
        attention = dict(pairs="attention", fresh=True)  # W_Q / W_K only; a fresh model may start them orthonormal
    else:
        model, tokenizer = load_causal_lm(args.converted)
        model = prepare_for_training(model, "metric-only").train()
        train_set, _, _ = corpus(tokenizer, args.block_size or 256, args.batch_size or 4)
        ids = torch.tensor(train_set[: args.batch_size or 4]["input_ids"])
        task, attention = f"{args.converted}, metric-only", {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizers = {"adamw": torch.optim.AdamW(trainable, lr=1e-6)}
    for geometry in GEOMETRIES:  # tiny rates: the weights barely move, the cost is what is measured
        optimizers[geometry] = build_optimizer(model, geometry, lr=1e-6, riemannian_lr=1e-6, **attention)
        if geometry not in ("riemannian-quotient", "riemannian-embedded"):  # fixed rank: the block step is the stacked
            optimizers[f"{geometry} (block)"] = build_optimizer(model, geometry, lr=1e-6, riemannian_lr=1e-6,
                                                                block=True, **attention)
    forward = compile_regions(model, fullgraph=True) if args.compile else model  # as --torch-compile trains it
    times = {name: {"forward_backward": [], "step": []} for name in optimizers}
    for round_ in range(args.rounds + 1):
        for name, optimizer in optimizers.items():
            optimizer.zero_grad(set_to_none=True)
            started = time.perf_counter()
            forward(input_ids=ids, labels=ids).loss.backward()
            middle = time.perf_counter()
            optimizer.step()
            ended = time.perf_counter()
            if round_ > 0:  # round 0 warms up
                times[name]["forward_backward"].append(middle - started)
                times[name]["step"].append(ended - middle)
    medians = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    reference = medians["adamw"]
    print(f"{task}, {tuple(ids.shape)} tokens, {args.rounds} rounds{', compiled' if args.compile else ''}; "
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
        "model": f"from scratch: {args.from_scratch}" if args.from_scratch else args.converted,
        "batch_size": ids.shape[0], "block_size": ids.shape[1], "rounds": args.rounds, "compiled": args.compile,
        "median_seconds": medians,
    }
    path = Path(args.record)
    history = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(history + [record], indent=2) + "\n")
    print(f"-> {path}")


def scratch_setup(arm: str, batch_size: int, block_size: int, corpus_root=None):
    """(model, batch) of the optimiser abstract's setting: a fresh ``small`` model of ``analyze scratch``'s ``arm``
    (seed 0) in full training and one batch of the standard library corpus (``corpus_root``: a stand-in folder)."""
    import torch

    from fiber_bundle.analysis.scratch import arm_config, scratch_corpus
    from fiber_bundle.training.scratch import byte_tokenizer, fresh_model

    tokenizer = byte_tokenizer()
    try:
        config = arm_config(arm, tokenizer)
    except ValueError as error:
        raise SystemExit(f"--from-scratch: {error}") from None
    train_set, _ = scratch_corpus(tokenizer, block_size, 1, corpus_root)
    return fresh_model(config, 0).train(), torch.tensor(train_set[:batch_size]["input_ids"])


if __name__ == "__main__":
    main()
