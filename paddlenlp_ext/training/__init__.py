"""Training: build everything from a RunConfig and run PaddleNLP's Trainer.

``run``           config -> training args, tokenizer, data, model, trainer; summary
``model_build``   the model half: load, quantize, adapters (BuiltModel)
``trainer``       FinetuneTrainer: token accounting, global-batch order and loss, NEFTune lengths,
                  adapter-aware staged save/resume hooks, tensor-parallel save gather
``loss``          the loss normalized by the label tokens of the whole global batch
``resume``        staged checkpoints, run totals carried over a resume, checkpoint rotation
``signals``       SIGTERM/SIGINT: save a checkpoint and stop
``errors``        SaveError, TrainingInterrupted
``console``       console formats (configuration line, progress, summary table)
``logfile``       train.log and the console level
``reporting``     progress, VisualDL, loss.png, the final table
``plot``          loss.png
``callbacks``     epoch and lazy-stream cursor callbacks
``packing_check`` packed == unpacked loss/gradient check (llm/tools/check_packing.py)
``heap``          glibc mmap/trim thresholds so freed activations return to the OS
"""
