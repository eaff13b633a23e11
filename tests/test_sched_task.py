"""TaskSpec validation, the gpu_spec matcher, and the error tree's fields."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler.errors import (
    InvalidArgument,
    InvalidTask,
    InvalidWeight,
    NotLeaseHolder,
    SchedulerError,
    TaskConflict,
    UnknownPolicy,
)
from scheduler.gpuspec import gpu_spec_mask, parse_gpu_spec
from scheduler.task import (
    MAX_KIND_LEN,
    MAX_LABEL_KEY_LEN,
    MAX_LABEL_VALUE_LEN,
    MAX_LABELS,
    MAX_TASK_ID_LEN,
    MAX_TENANT_LEN,
    Priority,
    TaskSpec,
)


def spec(**changes) -> TaskSpec:
    base = dict(task_id="t", vram_mib=1024.0, gpu_share=0.5)
    base.update(changes)
    return TaskSpec(**base)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(task_id=""), "task_id"),
        (dict(task_id="x" * (MAX_TASK_ID_LEN + 1)), "task_id"),
        (dict(task_id="a\nb"), "task_id"),
        (dict(num_gpus=0), "num_gpus"),
        (dict(num_gpus=65), "num_gpus"),
        (dict(num_gpus=2.0), "num_gpus"),
        (dict(num_gpus=True), "num_gpus"),
        (dict(vram_mib=0), "vram_mib"),
        (dict(vram_mib=-5), "vram_mib"),
        (dict(vram_mib=math.nan), "vram_mib"),
        (dict(vram_mib=math.inf), "vram_mib"),
        (dict(gpu_share=math.nan), "gpu_share"),
        (dict(gpu_share=-0.01), "gpu_share"),
        (dict(gpu_share=1.01), "gpu_share"),
        (dict(duration_s=-1.0), "duration_s"),
        (dict(duration_s=math.nan), "duration_s"),
        (dict(deadline_s=-1.0), "deadline_s"),
        (dict(deadline_s=math.nan), "deadline_s"),
        (dict(priority=4), "priority"),
        (dict(priority=-1), "priority"),
        (dict(priority=1.0), "priority"),
        (dict(gpu_spec="V100|"), "gpu_spec"),
        (dict(gpu_spec="V100M16 A100M80"), "gpu_spec"),
        (dict(required_node_labels={"": "x"}), "required_node_labels"),
        (dict(labels={"k": 1}), "labels"),
        (dict(kind="k" * (MAX_KIND_LEN + 1)), "kind"),  # a metric label: bounded
        (dict(kind="batch\n"), "kind"),
        (dict(tenant="t" * (MAX_TENANT_LEN + 1)), "tenant"),
        (dict(labels={f"k{i}": "v" for i in range(MAX_LABELS + 1)}), "labels"),
        (dict(labels={"k" * (MAX_LABEL_KEY_LEN + 1): "v"}), "labels"),
        (dict(preferred_node_labels={"zone": "z" * (MAX_LABEL_VALUE_LEN + 1)}), "preferred_node_labels[zone]"),
        (dict(gpu_spec="|".join(["V100M16"] * 40)), "gpu_spec"),  # 319 characters: a 3 MB one was taken whole
        # the three maps together: at their per-map limits a task pinned ~159 KiB while retained
        (dict(labels={f"k{i:02d}": "v" * 200 for i in range(30)},
              preferred_node_labels={f"p{i:02d}": "v" * 200 for i in range(15)}), "preferred_node_labels"),
    ],
)
def test_validate_names_the_bad_field(changes: dict, field: str) -> None:
    with pytest.raises(InvalidTask) as info:
        spec(**changes).validate()
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(task_id="x" * MAX_TASK_ID_LEN),
        dict(num_gpus=64),
        dict(gpu_share=0.0),
        dict(gpu_share=1.0),
        dict(duration_s=0.0, deadline_s=0.0),
        dict(priority=Priority.P0),
        dict(priority=3),
        dict(gpu_spec="V100M16|V100M32"),
        dict(gpu_spec="RTX 4090"),
        dict(kind="k" * MAX_KIND_LEN, tenant="t" * MAX_TENANT_LEN),
        dict(labels={f"k{i}": "v" * 100 for i in range(MAX_LABELS)}),  # 64 entries, 6,592 characters
        dict(labels={"k": "v" * MAX_LABEL_VALUE_LEN}, required_node_labels={"r" * MAX_LABEL_KEY_LEN: "x"}),
    ],
)
def test_valid_specs_pass(changes: dict) -> None:
    assert spec(**changes).validate() is not None


def test_spec_equality_copies_labels_and_lists_differences() -> None:
    labels = {"team": "a"}
    a = spec(labels=labels)
    labels["team"] = "b"  # the caller's later change must not reach the spec
    assert a.labels == {"team": "a"}
    assert a == spec(labels={"team": "a"}) and hash(a) == hash(spec())
    assert spec().differing_fields(spec(vram_mib=2.0, num_gpus=2)) == ["num_gpus", "vram_mib"]


@pytest.mark.parametrize(
    "gpu_spec, model, memory_mib, expected",
    [
        ("", "anything", 1.0, True),
        ("RTX 4090", "NVIDIA GeForce RTX 4090", 24_564, True),
        ("rtx4090", "NVIDIA GeForce RTX 4090", 24_564, True),
        ("4090", "NVIDIA GeForce RTX 4090", 24_564, True),
        ("GeForce 4090", "NVIDIA GeForce RTX 4090", 24_564, True),
        ("RTX 4080", "NVIDIA GeForce RTX 4090", 24_564, False),
        ("A100", "NVIDIA A100-SXM4-80GB", 81_920, True),
        ("A10", "NVIDIA A100-SXM4-80GB", 81_920, False),
        ("A10", "NVIDIA A10", 22_731, True),
        ("V100 16GB", "Tesla V100-SXM2-16GB", 16_160, True),
        ("V100 16GB", "Tesla V100-SXM2-32GB", 32_510, False),
        ("V100M16", "Tesla V100-SXM2-16GB", 16_160, True),
        ("V100M16", "Tesla V100-SXM2-32GB", 32_510, False),
        ("V100M32", "Tesla V100-PCIE-32GB", 32_510, True),
        ("V100M16|V100M32", "Tesla V100-PCIE-32GB", 32_510, True),
        ("V100M16|V100M32", "NVIDIA A100-SXM4-40GB", 40_960, False),
        ("V100SXM2", "Tesla V100-SXM2-16GB", 16_160, True),  # a model word, not the shorthand
        ("V100M16", "Tesla V100-SXM2-16GB", math.nan, False),  # unknown size proves nothing
        ("H100|A100", "NVIDIA H100 80GB HBM3", 81_559, True),
    ],
)
def test_gpu_spec_matches_by_token(gpu_spec: str, model: str, memory_mib: float, expected: bool) -> None:
    mask = gpu_spec_mask(np.array([model], dtype=object), np.array([memory_mib]), gpu_spec)
    assert mask.tolist() == [expected]


def test_gpu_spec_mask_is_per_gpu_over_mixed_models() -> None:
    models = np.array(["Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB"], dtype=object)
    memory = np.array([16_160.0, 24_564.0, 32_510.0])
    assert gpu_spec_mask(models, memory, "V100M32|4090").tolist() == [False, True, True]
    assert parse_gpu_spec("") == ()


def test_error_tree_carries_what_the_coordinator_needs() -> None:
    assert issubclass(InvalidTask, InvalidArgument) and issubclass(InvalidArgument, SchedulerError)
    weight = InvalidWeight("load", "must be >= 0")
    assert weight.name == "load" and weight.field == "weights[load]"
    unknown = UnknownPolicy("fastest", ["load_aware", "binpack"])
    assert unknown.name == "fastest" and "fastest" in str(unknown) and unknown.available == ("binpack", "load_aware")
    conflict = TaskConflict("t1", ["vram_mib"])
    assert conflict.task_id == "t1" and conflict.fields == ("vram_mib",) and "vram_mib" in str(conflict)
    lease = NotLeaseHolder("t1", "L9", "the lease expired")
    assert (lease.task_id, lease.lease_id, lease.reason) == ("t1", "L9", "the lease expired")
