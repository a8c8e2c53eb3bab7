"""The model outside Python transformers' generate: ``torch.export`` with a static cache through transformers' own
exportable wrapper (docs/deployment.md)."""

import pytest
import torch
from helpers import random_ids, set_gates, tiny_model


def exportable_model():
    """The tiny model, its geometry awake, with the static cache the exportable wrapper requires."""
    model = set_gates(tiny_model(dtype=torch.float32)).eval()
    model.generation_config.cache_implementation = "static"
    return model


@pytest.mark.parametrize("strict", [True, False])
def test_exported_program_generates_the_eager_tokens(strict):
    """``TorchExportableModuleForDecoderOnlyLM(...).export`` in eval mode (gradients on, as torch.export traces): the
    exported one-token program's logits at every prompt position equal the full forward's, and its greedy tokens equal
    ``generate``'s. (The layer checkpointed its geometry whenever gradients were enabled, which an export trace cannot
    take: ``_checkpoint_context_fn``.)"""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = exportable_model()
    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32).export(
        input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]), strict=strict)
    prompt = random_ids(1, 6)
    program = exported.module()
    with torch.no_grad():
        full = model(prompt, use_cache=False).logits
        steps = torch.cat([program(input_ids=prompt[:, i:i + 1], cache_position=torch.tensor([i]))
                           for i in range(prompt.shape[1])], dim=1)
        torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
        # greedy decoding, one token per call at its own position (transformers 5.25's
        # TorchExportableModuleWithStaticCache.generate feeds the first new token at position n + 1, not n)
        tokens, logits = prompt, steps[:, -1]
        for position in range(prompt.shape[1], prompt.shape[1] + 12):
            token = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=1)
            logits = program(input_ids=token, cache_position=torch.tensor([position]))[:, -1]
        expected = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, expected)
