"""Parity of a converted folder with its source (docs/design.md section 2), kept apart from the weight transform.

The bound: max |logits difference| <= max(1e-4, 2 x the source's own eager-versus-sdpa difference on the same text),
which is the floor any re-implemented attention sits on; greedy generations must be identical. The logits compared are
the head's: next-token logits for a causal LM, the pooled class scores for a sequence classifier (which does not
generate, so has no greedy check).
"""

import resource
import sys
from pathlib import Path

import torch

from .sources import Location, calibration_text, load_model, load_tokenizer

CALIBRATION_TOKENS = 384
GREEDY_TOKENS = 32
MIN_TEXT_TOKENS = 32  # fewer ids than this from a tokenizer: not a real one (a tiny test tokenizer)


def calibration_ids(tokenizer: str | Path | Location | None, vocab_size: int,
                    tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """The first ``tokens`` ids (shape (1, tokens)) of the calibration text read by the tokenizer at ``tokenizer``
    (what ``load_tokenizer`` takes); seeded random ids when there is none, it does not load, or it yields fewer than
    ``MIN_TEXT_TOKENS`` (tiny test checkpoints). Conversion's parity check, ``--metric-rank auto`` and export's check
    all read their prompt here."""
    drawn = max(tokens, MIN_TEXT_TOKENS)  # why: a shorter prompt is the head of a usable text, not random ids
    try:
        if tokenizer is not None:
            ids = load_tokenizer(tokenizer)(calibration_text()[:20000], return_tensors="pt").input_ids[:, :drawn]
            if ids.shape[1] >= MIN_TEXT_TOKENS:
                return ids[:, :tokens]
    except (OSError, ValueError, TypeError):  # no usable tokenizer in the folder
        pass
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, drawn), generator=generator)[:, :tokens]


def _load_source(src):
    """The source model in float32 with its own head, attention sdpa (a run switches it to eager in place)."""
    return load_model(src.location, head=src.head, attn_implementation="sdpa")


def auto_metric_rank(src, tokens: int = 256) -> tuple[int, dict]:
    """``--metric-rank auto``: the rank ``rank.suggest_metric_rank`` picks from the intrinsic rank of the source's
    attention logits on calibration text, and the figures behind the choice."""
    from .rank import suggest_metric_rank

    source = _load_source(src)
    ids = calibration_ids(src.location, source.config.vocab_size, tokens)
    return suggest_metric_rank(source, ids)


def verify_conversion(src, folder, seconds: float) -> dict:
    """Run source and converted model on calibration text; return the conversion report (a JSON-able dict)."""
    converted = load_model(folder, head=src.head)
    ids = calibration_ids(folder, converted.config.vocab_size)
    source = _load_source(src)  # loaded once; its eager run switches the attention implementation in place
    with torch.no_grad():
        got = converted(ids).logits
        sdpa = source(ids).logits
        source.set_attn_implementation("eager")
        eager = source(ids).logits
    floor = (eager - sdpa).abs().max().item()
    diff = (got - sdpa).abs().max().item()
    bound = max(1e-4, 2 * floor)
    summary = f"max |dlogits| {diff:.3g} (bound {bound:.3g})"
    greedy_tokens, agreement, same_tokens = 0, None, True  # a classifier does not generate
    if converted.can_generate():
        prompt, greedy_tokens = ids[:, :16], GREEDY_TOKENS
        args = dict(max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens, do_sample=False)
        source_tokens = source.generate(prompt, **args)[0, 16:].tolist()
        converted_tokens = converted.generate(prompt, **args)[0, 16:].tolist()
        agreement = sum(a == b for a, b in zip(source_tokens, converted_tokens)) / len(source_tokens)
        same_tokens = source_tokens == converted_tokens
        summary += f", greedy agreement {agreement:.0%} over {greedy_tokens} tokens"
    geometry = sum(p.numel() for p in converted.geometry_parameters())
    backbone = converted.num_parameters() - geometry
    passed = diff <= bound and same_tokens
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 1024**2)
    return {
        "parity": {
            "passed": passed,
            "max_abs_logit_diff": diff,
            "source_eager_vs_sdpa": floor,
            "bound": bound,
            "calibration_tokens": int(ids.shape[1]),
            "greedy_tokens": greedy_tokens,
            "greedy_agreement": agreement,
            "summary": summary,
        },
        "parameters": {"backbone": backbone, "geometry": geometry, "overhead_percent": 100 * geometry / backbone},
        "conversion_seconds": seconds,
        "peak_memory_mib": peak,
        "metric_rank": converted.config.metric_rank,
        "ffn_metric_rank": converted.config.ffn_metric_rank,
    }
