"""Small, importable examples that configs can name by module path (e.g. GRPO's ``tools`` and ``reward_funcs``)."""
