"""A model's versions as a user manages them: the signature callers see and its
differences, a served configuration applied to another graph, and the rules of rollback
and removal on a folder repository (pure files, no model run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spillway.models.config import ModelConfig
from spillway.models.lineage import (
    for_new_version,
    keep_outgoing,
    kept_config_of,
    remove_version,
    rollback,
    view_model,
)
from spillway.models.loader import chosen_versions
from spillway.models.processing import GraphTensor
from spillway.models.repository import LocalRepository
from spillway.models.signature import GraphSignature, refit, signature_differences
from spillway.protocol.errors import InvalidInputError, ModelLoadError, ModelNotFoundError
from spillway_cli.models_where import deployed_repository

DIGITS: dict[str, Any] = {
    "name": "digits",
    "max_batch_size": 64,
    "input": [{"name": "image", "data_type": "TYPE_FP32", "dims": [8, 8]}],
    "output": [
        {"name": "label", "data_type": "TYPE_INT64", "dims": [1]},
        {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [10]},
    ],
    "spillway": {"kind": "image_classifier"},
}
FLAT = GraphSignature(
    (GraphTensor("input", "FP32", ("batch", 64)),),
    (GraphTensor("label", "INT64", ("batch", 1)), GraphTensor("probabilities", "FP32", ("n", 10))),
)
DENSE = GraphSignature(
    (GraphTensor("x", "FP32", ("batch", 4)),), (GraphTensor("y", "FP32", ("batch", 3)),)
)


def config(**changes: Any) -> ModelConfig:
    return ModelConfig.model_validate({**DIGITS, **changes})


def test_the_served_config_fits_a_graph_of_the_same_signature() -> None:
    # GIVEN an image classifier (images [8, 8] in, flattened to the graph's [batch, 64])
    served = config()
    # WHEN it is applied to a graph taking [batch, 64] and to one taking [batch, 4]
    same = refit(served, FLAT)
    # THEN the first changes nothing a caller sees; the second is refused in one line
    assert signature_differences(served, same) == []
    with pytest.raises(ModelLoadError, match=r"flattened, one float input \[batch, 64\]"):
        refit(served, DENSE)


def test_differences_name_each_input_output_and_the_kind() -> None:
    # GIVEN the classifier and the configuration of a dense graph
    tensor = ModelConfig.model_validate(
        {
            "name": "digits",
            "max_batch_size": 8,
            "input": [{"name": "image", "data_type": "TYPE_FP64", "dims": [64]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}],
        }
    )
    # WHEN they are compared THEN kind, datatype, shape, gone and new are each one phrase
    assert signature_differences(config(), tensor) == [
        "kind image_classifier -> tensor",
        "input 'image' datatype FP32 -> FP64",
        "input 'image' shape [-1, 8, 8] -> [-1, 64]",
        "output 'label' INT64 [-1, 1] is gone",
        "output 'probabilities' FP32 [-1, 10] is gone",
        "new output 'y' FP32 [-1, 3]",
    ]
    # AND an unbatched configuration differs by its shapes, not its dims alone
    unbatched = config(max_batch_size=0, input=[{**DIGITS["input"][0], "dims": [-1, 8, 8]}])
    assert signature_differences(config(), unbatched) == [
        "output 'label' shape [-1, 1] -> [1]",
        "output 'probabilities' shape [-1, 10] -> [10]",
    ]


def test_a_new_version_is_served_after_a_rollback() -> None:
    # GIVEN the policy a rollback wrote, and one with a canary
    rolled = config(version_policy={"specific": {"versions": [1]}})
    # WHEN a new version keeps the configuration THEN the newest is served again
    kept, why = for_new_version(rolled)
    assert chosen_versions(kept.version_policy, [1, 2, 3]) == [3]
    assert why == "version_policy specific [1] -> latest 1: the new version is served"
    assert for_new_version(config()) == (config(), None)


def _repository(tmp_path: Path, versions: int) -> LocalRepository:
    """digits with ``versions`` versions, each a one-byte "graph"."""
    (tmp_path / "repo").mkdir()
    repository = LocalRepository(tmp_path / "repo")
    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"g")
    for _ in range(versions):
        repository.publish_version("digits", {"model.onnx": graph}, config())
    return repository


def _served(repository: LocalRepository) -> list[int]:
    policy = repository.read_config("digits").version_policy
    return chosen_versions(policy, repository.list_versions("digits"))


def test_rollback_serves_the_previous_version_and_refuses_the_oldest(tmp_path: Path) -> None:
    # GIVEN digits v1..v3, v3 served
    repository = _repository(tmp_path, 3)
    # WHEN rolled back twice
    first = rollback(repository, "digits")
    second = rollback(repository, "digits")
    # THEN v2, then v1 is the served one, and the versions stay
    assert (first.before.served, first.after.served) == ([3], [2])
    assert (second.before.served, second.after.served) == ([2], [1])
    assert _served(repository) == [1]
    assert repository.list_versions("digits") == [1, 2, 3]
    # AND a third has nothing to go back to; --to an unknown version is not found
    with pytest.raises(InvalidInputError, match="serves v1, its oldest version"):
        rollback(repository, "digits")
    with pytest.raises(ModelNotFoundError, match="has no version 7"):
        rollback(repository, "digits", to=7)
    assert rollback(repository, "digits", to=3).after.served == [3]


def test_a_rollback_brings_back_the_configuration_a_version_was_served_under(
    tmp_path: Path,
) -> None:
    # GIVEN v1 served as the classifier, then v2 published under another signature
    repository = _repository(tmp_path, 1)
    other = ModelConfig.model_validate(
        {**DIGITS, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]}
        | {"spillway": {"kind": "tensor"}}
    )
    keep_outgoing(repository, "digits", repository.read_config("digits"))
    repository.publish_version("digits", {"model.onnx": tmp_path / "model.onnx"}, other)
    # WHEN rolled back to v1, then forward to v2
    back = rollback(repository, "digits")
    assert back.restored[0] == "kind tensor -> image_classifier"
    assert repository.read_config("digits").spillway.kind == "image_classifier"
    forth = rollback(repository, "digits", to=2)
    # THEN each version is served under its own configuration
    assert forth.restored[0] == "kind image_classifier -> tensor"
    assert [t.name for t in repository.read_config("digits").input] == ["x"]
    assert kept_config_of(repository, "digits", 1) == config()


def test_removing_keeps_a_served_version_and_never_reuses_a_number(tmp_path: Path) -> None:
    # GIVEN digits v1, v2 (v2 served)
    repository = _repository(tmp_path, 2)
    # WHEN the only served version is to be removed THEN refused
    with pytest.raises(InvalidInputError, match="v2 is the only version digits serves"):
        remove_version(repository, "digits", 2)
    # WHEN v1 is removed THEN it leaves its tombstone; v2 stays served
    after = remove_version(repository, "digits", 1)
    assert (after.versions, after.served) == ([2], [2])
    assert [(r.version, r.removed is not None) for r in after.records] == [(1, True), (2, False)]
    with pytest.raises(ModelNotFoundError, match=r"no version 1 \(it was removed\)"):
        remove_version(repository, "digits", 1)
    with pytest.raises(ModelNotFoundError):
        repository.fetch_version("digits", 1, tmp_path / "cache")
    # AND the next version is 3, and the repository lists what a server loads
    graph = tmp_path / "model.onnx"
    assert repository.publish_version("digits", {"model.onnx": graph}) == 3
    assert view_model(repository, "digits").served == [3]
    # AND the whole model goes in one step
    repository.remove_model("digits")
    assert repository.list_models() == []


class _Stacks:
    """CloudFormation's DescribeStacks over given stacks."""

    def __init__(self, stacks: dict[str, dict[str, Any]]) -> None:
        self.stacks = stacks

    def describe_stacks(self, StackName: str) -> dict[str, Any]:
        return {"Stacks": [self.stacks[StackName]]}


def test_a_deployed_stack_names_its_repository() -> None:
    # GIVEN an app stack naming its storage stack and prefix, and the storage stack
    storage = {"Outputs": [{"OutputKey": "ModelsBucket", "OutputValue": "models-123"}]}
    app = {
        "Parameters": [
            {"ParameterKey": "StorageStack", "ParameterValue": "prod-storage"},
            {"ParameterKey": "ModelsPrefix", "ParameterValue": "served"},
        ]
    }
    client = _Stacks({"prod": app, "prod-storage": storage})
    # WHEN either is named THEN the repository is the bucket under the prefix
    assert deployed_repository(client, "prod") == "s3://models-123/served"
    assert deployed_repository(client, "prod-storage") == "s3://models-123/models"
