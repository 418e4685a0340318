"""nanotune models: one transformer for Llama, Qwen and Gemma, loaded from HF safetensors or GGUF.

    from model import load_model, load_tokenizer
    model, config = load_model("tinyllama", dtype=torch.bfloat16, device="cuda")
    logits = model(input_ids)  # (B, T, V)
"""
from model.config import NAMED_MODELS, ModelConfig, from_hf_config
from model.generate import KVCache, generate
from model.hub import base_model_id, resolve
from model.load import load_model, load_tokenizer, read_config
from model.lora import LoRAConfig, LoRALinear
from model.transformer import Transformer
from model.weights import CheckpointError, check_quantize, is_gguf

__all__ = ["NAMED_MODELS", "ModelConfig", "from_hf_config", "KVCache", "generate", "base_model_id", "resolve",
           "load_model", "load_tokenizer", "read_config", "LoRAConfig", "LoRALinear", "Transformer",
           "CheckpointError", "check_quantize", "is_gguf"]
