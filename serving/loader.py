"""The model loader of ``fiber-bundle serve``: transformers' server's ``ModelLoader``, which also loads a remote-code
causal LM. Imported only where the server runs (it imports the server's module, which needs ``transformers[serving]``);
the server's model process unpickles it from here."""

from transformers.cli.serving.model_manager import ModelLoader


def server_resolves_remote_code(config) -> bool:
    """Whether transformers' server would find the class of ``config`` itself: its first architecture is a class of
    the transformers package (never, for a remote-code model, in 5.25)."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    return bool(architectures) and hasattr(transformers, architectures[0])


class FiberBundleModelLoader(ModelLoader):
    """``ModelLoader`` whose ``_load_model`` takes a model whose architecture is not a transformers class (a remote-code
    model: the folder's ``auto_map`` names its ``AutoModelForCausalLM``) through ``AutoModelForCausalLM``, with the
    server's own loading options; every other model as the server does."""

    def _load_model(self, model_id, tqdm_class=None, progress_callback=None):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.cli.serving.utils import parse_model_id

        repo, revision, gguf_file = parse_model_id(model_id)
        config = AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=self.trust_remote_code)
        auto_map = getattr(config, "auto_map", None) or {}
        if gguf_file is not None or server_resolves_remote_code(config) or "AutoModelForCausalLM" not in auto_map:
            return super()._load_model(model_id, tqdm_class=tqdm_class, progress_callback=progress_callback)
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id, "stage": "weights"})
        kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                  "device_map": self.device, "trust_remote_code": self.trust_remote_code, "tqdm_class": tqdm_class}
        quantization_config = self.get_quantization_config()
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        return AutoModelForCausalLM.from_pretrained(repo, **kwargs)
