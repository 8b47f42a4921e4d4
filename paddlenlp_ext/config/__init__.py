"""Config: JSON + ``--key value`` -> validated Model/Data/Generate/Training arguments.

Owns the key schema (``schema.py``, PaddleNLP's names and meanings; the alignment CLIs' key
groups in ``alignment_schema.py``, re-exported by ``schema.py``; the field helpers in ``keys.py``), the field
specs (``fields.py``), parsing with every problem reported at once and exit
code 2 (``parse.py``), the generated docs/config.md (``docs.py``), the
output_dir / resume_from_checkpoint checks (``resume.py``) and the checkpoint
directory facts they need (``checkpoints.py``: completion marker, newest
complete checkpoint), and the kinds of the checks about this machine
(``problems.py``: what the memory planner sets aside).  Never imports paddle: a typo is reported in well under
a second.
"""
