"""DFlash2's speculative_config: keys, the sm70_dflash2 options, replay defaults, the concurrency
ladder and the graph-memory defaults (spec/engine.md §2.5-2.7, §3.3, §4.7; release note 0.1.3)."""

from __future__ import annotations

import pytest

from revolta.plan import dry_run_plan
from revolta.engine import EngineConfig
from revolta.spec.config import SpeculativeConfig
from revolta.spec.dflash2.ladder import drafts_at, parse_ladder
from revolta.spec.dflash2.options import OPTIONS, SM70DFlash2Options, resolve_replay
from dflash2_fixtures import REAL, write_drafter

# the release note's recommended DFlash2 configuration (Deployment notes)
RECOMMENDED = {"method": "dflash2", "num_speculative_tokens": 7, "draft_sample_method": "greedy",
               "dflash_concurrency_drafts": {"4": 3, "5": 4}, "sm70_dflash2": {"spec_state_replay": False}}


def resolve(raw, **kw):
    return SpeculativeConfig.resolve(raw, has_mtp=True, env=kw.pop("env", {}), **kw)


@pytest.fixture
def drafter(tmp_path):
    return write_drafter(tmp_path / "drafter")


def test_recommended_configuration_resolves(drafter):
    spec = resolve({**RECOMMENDED, "model": drafter})
    assert (spec.method, spec.num_speculative_tokens, spec.draft_sample_method) == ("dflash2", 7, "greedy")
    assert spec.model == drafter and spec.drafter.block_size == 8 and spec.drafter.num_sliding_layers == 2
    assert spec.dflash_concurrency_drafts == ((4, 3), (5, 4))
    assert spec.spec_state_replay is False and spec.sm70_dflash2.spec_state_replay is False
    assert spec.sm70_dflash2.source("spec_state_replay") == "config"
    assert "DFlash2 x7" in spec.describe() and "per-draft state slots" in spec.describe()
    assert resolve(spec) is spec  # an already resolved config passes through
    # "dflash" is the release note's name for the same method; defaults: block_size - 1 drafts, greedy, replay on
    alias = resolve({"method": "dflash", "model": drafter})
    assert (alias.method, alias.num_speculative_tokens, alias.draft_sample_method) == ("dflash2", 7, "greedy")
    assert alias.spec_state_replay is True and alias.dflash_concurrency_drafts == ()
    assert resolve({"method": "dflash2", "model": drafter, "draft_sample_method": "probabilistic"}
                   ).draft_sample_method == "probabilistic"


def test_drafter_directory_is_checked(tmp_path, drafter):
    (tmp_path / "empty").mkdir()
    v1 = write_drafter(tmp_path / "v1", dflash_config={"selector_rank": None, "selector_top_k": None})
    cases = [({"method": "dflash2"}, "needs 'model'"),
             ({"method": "dflash2", "model": str(tmp_path / "nope")}, "is not a directory"),
             ({"method": "dflash2", "model": str(tmp_path / "empty")}, "has no config.json"),
             ({"method": "dflash2", "model": v1}, "without the DFlash2 candidate selector"),
             ({"method": "dflash2", "model": write_drafter(tmp_path / "bad", layer_types=["full_attention"])},
              "layer_types has 1 entries"),
             ({"method": "dflash2", "model": write_drafter(tmp_path / "badwin", sliding_window=0)},
              "sliding_window=0 must be at least 1")]
    for raw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            resolve(raw)
    # the Qwen3 rules the dflash package builds on: no window unless use_sliding_window; default layer types
    with pytest.raises(ValueError, match="sliding_attention layers but no window: set use_sliding_window=true"):
        resolve({"method": "dflash2", "model": write_drafter(tmp_path / "nowin", use_sliding_window=False)})
    full = resolve({"method": "dflash2", "model": write_drafter(tmp_path / "full", use_sliding_window=False,
                                                                layer_types=["full_attention"] * 3)})
    assert full.drafter.num_sliding_layers == 0 and full.drafter.sliding_window is None
    auto = resolve({"method": "dflash2", "model": write_drafter(tmp_path / "auto", layer_types=None,
                                                                max_window_layers=1)})
    assert (auto.drafter.num_sliding_layers, auto.drafter.sliding_window) == (2, 64)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve({"method": "dflash2", "model": str(tmp_path / "broken")})


def test_key_errors(drafter):
    base = {"method": "dflash2", "model": drafter}
    cases = [({"num_speculative_tokens": 8}, r"\[1, 7\]: the drafter proposes block_size - 1 = 7"),
             ({"num_speculative_tokens": 0}, r"\[1, 7\]"),
             ({"draft_sample_method": "typical"}, "'greedy' .recommended. or 'probabilistic'"),
             ({"typo": 1}, "unknown keys \\['typo'\\] for method 'dflash2'"),
             ({"sample_from_anchor": True}, "fixed \\[anchor, mask x drafts\\] layout"),
             ({"kv_cache_dtype": 8}, "KV format name"),
             ({"spec_state_replay": True, "sm70_dflash2": {"spec_state_replay": False}}, "give it once"),
             ({"sm70_dflash2": ["x"]}, "must be a dict of options"),
             ({"dflash_concurrency_drafts": {"4": 9}}, r"\[1, 7\]")]
    for extra, msg in cases:
        with pytest.raises(ValueError, match=msg):
            resolve({**base, **extra})
    # top-level sm70_dflash2 options are the same options
    assert resolve({**base, "spec_state_replay": False}).sm70_dflash2.spec_state_replay is False
    assert resolve({**base, "fused_gdn_verify": False}).sm70_dflash2.source("fused_gdn_verify") == "config"
    # MTP keeps its own keys: DFlash2's are unknown there
    with pytest.raises(ValueError, match="unknown keys"):
        resolve({"method": "mtp", "model": drafter})
    with pytest.raises(ValueError, match="not validated"):
        resolve({"method": "mtp", "draft_sample_method": "probabilistic"})


def test_option_defaults_follow_the_release_note():
    recommended = {"context_kv_graph", "context_pipeline", "verify_fastpath", "fused_gdn_metadata",
                   "fused_smallq_metadata", "grouped_smallq_metadata"}
    by_name = {o.name: o for o in OPTIONS}
    assert {n for n, o in by_name.items() if o.release_default} == recommended | {
        "sharded_selector_codebook", "spec_state_replay", "draft_window_split"}
    assert set(by_name) == set(SM70DFlash2Options.__dataclass_fields__) - {"sources"}
    opts = SM70DFlash2Options.resolve(None, env={})
    for o in OPTIONS:  # every option resolves to what revolta runs, or n/a
        value = getattr(opts, o.name)
        if o.honoured:
            assert value in o.honoured and opts.source(o.name) == "default", o.name
        else:
            assert value is None and opts.source(o.name) == "no effect in revolta", o.name
    assert opts.spec_state_replay is True and opts.fused_gdn_verify is False
    assert opts.sharded_selector_codebook is False  # TP 1: nothing to split
    assert SM70DFlash2Options.resolve(None, env={}, tensor_parallel_size=4).sharded_selector_codebook is True
    assert SM70DFlash2Options.resolve({"sharded_selector_codebook": False}, env={},
                                      tensor_parallel_size=4).sharded_selector_codebook is False
    lines = opts.describe()
    assert len(lines) == len(OPTIONS)
    assert any(line.startswith("context_kv_graph=n/a [no effect in revolta, release note true]") for line in lines)


def test_options_revolta_cannot_run_are_refused():
    for o in OPTIONS:
        if not o.honoured:
            for value in (True, False):
                if value in o.ignored:  # accepted and logged, runs as n/a
                    opts = SM70DFlash2Options.resolve({o.name: value}, env={})
                    assert getattr(opts, o.name) is None and "ignored" in opts.source(o.name), o.name
                    continue
                with pytest.raises(ValueError, match=f"{o.name}={value} \\(config\\) has no effect in revolta"):
                    SM70DFlash2Options.resolve({o.name: value}, env={})
        elif len(o.honoured) == 1 and o.name != "fused_gdn_verify":
            other = not o.honoured[0]
            with pytest.raises(ValueError, match=f"{o.name}={other} \\(config\\) cannot run in revolta, which always "
                                                 f"runs {o.name}={o.honoured[0]}"):
                SM70DFlash2Options.resolve({o.name: other}, env={})
            assert getattr(SM70DFlash2Options.resolve({o.name: o.honoured[0]}, env={}), o.name) is o.honoured[0]
    with pytest.raises(ValueError, match="fused_gdn_verify=true cannot run in revolta: revolta has no packed"):
        SM70DFlash2Options.resolve({"fused_gdn_verify": True}, env={})
    with pytest.raises(ValueError, match="needs a tensor-parallel group of 2 or more"):
        SM70DFlash2Options.resolve({"sharded_selector_codebook": True}, env={})
    with pytest.raises(ValueError, match="unknown options \\['context_kv'\\]"):
        SM70DFlash2Options.resolve({"context_kv": True}, env={})
    with pytest.raises(ValueError, match="must be true or false"):
        SM70DFlash2Options.resolve({"spec_state_replay": "no"}, env={})


def test_environment_aliases():
    opts = SM70DFlash2Options.resolve(None, env={"VLLM_SM70_DFLASH2_SPEC_STATE_REPLAY": "0"})
    assert opts.spec_state_replay is False
    assert opts.source("spec_state_replay") == "environment (VLLM_SM70_DFLASH2_SPEC_STATE_REPLAY)"
    # the typed field wins over the environment
    assert SM70DFlash2Options.resolve({"spec_state_replay": True},
                                      env={"VLLM_SM70_DFLASH2_SPEC_STATE_REPLAY": "0"}).spec_state_replay is True
    with pytest.raises(ValueError, match="VLLM_SM70_DFLASH2_FUSED_GDN_NORM.*has no effect in revolta"):
        SM70DFlash2Options.resolve(None, env={"VLLM_SM70_DFLASH2_FUSED_GDN_NORM": "1"})
    ignored = SM70DFlash2Options.resolve(None, env={"VLLM_SM70_DFLASH2_CONTEXT_KV_GRAPH": "1"})  # speed-only: logged
    assert ignored.source("context_kv_graph").startswith("environment (VLLM_SM70_DFLASH2_CONTEXT_KV_GRAPH), ignored")
    with pytest.raises(ValueError, match="VLLM_SM70_DFLASH2_SPEC_STATE_REPLAY='maybe' must be 1 or 0"):
        SM70DFlash2Options.resolve(None, env={"VLLM_SM70_DFLASH2_SPEC_STATE_REPLAY": "maybe"})
    with pytest.raises(ValueError, match="both spec_state_replay and fused_gdn_verify"):
        SM70DFlash2Options.resolve({"spec_state_replay": True}, env={"VLLM_SM70_DFLASH2_FUSED_GDN_VERIFY": "1"})


def test_replay_default_yields_to_an_automatic_fused_verify():
    # (explicit replay, explicit fused, fused automatic policy, supported) -> (replay, fused)
    cases = {(None, None, False, True): (True, False),  # on where supported
             (None, None, True, True): (False, True),  # yields to the automatic packed verifier
             (True, None, True, True): (True, False),  # explicit replay beats the automatic fused default
             (None, True, False, True): (False, True),  # explicit fused: replay's default yields
             (False, None, False, True): (False, False),
             (None, False, True, True): (True, False),
             (None, None, False, False): (False, False)}  # unsupported: per-draft slots
    for (replay, fused, auto, supported), want in cases.items():
        assert resolve_replay(replay, fused, fused_auto=auto, supported=supported) == want
    with pytest.raises(ValueError, match="both spec_state_replay and fused_gdn_verify to true"):
        resolve_replay(True, True, fused_auto=False)
    with pytest.raises(ValueError, match="not supported by this configuration"):
        resolve_replay(True, None, fused_auto=False, supported=False)
    # through the option object: explicit both is the release note's error, not a refusal of fused_gdn_verify
    with pytest.raises(ValueError, match="both spec_state_replay and fused_gdn_verify"):
        SM70DFlash2Options.resolve({"spec_state_replay": True, "fused_gdn_verify": True}, env={})
    auto = SM70DFlash2Options.resolve({"spec_state_replay": True}, env={}, fused_gdn_verify_auto=True)
    assert (auto.spec_state_replay, auto.fused_gdn_verify) == (True, False)
    with pytest.raises(ValueError, match="fused_gdn_verify=true cannot run in revolta"):  # auto on, replay unset
        SM70DFlash2Options.resolve(None, env={}, fused_gdn_verify_auto=True)


def test_concurrency_ladder():
    ladder = parse_ladder({"4": 3, "5": 4}, 7)
    assert ladder == ((4, 3), (5, 4))
    assert [drafts_at(ladder, 7, c) for c in range(1, 10)] == [7, 7, 7, 3, 4, 4, 4, 4, 4]
    assert [drafts_at((), 7, c) for c in (1, 8)] == [7, 7]
    assert [drafts_at(parse_ladder({2: 5, "6": 2}, 5), 5, c) for c in range(1, 8)] == [5, 5, 5, 5, 5, 2, 2]
    assert drafts_at(ladder, 2, 1) == 2 and drafts_at(ladder, 2, 5) == 2  # never more than the drafts asked for
    for raw, msg in [({"0": 3}, "running requests >= 1"), ({"x": 3}, "running requests >= 1"),
                     ({"4": 0}, r"\[1, 7\]"), ({"4": True}, r"\[1, 7\]"), ({"4": 3, 4: 2}, "twice"),
                     ([4, 3], "must be a dict")]:
        with pytest.raises(ValueError, match=msg):
            parse_ladder(raw, 7)


def test_spec_config_exposes_the_ladder(drafter):
    spec = resolve({**RECOMMENDED, "model": drafter})
    assert [spec.drafts_at(c) for c in range(1, 9)] == [7, 7, 7, 3, 4, 4, 4, 4]
    assert resolve({"method": "mtp"}).drafts_at(8) == 4  # MTP has no ladder


def test_graph_reserve_defaults_by_method(drafter, monkeypatch):
    monkeypatch.delenv("REVOLTA_CUDAGRAPH_MEM_MIB", raising=False)
    dflash = {"method": "dflash2", "model": drafter}
    assert EngineConfig(max_model_len=64, speculative_config=dflash).resolved_cudagraph_mem_mib() == 1200
    assert EngineConfig(max_model_len=64, speculative_config={"method": "dflash", "model": drafter}
                        ).resolved_cudagraph_mem_mib() == 1200
    assert EngineConfig(max_model_len=64, speculative_config=resolve(dflash)).resolved_cudagraph_mem_mib() == 1200
    for spec in (None, {"method": "mtp"}, {"method": None}, resolve({"method": "mtp"})):
        assert EngineConfig(max_model_len=64, speculative_config=spec).resolved_cudagraph_mem_mib() == 700
    # explicit values win
    assert EngineConfig(max_model_len=64, speculative_config=dflash, cudagraph_mem_mib=1500
                        ).resolved_cudagraph_mem_mib() == 1500
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "1500")
    assert EngineConfig(max_model_len=64, speculative_config=dflash).resolved_cudagraph_mem_mib() == 1500
    assert EngineConfig(max_model_len=64, speculative_config=dflash, cudagraph_mem_mib=0
                        ).resolved_cudagraph_mem_mib() == 0


def test_dry_run_reserve_by_method(tmp_path):
    from revolta.config import ModelConfig

    cfg = ModelConfig.from_pretrained(REAL)
    spec = resolve({"method": "dflash2", "model": write_drafter(tmp_path / "d", cfg)}, tensor_parallel_size=4)
    fields = spec.cache_fields("fp8_e4m3", "float16")
    MiB = 2**20
    assert dry_run_plan(cfg, 32.0, 4, 8192, "fp8_e4m3", **fields).budget.cudagraph_reserve_bytes == 1200 * MiB
    assert dry_run_plan(cfg, 32.0, 4, 8192, "fp8_e4m3", num_speculative_tokens=4
                        ).budget.cudagraph_reserve_bytes == 700 * MiB
    assert dry_run_plan(cfg, 32.0, 4, 8192, "fp8_e4m3").budget.cudagraph_reserve_bytes == 700 * MiB
    assert dry_run_plan(cfg, 32.0, 4, 8192, "fp8_e4m3", cudagraph_reserve_mib=1500, **fields
                        ).budget.cudagraph_reserve_bytes == 1500 * MiB


def test_llm_resolves_the_codebook_option_at_its_tensor_parallel_size(drafter, tmp_path):
    """LLM(tensor_parallel_size=2) resolves sm70_dflash2 at tp 2: sharded codebooks by default, an explicit true
    accepted (at tp 1 it is refused: nothing to split)."""
    from dflash2_fixtures import tiny_target
    from revolta.llm_load import resolve_llm_speculation

    def llm_spec(raw, tp):
        return resolve_llm_speculation(raw, tiny_target(), tmp_path, is_default=False, mtp_weights=False,
                                       dtype="float32", kv_cache_dtype="auto", tensor_parallel_size=tp)

    assert llm_spec({"method": "dflash2", "model": drafter}, 2).sm70_dflash2.sharded_selector_codebook is True
    assert llm_spec({"method": "dflash2", "model": drafter}, 1).sm70_dflash2.sharded_selector_codebook is False
    explicit = {"method": "dflash2", "model": drafter, "sm70_dflash2": {"sharded_selector_codebook": True}}
    assert llm_spec(explicit, 2).sm70_dflash2.source("sharded_selector_codebook") == "config"
    with pytest.raises(ValueError, match="needs a tensor-parallel group"):
        llm_spec(explicit, 1)


def test_graph_option_refusals_name_revolta_graph_flags_not_a_false_claim():
    """revolta does capture DFlash2 rounds (dflash2_graph_rounds) and MTP rounds in CUDA graphs: refusing the
    release note's graph options must point there, not claim that speculative steps never use graphs."""
    from revolta.spec.dflash2.checks import check_tail_cudagraphs
    from revolta.spec.dflash2.options import SM70DFlash2Options

    messages = [o.meaning for o in OPTIONS if o.name in ("context_kv_graph", "context_pipeline")]  # their warnings
    with pytest.raises(ValueError) as e:
        check_tail_cudagraphs({"VLLM_SM70_DFLASH2_TAIL_CUDAGRAPHS": "1"})
    messages.append(str(e.value))
    for message in messages:
        assert "without CUDA graphs" not in message and "--dflash2-graph-rounds" in message, message


def test_the_release_notes_recommended_configuration_starts_as_written(caplog, drafter):
    """The note says to keep six sm70_dflash2 options on; two of them (context_kv_graph, context_pipeline) are speed
    options revolta has no counterpart for: accepted with a warning, not refused. Options revolta cannot run are all
    named in one error."""
    recommended = {"context_kv_graph": True, "context_pipeline": True, "verify_fastpath": True,
                   "fused_gdn_metadata": True, "fused_smallq_metadata": True, "grouped_smallq_metadata": True,
                   "spec_state_replay": False}
    with caplog.at_level("WARNING", logger="revolta.spec.dflash2.options"):
        opts = SM70DFlash2Options.resolve(recommended, env={})
    assert opts.spec_state_replay is False and opts.verify_fastpath is True and opts.context_kv_graph is None
    assert "ignored" in opts.source("context_pipeline")
    warned = [r.getMessage() for r in caplog.records]
    assert any("context_kv_graph=True" in m and "--dflash2-graph-rounds" in m for m in warned), warned
    assert resolve({"method": "dflash2", "model": str(drafter), "draft_sample_method": "greedy",
                    "dflash_concurrency_drafts": {"4": 3, "5": 4}, "sm70_dflash2": recommended})
    with pytest.raises(ValueError) as e:
        SM70DFlash2Options.resolve({"fused_gdn_norm": True, "quant_lm_head": True, "lookup": False}, env={})
    assert all(name in str(e.value) for name in ("fused_gdn_norm=True", "quant_lm_head=True", "lookup=False"))
