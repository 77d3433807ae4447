"""The vLLM engine arguments a stage builds from its YAML."""
from pathlib import Path

from omni_server.config.loader import load_config, load_config_text
from omni_server.stage.ar import FIXED_KV_UTILIZATION, build_engine_args

REPO = Path(__file__).resolve().parents[1]


def test_a_fixed_kv_size_stops_vllm_demanding_most_of_the_gpu_free():
    """With `kv_cache_memory_bytes` the stage asks vLLM's start-up check for ~nothing free (stages
    sharing a GPU failed it: 'Free memory ... less than desired GPU memory utilization (0.92)');
    an explicit `gpu_memory_utilization` is kept, and without a fixed size vLLM's default stays."""
    cfg = load_config(REPO / "configs" / "qwen2_5_omni.yaml", ["talker.gpu_memory_utilization=0.3"])
    thinker, talker = build_engine_args(cfg, 0), build_engine_args(cfg, 1)
    assert thinker.kv_cache_memory_bytes == 16 << 30 and thinker.gpu_memory_utilization == FIXED_KV_UTILIZATION
    assert talker.kv_cache_memory_bytes == 12 << 30 and talker.gpu_memory_utilization == 0.3
    cfg = load_config_text("model: m\nstages: [{id: 0, name: lm, model: x, output: text, "
                           "engine_args: {gpu_memory_utilization: 0.6}}]\n")
    assert build_engine_args(cfg, 0).kv_cache_memory_bytes is None
    assert build_engine_args(cfg, 0).gpu_memory_utilization == 0.6
    cfg = load_config_text("model: m\nstages: [{id: 0, name: lm, model: x, output: text}]\n")
    assert build_engine_args(cfg, 0).gpu_memory_utilization == 0.92  # vLLM's default


def test_top_k_stages_register_our_sampler():
    """A talker (default top-k) gets omni-server's sampler as a vLLM logits processor, beside any
    the YAML names; the thinker (vLLM's sampler) gets none; `sampler: vllm` opts out."""
    from omni_server.stage.sampling import LOGITS_PROCESSOR

    cfg = load_config(REPO / "configs" / "qwen2_5_omni.yaml", ["talker.logits_processors=[pkg.mod:Other]"])
    assert build_engine_args(cfg, 1).logits_processors == ["pkg.mod:Other", LOGITS_PROCESSOR]
    assert not build_engine_args(cfg, 0).logits_processors
    cfg = load_config(REPO / "configs" / "qwen3_omni.yaml", ["talker.sampler=vllm"])
    assert not build_engine_args(cfg, 1).logits_processors


def test_a_stage_feeding_hidden_states_keeps_them_beside_its_prefix_cache():
    """The thinker (its talker reads hidden rows) keeps vLLM's prefix caching and asks its runner
    for the rows store; `enable_prefix_caching: false` still turns caching off. The talker feeds
    token2wav codes only: no store, and vLLM's caching as it is (blocks keyed by their embeddings)."""
    from omni_server.stage.prefix_rows import PREFIX_ROWS

    cfg = load_config(REPO / "configs" / "qwen2_5_omni.yaml", ["thinker.additional_config={a: 1}"])
    thinker, talker = build_engine_args(cfg, 0), build_engine_args(cfg, 1)
    assert thinker.additional_config == {"a": 1, PREFIX_ROWS: True}  # (it turns no modality off)
    assert thinker.enable_prefix_caching is not False
    assert PREFIX_ROWS not in (talker.additional_config or {}) and talker.enable_prefix_caching is not False
    cfg = load_config(REPO / "configs" / "qwen2_5_omni.yaml", ["thinker.enable_prefix_caching=false"])
    assert build_engine_args(cfg, 0).enable_prefix_caching is False


def test_the_kv_budget_covers_the_rows_beside_it():
    """A stage keeping hidden rows beside its KV cache hands vLLM the share of its budget that
    leaves room for one row per KV token: 7B thinker shapes, 56 KiB of KV and 7 KiB of rows a token."""
    from types import SimpleNamespace

    import torch

    from omni_server.stage.prefix_rows import kv_share

    layer = SimpleNamespace(page_size_bytes=16 * 2 * 4 * 128 * 2, block_size=16)  # 2 KiB a token
    specs = {f"layer{i}": layer for i in range(28)}
    cfg = SimpleNamespace(model_config=SimpleNamespace(get_hidden_size=lambda: 3584, dtype=torch.bfloat16))
    budget = 16 << 30
    kv = kv_share(budget, specs, cfg)
    tokens = kv // (28 * 2048)
    assert kv + tokens * 3584 * 2 <= budget < kv + (tokens + 1) * (28 * 2048 + 3584 * 2)
    assert kv_share(budget, {}, cfg) == budget  # no KV layers: nothing to share


def test_speculative_decoding_is_refused_where_a_consumer_reads_hidden_states():
    """Its steps emit no rows: the talker would fail every request on an empty tensor. A stage whose
    consumers read only tokens may use it."""
    import pytest

    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    cfg = load_config(REPO / "configs" / "qwen2_5_omni.yaml", [f"thinker.speculative_config={spec}"])
    with pytest.raises(ValueError, match=r"stage 0 \(thinker\): engine_args.speculative_config: .* talker reads them"):
        build_engine_args(cfg, 0)
    cfg = load_config(REPO / "configs" / "qwen2_5_omni.yaml", [f"talker.speculative_config={spec}"])
    assert build_engine_args(cfg, 1).speculative_config["method"] == "ngram"  # (token2wav reads codes)


def test_a_sub_model_stage_is_quantized_to_fp8_at_load(tiny_models):
    """`talker.quantization: fp8` reaches vLLM through the talker's own config (vLLM 0.26 takes an
    engine-level quantization only with dict `hf_overrides`): the engine's quantization is vLLM's
    FP8 method with unquantized checkpoint weights (quantized as they load), on the talker's model."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from omni_server.models import register_vllm_models
    from omni_server.stage.model_classes import ONLINE_FP8

    register_vllm_models()
    model = tiny_models["tiny-qwen2_5-omni"]
    cfg = load_config(REPO / "configs" / "default.yaml", [f"talker.model={model}", "talker.quantization=fp8",
                                                          "talker.dtype=bfloat16"])
    vc = build_engine_args(cfg, 1).create_engine_config()
    assert vc.model_config.quantization == ONLINE_FP8
    assert isinstance(vc.quant_config, Fp8Config) and not vc.quant_config.is_checkpoint_fp8_serialized
    assert vc.quant_config.activation_scheme == "dynamic"
    assert vc.model_config.hf_config.architectures == ["OmniServerQwen2_5OmniTalker"]
    # without it, no quantization
    vc = build_engine_args(load_config(REPO / "configs" / "default.yaml", [f"talker.model={model}"]), 1)
    assert vc.create_engine_config().quant_config is None


def test_a_text_only_stage_compiles_apart_from_a_media_one(tiny_models):
    """vLLM 0.26's compile-cache key leaves out the multimodal limits (vLLM issue 50891), but with
    every modality off the thinker's forward takes token ids, not embeddings: on a GPU, a text-only
    start after a media one from the same cache loaded the media graph and died in it
    ("'NoneType' object has no attribute 'size'"). The stage adds what it turns off to the key; a
    stage with every modality on keeps vLLM's key as it was (users' warm caches stay valid)."""
    from omni_server.stage.ar import DISABLED_MODALITIES, disabled_modalities

    model = tiny_models["tiny-qwen2_5-omni"]

    def config(*overrides):
        cfg = load_config(REPO / "configs" / "default.yaml", [f"thinker.model={model}", *overrides])
        return build_engine_args(cfg, 0)

    media = config()
    assert DISABLED_MODALITIES not in (media.additional_config or {})
    text = config('thinker.limit_mm_per_prompt={"image": 0, "audio": 0, "video": {"count": 0}}')
    assert text.additional_config[DISABLED_MODALITIES] == ["audio", "image", "video"]
    hashes = {media.create_engine_config().compute_hash(), text.create_engine_config().compute_hash()}
    assert len(hashes) == 2
    assert disabled_modalities({"limit_mm_per_prompt": {"image": 0, "audio": 2}}) == ["image"]
    assert disabled_modalities({"language_model_only": True}) == ["*"]
    assert disabled_modalities({"limit_mm_per_prompt": {"video": {"count": 1}}}) == []


def test_a_stage_takes_the_defaults_vllm_serve_takes(tiny_models, monkeypatch):
    """Where a stage's engine_args are silent, its engine gets `vllm serve`'s defaults, not those
    of a bare engine: on a large GPU (its defaults as vLLM's get_batch_defaults gives them there)
    a prefill of up to 8,192 tokens a step instead of 2,048. A stage's own value wins."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from omni_server.stage.ar import engine_config

    large_gpu = ({UsageContext.LLM_CLASS: 16384, UsageContext.OPENAI_API_SERVER: 8192},
                 {UsageContext.LLM_CLASS: 1024, UsageContext.OPENAI_API_SERVER: 1024})
    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(lambda cls, world_size: large_gpu))
    model = tiny_models["tiny-qwen2_5-omni"]
    cfg = load_config(REPO / "configs" / "default.yaml", [f"thinker.model={model}"])
    assert "max_num_batched_tokens" not in cfg.stage(0).engine_args
    assert engine_config(cfg, 0).scheduler_config.max_num_batched_tokens == 8192
    assert build_engine_args(cfg, 0).create_engine_config().scheduler_config.max_num_batched_tokens == 2048
    cfg = load_config(REPO / "configs" / "default.yaml", [f"thinker.model={model}", "thinker.max_num_batched_tokens=4096"])
    assert engine_config(cfg, 0).scheduler_config.max_num_batched_tokens == 4096
