"""Training a model that does not fit one device, standing on torch's engines: fully sharded parameters
through FSDP2 (``torch.distributed.fsdp.fully_shard``) with fastpar's wrapping, precision and meta-device
policies; pipeline stages through ``torch.distributed.pipelining`` with split points fastpar chooses; and
reshardable checkpoints of sharded state through ``torch.distributed.checkpoint``.

ZeRO-1/2 (sharding on fastpar's own DDP buckets) lives in :mod:`fastpar.zero`; the memory planner that
chooses between the strategies lives in :mod:`fastpar.costmodel`.

Fully sharded: :func:`fully_shard_model` (the entry point), :func:`fsdp_memory_report`, the unit choice
:func:`select_units`, the precision :func:`precision_policy`, and the meta-device reference
:func:`build_eager`. Pipeline stages: :func:`pipeline_model` (the entry point), :func:`pipeline_memory_report`,
the split choice :func:`choose_split` and the layers a model is cut along :func:`model_layers`.
"""

from __future__ import annotations

from .activation_checkpoint import ActivationCheckpointError, checkpoint_activations
from .fully_sharded import fsdp_memory_report, fully_shard_model
from .meta_init import build_eager
from .pipeline_layout import PipelineLayout, pipeline_layout
from .pipeline_profile import LayerCost, ModelLayers, PipelineConfigError, model_layers, profile_layers
from .pipeline_split import SCHEDULES, PipelineSplit, check_pipeline_shape, choose_split
from .pipeline_stages import PipelinedModel, StageLayers, pipeline_memory_report, pipeline_model
from .precision import precision_policy
from .wrap_policy import WrapError, describe_units, select_units

__all__: list[str] = [
    "SCHEDULES",
    "ActivationCheckpointError",
    "LayerCost",
    "ModelLayers",
    "PipelineConfigError",
    "PipelineLayout",
    "PipelineSplit",
    "PipelinedModel",
    "StageLayers",
    "WrapError",
    "build_eager",
    "checkpoint_activations",
    "check_pipeline_shape",
    "choose_split",
    "describe_units",
    "fsdp_memory_report",
    "fully_shard_model",
    "model_layers",
    "pipeline_layout",
    "pipeline_memory_report",
    "pipeline_model",
    "precision_policy",
    "profile_layers",
    "select_units",
]
