"""Training a model that does not fit one device, standing on torch's engines: fully sharded parameters
through FSDP2 (``torch.distributed.fsdp.fully_shard``) with fastpar's wrapping, precision and meta-device
policies; pipeline stages through ``torch.distributed.pipelining`` with split points fastpar chooses; and
reshardable checkpoints of sharded state through ``torch.distributed.checkpoint``.

ZeRO-1/2 (sharding on fastpar's own DDP buckets) lives in :mod:`fastpar.zero`; the memory planner that
chooses between the strategies lives in :mod:`fastpar.costmodel`.
"""

from .pipeline_layout import PipelineLayout, pipeline_layout
from .pipeline_profile import LayerCost, ModelLayers, PipelineConfigError, model_layers, profile_layers
from .pipeline_split import SCHEDULES, PipelineSplit, check_pipeline_shape, choose_split
from .pipeline_stages import PipelinedModel, StageLayers, pipeline_memory_report, pipeline_model

__all__ = [
    "SCHEDULES",
    "LayerCost",
    "ModelLayers",
    "PipelineConfigError",
    "PipelineLayout",
    "PipelineSplit",
    "PipelinedModel",
    "StageLayers",
    "check_pipeline_shape",
    "choose_split",
    "model_layers",
    "pipeline_layout",
    "pipeline_memory_report",
    "pipeline_model",
    "profile_layers",
]
