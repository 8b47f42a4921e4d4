"""Evaluation by generation (eval_with_do_generation): metrics and the generation loop."""
