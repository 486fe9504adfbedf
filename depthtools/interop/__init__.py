"""Hugging Face interop: Llama-family checkpoints in and out of depthtools (`preln` only).

    model = from_hf("path/to/llama")                      -> DepthModel (eval), every probe runs on it
    import_hf("path/to/llama", name="llama-tiny")         -> checkpoint under $DEPTHTOOLS_CHECKPOINTS
    export_hf("preln_L4", "exported/")                    -> LlamaForCausalLM.from_pretrained("exported/")

Only safetensors + JSON are read or written; `transformers` is needed only to use an export.
"""

from depthtools.interop.llama import (
    EXPORTABLE, check_exportable, export_hf, from_hf, hf_state_to_depthtools, hf_to_model_config, import_hf,
    model_config_to_hf, read_hf_config, read_hf_tensors, to_hf_state_dict, weight_name_map,
)
from depthtools.interop.tokenizer import TokenizerPlan, byte_tokenizer, bytes_to_unicode, resolve_tokenizer

__all__ = [
    "EXPORTABLE", "check_exportable", "export_hf", "from_hf", "hf_state_to_depthtools", "hf_to_model_config",
    "import_hf", "model_config_to_hf", "read_hf_config", "read_hf_tensors", "to_hf_state_dict", "weight_name_map",
    "TokenizerPlan", "byte_tokenizer", "bytes_to_unicode", "resolve_tokenizer",
]
