"""The one boundary to PaddleNLP's and Paddle's private internals.

Everything in paddlenlp_ext that imports a private name of paddle/paddlenlp
(``paddle._C_ops``, ``paddlenlp.transformers.llama.fusion_ops.F``), patches a
library module, overrides a private ``Trainer`` method, or reads library
source (``ast.parse``, ``inspect.getsource``) lives in this package.  The rest
of the code calls the public functions defined here.

Each module names the symbols it relies on in ``RELIED_ON`` so that
``tests/test_integrations.py`` can assert they still exist with the expected
signature: a PaddleNLP upgrade that renames one fails ``make test``, not a
user's run.  Patches are installed by context managers and removed on exit.

Modules:
    versions             tested paddle / paddlenlp ranges, checked at import
    training_args_source PaddleNLP's TrainingArguments fields read with ast (no paddle import)
    trainer              Trainer subclass: private save/load/log overrides, public hooks
    training_args        TrainingArguments class built on PaddleNLP's, and its fix-ups
    flashmask            the fusion_ops patch that routes FlashMask attention to our CPU kernel
    mp_ops               fleet's model-parallel collectives, and building TP layers without fleet.init
    sharding             sharding stage 2/3: Paddle's partition and slice parameters (for the simulation),
                         the weight-decay rule made to answer for stage 3's "slice@" parameters
    pipeline             PaddleNLP's *ForCausalLMPipe: plain layer names, loss / inputs hooks, simulated stages
    lazy_init            lazy parameter skeletons for the streaming loader
    logging              PaddleNLP's logger routed to train.log / the console, its tqdm/printer callbacks
                         replaced, the run-long VisualDL writer
    rotary, dense_attention, rms_norm
                         cheaper CPU forms of Llama/Qwen2's rotary embedding, dense-mask attention and RMSNorm
    qwen3                our Qwen3 (models/qwen3) made known to PaddleNLP's Auto classes; the Qwen2 pieces it uses

Importing this package itself never imports paddle.
"""
