"""The PNG figures of ``fiber-bundle analyze``: one function per subcommand, from its results dict."""

import math
from pathlib import Path

from .output import figure, label_axes, save_figure

STYLES = {"euclidean": ("C0", "-"), "euclidean-distance": ("C2", "--"), "riemannian": ("C3", "-")}


def _band(ax, depths, stats, color, style, label):
    """Mean line and a mean ± std band of log10 values (stats: summaries of log10 residuals per depth)."""
    mean = [10 ** s["mean"] for s in stats]
    low = [10 ** (s["mean"] - s["std"]) for s in stats]
    high = [10 ** (s["mean"] + s["std"]) for s in stats]
    ax.plot(depths, mean, color=color, ls=style, label=label)
    ax.fill_between(depths, low, high, color=color, alpha=0.15, lw=0)


def plot_collapse(results: dict, path: str | Path) -> Path:
    """One panel per stack configuration (residual vs depth, geometric mean ± std over seeds) and one for real models."""
    stacks = results.get("stacks", [])
    models = results.get("models", {})
    panels = len(stacks) + (1 if models else 0)
    ncols = min(3, max(1, panels))
    fig, axes = figure(ncols=ncols, nrows=math.ceil(panels / ncols))
    for ax, stack in zip(axes, stacks):
        for i, (label, variant) in enumerate(stack["variants"].items()):
            color, style = STYLES.get(variant["kind"], (f"C{i}", "-"))
            if variant["kind"] == "riemannian":
                color = f"C{3 + list(stack['variants']).index(label) % 6}"
            depths = range(len(variant["log10_per_depth"]))
            _band(ax, depths, variant["log10_per_depth"], color, style, label)
        ax.axhline(results["threshold"], color="k", lw=0.6, ls=":")
        ax.set_yscale("log")
        label_axes(ax, "layer", "‖X − 1xᵀ‖ / ‖X‖", title=stack["title"], legend=7)
    if models:
        ax = axes[len(stacks)]
        for i, (label, curve) in enumerate(models.items()):
            depths = range(len(curve["per_depth"]))
            ax.errorbar(depths, [s["mean"] for s in curve["per_depth"]], yerr=[s["std"] for s in curve["per_depth"]],
                        color=f"C{i}", label=f"{label}", capsize=2, lw=1)
            ax.plot(depths, [s["mean"] for s in curve["per_depth_without_first_token"]], color=f"C{i}", ls=":",
                    lw=1, label=f"{label} (without token 0)")
        ax.set_yscale("log")
        label_axes(ax, "layer (residual stream entering it)", "‖X − 1xᵀ‖ / ‖X‖",
                   title="real models on real text (mean ± std over samples)", legend=6)
    for ax in axes[panels:]:
        ax.axis("off")
    return save_figure(fig, path)


def plot_intrinsic_rank(results: dict, path: str | Path) -> Path:
    """Per layer: median over heads of each rank measure, with the Gram bound d + 1, one column per model."""
    models = results["models"]
    fig, axes = figure(ncols=len(models))
    for ax, (label, rank) in zip(axes, models.items()):
        layers = range(len(rank["layers"]))
        median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
        for key, name, color in (("text_energy_rank", f"logits on text, energy {rank['threshold']:.0%}", "C0"),
                                 ("interaction_energy_rank", f"W_Q^T W_K, energy {rank['threshold']:.0%}", "C1"),
                                 ("score_numerical_rank", f"score matrix, numerical (rtol {rank['rtol']:g})", "C3")):
            values = [layer[key] for layer in rank["layers"]]
            ax.plot(layers, [median(v) for v in values], color=color, marker="o", ms=3, label=f"{name} (median)")
            ax.fill_between(layers, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.12, lw=0)
        ax.axhline(rank["head_dim"] + 1, color="k", lw=0.7, ls="--", label="Gram bound d + 1")
        ax.set_yscale("log")
        label_axes(ax, "layer", "rank (band: min..max over heads)",
                   title=f"{label}: {rank['samples']} x {rank['tokens']} tokens", legend=7)
    return save_figure(fig, path)


def plot_geometry(results: dict, path: str | Path) -> Path:
    """Row per model: connection proxies per layer, RMSNorm Lipschitz constant vs eps, attention entropy vs context."""
    models = results["models"]
    fig, axes = figure(ncols=3, nrows=len(models))
    for row, (label, report) in enumerate(models.items()):
        ax_proxy, ax_lip, ax_ent = axes[3 * row : 3 * row + 3]
        proxies = report["proxies"]
        if proxies:
            for i, (key, values) in enumerate(proxies.items()):
                ax_proxy.plot(range(len(values)), [abs(v) for v in values], marker="o", ms=3, color=f"C{i}", label=key)
            ax_proxy.set_yscale("symlog", linthresh=1e-6)
            ax_proxy.legend(fontsize=7)
        else:
            ax_proxy.text(0.5, 0.5, "no metric (a plain backbone)", ha="center", va="center", transform=ax_proxy.transAxes)
        ax_proxy.set_xlabel("layer")
        ax_proxy.set_title(f"{label}: |connection proxies|", fontsize=9)
        for i, (name, norm) in enumerate(report["rmsnorm_lipschitz"].items()):
            fit = norm["worst_case_fit"]
            ax_lip.plot(norm["eps"], norm["worst_case"], marker="o", ms=3, color=f"C{i}",
                        label=f"{name} worst case: slope {fit['exponent']:.3f} (R² {fit['r2']:.3f})")
            if "on_data" in norm:
                ax_lip.plot(norm["eps"], norm["on_data"], ls=":", color=f"C{i}",
                            label=f"{name} at real tokens: slope {norm['on_data_fit']['exponent']:.3f}")
        ax_lip.set_xscale("log")
        ax_lip.set_yscale("log")
        label_axes(ax_lip, "RMSNorm eps", "Lipschitz constant",
                   title="RMSNorm Lipschitz constant vs eps (prediction: slope −1/2)", legend=5)
        entropy = report["attention_entropy"]
        centres = [(lo + hi) / 2 for lo, hi in entropy["bins"]]
        ax_ent.plot(centres, entropy["uniform"], color="k", ls="--", lw=0.8, label="uniform, log c")
        ax_ent.plot(centres, entropy["mean_over_layers"], color="C0", marker="o", ms=3, label="mean over layers")
        layers = entropy["per_layer"]
        for j in sorted({0, len(layers) // 2, len(layers) - 1}):
            ax_ent.plot(centres, layers[j], lw=0.8, alpha=0.7, label=f"layer {j}")
        ax_ent.set_xscale("log")
        label_axes(ax_ent, "context length c", "attention entropy (nats)",
                   title="attention entropy vs context length", legend=7)
    return save_figure(fig, path)


def plot_compare(results: dict, path: str | Path) -> Path:
    """Held-out eval loss per arm (every seed, mean ± std) and the mean training-loss curves."""
    fig, (ax_loss, ax_curve) = figure(ncols=2)
    summary = results["summary"]
    for x, arm in enumerate(summary):
        points = [r["eval_loss_after"] for r in results["runs"] if r["arm"] == arm]
        ax_loss.scatter([x] * len(points), points, color="0.6", s=14, zorder=2)
        ax_loss.errorbar([x], [summary[arm]["eval_loss_after_mean"]], yerr=[summary[arm]["eval_loss_after_std"]],
                         fmt="o", color=f"C{x}", capsize=5, zorder=3)
        curves = [r["train_loss"] for r in results["runs"] if r["arm"] == arm and r["train_loss"]]
        if curves:
            length = min(len(c) for c in curves)
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
            ax_curve.plot(range(1, length + 1), mean, color=f"C{x}", label=f"{arm} ({summary[arm]['trainable_parameters']:,} params)")
    before = next(iter(summary.values()))["eval_loss_before"]
    ax_loss.axhline(before, color="k", lw=0.8, ls="--", label="before training")
    ax_loss.set_xticks(range(len(summary)), list(summary), rotation=10)
    ax_loss.set_ylabel("held-out eval loss (nats/token)")
    ax_loss.set_title(f"after {results['budget']['tokens']:,} training tokens; mean ± std, {len(results['seeds'])} seeds")
    ax_loss.legend(fontsize=8)
    label_axes(ax_curve, "step", "training loss (mean over seeds)", legend=8)
    return save_figure(fig, path)


def plot_scratch(results: dict, path: str | Path) -> Path:
    """From-scratch comparison: held-out loss curves at each arm's chosen rates (mean over seeds, min-max band), the
    learning-rate sweep (first seed), the rank-collapse residual and the hidden states' numerical rank at every depth
    after training (solid) and at initialisation (dashed, where recorded), the learned alpha per layer, and each arm's
    held-out loss minus the Euclidean arm's along the run, paired by seed with its 95 % t-interval (arms of equal
    steps)."""
    from .measures import paired_interval
    from .scratch import chosen_runs

    fig, (ax_curve, ax_sweep, ax_residual, ax_rank, ax_alpha, ax_paired) = figure(ncols=2, nrows=3)
    summary = results["summary"]

    def finished(arm, row):  # the arm's evaluation runs at its chosen rates (a separate tuning seed is not drawn)
        return [r for r in chosen_runs(results, arm) if r["eval_loss_after"] is not None]

    chosen = {arm: {r["seed"]: r for r in finished(arm, row)} for arm, row in summary.items()}
    for colour, (arm, row) in enumerate(summary.items()):
        runs = finished(arm, row)
        label = (f"{arm} (lr {row['learning_rate']:g}): {row['eval_loss_after_mean']:.4f} ± "
                 f"{row['eval_loss_after_std']:.4f}" if row["eval_loss_after_mean"] is not None else arm)
        if runs:
            steps = [step for step, _ in runs[0]["eval_curve"]]
            columns = list(zip(*([loss for _, loss in r["eval_curve"]] for r in runs)))
            ax_curve.plot(steps, [sum(c) / len(c) for c in columns], color=f"C{colour}", label=label)
            ax_curve.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=f"C{colour}",
                                  alpha=0.2)
        sweep = sorted((float(lr), loss) for lr, loss in row["sweep"].items() if loss is not None)
        ax_sweep.plot([lr for lr, _ in sweep], [loss for _, loss in sweep], "o-", color=f"C{colour}", label=arm)
        at_init = row.get("at_init", {})
        for axis, key in ((ax_residual, "residual_per_layer"), (ax_rank, "hidden_numerical_rank_per_layer")):
            if row.get(key):
                axis.plot(range(len(row[key])), row[key], "o-", color=f"C{colour}", label=f"{arm}, trained")
            if at_init.get(key):
                axis.plot(range(len(at_init[key])), at_init[key], "--", color=f"C{colour}", label=f"{arm}, at init")
        if row["gates"].get("alpha"):
            ax_alpha.plot(range(len(row["gates"]["alpha"])), row["gates"]["alpha"], "o-", color=f"C{colour}",
                          label=arm)
    budget = results["budget"]
    ax_curve.set_title(f"{budget['tokens']:,} tokens per run, {len(results['seeds'])} seeds", fontsize=9)
    label_axes(ax_curve, "step", "held-out loss (nats / byte)", legend=7)
    ax_sweep.set_xscale("log")
    label_axes(ax_sweep, f"learning rate (seed {results.get('tuning_seed', results['seeds'][0])})",
               "held-out loss after", legend=7)
    label_axes(ax_residual, "depth (0: embeddings)", "relative residual ||X - 1x^T|| / ||X||", legend=7)
    label_axes(ax_rank, "depth (0: embeddings)", "hidden states' numerical rank", legend=7)
    reference = chosen.get("euclidean", {})
    for colour, arm in enumerate(summary):
        mine = chosen[arm]
        seeds = sorted(set(mine) & set(reference))
        if arm == "euclidean" or len(seeds) < 2 or summary[arm]["steps"] != summary["euclidean"]["steps"]:
            continue  # the paired curve needs equal steps (an equal-time study compares only the final losses)
        steps = [step for step, _ in mine[seeds[0]]["eval_curve"]]
        rows = [paired_interval([mine[s]["eval_curve"][i][1] - reference[s]["eval_curve"][i][1] for s in seeds])
                for i in range(len(steps))]
        ax_paired.plot(steps, [row["mean"] for row in rows], color=f"C{colour}", label=f"{arm} - euclidean")
        ax_paired.fill_between(steps, [row["t_interval"][0] for row in rows], [row["t_interval"][1] for row in rows],
                               color=f"C{colour}", alpha=0.2)
    ax_paired.axhline(0.0, color="k", lw=0.8)
    ax_paired.set_xlabel("step")
    ax_paired.set_ylabel("held-out loss minus euclidean's (paired, 95 %)")
    if ax_paired.lines[:-1]:
        ax_paired.legend(fontsize=7)
    label_axes(ax_alpha, "layer", "learned alpha (mean over heads and seeds)", legend=7)
    return save_figure(fig, path)


def plot_scaling(results: dict, path: str | Path) -> Path:
    """The scaling study from its JSON: the arm minus its Euclidean twin per seed against parameters (log scale), each
    size's mean with its 95 % t-interval, at equal tokens and (where run) at equal time, with the trend line; and each
    size's mean held-out curves against tokens."""
    fig, (ax_difference, ax_curves) = figure(ncols=2)
    arm, reference, rows = results["arm"], results["reference"], results["sizes"]
    for offset, (key, marker, label) in enumerate(((None, "o", "equal tokens"), ("equal_time", "s", "equal time"))):
        points = [(row["parameters"], row[key] if key else row) for row in rows if not key or key in row]
        for parameters, part in points:  # equal-time points a little to the right, so both stay readable
            x = parameters * (1.03 if offset else 1.0)
            ax_difference.scatter([x] * len(part["differences"]), list(part["differences"].values()), s=10,
                                  color=f"C{offset}", alpha=0.5, marker=marker)
            mean, interval = part["paired"]["mean"], part["paired"]["t_interval"]
            if interval:
                ax_difference.errorbar([x], [mean], yerr=[[mean - interval[0]], [interval[1] - mean]],
                                       color=f"C{offset}", fmt=marker, capsize=3)
        if points:
            ax_difference.plot([], [], marker, color=f"C{offset}", label=label)
    trend = results.get("trend")
    if trend:
        xs = [rows[0]["parameters"], rows[-1]["parameters"]]
        slope, low, high = trend["slope_per_tenfold_parameters"], *trend["bootstrap_interval"]
        ax_difference.plot(xs, [trend["intercept"] + slope * math.log10(x) for x in xs], "k--", lw=0.8,
                           label=f"trend {slope:+.4f} per 10x [{low:+.4f}, {high:+.4f}]")
    ax_difference.axhline(0.0, color="k", lw=0.8)
    ax_difference.set_xscale("log")
    label_axes(ax_difference, "parameters", f"{arm} minus {reference}, held-out loss (paired)", legend=7)
    for colour, row in enumerate(rows):
        per_step = row["tokens"] / row["steps"]
        for style, name in (("--", reference), ("-", arm)):
            curve = row["curves"][name]
            ax_curves.plot([step * per_step for step, _ in curve], [loss for _, loss in curve], style,
                           color=f"C{colour}", label=f"{row['parameters'] / 1e6:.1f} M, {name}")
    ax_curves.set_xscale("log")
    label_axes(ax_curves, "tokens", "held-out loss (mean over seeds)", legend=7)
    return save_figure(fig, path)


def plot_ide(results: dict, path: str | Path) -> Path:
    """The four IDE observables per model: splitting torsion against the step h (median over layers, h^2 for
    reference), ablation loss change measured against the adjoint prediction, rotary recurrence against the offset
    (mean and envelope, 1/m for reference) and the two principal coordinates of the detrended SGD and AdamW
    trajectories."""
    import torch

    from .ide import detrend, principal_plane

    fig, (ax_torsion, ax_ablation, ax_rope, ax_current) = figure(ncols=2, nrows=2)
    for colour, (label, model) in enumerate(results["models"].items()):
        c = f"C{colour}"
        if "torsion" in model:
            layers = model["torsion"]["layers"]
            steps = layers[0]["steps"]
            median = [sorted(layer["relative_torsion"][i] for layer in layers)[len(layers) // 2]
                      for i in range(len(steps))]
            ax_torsion.loglog(steps, median, "o-", color=c, label=f"{label} (median layer)")
            ax_torsion.loglog(steps, [median[0] * (h / steps[0]) ** 2 for h in steps], ":", color=c)
        if "ablation" in model:
            ab = model["ablation"]
            ax_ablation.scatter(ab["predicted"], ab["measured"], s=12, color=c, label=label)
        if "rope" in model:
            rope = model["rope"]
            ax_rope.loglog(rope["offsets"], rope["mean"], color=c, label=f"{label}: mean over (q, k) pairs")
            ax_rope.loglog(rope["decay"]["offsets"], rope["decay"]["envelope"], "--", color=c, lw=0.8)
            if colour == 0:
                ax_rope.loglog(rope["offsets"], rope["kernel"], color="0.5", lw=0.8, label="kernel (c_j = 1)")
                ax_rope.loglog(rope["offsets"], [1 / m for m in rope["offsets"]], ":", color="k", label="1/m")
        if "current" in model:
            for style, name in (("-", "sgd"), ("--", "adamw")):
                # as probability_current reads it: detrended, standardised (AdamW moves farther than SGD)
                plane = principal_plane(detrend(torch.tensor(model["current"][name]["trajectory"],
                                                              dtype=torch.float64)))
                ax_current.plot(plane[:, 0], plane[:, 1], style, color=c, lw=0.6, label=f"{label}, {name}")
    label_axes(ax_torsion, "step h", "||T(h)|| / ||X|| (dotted: h^2)", legend=7)
    ax_ablation.axline((0, 0), slope=1, color="k", lw=0.8, ls=":")
    label_axes(ax_ablation, "adjoint prediction -<g, u> (nats)", "measured loss change, layer removed (nats)",
               legend=7)
    label_axes(ax_rope, "relative offset m", "recurrence |sum c_j e^{i m theta_j}| / sum |c_j|", legend=7)
    label_axes(ax_current, "principal coordinate 1 (detrended, standardised)", "principal coordinate 2 (standardised)",
               legend=7)
    return save_figure(fig, path)
