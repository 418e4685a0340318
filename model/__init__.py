"""nanotune models: one transformer for Llama, Qwen and Gemma, loaded from HF safetensors.

    from model import load_model, load_tokenizer
    model, config = load_model("tinyllama", dtype=torch.bfloat16, device="cuda")
    logits = model(input_ids)  # (B, T, V)
"""
from model.config import NAMED_MODELS, ModelConfig, from_hf_config
from model.load import CheckpointError, load_model, load_tokenizer
from model.lora import LoRAConfig, LoRALinear
from model.transformer import Transformer

__all__ = ["NAMED_MODELS", "ModelConfig", "from_hf_config", "CheckpointError", "load_model", "load_tokenizer",
           "LoRAConfig", "LoRALinear", "Transformer"]
