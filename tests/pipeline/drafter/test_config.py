"""The drafter config's own declarations (pipeline/drafter/config.py)."""

import dataclasses

from pipeline.drafter.config import DrafterConfig, architecture_fields

# The list stages/train/setup.py's fresh_config kept by hand before the fields declared it.
ARCHITECTURE_BEFORE = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "layer_types",
    "sliding_window",
    "is_causal",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "input_embedding_scale",
)
HEAD_FIELDS = ("head", "markov_rank")  # the dspark head (issue 52), architecture since it was added


def test_architecture_fields_are_the_ones_a_drafter_config_gives():
    """--drafter-config carries exactly these DrafterConfig fields; the store gives the rest."""
    names = architecture_fields()
    assert len(names) == len(set(names)) == 14 and set(names) == set(ARCHITECTURE_BEFORE + HEAD_FIELDS)
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    assert set(names) <= fields
    assert not {
        "hidden_size",
        "vocab_size",
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
    } & set(names)
