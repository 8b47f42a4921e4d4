"""Read a ``config.json`` in either transformers spelling (4.x or 5.x) as one canonical dict.

transformers 5 moved several settings when it saves a config (``configuration_utils.py``,
``modeling_rope_utils.py`` and the per-model configuration files of 5.24):

* RoPE: top-level ``rope_theta`` + ``rope_scaling`` (4.x) became one ``rope_parameters`` dict
  holding ``rope_theta`` and ``rope_type`` (5.x), flat, or nested per attention type
  (``{"full_attention": {...}, "sliding_attention": {...}}``, Gemma 2/3 style) when its keys
  are the config's ``layer_types``.  5.x reads a legacy ``rope_scaling`` as ``rope_parameters``
  (it wins when truthy) and a top-level ``rope_theta`` as the default of
  ``rope_parameters.rope_theta``; a ``llama3``/``yarn``/``longrope`` dict without
  ``original_max_position_embeddings`` gets ``max_position_embeddings``.  5.x's yarn scales by
  ``factor``, 4.x's by ``max_position_embeddings / original_max_position_embeddings`` whenever
  the latter is set (:func:`_yarn_as_4x`).
* ``torch_dtype`` became ``dtype`` (``dtype`` wins when both are set).
* ``layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per layer) is written by
  Qwen2/Qwen3 (derived from ``use_sliding_window``, ``sliding_window``, ``max_window_layers``;
  ``sliding_window`` itself is saved as null when ``use_sliding_window`` is false).  A
  ``mistral`` config with ``layer_types`` is built by 5.x's AutoConfig as ``ministral``: only
  the layers marked ``sliding_attention`` use the window, where 4.x slides every layer.
* legacy layer-type names are renamed (``"attention"`` -> ``"full_attention"``).

:func:`canonical_config` turns either spelling into transformers 4.55's (``rope_theta``,
``rope_scaling`` with ``rope_type``, ``sliding_window``/``use_sliding_window``/
``max_window_layers``, ``torch_dtype``; ``layer_types`` kept), which is what PaddleNLP's config
classes and models read, and lists what it cannot express exactly.  :func:`rope_problems` says
which RoPE a family's model here computes.  No paddle: ``config/`` calls it before anything loads.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

#: transformers' RoPE types (modeling_rope_utils.ROPE_INIT_FUNCTIONS of 5.24 + "default")
KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
#: rope types that carry original_max_position_embeddings (5.x fills it from max_position_embeddings)
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
#: the default RoPE base of every family here (transformers' RotaryEmbeddingConfigMixin.default_theta, PaddleNLP's)
DEFAULT_THETA = 10000.0

#: model_type -> why a config.json in transformers 5.x's spelling is refused for it (measured, not assumed)
NOT_READ_5X: Dict[str, str] = {}
_LEGACY_LAYER_TYPES = {"attention": "full_attention"}


def _rope_type(d: Mapping[str, Any]) -> Any:
    return d.get("rope_type", d.get("type", "default"))


def _scaling_of(d: Mapping[str, Any]) -> Dict[str, Any]:
    """A RoPE dict without its base: ``{"type": "linear", "factor": 2.0, "rope_theta": 1e4}`` ->
    ``{"rope_type": "linear", "factor": 2.0}``."""
    return {"rope_type": _rope_type(d), **{k: v for k, v in d.items() if k not in ("type", "rope_type", "rope_theta")}}


def _local_theta_key(model_type: Any) -> Optional[str]:
    """The config key of the local (sliding-layer) RoPE theta of a decoder row that has one (Gemma 3:
    ``rope_local_base_freq``), else None."""
    from .family_table import row

    family = row(model_type)
    return family.arch.local_rope_theta if family is not None and family.arch is not None else None


def _per_type_rope(raw: Mapping[str, Any], per_type: Dict[str, Any], problems: List[str]) -> Optional[Dict[str, Any]]:
    """A per-attention-type ``rope_parameters`` whose types differ, read onto a row with a local-layer theta knob.

    transformers 5.x's Gemma 3 writes ``{"full_attention": {theta, scaling}, "sliding_attention": {theta}}``;
    4.x's spelling of the same model is ``rope_theta`` + ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` for the sliding ones, which take no scaling.  Returns the global dict with the local
    theta under the row's key (``_local``), or None with a problem when the file says more than that.
    """
    key = _local_theta_key(raw.get("model_type"))
    full, local = per_type.get("full_attention"), per_type.get("sliding_attention")
    if key is None or set(per_type) != {"full_attention", "sliding_attention"}:
        problems.append(
            f"config.json rope_parameters gives a different RoPE per attention type "
            f"({', '.join(f'{k}: {v}' for k, v in per_type.items())}); the model here has one RoPE for "
            "every layer (only a row with a local-layer theta, Gemma 3, reads a sliding_attention RoPE)"
        )
        return None
    extra = {k: v for k, v in local.items() if k not in ("rope_theta", "rope_type", "type")}
    if _rope_type(local) != "default" or extra or local.get("rope_theta") is None:
        problems.append(
            f"config.json rope_parameters.sliding_attention={local!r}: the sliding layers here take a "
            f"RoPE theta only ({key}); a scaled or theta-less local RoPE is not computed"
        )
        return None
    return {**full, "_local": (key, float(local["rope_theta"]))}


def _flat_rope(raw: Mapping[str, Any], problems: List[str]) -> Optional[Dict[str, Any]]:
    """The one RoPE dict (rope_type + rope_theta + scaling keys) of a 5.x ``rope_parameters``, or None.

    A nested dict (per attention type) is accepted when every type has the same RoPE, or on a row with a
    local-layer theta knob (:func:`_per_type_rope`)."""
    rp = raw.get("rope_parameters")
    if not isinstance(rp, dict):
        problems.append(f"config.json rope_parameters={rp!r}: expected a JSON object with rope_type and rope_theta")
        return None
    layer_types = raw.get("layer_types") or ()
    nested = [k for k in rp if k in layer_types]
    if not nested:
        return dict(rp)
    per_type = {k: rp[k] for k in nested if rp[k] is not None}
    if len(nested) != len(rp) or any(not isinstance(v, dict) for v in per_type.values()):
        problems.append(
            f"config.json rope_parameters mixes per-attention-type entries {nested} with other keys "
            f"{sorted(set(rp) - set(nested))}; give one RoPE dict or one per layer type"
        )
        return None
    distinct = {repr(sorted(v.items())) for v in per_type.values()}
    if len(distinct) > 1 and len(per_type) == len(nested):
        return _per_type_rope(raw, per_type, problems)
    if len(distinct) > 1 or len(per_type) < len(nested):
        problems.append(
            f"config.json rope_parameters gives a different RoPE per attention type "
            f"({', '.join(f'{k}: {v}' for k, v in rp.items())}); the model here has one RoPE for every "
            "layer (a local/global RoPE model such as Gemma 2/3 is not supported)"
        )
        return None
    return dict(next(iter(per_type.values())))


def _canonical_rope(raw: Mapping[str, Any], out: Dict[str, Any], problems: List[str]) -> None:
    """Set ``out['rope_theta']`` / ``out['rope_scaling']`` from either spelling (transformers 5.x's precedence)."""
    rs, rt = raw.get("rope_scaling"), raw.get("rope_theta")
    out.pop("rope_parameters", None)
    if raw.get("rope_parameters") is None:  # 4.x spelling (or no RoPE keys at all: the default)
        if isinstance(rs, dict):
            rope = dict(rs)
            rope["rope_type"] = _rope_type(rs)
            rope.pop("type", None)
            out["rope_scaling"] = None if rope["rope_type"] == "default" and len(rope) == 1 else rope
        elif rs is not None:
            problems.append(f"config.json rope_scaling={rs!r}: expected a JSON object with rope_type")
        return
    rope = _flat_rope(raw, problems)
    if rope is None:
        return
    local = rope.pop("_local", None)
    if local is not None:
        key, theta_local = local
        if raw.get(key) is not None and float(raw[key]) != theta_local:
            problems.append(
                f"config.json {key}={raw[key]!r} and rope_parameters.sliding_attention.rope_theta="
                f"{theta_local!r} differ (transformers 4.x reads the first, 5.x the second); keep one"
            )
            return
        out[key] = theta_local
    prf = rope.pop("partial_rotary_factor", None)
    if prf is not None:  # 5.x keeps it in rope_parameters (Phi-3, GLM-4); 4.x at the top level
        if raw.get("partial_rotary_factor") is not None and float(raw["partial_rotary_factor"]) != float(prf):
            problems.append(
                f"config.json partial_rotary_factor={raw['partial_rotary_factor']!r} and "
                f"rope_parameters.partial_rotary_factor={prf!r} differ; keep one"
            )
            return
        out["partial_rotary_factor"] = prf
    if rs:  # 5.x: a truthy legacy rope_scaling replaces rope_parameters; 4.x reads only rope_scaling
        if not isinstance(rs, dict) or _scaling_of(rs) != _scaling_of(rope):
            problems.append(
                f"config.json has both rope_scaling={rs!r} and rope_parameters={raw['rope_parameters']!r} "
                "and they differ (transformers 4.x reads the first, 5.x the second); keep one"
            )
            return
    theta = rope.get("rope_theta")
    if theta is None:
        theta = rt if rt is not None else DEFAULT_THETA
    elif rt is not None and float(rt) != float(theta):
        problems.append(
            f"config.json rope_theta={rt!r} and rope_parameters.rope_theta={theta!r} differ "
            "(transformers 4.x reads the first, 5.x the second); keep one"
        )
        return
    rtype = _rope_type(rope)
    if rtype in _NEEDS_ORIGINAL_MAX and "original_max_position_embeddings" not in rope:
        omax = raw.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if omax is not None:
            rope["original_max_position_embeddings"] = omax
    if rtype == "yarn" and _decoder_row(raw.get("model_type")):  # the rows that compute yarn (others refuse it)
        _yarn_as_4x(raw, rope, problems)
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "rope_type")}
    out["rope_theta"] = float(theta)
    out["rope_scaling"] = None if rtype == "default" and not scaling else {"rope_type": rtype, **scaling}


def _yarn_as_4x(raw: Mapping[str, Any], rope: Dict[str, Any], problems: List[str]) -> bool:
    """Rewrite a 5.x yarn dict (in place) so that 4.55's yarn formula computes what 5.x's does; False: it cannot.

    5.x (``_compute_yarn_parameters`` of 5.24) scales by ``factor`` and takes
    ``max_position_embeddings / original_max_position_embeddings`` only when ``factor`` is null; 4.55 replaces
    ``factor`` by that ratio whenever ``original_max_position_embeddings`` is set (and, without it, takes the
    original context to be ``max_position_embeddings``).  5.x fills ``original_max_position_embeddings`` with
    ``max_position_embeddings`` when it saves (gpt-oss' config does), which 4.55 would read as a factor of 1.

    >>> r = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    >>> _yarn_as_4x({"max_position_embeddings": 128}, r, []), r  # 4.55 then uses factor 4 and 128
    (True, {'rope_type': 'yarn', 'factor': 4.0})
    >>> r = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}  # gpt-oss-20b
    >>> _yarn_as_4x({"max_position_embeddings": 131072}, r, []), r["original_max_position_embeddings"]
    (True, 4096)
    """
    omax, maxp, factor = (
        rope.get("original_max_position_embeddings"),
        raw.get("max_position_embeddings"),
        rope.get("factor"),
    )
    if omax is None or maxp is None:
        return True
    if factor is None:  # 5.x: the ratio, which 4.55 computes from the same keys
        rope["factor"] = float(maxp) / float(omax)
    elif float(omax) == float(
        maxp
    ):  # 4.55 without the key: factor as given, original context = max_position_embeddings
        del rope["original_max_position_embeddings"]
    elif float(factor) != float(maxp) / float(omax):
        problems.append(
            f"config.json rope_parameters: yarn factor={factor} with original_max_position_embeddings={omax} "
            f"and max_position_embeddings={maxp}: transformers 5.x scales by factor, 4.x by "
            f"{maxp}/{omax}; the model here computes 4.x's yarn only, so make factor equal that ratio"
        )
        return False
    return True


def _canonical_layers(raw: Mapping[str, Any], out: Dict[str, Any], problems: List[str]) -> None:
    """``layer_types`` with legacy names renamed; mistral's 5.x (ministral) reading of it as ``sliding_window``."""
    lt = raw.get("layer_types")
    if lt is None:
        return
    n = raw.get("num_hidden_layers")
    if not isinstance(lt, list) or (isinstance(n, int) and len(lt) != n):
        problems.append(f"config.json layer_types={lt!r}: expected a list of num_hidden_layers={n} layer types")
        return
    lt = [_LEGACY_LAYER_TYPES.get(t, t) for t in lt]
    other = sorted({t for t in lt if t not in ("full_attention", "sliding_attention")})
    if other:
        problems.append(f"config.json layer_types has {other}: the model here computes full or sliding attention only")
        return
    out["layer_types"] = lt
    if raw.get("model_type") == "mistral" and raw.get("sliding_window") and "sliding_attention" not in lt:
        problems.append(
            f"config.json layer_types marks no layer sliding_attention but sliding_window="
            f"{raw['sliding_window']}: transformers 5.x reads this mistral config as ministral (no window), "
            "4.x slides every layer; set sliding_window to null or remove layer_types"
        )


def _decoder_row(model_type: Any) -> bool:
    from .family_table import row

    family = row(model_type)
    # qwen3_moe: a RoPE scaling sends its checkpoint to the decoder's row (family_table.layout_row, Family.hf_row_keys)
    return family is not None and (family.decoder or (family.hf_row is not None and family.hf_row.decoder))


#: model_type -> (4.55 key, the key transformers 5.x saves the same value under): 5.24's Qwen3MoeConfig writes the
#: expert count as num_local_experts (num_experts: null)
RENAMED_5X = {"qwen3_moe": (("num_experts", "num_local_experts"),)}


def canonical_config(raw: Mapping[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """(config in transformers 4.55's spelling, problems) for a config.json dict of either spelling.

    Pure; ``raw`` is not modified.  A problem names the key and what to change; with any
    problem the dict must not be used (no value is guessed).

    >>> c, p = canonical_config({"model_type": "llama", "rope_theta": None, "rope_scaling": None, "dtype": "float32",
    ...     "max_position_embeddings": 256, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
    ...     "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    >>> p, c["rope_theta"], c["rope_scaling"]["rope_type"], c["rope_scaling"]["original_max_position_embeddings"]
    ([], 500000.0, 'llama3', 256)
    >>> "rope_parameters" in c, c["torch_dtype"]
    (False, 'float32')
    >>> canonical_config({"model_type": "qwen3_moe", "num_experts": None, "num_local_experts": 4})[0]["num_experts"]
    4
    >>> canonical_config({"model_type": "qwen2", "rope_parameters": {"rope_type": "su", "rope_theta": 1e6}})[1]
    ["config.json rope_parameters.rope_type='su': not a RoPE type transformers knows (default, linear, dynamic, yarn, longrope, llama3, proportional)"]
    """
    out: Dict[str, Any] = dict(raw)
    problems: List[str] = []
    if raw.get("dtype") is not None or "torch_dtype" in raw:
        out["torch_dtype"] = raw["dtype"] if raw.get("dtype") is not None else raw.get("torch_dtype")
    _canonical_rope(raw, out, problems)
    _canonical_layers(raw, out, problems)
    for key, new in RENAMED_5X.get(raw.get("model_type"), ()):  # 5.x's name of a 4.55 key (the same value)
        if raw.get(key) is None and raw.get(new) is not None:
            out[key] = raw[new]
    why = NOT_READ_5X.get(raw.get("model_type"))
    if why and "rope_parameters" in raw:
        problems.append(
            f"config.json rope_parameters: a {raw.get('model_type')} checkpoint saved by transformers 5.x "
            f"is not read exactly yet ({why}); use the checkpoint as its makers released it (saved by "
            "transformers 4.x: rope_theta / rope_scaling in config.json)"
        )
    key = spelled_rope_key(raw)
    rope = out.get("rope_scaling")
    # our decoder: rows.config_problems names what it computes; other families: PaddleNLP's own rope_scaling kinds
    on_decoder = _decoder_row(raw.get("model_type"))
    if on_decoder and isinstance(rope, dict) and rope.get("rope_type") not in KNOWN_ROPE_TYPES:
        problems.append(
            f"config.json {key}.rope_type={rope.get('rope_type')!r}: not a RoPE type transformers knows "
            f"({', '.join(KNOWN_ROPE_TYPES)})"
        )
    elif not on_decoder and key == "rope_parameters" and rope:
        problems.append(
            f"config.json rope_parameters.rope_type={rope.get('rope_type')!r}: RoPE scaling written by "
            "transformers 5.x is read for our decoder's rows (docs/models.md) only; whether "
            f"PaddleNLP's {raw.get('model_type')} computes it is not verified"
        )
    return out, problems


def rope_problems(config: Mapping[str, Any], spelled: str = "rope_scaling") -> List[str]:
    """What in a canonical config's RoPE the model of a decoder row does not compute (``decoder/rows.py``; the
    PaddleNLP-class families keep their own ``rope_scaling`` kinds, unchecked).

    ``spelled``: the key the file used (``rope_parameters`` for a 5.x config), named in the message.

    >>> rope_problems({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    ...     "intermediate_size": 96, "vocab_size": 10, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    ...     "rope_parameters")
    ["config.json rope_parameters.rope_type='dynamic' is not implemented by the decoder (it implements default, linear, llama3, yarn, longrope); remove rope_scaling or use another checkpoint"]
    >>> rope_problems({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    []
    """
    from .family_table import row

    rope = config.get("rope_scaling")
    family = row(config.get("model_type"))
    if not isinstance(rope, dict) or family is None or not family.decoder or family.arch is None:
        return []
    from .decoder.rows import ArchError, _rope_scaling

    try:
        _rope_scaling(config)
    except ArchError as e:
        return [str(e).replace("config.json rope_scaling", f"config.json {spelled}", 1)]
    return []


def spelled_rope_key(raw: Mapping[str, Any]) -> str:
    """The RoPE key a config.json uses: ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x).

    >>> spelled_rope_key({"rope_parameters": {"rope_type": "default"}}), spelled_rope_key({"rope_theta": 1e6})
    ('rope_parameters', 'rope_scaling')
    """
    return "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"


def read_problems(raw: Mapping[str, Any]) -> List[str]:
    """Every problem of reading ``raw`` for its family's model here: the spelling's and the RoPE's.

    >>> read_problems({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4,
    ...     "factor": 2.0}})[0][:59]
    "config.json rope_parameters.rope_type='dynamic' is not impl"
    """
    canon, problems = canonical_config(raw)
    return problems or rope_problems(canon, spelled_rope_key(raw))


def sliding_layers(config: Mapping[str, Any]) -> Optional[List[bool]]:
    """Per layer, whether transformers applies the sliding window (canonical config), or None without a window.

    qwen2/qwen3: ``sliding_window`` counts only with ``use_sliding_window``; the layers are
    ``layer_types`` or else those from ``max_window_layers`` on.  mistral: every layer (4.x), or the
    ``layer_types`` ones (5.x reads such a config as ministral).  Others: every layer when set.

    >>> sliding_layers({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
    ...                 "max_window_layers": 1, "num_hidden_layers": 2})
    [False, True]
    >>> sliding_layers({"model_type": "qwen2", "sliding_window": 8, "num_hidden_layers": 2}) is None
    True
    """
    window = config.get("sliding_window")
    if not window:
        return None
    mt, n = config.get("model_type"), int(config.get("num_hidden_layers") or 0)
    lt = config.get("layer_types")
    if mt in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window"):
            return None
        if lt is None:
            start = config.get("max_window_layers")
            start = 28 if start is None else int(start)  # transformers' default
            return [i >= start for i in range(n)]
    if lt is not None:
        return [t == "sliding_attention" for t in lt]
    return [True] * n
