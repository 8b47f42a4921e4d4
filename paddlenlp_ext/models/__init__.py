"""Model-family facts and model builders.

``targets``  which Linear layers are the decoder linears (adapters, quantization)
``families`` per-family facts config validation needs (dropout fields), paddle-free
``checkpoint`` finding, validating and reading checkpoints tensor by tensor (safetensors, pdparams)
``loading``  streaming load: lazy skeleton, quantize-on-arrival, run dtype, never the whole fp32 model
``tiny``     the tiny Llama (or Qwen2 / Qwen3) + tokenizer that the demo and tests build
``qwen3``    Qwen3 as our own family on PaddleNLP's Qwen2 classes (docs/qwen3.md)
"""
