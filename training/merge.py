"""``fiber-bundle merge``: a LoRA adapter (``fiber-bundle train --mode lora``, QLoRA included) merged into its base, in
full precision, saved as a normal Fiber Bundle folder (weights, tokenizer, model card, remote code) that loads with
``trust_remote_code`` and no PEFT."""

import json
import shutil
from pathlib import Path

from fiber_bundle.model_cards import public_name, render_card

from .errors import TrainingError, describe

ADAPTER_CONFIG = "adapter_config.json"
CONVERSION_REPORT = "conversion_report.json"
TRAINING_METRICS = "training_metrics.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def adapter_base(adapter_dir: str | Path) -> str | None:
    """The base model an adapter folder names (``base_model_name_or_path`` in its adapter_config.json), or None."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise TrainingError(f"{adapter_dir} holds no {ADAPTER_CONFIG}: pass the OUTPUT of fiber-bundle train --mode "
                            "lora (a PEFT adapter folder).")
    try:
        return json.loads(path.read_text()).get("base_model_name_or_path") or None
    except ValueError as error:
        raise TrainingError(f"{path} is not valid JSON ({describe(error)}); pass an intact adapter folder.") from error


def merge_adapter(adapter_dir: str | Path, output: str | Path, *, base: str | Path | None = None,
                  overwrite: bool = False) -> dict:
    """Merge the LoRA adapter in ``adapter_dir`` into its base and save the result to ``output``.

    Arguments:
        adapter_dir: a PEFT adapter folder (the OUTPUT of ``fiber-bundle train --mode lora``, with or without
            ``--load-in-4bit`` / ``--load-in-8bit``): the LoRA pairs and the trained ``fiber`` modules.
        output: the folder for the merged model; refused when it holds anything unless ``overwrite``. It is written
            into a staging folder beside it and renamed into place when complete (``checkpoints.write_output``).
        base: the full-precision Fiber Bundle folder (or Hub id) the adapter was trained on; default: the
            ``base_model_name_or_path`` of the adapter's adapter_config.json. It is loaded unquantised, in the dtype
            it is stored in, even when the adapter was trained on a 4-bit or 8-bit load of it.
        overwrite: replace an ``output`` that already holds a model or other files.
    Returns the output folder and the base and adapter used. The tokenizer comes from ``adapter_dir`` (where
    ``fiber-bundle train`` saves it) or else from the base; conversion_report.json from ``adapter_dir`` or a local base
    folder; training_metrics.json from ``adapter_dir`` with the merge recorded; the model card is rendered from them.
    """
    from peft import PeftModel
    from transformers import AutoTokenizer

    from modeling_fiber_bundle import FiberBundleForCausalLM

    from .checkpoints import prepare_output, write_output

    adapter_dir, output = Path(adapter_dir), Path(output)
    base = str(base) if base is not None else adapter_base(adapter_dir)
    if base is None:
        raise TrainingError(f"{adapter_dir / ADAPTER_CONFIG} names no base model: pass --base (base=) with the Fiber "
                            "Bundle folder the adapter was trained on.")
    prepare_output(output, overwrite=overwrite)
    try:
        model = FiberBundleForCausalLM.from_pretrained(base)
    except Exception as error:
        raise TrainingError(f"could not load the base model {base} ({describe(error)}); pass --base (base=) with the "
                            "full-precision Fiber Bundle folder the adapter was trained on.") from error
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir if (adapter_dir / TOKENIZER_CONFIG).is_file() else base)
    try:
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    except Exception as error:
        raise TrainingError(f"could not apply the adapter {adapter_dir} to {base} ({describe(error)}); pass --base "
                            "with the model the adapter was trained on.") from error
    conversion = [path for path in (adapter_dir / CONVERSION_REPORT, Path(base) / CONVERSION_REPORT) if path.is_file()]
    run = json.loads((adapter_dir / TRAINING_METRICS).read_text()) if (adapter_dir / TRAINING_METRICS).is_file() else {}
    # what the card says of the merge (model_cards.card), by Hub id or name, never by local path
    run["merged"] = {"adapter": public_name(adapter_dir), "base": public_name(base)}
    if "model" in run:  # the adapter's counts include its LoRA pairs; the merged model has none
        run["model"] = {**run["model"], "parameters": sum(p.numel() for p in merged.parameters()), "trainable": None}

    def write(folder: Path):
        merged.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if conversion:  # the source and its parity travel with the model
            shutil.copyfile(conversion[0], folder / CONVERSION_REPORT)
        (folder / TRAINING_METRICS).write_text(json.dumps(run, indent=2) + "\n")
        render_card(folder, name=output.name)

    write_output(output, write)
    return {"output": str(output), "base": base, "adapter": str(adapter_dir)}
