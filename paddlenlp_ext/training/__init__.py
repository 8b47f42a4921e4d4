"""Training: build everything from a RunConfig and run PaddleNLP's Trainer.

``run``           config -> training args, tokenizer, data, model, quantization, adapters, trainer; summary
``trainer``       FinetuneTrainer: token accounting, NEFTune lengths, adapter-aware save/resume hooks
``callbacks``     epoch and lazy-stream cursor callbacks
``packing_check`` packed == unpacked loss/gradient check (llm/tools/check_packing.py)
``heap``          glibc mmap/trim thresholds so freed activations return to the OS
"""
