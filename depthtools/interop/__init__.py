"""Interop: Hugging Face folders, GGUF files and OLMo-core runs in; Llama folders out (`preln` only).

    model = from_hf("path/to/llama")                      -> DepthModel (eval), every probe runs on it
    import_hf("path/to/llama", name="llama-tiny")         -> checkpoint under $DEPTHTOOLS_CHECKPOINTS
    export_hf("preln_L4", "exported/")                    -> LlamaForCausalLM.from_pretrained("exported/")
    import_path("runs/hc_L24", name="hc_L24")             -> an OLMo-core run, HF folder or .gguf, whichever it is
    read_model_tensors("runs/hc_L24/step100/model_and_optim")  -> DCP model tensors, no pickled code run

Only safetensors + JSON are read or written, and DCP folders through restricted unpicklers that run no code
(`dcp`); `transformers` is needed only to use an export.
"""

import importlib

# Public names and the submodule each lives in, imported on first use (PEP 562): importing one light module of
# this package (depthtools.interop.tokenizer, which writes tokenizer files) does not load torch through llama.
_EXPORTS = {
    "depthtools.interop.llama": [
        "EXPORTABLE", "check_exportable", "export_hf", "from_hf", "hf_state_to_depthtools", "hf_to_model_config",
        "import_hf", "model_config_to_hf", "read_hf_config", "read_hf_tensors", "to_hf_state_dict", "weight_name_map",
    ],
    "depthtools.interop.tokenizer": ["TokenizerPlan", "byte_tokenizer", "bytes_to_unicode", "resolve_tokenizer"],
    "depthtools.interop.dcp": ["read_model_tensors"],
    "depthtools.interop.formats": ["detect_format", "import_path", "import_paths"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'depthtools.interop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
