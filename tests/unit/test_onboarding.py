"""Adding a model: configuration from a graph signature, the batching proposal from a
profile, the refusals (pure functions, no model run)."""

from __future__ import annotations

import pytest

from spillway.models.onboarding import (
    BatchProof,
    ProfileRow,
    Proposal,
    configure,
    propose,
    text_config,
)
from spillway.models.processing import GraphTensor
from spillway.models.signature import DEFAULT_MAX_BATCH_SIZE, GraphSignature, config_from_signature
from spillway.protocol.errors import ModelLoadError
from spillway_cli.models_add import profile_table

DENSE = GraphSignature(
    (GraphTensor("x", "FP32", ("batch", 4)),), (GraphTensor("y", "FP32", ("batch", 3)),)
)
TABLE = (ProfileRow(1, 2.0, 3.0), ProfileRow(8, 6.0, 9.0), ProfileRow(32, 20.0, 30.0))
"""A fake profile: p99 3, 9 and 30 ms at batch 1, 8 and 32."""


def test_a_dynamic_leading_dimension_is_the_batch() -> None:
    # GIVEN a graph whose input and output lead with a symbolic dimension
    # WHEN its configuration is completed
    config = config_from_signature("dense", DENSE)
    # THEN it batches, and dims exclude the batch dimension
    assert config.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [("x", "TYPE_FP32", (4,))]
    assert [(t.name, t.data_type, t.dims) for t in config.output] == [("y", "TYPE_FP32", (3,))]
    assert config.dynamic_batching is None


def test_a_fixed_leading_dimension_does_not_batch() -> None:
    # GIVEN a graph with a fixed batch of 1, and one whose output has no batch dimension
    fixed = GraphSignature((GraphTensor("x", "FP32", (1, 4)),), (GraphTensor("y", "FP32", (1, 3)),))
    reduced = GraphSignature(
        (GraphTensor("x", "FP32", (None, 4)),), (GraphTensor("y", "FP32", (3,)),)
    )
    # WHEN their configurations are completed THEN neither batches; dims are whole shapes
    assert config_from_signature("one", fixed).max_batch_size == 0
    assert config_from_signature("one", fixed).input[0].dims == (1, 4)
    assert config_from_signature("sum", reduced).max_batch_size == 0
    assert config_from_signature("sum", reduced).input[0].dims == (-1, 4)


def test_two_int64_inputs_and_a_symbolic_inner_dimension() -> None:
    # GIVEN two int64 inputs with a symbolic inner dimension, and a string output
    signature = GraphSignature(
        (
            GraphTensor("a", "INT64", ("n", "width")),
            GraphTensor("b", "INT64", ("n", 3)),
        ),
        (GraphTensor("label", "BYTES", ("n",)),),
    )
    # WHEN completed THEN the symbolic dimension is -1 and the string is TYPE_STRING
    config = config_from_signature("ints", signature, max_batch_size=16)
    assert config.max_batch_size == 16
    assert [(t.data_type, t.dims) for t in config.input] == [
        ("TYPE_INT64", (-1,)),
        ("TYPE_INT64", (3,)),
    ]
    assert [(t.data_type, t.dims) for t in config.output] == [("TYPE_STRING", ())]


def test_a_model_that_is_not_batch_safe_is_served_one_request_per_run() -> None:
    # GIVEN a batchable draft whose proof failed
    draft = config_from_signature("centred", DENSE, max_batch_size=32)
    proof = BatchProof(False, 8, "output 'y' of row 0 differs")
    # WHEN configured THEN no batching, no dynamic batcher, the batch dimension in dims
    config = configure(draft, proof, propose(TABLE, 50))
    assert config.max_batch_size == 0
    assert config.dynamic_batching is None
    assert config.input[0].dims == (-1, 4)
    assert config.output[0].dims == (-1, 3)


def test_the_proposal_takes_the_largest_batch_that_fits_the_target() -> None:
    # GIVEN p99 3/9/30 ms at batch 1/8/32 WHEN the target is 50 ms
    proposal = propose(TABLE, 50)
    # THEN 32 does not fit twice (60 ms), 8 does (18 ms); the delay is one median of 8
    # (6 ms, less than the 32 ms left)
    assert proposal == Proposal(8, (8,), 6000, proposal.reason)
    assert "batch 8" in proposal.reason
    assert "a batch of 32 takes 30.0 ms" in proposal.reason
    # AND with a 61 ms target 32 fits, and the delay is what is left (1 ms)
    wide = propose(TABLE, 61)
    assert (wide.max_batch_size, wide.preferred_batch_size) == (32, (8, 32))
    assert wide.max_queue_delay_microseconds == 1000
    # AND the chosen settings are what the configuration gets
    config = configure(config_from_signature("dense", DENSE, max_batch_size=32), None, wide)
    assert config.max_batch_size == 32
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.preferred_batch_size == (8, 32)
    assert config.dynamic_batching.max_queue_delay_microseconds == 1000


def test_when_nothing_fits_a_batch_of_one_without_delay_is_proposed() -> None:
    # GIVEN a target below twice even batch 1's p99 WHEN proposed
    proposal = propose(TABLE, 5)
    # THEN batch 1, no delay, no dynamic batcher, and the reason names the miss
    assert (proposal.max_batch_size, proposal.max_queue_delay_microseconds) == (1, 0)
    assert proposal.batching() is None
    assert "3.0 ms" in proposal.reason


def test_the_printed_table_shows_each_batch_size() -> None:
    # GIVEN the fake profile WHEN printed THEN one row per batch size with rows per second
    lines = profile_table(TABLE)
    assert lines[0].split() == ["batch", "p50", "ms", "p99", "ms", "rows/s"]
    assert lines[1].split() == ["1", "2.00", "3.00", "500"]
    assert lines[3].split() == ["32", "20.00", "30.00", "1600"]


def test_a_text_model_needs_the_graph_the_text_kind_feeds() -> None:
    # GIVEN the text kind's graph WHEN configured THEN one string in, the pooled output out
    encoder = GraphSignature(
        (
            GraphTensor("input_ids", "INT64", ("batch", "sequence")),
            GraphTensor("attention_mask", "INT64", ("batch", "sequence")),
        ),
        (GraphTensor("pooled", "FP32", ("batch", 8)),),
    )
    config = text_config("enc", encoder, 64, 32)
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [("text", "TYPE_STRING", (1,))]
    assert [(t.name, t.dims) for t in config.output] == [("pooled", (8,))]
    assert config.spillway.kind == "text_embedding"
    assert config.spillway.max_sequence_length == 64
    # AND a graph that takes something else is refused in one line
    with pytest.raises(ModelLoadError, match="takes exactly input_ids and attention_mask") as info:
        text_config("enc", DENSE, 64, 32)
    assert "\n" not in info.value.message
    # AND so is a token-level output
    tokens = GraphSignature(encoder.inputs, (GraphTensor("h", "FP32", ("batch", "seq", 8)),))
    with pytest.raises(ModelLoadError, match="pooled"):
        text_config("enc", tokens, 64, 32)
