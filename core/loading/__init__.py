"""From a model name to loaded weights: the hub, checkpoint formats (safetensors, GGUF, quantized), strict loading."""
