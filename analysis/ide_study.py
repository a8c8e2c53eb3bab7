"""The study behind ``fiber-bundle analyze ide``: the four observables of ``ide`` measured on real models, one
(model, observable) at a time, each written to ``ide.json`` as soon as it is measured (``study.StudyFile``: a rerun with
the same settings measures only what is missing; a file of other settings is refused)."""

import math

import torch

from .ide import ablation_responses, model_torsion, recurrence_decay, rope_recurrence, rotary_pairs
from .ide import TrajectoryRecorder, trajectory_currents
from .models import held_out_ids, load_causal_lm, model_labels, pydoc_blocks, sample_ids
from .probes import decoder
from .study import StudyFile, progress_bar

OBSERVABLES = ("torsion", "ablation", "rope", "current")
ABLATION_FRACTIONS = (0.01, 0.1)  # partial removals: where the adjoint (first-order) prediction should hold


def ide_study(output_dir, models, *, labels=None, observables=OBSERVABLES, samples: int = 2, length: int = 256,
              torsion_steps=None, torsion_layers=None, ablation_blocks: int = 8, rope_pairs: int = 64,
              rope_max_offset: int | None = None, current_steps: int = 300, current_block_size: int = 128,
              current_batch: int = 1, sgd_learning_rate: float = 1e-3, adamw_learning_rate: float = 1e-5,
              current_dims: int = 8, progress: bool = True) -> dict:
    """Measure the four observables on each model (a Fiber Bundle folder, a transformers checkpoint, a Hub id or a
    GGUF file); ``ide.json`` is written after each (model, observable) and a rerun with the same settings skips what
    is done (``reports.run_ide`` also draws ``ide.png``).

    - torsion: ``model_torsion`` in float64 on ``samples`` x ``length`` tokens of sample text, steps ``torsion_steps``
      (default 1e-4 ... 1), every layer (or ``torsion_layers``);
    - ablation: ``ablation_responses`` on ``ablation_blocks`` held-out blocks of 256 tokens (the main job's split),
      whole layers and the fractions ``ABLATION_FRACTIONS`` of their updates;
    - rope: the recurrence amplitude averaged over ``rope_pairs`` (q, k) pairs per layer and head, offsets up to
      ``rope_max_offset`` (default: the model's context), with ``recurrence_decay``'s fits, and the bare kernel
      (every c_j = 1);
    - current: the model trained in full at a constant rate with SGD (no momentum) and with AdamW, ``current_steps``
      steps of ``current_batch`` x ``current_block_size`` tokens of the pydoc training split, the trajectory of the
      last decoder layer's parameters projected on ``current_dims`` random directions, ``probability_current`` at lags
      1, 2, 5 and 10 (``trajectory_currents``: a least-squares line through each coordinate removed first)."""
    names = model_labels(models, labels)
    unknown = sorted(set(observables) - set(OBSERVABLES))
    if unknown or not observables:
        raise ValueError(f"unknown observable(s) {unknown}: choose from {', '.join(OBSERVABLES)}.")
    steps = sorted(float(h) for h in (torsion_steps or [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0]))
    settings = {"samples": samples, "length": length, "torsion_steps": steps, "torsion_layers": torsion_layers,
                "ablation_blocks": ablation_blocks, "rope_pairs": rope_pairs, "rope_max_offset": rope_max_offset,
                "current": {"steps": current_steps, "block_size": current_block_size, "batch": current_batch,
                            "sgd_learning_rate": sgd_learning_rate, "adamw_learning_rate": adamw_learning_rate,
                            "dims": current_dims}}
    # the models and observables are not settings: a rerun may add some to what is measured
    file = StudyFile(output_dir, "ide", settings, nested=True, empty={"models": {}}, holds="measurements")
    bar = progress_bar(len(names) * len(observables), "ide", progress)
    for label, source in zip(names, models):
        done = file.results["models"].setdefault(label, {"source": str(source)})
        for observable in observables:
            bar.set_postfix_str(f"{label}: {observable}")
            file.once(done, observable, lambda: measure_observable(observable, source, settings))
            bar.update(1)
    bar.close()
    return file.results


def measure_observable(observable: str, source, settings: dict) -> dict:
    """One observable of ``ide_study`` on the model ``source``, with the study's ``settings``."""
    if observable == "torsion":
        model, tokenizer = load_causal_lm(source, dtype=torch.float64)
        ids = sample_ids(tokenizer, settings["samples"], settings["length"])
        layers = model_torsion(model, ids, settings["torsion_steps"], settings["torsion_layers"])
        exponents = [layer["fit"]["exponent"] for layer in layers if layer["fit"]]
        return {"layers": layers, "exponent_median": float(torch.tensor(exponents).median()) if exponents else None}
    if observable == "ablation":
        model, tokenizer = load_causal_lm(source, dtype=torch.float32)
        return ablation_responses(model, held_out_ids(tokenizer, settings["ablation_blocks"]),
                                  fractions=ABLATION_FRACTIONS)
    if observable == "rope":
        model, tokenizer = load_causal_lm(source, dtype=torch.float32)
        ids = sample_ids(tokenizer, settings["samples"], settings["length"])
        coefficients = rotary_pairs(model, ids, settings["rope_pairs"])  # (layers, heads, pairs, d/2)
        inv_freq = decoder(model).rotary_emb.inv_freq.double().cpu()
        top = settings["rope_max_offset"] or model.config.max_position_embeddings
        offsets = sorted({int(round(v)) for v in torch.logspace(0, math.log10(top), 400).tolist()} | set(range(1, 65)))
        r = rope_recurrence(coefficients, inv_freq, offsets)  # (layers, heads, pairs, M)
        mean = r.mean(dim=(0, 1, 2))
        kernel = rope_recurrence(torch.ones(inv_freq.numel(), dtype=torch.complex128), inv_freq, offsets)
        per_layer = [recurrence_decay(offsets, r[i].mean(dim=(0, 1)).tolist(), low=16)["mean_fit"]
                     for i in range(r.shape[0])]
        return {"offsets": offsets, "inv_freq": inv_freq.tolist(), "mean": mean.tolist(), "kernel": kernel.tolist(),
                "decay": recurrence_decay(offsets, mean.tolist(), low=16),
                "kernel_decay": recurrence_decay(offsets, kernel.tolist(), low=16),
                "per_layer_mean_exponent": [fit["exponent"] if fit else None for fit in per_layer]}
    return {name: training_current(source, name, settings["current"]) for name in ("sgd", "adamw")}


def training_current(source, optimizer: str, options: dict, seed: int = 0) -> dict:
    """Train ``source`` in full at a constant rate (``optimizer`` "sgd": plain SGD, no momentum; "adamw": AdamW, no
    weight decay), record the last decoder layer's parameters projected on random directions after every step, and
    measure ``probability_current`` of the detrended trajectory at several lags."""
    model, tokenizer = load_causal_lm(source, dtype=torch.float32)
    model.train()
    torch.manual_seed(seed)
    blocks = torch.tensor(pydoc_blocks(tokenizer, options["block_size"])[0]["input_ids"])
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    parameters = [p for p in model.parameters() if p.requires_grad]
    rate = options[f"{optimizer}_learning_rate"]
    optim = (torch.optim.SGD(parameters, lr=rate, momentum=0.0) if optimizer == "sgd"
             else torch.optim.AdamW(parameters, lr=rate, weight_decay=0.0))
    last = decoder(model).layers[-1]
    recorder = TrajectoryRecorder(last.parameters(), dims=options["dims"], seed=seed)
    losses = []
    for step in range(options["steps"]):
        take = order[(torch.arange(options["batch"]) + step * options["batch"]) % len(order)]
        ids = blocks[take]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        recorder.record()
        losses.append(loss.item())
    return {"learning_rate": rate, "losses": losses, "trajectory": recorder.trajectory().tolist(),
            "recorded_parameters": sum(p.numel() for p in recorder.parameters),
            "lags": trajectory_currents(recorder.trajectory())}
