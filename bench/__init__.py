"""The benchmarks (docs/benchmarks.md), a package: run one as ``python -m bench.<name>`` from the repository root.

``bench/harness.py`` runs and measures every command the benchmarks launch; the other modules are the
benchmarks and their shared set-up (``cpu_setup``: the 0.25B Llama and the Alpaca rows; ``big_model``:
the 0.84B Llama).
"""
