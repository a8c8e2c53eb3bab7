"""``fiber-bundle analyze``: the measurements of docs/design.md section 4, each a thin command over this package's functions.
Every subcommand writes a JSON file of figures and a PNG plot into --out. And ``fiber-bundle evaluate``: a model and its
source side by side on lm-evaluation-harness tasks (``evaluation``)."""

import argparse
from pathlib import Path

from fiber_bundle.conversion.cli import report_failure


def _print_table(lines: list[str], out, *files: str, seconds: float | None = None) -> int:
    """Print a command's table and the files it wrote into ``out`` (after the ``seconds`` it took, where the results
    record them); the command's exit code."""
    print(*lines, sep="\n")
    took = "" if seconds is None else f"{seconds:.0f} s "
    print(f"{took}-> " + ", ".join(str(Path(out) / name) for name in files))
    return 0


def _compare(args) -> int:
    from .reports import run_compare

    results = run_compare(args.converted, args.source, args.out, gguf_file=args.gguf_file, seeds=args.seeds,
                          arms=args.arms, max_steps=args.max_steps, batch_size=args.batch_size,
                          block_size=args.block_size, metric_learning_rate=args.metric_learning_rate,
                          lora_learning_rate=args.lora_learning_rate, lora_r=args.lora_r,
                          max_eval_blocks=args.eval_blocks)
    return _print_table(compare_table(results), args.out, "compare.json", "compare.png")


def compare_table(results: dict) -> list[str]:
    """The lines ``analyze compare`` prints of its results."""
    lines = [f"token budget {results['budget']['tokens']:,} per run; LoRA rank {results['lora_r']} "
             f"(metric parameters {results['metric_parameters']:,})"]
    for arm, row in results["summary"].items():
        lines.append(f"  {arm:12s} eval loss {row['eval_loss_before']:.4f} -> {row['eval_loss_after_mean']:.4f} "
                     f"± {row['eval_loss_after_std']:.4f} ({row['seeds']} seeds, {row['trainable_parameters']:,} "
                     f"trainable, {row['train_seconds_mean']:.0f} s)")
    return lines


def _optimizers(args) -> int:
    from .optimizers import run_optimizer_comparison

    grids = {name: args.learning_rates for name in args.optimizers} if args.learning_rates else None
    results = run_optimizer_comparison(args.converted, args.out, optimizers=args.optimizers, grids=grids,
                                       seeds=args.seeds, mode=args.mode, block=args.block, lora_r=args.lora_r,
                                       max_steps=args.max_steps, batch_size=args.batch_size,
                                       block_size=args.block_size, max_eval_blocks=args.eval_blocks,
                                       adamw_learning_rate=args.adamw_learning_rate,
                                       max_extensions=args.max_extensions, from_scratch=args.from_scratch,
                                       compile=args.compile, warmup_steps=args.warmup_steps, gauge=args.gauge)
    return _print_table(optimizers_table(results), args.out, "optimizers.json")


def optimizers_table(results: dict) -> list[str]:
    """The lines ``analyze optimizers`` prints of its results."""
    task = f"from scratch ({results['from_scratch']}, W_Q / W_K pairs)" if results.get("from_scratch") else \
        results["mode"]
    lines = [f"{task}, token budget {results['budget']['tokens']:,} per run, held-out loss before "
             f"{results['eval_loss_before']:.4f}"]
    for name, row in results["summary"].items():
        loss = "diverged" if row["eval_loss_after_mean"] is None else \
            f"{row['eval_loss_after_mean']:.4f} ± {row['eval_loss_after_std']:.4f}"
        edge = " (best rate at the grid's edge)" if row["at_grid_edge"] else ""
        if row.get("loss_vs_adamw") is not None:
            loss += f", minus AdamW {row['loss_vs_adamw']:+.4f} ± {row['loss_vs_adamw_std']:.4f} (paired by seed)"
        for key, which in (("loss_vs_adamw_interval", "95 %"), ("loss_vs_plain_interval", "minus its plain geometry"),
                           ("loss_vs_scaled_interval", "minus the scale control")):
            interval = (row.get(key) or {}).get("t_interval")
            loss += f", {which} [{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else ""
        lines.append(f"  {name:20s} lr {row['learning_rate']:.3g}{edge}: eval loss {loss} ({row['seeds']} seeds), "
                     f"{row['seconds_per_step_mean']:.2f} s/step ({row.get('time_vs_adamw', float('nan')):.2f} x "
                     "AdamW)")
    return lines


def _scratch(args) -> int:
    from .reports import run_scratch_comparison

    fields = {"num_hidden_layers": args.layers, "hidden_size": args.width, "intermediate_size": args.intermediate_size,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "metric_rank": args.metric_rank,
              "ffn_metric_rank": args.ffn_metric_rank, "metric_hidden": args.metric_hidden}
    if args.attention_only:  # no MLP, so no MLP metric unless asked for (which the config then refuses)
        fields.update(attention_only=True, ffn_metric_rank=0 if args.ffn_metric_rank is None else args.ffn_metric_rank)
    results = run_scratch_comparison(args.out, seeds=args.seeds, learning_rates=args.learning_rates,
                                     strong=args.strong_alphas, arms=args.arms,
                                     model_fields={k: v for k, v in fields.items() if v is not None},
                                     max_steps=args.max_steps, batch_size=args.batch_size, block_size=args.block_size,
                                     eval_blocks=args.eval_blocks, eval_every=args.eval_every,
                                     warmup_steps=args.warmup_steps, max_extensions=args.max_extensions,
                                     compile=args.compile, metric_rate_ratios=args.metric_rate_ratios,
                                     metric_rate_extensions=args.metric_rate_extensions,
                                     steps_by_arm=dict(args.steps_by_arm) if args.steps_by_arm else None,
                                     reuse_from=args.reuse_runs, tuning_seed=args.tuning_seed)
    return _print_table(scratch_table(results), args.out, "scratch.json", "scratch.png")


def scratch_table(results: dict) -> list[str]:
    """The lines ``analyze scratch`` prints of its results."""
    lines = [f"{results['budget']['tokens']:,} tokens per run, {len(results['seeds'])} seeds, held-out "
             f"{results['eval_blocks']} x {results['budget']['block_size']} bytes"]
    for arm, row in results["summary"].items():
        versus = (f", vs euclidean {row['loss_vs_euclidean']:+.4f} ± {row['loss_vs_euclidean_std']:.4f}"
                  if row.get("loss_vs_euclidean") is not None and arm != "euclidean" else "")
        for key, which in (("loss_vs_euclidean_interval", "95 %"),
                           ("loss_vs_euclidean_interval_without_sweep_seed", "95 % without the sweep seed")):
            interval = (row.get(key) or {}).get("t_interval")
            versus += f", {which} [{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else ""
        loss = ("diverged" if row["eval_loss_after_mean"] is None else
                f"{row['eval_loss_after_mean']:.4f} ± {row['eval_loss_after_std']:.4f}")
        metric = f", metric lr {row['metric_learning_rate']:g}" if row.get("metric_learning_rate") else ""
        edge = " (sweep edge)" if row["at_sweep_edge"] else ""
        lines.append(f"  {arm:12s} lr {row['learning_rate']:g}{edge}{metric}: held-out loss {loss}{versus}; "
                     f"{row['seconds_per_step_mean']:.2f} s/step; {row['parameters']:,} parameters")
    return lines


def _scaling(args) -> int:
    from .reports import run_scaling

    results = run_scaling(args.studies, args.out, equal_time=args.equal_time or (), arm=args.arm,
                          reference=args.reference)
    return _print_table(scaling_table(results), args.out, "scaling.json", "scaling.png")


def scaling_table(results: dict) -> list[str]:
    """The lines ``analyze scaling`` prints of its results."""
    arm, reference = results["arm"], results["reference"]
    lines = [f"{arm} minus {reference}, final held-out loss paired by seed (rates chosen on a tuning seed in no "
             "interval):"]
    for row in results["sizes"]:
        rates = ", ".join(f"{a} lr {r['learning_rate']:g}" + (" at the sweep's edge" if r["at_sweep_edge"] else "")
                          + (f" (metric {r['metric_learning_rate']:g})" if "metric_learning_rate" in r else "")
                          + (" (its metric rate at its sweep's edge)" if r.get("metric_at_sweep_edge") else "")
                          for a, r in row["rates"].items())
        settled = ", ".join(f"{a} {s['ratio']:.3f}" if s["ratio"] is not None else f"{a} -"
                            for a, s in row["settling"].items())
        lines.append(f"  {row['parameters']:,} parameters, {row['steps']} steps ({row['tokens']:,} tokens), "
                     f"{len(row['seeds'])} seeds: {_difference(row['paired'])}; last-third / first-third drop "
                     f"{settled}; {rates}")
        if row.get("step_ratio"):
            ratio = row["step_ratio"]
            unrecorded = ratio["runs_without_host"]
            hosts = ", ".join(ratio["cpus"] + ([f"{unrecorded} run(s) without a host record"] if unrecorded else []))
            if ratio["load_average_max"] is not None:
                hosts += f", load average up to {ratio['load_average_max']:.2f}"
            lines.append(f"    step in the runs, {arm} / {reference} by seed: median {ratio['median']:.3f} "
                         f"({ratio['range'][0]:.3f}-{ratio['range'][1]:.3f}); equal time gives {reference} "
                         f"{ratio['reference_steps_at_equal_time']} steps ({hosts})")
        if "equal_time" in row:
            timed = row["equal_time"]
            steps = ", ".join(f"{a} {n}" for a, n in timed["steps"].items())
            lines.append(f"    equal time ({steps} steps), {len(timed['seeds'])} seeds: {_difference(timed['paired'])}")
    trend = results["trend"]
    if trend is None:
        lines.append("  trend: needs three or more sizes")
    else:
        low, high = trend["bootstrap_interval"]
        lines.append(f"  trend: {trend['slope_per_tenfold_parameters']:+.4f} per tenfold parameters, bootstrap 95 % "
                     f"[{low:+.4f}, {high:+.4f}] ({trend['below_zero']:.0%} of draws below zero): the edge "
                     f"{trend['reading']}")
    return lines


def _difference(paired: dict) -> str:
    """A paired difference as the tables print it: mean, and its t-interval where there is one."""
    interval = paired["t_interval"]
    return f"{paired['mean']:+.4f}" + (f", 95 % [{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "")


def _collapse(args) -> int:
    from .reports import run_collapse
    from .stacks import StackSpec

    spec = StackSpec(width=args.width, heads=args.heads, depth=args.depth, tokens=args.tokens,
                     metric_rank=args.metric_rank, code_width=args.code_width)
    results = run_collapse(args.out, models=args.models, labels=args.labels, samples=args.samples, length=args.length,
                           seeds=range(args.seeds), spec=spec, alphas=args.alphas, threshold=args.threshold,
                           stacks=not args.no_stacks)
    return _print_table(collapse_table(results), args.out, "collapse.json", "collapse.png", seconds=results["seconds"])


def collapse_table(results: dict) -> list[str]:
    """The lines ``analyze collapse`` prints of its results."""
    lines = []
    for stack in results["stacks"]:
        lines.append(stack["title"])
        for label, variant in stack["variants"].items():
            depth = variant["depth_below_threshold_summary"]
            reached = f"{depth['mean']:.2f} ± {depth['std']:.2f}" if depth["count"] else "never"
            lines.append(f"  {label:26s} depth where residual < {results['threshold']:g}: {reached} "
                         f"({variant['seeds_reaching_threshold']}/{len(stack['seeds'])} seeds); "
                         f"final residual {variant['per_depth'][-1]['mean']:.2e}")
    for label, curve in results["models"].items():
        lines.append(f"{label}: residual entering layer 0 / last layer / after it: "
                     f"{curve['per_depth'][0]['mean']:.3g} / {curve['per_depth'][-2]['mean']:.3g} / "
                     f"{curve['per_depth'][-1]['mean']:.3g}")
    return lines


def _intrinsic_rank(args) -> int:
    from .reports import run_intrinsic_rank

    results = run_intrinsic_rank(args.out, args.models, labels=args.labels, samples=args.samples, length=args.length,
                                 threshold=args.threshold, rtol=args.rtol)
    return _print_table(intrinsic_rank_table(results), args.out, "intrinsic_rank.json", "intrinsic_rank.png",
                        seconds=results["seconds"])


def intrinsic_rank_table(results: dict) -> list[str]:
    """The lines ``analyze intrinsic-rank`` prints of its results."""
    lines = []
    for label, rank in results["models"].items():
        s = rank["summary"]
        lines.append(f"{label} (d = {rank['head_dim']}): logits on text {s['text_energy_rank']['mean']:.1f} "
                     f"[{s['text_energy_rank']['min']:.1f}, {s['text_energy_rank']['max']:.1f}], W_Q^T W_K "
                     f"{s['interaction_energy_rank']['mean']:.1f}, score numerical rank "
                     f"{s['score_numerical_rank']['mean']:.1f} (max {s['score_numerical_rank']['max']:.0f}); "
                     f"{s['heads_above_gram_bound']}/{s['heads']} heads above the Gram bound d + 1")
    return lines


def _geometry(args) -> int:
    from .reports import run_geometry

    results = run_geometry(args.out, args.models, labels=args.labels, samples=args.samples, length=args.length,
                           eps_values=args.eps, norm_layers=args.norm_layers, ablation_blocks=args.ablation_blocks)
    return _print_table(geometry_table(results), args.out, "geometry.json", "geometry.png", seconds=results["seconds"])


def geometry_table(results: dict) -> list[str]:
    """The lines ``analyze geometry`` prints of its results."""
    lines = []
    for label, report in results["models"].items():
        if report["proxies"]:
            means = ", ".join(f"{k} {sum(v) / len(v):.3g}" for k, v in report["proxies"].items())
            lines.append(f"{label}: layer means {means}")
        for name, norm in report["rmsnorm_lipschitz"].items():
            fit = norm["worst_case_fit"]
            lines.append(f"  {name} RMSNorm Lipschitz vs eps: worst case exponent {fit['exponent']:.4f} (R² "
                         f"{fit['r2']:.4f}), at real tokens {norm['on_data_fit']['exponent']:.4f} (R² "
                         f"{norm['on_data_fit']['r2']:.3f})")
        if report.get("ablation"):
            a = report["ablation"]
            lines.append(f"  held-out loss ({a['blocks']} x {a['tokens_per_block']} tokens): learned "
                         f"{a['learned']:.4f}, attention metric off {a['attention_metric_off']:.4f}, MLP metric off "
                         f"{a['mlp_metric_off']:.4f}, both off (backbone) {a['backbone']:.4f}")
        entropy = report["attention_entropy"]
        lines.append(f"  attention entropy (mean over layers) at context {entropy['bins'][-1]}: "
                     f"{entropy['mean_over_layers'][-1]:.3f} nats (uniform {entropy['uniform'][-1]:.3f})")
    return lines


def _ide(args) -> int:
    from .reports import run_ide

    results = run_ide(args.out, args.models, labels=args.labels, observables=args.observables, samples=args.samples,
                      length=args.length, torsion_steps=args.torsion_steps, torsion_layers=args.torsion_layers,
                      ablation_blocks=args.ablation_blocks, rope_pairs=args.rope_pairs,
                      rope_max_offset=args.rope_max_offset, current_steps=args.current_steps,
                      current_block_size=args.current_block_size, current_batch=args.current_batch,
                      sgd_learning_rate=args.sgd_learning_rate, adamw_learning_rate=args.adamw_learning_rate)
    return _print_table(ide_table(results), args.out, "ide.json", "ide.png")


def ide_table(results: dict) -> list[str]:
    """The lines ``analyze ide`` prints of its results."""
    from .ide import trajectory_currents

    lines = []
    for label, model in results["models"].items():
        lines.append(f"{label}:")
        if "torsion" in model:
            lines.append(f"  splitting torsion ||T(h)|| ~ h^p: median exponent over layers "
                         f"{model['torsion']['exponent_median']:.3f} (prediction 2)")
        if "ablation" in model:
            fit = model["ablation"]["fit"]
            line = ("too few layers for a fit" if fit["slope"] is None else
                    f"measured = {fit['slope']:.3f} x adjoint prediction (95 % [{fit['slope_interval'][0]:.3f}, "
                    f"{fit['slope_interval'][1]:.3f}], R² {fit['r2']:.3f})")
            pair = model["ablation"].get("pair_fit") or {}
            pair_line = ("" if pair.get("slope") is None else
                         f", measured asymmetry = {pair['slope']:.3f} x predicted (R² {pair['r2']:.3f})")
            lines.append(f"  ablation: {line}; symmetric pairs whose asymmetry has the predicted sign: "
                         f"{model['ablation']['pair_signs_agree']} of {len(model['ablation']['pairs'])}{pair_line}")
            for partial in model["ablation"].get("partial", []):
                if partial["fit"]["slope"] is not None:
                    lines.append(f"  removing {partial['fraction']:g} of each update: measured = "
                                 f"{partial['fit']['slope']:.3f} x prediction (R² {partial['fit']['r2']:.3f}; the "
                                 "dual law's first order: 1)")
        if "rope" in model:
            decay = model["rope"]["decay"]
            lines.append(f"  rotary recurrence ~ m^p: mean {decay['mean_fit']['exponent']:.3f} "
                         f"(R² {decay['mean_fit']['r2']:.3f}), envelope {decay['envelope_fit']['exponent']:.3f} "
                         f"(R² {decay['envelope_fit']['r2']:.3f}); prediction -1")
            if decay.get("mean_log_fit", {}).get("slope") is not None:
                log_fit = decay["mean_log_fit"]
                lines.append(f"  rotary recurrence linear in ln m: mean slope {log_fit['slope']:.4f} "
                             f"(R² {log_fit['r2']:.3f})")
        for name in (name for name in ("sgd", "adamw") if name in model.get("current", {})):
            run = model["current"][name]
            lag = run["lags"]["1"] if "1" in run["lags"] else run["lags"][1]
            curved = trajectory_currents(run["trajectory"], degree=2, lags=(1,))[1]  # is it the drift's curvature?
            lines.append(f"  {name} (lr {run['learning_rate']:g}): lag-1 current {lag['current']:+.4f} "
                         f"[{lag['interval'][0]:+.4f}, {lag['interval'][1]:+.4f}]"
                         + (" excludes 0" if lag["excludes_zero"] else " includes 0")
                         + f"; quadratics removed {curved['current']:+.4f} [{curved['interval'][0]:+.4f}, "
                           f"{curved['interval'][1]:+.4f}]"
                         + (" excludes 0" if curved["excludes_zero"] else " includes 0"))
    return lines


def _model_arguments(parser, *, required: bool) -> None:
    parser.add_argument("models", nargs="+" if required else "*",
                        help="models to measure: Fiber Bundle folders, transformers checkpoint folders, Hub ids or "
                             ".gguf files")
    parser.add_argument("--labels", nargs="+", default=None, help="a name per model for the figures (default: folder)")
    parser.add_argument("--samples", type=int, default=4, help="windows of sample text (pydoc topics)")
    parser.add_argument("--length", type=int, default=512, help="tokens per window")
    parser.add_argument("--out", required=True, help="folder for the JSON figures and the PNG plot")


# subcommand -> (one-line help, description)
SUBCOMMANDS = {
    "collapse": (
        "relative residual ||X - 1x^T||/||X|| per layer: pure-attention stacks and real models",
        "(a) Pure-attention stacks (no MLP, no norm; with and without skip connections, bidirectional and causal) at "
        "random initialisation, Euclidean vs Riemannian attention over many seeds; (b) MODELS on real text. Without "
        "MODELS only (a) runs."),
    "intrinsic-rank": (
        "energy effective rank of attention logits and W_Q^T W_K; numerical rank of scores",
        "Per layer and head, in float64: the energy effective rank of the row-centred pre-softmax logit matrix on "
        "sample text and of W_Q^T W_K, and the numerical rank of the score matrix (a dot-product head is a Gram matrix "
        "of rank <= d; a heterogeneous metric exceeds d + 1)."),
    "geometry": (
        "curvature / torsion / anisotropy per layer, RMSNorm Lipschitz vs eps, attention entropy",
        "Connection proxies per layer (Fiber Bundle models), RMSNorm's Lipschitz constant versus eps with the fitted "
        "exponent and R^2 (prediction -1/2), and attention entropy versus context length."),
    "ide": (
        "the IDE picture's observables: splitting torsion, symmetric ablation, rotary recurrence, training current",
        "Per model: the Lie-Trotter torsion of each layer's attention and MLP flows against the step h (prediction "
        "h^2), each layer's ablation against the adjoint's first-order prediction and the asymmetry of symmetric "
        "pairs, the recurrence of (q, k) scores on the rotary torus against the offset (prediction 1/m), and the "
        "probability current of SGD and AdamW trajectories at a constant rate. Definitions: analysis/ide.py. A rerun "
        "continues."),
    "compare": (
        "metric-only training vs equal-parameter LoRA on the source vs LoRA + metric",
        "Train each arm on the same token budget of pydoc topics with several seeds; report held-out eval loss (mean "
        "± std), wall time and the geometry at the end."),
    "optimizers": (
        "Riemannian optimisers vs AdamW, each at its best swept learning rate",
        "For each optimiser: a learning-rate sweep on the first seed (a grid, extended while the best rate is at its "
        "edge, then the geometric midpoints around the best), the best rate re-run on every seed; held-out eval loss "
        "(mean ± std, and minus AdamW's paired by seed) and seconds per step relative to AdamW. The Riemannian "
        "optimisers train the factored pairs; the other parameters use AdamW at AdamW's best rate. --from-scratch ARM: "
        "the optimiser abstract's setting, a fresh small model per run with the geometry on W_Q / W_K. A rerun "
        "continues a stopped comparison."),
    "scratch": (
        "from scratch: Euclidean vs Riemannian (gates 0, strong starts) at equal parameters and tokens",
        "Train small byte-level models from scratch on the standard library's source (split by module): the Euclidean "
        "twin (its MLP widened by the metric's parameters), the Riemannian model with gates 0, and with strong starts "
        "(alpha in --strong-alphas, gamma 1). Each arm's learning rate is swept on the first seed, the best re-run on "
        "every seed; held-out loss curves, time per step, residual per layer, score rank, gates and proxies. A rerun "
        "continues a stopped comparison."),
    "scaling": (
        "the from-scratch comparison across model sizes: the paired difference per size and its trend",
        "Read one analyze scratch study per model size (each tuned on its --tuning-seed) and optionally equal-time "
        "studies of some sizes: per size the paired difference of ARM minus REFERENCE with its intervals and whether "
        "the loss curves flattened (last third's drop under a tenth of the first third's); across sizes the slope of "
        "the difference in log10(parameters) with a bootstrap over seeds within size. Writes scaling.json and "
        "scaling.png; trains nothing."),
}


def _collapse_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze collapse``."""
    parser.add_argument("--seeds", type=int, default=20, help="random stacks per configuration")
    parser.add_argument("--depth", type=int, default=32, help="layers of each stack")
    parser.add_argument("--width", type=int, default=64, help="model width D of the stacks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads of the stacks")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stack input")
    parser.add_argument("--metric-rank", type=int, default=2, help="metric rank r of the Riemannian stacks")
    parser.add_argument("--code-width", type=int, default=16, help="fibre code width m of the Riemannian stacks")
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 10.0, 100.0],
                        help="metric gates alpha of the Riemannian stacks (G = I + alpha U U^T)")
    parser.add_argument("--threshold", type=float, default=1e-3,
                        help="report the first depth at which the residual falls below this")
    parser.add_argument("--no-stacks", action="store_true", help="measure only MODELS, not the random stacks")


def _intrinsic_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze intrinsic-rank``."""
    parser.add_argument("--threshold", type=float, default=0.9, help="energy fraction of the effective rank")
    parser.add_argument("--rtol", type=float, default=1e-10, help="relative tolerance of the numerical rank")


def _geometry_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze geometry``."""
    parser.add_argument("--eps", type=float, nargs="+", default=None,
                        help="RMSNorm eps values of the sweep (default: 10 values from 1e-10 to 1e-1)")
    parser.add_argument("--norm-layers", type=int, nargs="+", default=None,
                        help="layers whose input RMSNorm is swept (default: first, middle, last; the final norm "
                             "always)")
    parser.add_argument("--ablation-blocks", type=int, default=0,
                        help="also score the model on this many held-out 256-token blocks (the main job's eval "
                             "split) with the attention metric, the MLP metric and both switched off (0: skip)")


def _ide_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze ide``."""
    parser.add_argument("--observables", nargs="+", default=["torsion", "ablation", "rope", "current"],
                        choices=["torsion", "ablation", "rope", "current"], help="which observables to measure")
    parser.add_argument("--torsion-steps", type=float, nargs="+", default=None,
                        help="steps h of the splitting torsion (default 1e-4 ... 1)")
    parser.add_argument("--torsion-layers", type=int, nargs="+", default=None, help="layers measured (default: all)")
    parser.add_argument("--ablation-blocks", type=int, default=8,
                        help="held-out 256-token blocks (the main job's eval split) scored with each layer removed")
    parser.add_argument("--rope-pairs", type=int, default=64, help="(query, key) token pairs per layer and head")
    parser.add_argument("--rope-max-offset", type=int, default=None,
                        help="largest relative offset (default: the model's max_position_embeddings)")
    parser.add_argument("--current-steps", type=int, default=300, help="training steps per optimiser (current)")
    parser.add_argument("--current-block-size", type=int, default=128, help="tokens per training block (current)")
    parser.add_argument("--current-batch", type=int, default=1, help="blocks per training step (current)")
    parser.add_argument("--sgd-learning-rate", type=float, default=1e-3,
                        help="constant rate of plain SGD, no momentum (current)")
    parser.add_argument("--adamw-learning-rate", type=float, default=1e-5,
                        help="constant rate of AdamW, no weight decay (current)")


def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze compare``."""
    parser.add_argument("converted", help="a Fiber Bundle folder converted from SOURCE")
    parser.add_argument("source", help="the unconverted checkpoint: a folder, a Hub id or a .gguf file")
    parser.add_argument("--out", required=True, help="folder for compare.json and compare.png")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside SOURCE when SOURCE is a folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    parser.add_argument("--arms", nargs="+", default=["metric-only", "lora-source", "lora+metric"],
                        choices=["metric-only", "lora-source", "lora+metric"], help="which arms to run")
    parser.add_argument("--max-steps", type=int, default=16, help="optimiser steps per run")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per step")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block")
    parser.add_argument("--metric-learning-rate", type=float, default=2e-2, help="learning rate of the metric")
    parser.add_argument("--lora-learning-rate", type=float, default=1e-3, help="learning rate of the LoRA weights")
    parser.add_argument("--lora-r", type=int, default=None,
                        help="LoRA rank (default: the rank that trains as many parameters as the metric)")
    parser.add_argument("--eval-blocks", type=int, default=None,
                        help="score on the first N held-out blocks only (default: all)")


def _optimizers_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze optimizers``."""
    from fiber_bundle.training.riemannian import GAUGES, OPTIMIZERS

    from .optimizers import design_points

    parser.add_argument("converted", nargs="?", default=None,
                        help="a converted Fiber Bundle folder (its metric at the graft value); omit with "
                             "--from-scratch")
    parser.add_argument("--out", required=True, help="folder for optimizers.json")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(design_points()),
                        metavar="NAME", help="which optimisers to compare (AdamW runs first): adamw, "
                                             "riemannian-quotient, riemannian-embedded, stiefel-euclidean, "
                                             "stiefel-canonical, grassmann, a geometry's block variant "
                                             "(NAME+block), or a partial-isometry geometry's scale control "
                                             "(NAME+scaled: heads stacked, each head's query slice as large as "
                                             "NAME+block's)")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                        help="one sweep grid for every optimiser (default: each optimiser's own grid)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds; the first one is used for the sweep")
    parser.add_argument("--mode", choices=["metric-only", "lora", "full"], default=None,
                        help="the task (default: metric-only for a converted folder, full from scratch)")
    parser.add_argument("--from-scratch", default=None, metavar="ARM",
                        help="the optimiser abstract's setting: train a fresh small model of this analyze scratch "
                             "arm (euclidean, gates-0, strong-ALPHA) per run on the standard library's source, "
                             "the geometry on the per-head W_Q / W_K pairs only, the rest with AdamW")
    parser.add_argument("--compile", action="store_true",
                        help="train through torch.compile; the time per step is then the median step")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="linear warm-up steps before the linear decay (--from-scratch)")
    parser.add_argument("--block", action="store_true",
                        help="the block variants of every geometry (or name them: --optimizers grassmann+block)")
    parser.add_argument("--gauge", choices=list(GAUGES), default="balanced",
                        help="the factors riemannian-embedded stores each retracted X as: balanced, or continuous "
                             "(nearest the previous factors; for W_Q / W_K, whose RoPE breaks the gauge symmetry)")
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank in --mode lora")
    parser.add_argument("--max-steps", type=int, default=16, help="optimiser steps per run")
    parser.add_argument("--batch-size", type=int, default=4, help="blocks per step")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block")
    parser.add_argument("--eval-blocks", type=int, default=8, help="held-out blocks scored after each run")
    parser.add_argument("--max-extensions", type=int, default=3,
                        help="grid steps the sweep may add beyond the grid's edge while the best rate lies there")
    parser.add_argument("--adamw-learning-rate", type=float, default=None,
                        help="AdamW rate of the non-factored parameters when adamw is not among --optimizers "
                             "(default: AdamW's best rate already in OUT's results, else 3e-2)")


def _scratch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze scratch``."""
    parser.add_argument("--out", required=True, help="folder for scratch.json and scratch.png (rerun to continue)")
    parser.add_argument("--arms", nargs="+", default=None,
                        help="arms to run (default: euclidean gates-0 and strong-ALPHA for each --strong-alphas)")
    parser.add_argument("--strong-alphas", type=float, nargs="+", default=[1.0, 10.0],
                        help="alpha of the strong-start arms (gamma starts at 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds; the first one is used for the learning-rate sweep (unless --tuning-seed)")
    parser.add_argument("--tuning-seed", type=int, default=None,
                        help="sweep the rates on this seed, not in --seeds, and leave it out of every mean and "
                             "interval (default: the first of --seeds tunes and counts, its intervals also given "
                             "without it)")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2],
                        help="the sweep grid of every arm")
    parser.add_argument("--max-extensions", type=int, default=1,
                        help="grid steps the sweep may add beyond the grid's edge while the best rate lies there")
    parser.add_argument("--max-steps", type=int, default=200, help="optimiser steps per run")
    parser.add_argument("--compile", action="store_true",
                        help="train through torch.compile (transformers' torch_compile); the time per step leaves "
                             "the compilation out and records it as compile_seconds")
    parser.add_argument("--batch-size", type=int, default=16, help="blocks per step")
    parser.add_argument("--block-size", type=int, default=128, help="bytes (tokens) per block")
    parser.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps before the linear decay")
    parser.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks scored")
    parser.add_argument("--eval-every", type=int, default=25, help="score the held-out blocks every N steps")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    parser.add_argument("--width", type=int, default=None, help="hidden size (default 192)")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="MLP width of the Riemannian arms (default 512; the Euclidean arm's is derived)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 6)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 2)")
    parser.add_argument("--metric-rank", type=int, default=None, help="attention metric rank r (default 2)")
    parser.add_argument("--ffn-metric-rank", type=int, default=None, help="MLP preconditioner rank (default 2)")
    parser.add_argument("--metric-hidden", type=int, default=None, help="fibre code width m (default 32)")
    parser.add_argument("--metric-rate-ratios", type=float, nargs="+", default=None, metavar="RATIO",
                        help="after each arm's rate sweep, give the metric's parameters their own rate, best rate x "
                             "RATIO, each tried on the first seed (the one-rate run is ratio 1); the best pair runs on "
                             "every seed")
    parser.add_argument("--metric-rate-extensions", type=int, default=0, metavar="N",
                        help="with --metric-rate-ratios: while the best metric rate lies at an edge of those tried, "
                             "try one ratio step further, at most N times (default 0)")
    parser.add_argument("--steps-by-arm", type=_arm_steps, nargs="+", default=None, metavar="ARM=STEPS",
                        help="an arm's own number of steps (equal wall time: the steps its measured time per step "
                             "allows in the budget); other arms run --max-steps")
    parser.add_argument("--reuse-runs", nargs="+", default=(), metavar="FOLDER",
                        help="other studies' --out folders: their finished runs that this study would repeat exactly "
                             "(same model, data, budget, arm, steps, rates and seed) are taken over, not trained again")
    parser.add_argument("--attention-only", action="store_true",
                        help="layers without their MLP (x <- x + attention(RMSNorm(x))), the rank-collapse setting; "
                             "the Euclidean twin then has fewer parameters (no MLP to widen)")


def _scaling_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``analyze scaling``."""
    parser.add_argument("--studies", nargs="+", required=True, metavar="FOLDER",
                        help="the --out folders of analyze scratch studies, one per model size")
    parser.add_argument("--equal-time", nargs="+", default=None, metavar="FOLDER",
                        help="equal-time studies (--steps-by-arm), each matched to the size of the same model")
    parser.add_argument("--arm", default="strong-1", help="the arm compared (default strong-1)")
    parser.add_argument("--reference", default="euclidean", help="the arm it is compared with (default euclidean)")
    parser.add_argument("--out", required=True, help="folder for scaling.json and scaling.png")


# subcommand -> (its handler, the function adding its options, MODELS: required (True), optional (False) or none)
COMMANDS = {
    "collapse": (_collapse, _collapse_arguments, False),
    "intrinsic-rank": (_intrinsic_rank, _intrinsic_rank_arguments, True),
    "geometry": (_geometry, _geometry_arguments, True),
    "ide": (_ide, _ide_arguments, True),
    "compare": (_compare, _compare_arguments, None),
    "optimizers": (_optimizers, _optimizers_arguments, None),
    "scratch": (_scratch, _scratch_arguments, None),
    "scaling": (_scaling, _scaling_arguments, None),
}


def analyze_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fiber-bundle analyze",
        description="Measurements of the open problem (rank collapse), each writing JSON figures and a PNG plot.",
    )
    sub = parser.add_subparsers(dest="analysis", required=True)
    for name, (handler, arguments, models) in COMMANDS.items():
        summary, description = SUBCOMMANDS[name]
        command = sub.add_parser(name, help=summary, description=description)
        if models is not None:
            _model_arguments(command, required=models)
        arguments(command)
        command.set_defaults(handler=_run(handler))
    return parser


def _arm_steps(value: str) -> tuple[str, int]:
    arm, _, steps = value.partition("=")
    try:
        count = int(steps)
    except ValueError:
        count = 0
    if not arm or count < 1:
        raise argparse.ArgumentTypeError(f"expected ARM=STEPS with STEPS a positive integer, got {value!r}")
    return arm, count


def _run(handler):
    """Clear one-line errors for bad input (missing files, invalid values) instead of a traceback."""

    def wrapped(args) -> int:
        try:
            return handler(args)
        except (ValueError, FileNotFoundError, OSError) as error:
            return report_failure(f"analyze {args.analysis}", error, traceback=False)

    return wrapped


def analyze(argv: list[str]) -> int:
    args = analyze_parser().parse_args(argv)
    return args.handler(args)


# ----------------------------------------------------------------------------------------------------------------------
# fiber-bundle evaluate: a thin command over analysis.evaluation
# ----------------------------------------------------------------------------------------------------------------------
def evaluate_parser() -> argparse.ArgumentParser:
    from .evaluation import PACKAGED_TASKS

    parser = argparse.ArgumentParser(
        prog="fiber-bundle evaluate",
        description="Run EleutherAI's lm-evaluation-harness (`lm_eval --model hf`) on MODEL and on its SOURCE, and "
                    "print their metrics side by side with each task's largest per-example loglikelihood difference "
                    f"(zero at the graft). Packaged offline tasks: {', '.join(PACKAGED_TASKS)}. Needs the harness: "
                    "pip install 'fiber-bundle-transformers[evaluation]'.",
    )
    parser.add_argument("model", help="the model to evaluate: a Fiber Bundle folder (or any checkpoint folder, Hub id "
                                      "or .gguf file)")
    parser.add_argument("source", nargs="?", default=None,
                        help="the checkpoint MODEL was converted from: a folder, a Hub id or a .gguf file (omit to "
                             "evaluate MODEL alone)")
    parser.add_argument("--tasks", default=",".join(PACKAGED_TASKS),
                        help="comma-separated harness task names: the packaged ones, the harness's own, or ones in "
                             "--include-path (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N documents of each task")
    parser.add_argument("--batch-size", default="1", help="documents per forward pass, or 'auto' (default: 1)")
    parser.add_argument("--include-path", action="append", default=[], metavar="FOLDER",
                        help="a folder of harness task YAMLs to add (repeatable)")
    parser.add_argument("--tasks-dir", default=None,
                        help="write the packaged tasks into this folder and keep them, so that the printed lm_eval "
                             "commands can rerun them (default: a temporary folder)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float64", "bfloat16", "float16"],
                        help="dtype both models are loaded in (default: auto, each checkpoint's own)")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda:0 (default: the GPU when "
                                                       "there is one, else the CPU)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL when MODEL is a folder")
    parser.add_argument("--source-gguf-file", default=None, help="GGUF file name inside SOURCE when SOURCE is a folder")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the comparison (metrics, rows, per-example loglikelihoods) to this JSON file")
    return parser


def _batch_size(value: str) -> int | str:
    if value == "auto" or (value.isdigit() and int(value) > 0):
        return value if value == "auto" else int(value)
    raise ValueError(f"--batch-size must be a positive integer or 'auto', got {value!r}.")


def evaluate(argv: list[str]) -> int:
    args = evaluate_parser().parse_args(argv)
    import json

    try:
        from .evaluation import compare_on_harness, comparison_table

        tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
        comparison = compare_on_harness(args.model, args.source, tasks, gguf_file=args.gguf_file,
                                        source_gguf_file=args.source_gguf_file, limit=args.limit,
                                        batch_size=_batch_size(args.batch_size), include_paths=args.include_path,
                                        dtype=args.dtype, device=args.device, tasks_dir=args.tasks_dir)
    except (ValueError, FileNotFoundError, ImportError) as error:
        return report_failure("evaluate", error, traceback=False)
    print(comparison_table(comparison))
    for name, run in comparison["runs"].items():
        print(f"{name}: {run['seconds']:.0f} s; the same with the harness's own command:\n  {run['command']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(comparison, indent=2, default=str))
        print(f"-> {args.json}")
    return 0
