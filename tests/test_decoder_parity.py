"""Our decoder (paddlenlp_ext.models.decoder) against transformers 4.55 itself, on every architecture row.

The rows come from the family table (every ``Family`` with an ``arch``), so a new row is tested
without editing this file; :data:`KNOBS` only adds non-default settings where a row has them
(RoPE scalings, windows smaller than the sequence, soft-caps, tied embeddings, biases, NoPE layers,
partial rotary).  For each row, transformers builds the model at random weights (fp32, eager
attention: transformers' sdpa path drops Gemma 2's attention soft-cap), ``save_pretrained`` writes
it, and our streaming loader reads that directory (names and transposes converted while streaming).
Judged:

* logits within 1e-4 on a left-padded batch (our mask from the padding mask and position ids);
* 20 greedy tokens of our ``predict.generate`` (one left-padded batch, KV cache) equal to
  transformers' ``generate`` on each prompt alone;
* a packed row of two documents, fed as FlashMask start rows and as a dense [B, 1, L, L] mask with
  ``position_ids`` restarting per document, gives each document's logits as transformers on the
  document alone (windows and soft-caps honoured per document);
* LoRA gradients on every decoder Linear (same adapter weights) within 1e-4 of PEFT's on transformers' model
  (relative, ``||ours - peft|| / ||peft||`` per tensor).
"""

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paddlenlp_ext.models.family_table import FAMILIES  # noqa: E402

ROWS = [k for k, f in FAMILIES.items() if f.arch is not None]
VOCAB = 128
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
}
#: model_type -> transformers config overrides: the non-default knobs of the row (windows < sequence lengths)
KNOBS = {
    "llama": dict(
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=24,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": dict(
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "qwen3": dict(
        head_dim=24,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "mistral": dict(sliding_window=5, head_dim=24, rope_theta=1000.0),
    "gemma": dict(head_dim=24, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma2": dict(
        head_dim=16,
        sliding_window=5,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=8.0,
        query_pre_attn_scalar=24,
        tie_word_embeddings=True,
        num_hidden_layers=4,
    ),
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=5,
        attn_logit_softcapping=30.0,
        final_logit_softcapping=10.0,
        query_pre_attn_scalar=24,
        rope_local_base_freq=1000.0,
        num_hidden_layers=4,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        layer_types=["sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        partial_rotary_factor=0.75,
        sliding_window=5,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling=_LONGROPE,
    ),
    "glm4": dict(partial_rotary_factor=0.5, attention_bias=True, head_dim=16),
    "ernie4_5": dict(use_bias=True, tie_word_embeddings=True, rope_theta=500000.0),
    "olmo2": dict(attention_bias=True, rope_scaling={"type": "linear", "factor": 2.0}),
    # MoE rows (decoder/moe.py): 4 experts top-2; qwen2_moe with a dense layer (mlp_only_layers), a shared expert
    # and renormalised top-k; mixtral with a window
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
    "qwen2_moe": dict(
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # qwen3_moe: a dense layer between sparse ones (decoder_sparse_step), q/k norms, a window on every layer
    "qwen3_moe": dict(
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=2,
        head_dim=24,
        norm_topk_prob=True,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=5,
    ),
    "ernie4_5_moe": dict(
        num_hidden_layers=4,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=2,
        use_bias=True,
        tie_word_embeddings=True,
    ),
    # multi-head latent attention (decoder/mla.py): V2 without q_lora_rank (V2-Lite's q_proj), group-limited
    # softmax routing, biases; V3 with q/kv ranks, yarn with mscale != mscale_all_dim (mscale in the softmax scale),
    # sigmoid routing in 2 groups; v_head_dim != nope + rope on both; one dense layer first
    "deepseek_v2": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        attention_bias=True,
        mlp_bias=True,
        num_key_value_heads=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_key_value_heads=4,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
    # attention sinks, alternating windows (layer_types: sliding, full, sliding), yarn, 4 experts top-2 (fused)
    "gpt_oss": dict(
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=24,
        sliding_window=5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    ),
    "smollm3": dict(
        num_hidden_layers=4,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=5,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
}
#: rows whose RoPE depends on the longest position of the batch (longrope): equal-length prompts for generate,
#: and the judge is transformers' forward token by token: its Phi-3 generate, when it resets the cache at the
#: short -> long switch, recomputes the sequence under a one-row mask (cache_position) and then differs from
#: its own forward (measured: 42 vs 50 at token 8), while ours resets and recomputes causally
LONGROPE = {"phi3"}
_CACHE = {}
LORA_STD = 0.1  # adapter weights: large enough to move every logit, small enough for a well-conditioned fp32 backward


def build(model_type, tmp_path_factory):
    """(transformers model, its directory, our model loaded from it); built once per row."""
    if model_type in _CACHE:
        return _CACHE[model_type]
    kw = {**BASE, **KNOBS.get(model_type, {})}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(hf)
    with torch.no_grad():
        for name, b in hf.named_buffers():  # the routers' correction bias (ernie4_5_moe, deepseek_v3): non-zero
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    path = str(tmp_path_factory.mktemp(model_type))
    hf.save_pretrained(path)
    ours = load_ours(path, model_type)
    _CACHE[model_type] = (hf, path, ours)
    return _CACHE[model_type]


def randomize(hf):
    """Weights large enough that every knob matters and greedy winners are clear (norms around 1)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))


def load_ours(path, model_type):
    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import load_model_streaming

    config_cls, _, lm_cls = classes_for(model_type)
    model, stats = load_model_streaming(path, config_cls.from_pretrained(path), "float32", model_class=lm_cls)
    assert stats["layout"] == "transformers"
    model.eval()
    return model


@pytest.fixture(params=ROWS)
def row(request, tmp_path_factory):
    return (request.param,) + build(request.param, tmp_path_factory)


def _left_padded(lengths, seed):
    from paddlenlp_ext.predict.generate import left_padded

    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]
    return prompts, left_padded(prompts)


def assert_padded_logits_match(hf, ours, label):
    """transformers' and our logits on one left-padded batch agree within 1e-4 at the real positions (and the
    logits are not trivially small)."""
    _, (ids, mask, pos) = _left_padded([12, 7, 10], seed=1)
    with torch.no_grad():
        want = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits.numpy()
    got = ours(
        input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), position_ids=paddle.to_tensor(pos)
    ).logits.numpy()
    real = mask.astype(bool)
    assert np.abs(got[real] - want[real]).max() < 1e-4, label
    assert np.abs(want[real]).max() > 0.5, label


def test_logits_match_on_a_left_padded_batch(row):
    model_type, hf, _, ours = row
    assert_padded_logits_match(hf, ours, model_type)


def test_20_greedy_tokens_identical(row):
    from paddlenlp_ext.predict.generate import generate_batch
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.prompts import Prompt

    model_type, hf, _, ours = row
    lengths = [9, 9] if model_type in LONGROPE else [9, 4]
    prompts, _ = _left_padded(lengths, seed=5)
    want = []
    for p in prompts:
        with torch.no_grad():
            if model_type in LONGROPE:
                seq = list(p)
                for _ in range(20):
                    seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
                want.append(seq[len(p) :])
                continue
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
        want.append(out[0, len(p) :].tolist())
    assert all(len(w) == 20 for w in want) and len(set(map(tuple, want))) == 2
    eos = next(t for t in range(3, VOCAB) if all(t not in w for w in want))  # never generated: no early stop
    o = PredictOptions(model_name_or_path="unused", decode_strategy="greedy_search")
    got = generate_batch(ours, [Prompt(ids=p, max_new_tokens=20) for p in prompts], o, eos_ids=[eos], pad_id=0)
    assert got == want, model_type


def _packed(docs, width):
    """ids, position_ids, FlashMask start rows [1, 1, W, 1] and the dense bool mask [1, 1, W, W] of one packed row."""
    ids = np.zeros((1, width), dtype="int64")
    pos = np.zeros((1, width), dtype="int64")
    start = np.full((1, 1, width, 1), width, dtype="int32")
    dense = np.zeros((1, 1, width, width), dtype=bool)
    at = 0
    for d in docs:
        n = len(d)
        ids[0, at : at + n], pos[0, at : at + n] = d, np.arange(n)
        start[0, 0, at : at + n, 0] = at + n  # rows from the document's end on must not see its columns
        dense[0, 0, at : at + n, at : at + n] = np.tril(np.ones((n, n), dtype=bool))
        at += n
    for i in range(at, width):  # padding rows see themselves only (a finite softmax)
        dense[0, 0, i, i] = True
    return ids, pos, start, dense


def test_packed_documents_match_each_document_alone(row):
    model_type, hf, _, ours = row
    rng = np.random.default_rng(7)
    docs = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (8, 7)]
    ids, pos, start, dense = _packed(docs, width=17)
    want = []
    for d in docs:
        with torch.no_grad():
            want.append(hf(torch.tensor([d])).logits[0].numpy())
    want = np.concatenate(want)  # [15, V]
    for mask in (
        {"attn_mask_startend_row_indices": paddle.to_tensor(start)},
        {"attention_mask": paddle.to_tensor(dense)},
    ):
        got = ours(input_ids=paddle.to_tensor(ids), position_ids=paddle.to_tensor(pos), **mask).logits.numpy()[0]
        assert np.abs(got[:15] - want).max() < 1e-4, (model_type, list(mask))


def test_a_new_row_is_tested_without_edits():
    """Every table row with an arch is in ROWS; KNOBS names only rows that exist."""
    assert set(KNOBS) <= set(ROWS) and len(ROWS) >= 12


def test_lora_gradients_match_peft(row):
    """Same LoRA weights (random A and B, rank 4, alpha 8, every decoder Linear) on our model and on PEFT's
    wrap of transformers' model; the next-token loss of one padded batch; every lora_A / lora_B gradient."""
    peft = pytest.importorskip("peft")
    from paddlenlp_ext.adapters import apply_adapters
    from paddlenlp_ext.adapters.config import adapter_config_from_args

    model_type, hf, path, _ = row
    ours = load_ours(path, model_type)  # a fresh copy: the adapters change the model
    apply_adapters(
        ours, adapter_config_from_args({"lora": True, "lora_rank": 4, "lora_alpha": 8, "model_type": model_type})
    )
    names = {n[: -len(".lora_A")] for n, _ in ours.named_parameters() if n.endswith(".lora_A")}
    leaves = sorted({n.rsplit(".", 1)[1] for n in names})
    wrapped = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", torch_dtype=torch.float32),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=leaves),
    )
    theirs = dict(wrapped.named_parameters())
    ours_params = dict(ours.named_parameters())
    rng = np.random.default_rng(11)
    pairs = []
    for name in sorted(names):
        hf_name = "base_model.model.model." + name.split(".", 1)[1]
        a, b = ours_params[name + ".lora_A"], ours_params[name + ".lora_B"]
        a_val = rng.normal(0, LORA_STD, a.shape).astype("float32")  # [in, r]
        b_val = rng.normal(0, LORA_STD, b.shape).astype("float32")  # [r, out]
        a.set_value(paddle.to_tensor(a_val))
        b.set_value(paddle.to_tensor(b_val))
        ta, tb = theirs[hf_name + ".lora_A.default.weight"], theirs[hf_name + ".lora_B.default.weight"]
        with torch.no_grad():
            ta.copy_(torch.tensor(a_val.T))  # PEFT: A [r, in], B [out, r]
            tb.copy_(torch.tensor(b_val.T))
        pairs.append((a, b, ta, tb, name))
    assert pairs, model_type
    prompts, (ids, mask, pos) = _left_padded([12, 7], seed=3)
    target = np.where(mask[:, 1:] == 1, ids[:, 1:], -100)  # [B, L - 1]: next token on real positions
    logits = ours(
        input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), position_ids=paddle.to_tensor(pos)
    ).logits[:, :-1]
    loss = paddle.nn.functional.cross_entropy(
        logits.reshape([-1, VOCAB]), paddle.to_tensor(target.reshape([-1, 1])), ignore_index=-100, reduction="sum"
    ) / float((target != -100).sum())
    loss.backward()
    wrapped.train(False)
    t_logits = wrapped(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
    ).logits[:, :-1]
    t_loss = torch.nn.functional.cross_entropy(
        t_logits.reshape(-1, VOCAB), torch.tensor(target.reshape(-1)), ignore_index=-100
    )
    t_loss.backward()
    assert abs(float(loss) - float(t_loss)) < 1e-5 * max(1.0, abs(float(t_loss)))
    for a, b, ta, tb, name in pairs:
        if a.grad is None:  # an expert no token was routed to: no gradient on either side
            assert b.grad is None and (ta.grad is None or not ta.grad.any()), (model_type, name)
            continue
        for got, want in ((a.grad.numpy(), ta.grad.numpy().T), (b.grad.numpy(), tb.grad.numpy().T)):
            assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), (model_type, name)


def test_recompute_gives_the_same_gradients(tmp_path_factory):
    """config.recompute (the run's ``recompute: true``) recomputes each layer in backward: the same loss and
    gradients within float rounding (without recompute the layers take the one-node RMSNorm and the chunked
    causal attention, under it plain autograd through the dense ops: the same math, other summation orders)."""
    model_type = ROWS[-1]
    _, path, _ = build(model_type, tmp_path_factory)
    ids = paddle.to_tensor(np.random.default_rng(2).integers(3, VOCAB, size=(2, 11)))
    grads = []
    for on in (False, True):
        model = load_ours(path, model_type)
        model.config.recompute = on
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((float(loss), {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    assert abs(l0 - l1) <= 1e-6 * abs(l0) and set(g0) == set(g1) and len(g0) > 10
    bad = {
        n: float(np.abs(g0[n] - g1[n]).max())
        for n in g0
        if np.abs(g0[n] - g1[n]).max() > 1e-5 * max(1.0, np.abs(g0[n]).max())
    }
    assert not bad, bad


def test_save_pretrained_then_auto_classes_and_streaming_load_give_the_same_model(tmp_path_factory, tmp_path):
    """Our layout round trip: save_pretrained (PaddleNLP), then AutoModelForCausalLM.from_pretrained and the
    streaming loader both rebuild the decoder class with equal logits."""
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    from paddlenlp_ext.models.registration import decoder_model_types, register_decoder
    from paddlenlp_ext.models.loading import load_model_streaming

    import os

    import paddlenlp.transformers as T

    register_decoder()
    # PaddleNLP's Auto classes pick our class for a model_type PaddleNLP has no module of (mistral, gemma, mixtral,
    # ... resolve to PaddleNLP's own: the toolkit builds those through models.loading.decoder_class_for)
    model_type = next(
        t for t in decoder_model_types() if not os.path.isdir(os.path.join(os.path.dirname(T.__file__), t))
    )
    _, _, ours = build(model_type, tmp_path_factory)
    ours.save_pretrained(str(tmp_path))
    ids = paddle.to_tensor(np.random.default_rng(4).integers(3, VOCAB, size=(2, 9)))
    want = ours(input_ids=ids).logits.numpy()
    auto = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype="float32")
    streamed, stats = load_model_streaming(str(tmp_path), AutoConfig.from_pretrained(str(tmp_path)), "float32")
    assert type(auto) is type(ours) and type(streamed) is type(ours) and stats["layout"] == "paddlenlp"
    for model in (auto, streamed):
        model.eval()
        assert np.abs(model(input_ids=ids).logits.numpy() - want).max() < 1e-6


#: the MLA forms the rows' KNOBS leave out: V3 rotating halves (rope_interleave false) without q_lora_rank, greedy
#: top-k without groups; V2 with q_lora_rank, yarn (no mscale in V2's softmax scale) and v_head_dim > nope + rope
MLA_VARIANTS = {
    "v3_halves": (
        "deepseek_v3",
        dict(
            rope_interleave=False, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False, attention_bias=True
        ),
    ),
    "v2_yarn": (
        "deepseek_v2",
        dict(
            q_lora_rank=24,
            v_head_dim=32,
            topk_method="greedy",
            n_group=None,
            topk_group=None,
            attention_bias=False,
            mlp_bias=False,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        ),
    ),
}


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_mla_variants_match_transformers(variant, tmp_path):
    """Logits of the other MLA forms on a left-padded batch, within 1e-4 of transformers 4.55."""
    model_type, extra = MLA_VARIANTS[variant]
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **KNOBS[model_type], **extra})
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(hf)
    hf.save_pretrained(str(tmp_path))
    ours = load_ours(str(tmp_path), model_type)
    assert_padded_logits_match(hf, ours, variant)


def test_mla_configs_it_cannot_honour_are_refused_naming_the_key():
    """What transformers' MLA would not compute as the row does is a config-time problem naming the key."""
    from paddlenlp_ext.models.decoder.rows import config_problems

    base = {**BASE, **KNOBS["deepseek_v3"], "model_type": "deepseek_v3", "head_dim": 8}
    assert config_problems(FAMILIES["deepseek_v3"].arch, base) == []
    for change, key in (
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"kv_lora_rank": None}, "kv_lora_rank is missing"),
        ({"n_group": 3}, "n_group=3"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        # the original DeepSeek code's routing keys (PaddleNLP's configs carry them): another routing
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"topk_method": "gready"}, "topk_method='gready'"),
    ):
        found = config_problems(FAMILIES["deepseek_v3"].arch, {**base, **change})
        assert len(found) == 1 and key in found[0], (change, found)
    real = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}  # what DeepSeek-V3's own config.json says
    assert config_problems(FAMILIES["deepseek_v3"].arch, {**base, **real}) == []
    v2 = {**BASE, **KNOBS["deepseek_v2"], "model_type": "deepseek_v2", "head_dim": 8, "topk_method": "noaux_tc"}
    found = config_problems(FAMILIES["deepseek_v2"].arch, v2)
    assert len(found) == 1 and "topk_method='noaux_tc'" in found[0], found
