"""Interop: Hugging Face folders, GGUF files and OLMo-core runs in; Llama folders out (`preln` only).

    model = from_hf("path/to/llama")                      -> DepthModel (eval), every probe runs on it
    import_hf("path/to/llama", name="llama-tiny")         -> checkpoint under $DEPTHTOOLS_CHECKPOINTS
    export_hf("preln_L4", "exported/")                    -> LlamaForCausalLM.from_pretrained("exported/")
    import_path("runs/hc_L24", name="hc_L24")             -> an OLMo-core run, HF folder or .gguf, whichever it is
    read_model_tensors("runs/hc_L24/step100/model_and_optim")  -> DCP model tensors, no pickled code run

Only safetensors + JSON are read or written, and DCP folders through restricted unpicklers that run no code
(`dcp`); `transformers` is needed only to use an export.
"""

from depthtools.interop.llama import (
    EXPORTABLE, check_exportable, export_hf, from_hf, hf_state_to_depthtools, hf_to_model_config, import_hf,
    model_config_to_hf, read_hf_config, read_hf_tensors, to_hf_state_dict, weight_name_map,
)
from depthtools.interop.dcp import read_model_tensors
from depthtools.interop.formats import detect_format, import_path, import_paths
from depthtools.interop.tokenizer import TokenizerPlan, byte_tokenizer, bytes_to_unicode, resolve_tokenizer

__all__ = [
    "EXPORTABLE", "check_exportable", "export_hf", "from_hf", "hf_state_to_depthtools", "hf_to_model_config",
    "import_hf", "model_config_to_hf", "read_hf_config", "read_hf_tensors", "to_hf_state_dict", "weight_name_map",
    "TokenizerPlan", "byte_tokenizer", "bytes_to_unicode", "resolve_tokenizer",
    "read_model_tensors", "detect_format", "import_path", "import_paths",
]
