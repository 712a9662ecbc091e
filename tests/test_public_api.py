"""The public API is a decision, not an accident: what ``import sparsecomm`` offers is pinned here,
and every component class is importable by name for IDE users."""

import sparsecomm as sc
from sparsecomm import components

PUBLIC = [
    "GradientReducer", "register_ddp_hook", "ddp_comm_hook", "allreduce_gradients", "check_optimizer",  # training
    "HierarchicalReducer", "Topology", "register_fsdp_hooks",  # over nodes
    "Pipeline", "PRESETS", "available_presets", "parse_spec",  # pipelines and presets
    "SPARSIFIERS", "FEEDBACKS", "INDEX_CODECS", "VALUE_CODECS", "TRANSPORTS",  # their components, by name
    "SparseGradient", "encode", "decode", "read_info",  # payloads
    "SparseCommError", "SpecError", "PayloadError", "NonFiniteError",  # errors
    "keep_freed_host_memory",
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
