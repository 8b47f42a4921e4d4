"""Model-family facts and model builders.

``targets``  which Linear layers are the decoder linears (adapters, quantization)
``families`` per-family facts config validation needs (dropout fields), paddle-free
``checkpoint`` finding, validating and reading checkpoints tensor by tensor (safetensors, pdparams)
``loading``  streaming load: lazy skeleton, quantize-on-arrival, run dtype, never the whole fp32 model
``tiny``     the tiny Llama + tokenizer that the demo and tests build
"""
