"""The public API is a decision, not an accident: what ``import sparsecomm`` offers is pinned here,
and every component class is importable by name for IDE users."""

import sparsecomm as sc
from sparsecomm import components

PUBLIC = [
    "Agreement", "CallRecord", "CostModel", "FEEDBACKS", "GradientReducer", "INDEX_CODECS", "PRESETS", "PayloadError",
    "PayloadInfo", "Pipeline", "PipelineSpec", "Reduction", "Request", "SPARSIFIERS", "SparseCommError",
    "SparseGradient", "SpecError", "TRANSPORTS", "Transport", "TransportSession", "VALUE_CODECS", "agree",
    "allreduce_gradients", "as_tensor", "available_presets", "check_optimizer", "components", "ddp_comm_hook",
    "decode", "encode", "format_spec", "keep_freed_host_memory", "load_cost_model", "parse_spec", "read_info",
    "register_ddp_hook", "resolve",
]


def test_the_top_level_api_is_exactly_the_pinned_list():
    assert sorted(sc.__all__) == sorted(PUBLIC)
    assert all(hasattr(sc, name) for name in PUBLIC)


def test_every_registered_component_is_importable_from_sparsecomm_components():
    registered = {registry.get(name) for registry in (sc.SPARSIFIERS, sc.FEEDBACKS, sc.INDEX_CODECS, sc.VALUE_CODECS,
                                                      sc.TRANSPORTS) for name in registry.names()}
    bases = {components.Sparsifier, components.CountedSparsifier, components.Feedback, components.IndexCodec,
             components.ValueCodec, components.Transport}
    exported = {getattr(components, name) for name in components.__all__}
    assert registered | bases == exported


def test_registries_build_their_own_kind():
    assert isinstance(sc.SPARSIFIERS.parse("topk(ratio=0.1)"), components.TopK)
    assert sc.VALUE_CODECS.parse("qsgd(bits=4)") == components.QSGDValues(bits=4)
