"""The process's set-up before paddle loads: MKL/OpenMP threads (``cpu_env``) and the console policy
(``console_policy``).  Standard library only, so every entry script, the trainers and the benchmarks can
apply them first; no other package of paddlenlp_ext is imported here."""
