"""Which rank runs which pipeline stage, and the process groups of pipeline x data parallelism.

``world = stages * dp``. Group rank ``g`` is pipeline rank ``g // dp`` (which stages it runs) of replica
``g % dp``: the ``dp`` ranks of one stage are neighbours. On GPUs that keeps each stage's gradient all-reduce --
the heavy collective, once per step -- inside a node, while the pipeline's activation sends, one microbatch at
a time, are the traffic that crosses nodes (torchtitan's and Megatron's order, pipeline outermost).

Every rank creates every group, in the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place in the pipeline x data-parallel grid (ranks are global ranks)."""

    stages: int  # ranks per pipeline
    dp: int  # pipelines (data-parallel replicas)
    pp_rank: int  # which pipeline rank this is: it runs stages pp_rank, pp_rank + stages, ...
    dp_rank: int  # which replica
    pp_group: dist.ProcessGroup  # this replica's pipeline: its stages send activations and gradients here
    dp_group: dist.ProcessGroup  # the ranks running the same stages: gradients are averaged here
    pp_ranks: tuple[int, ...]  # global ranks of pp_group, by pipeline rank
    dp_ranks: tuple[int, ...]  # global ranks of dp_group, by replica


def pipeline_layout(stages: int, group: dist.ProcessGroup | None = None) -> PipelineLayout:
    """The layout of ``group`` (default: the world) as ``stages``-rank pipelines (module docstring). The caller
    checked that ``stages`` divides the group's size."""
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    dp = len(ranks) // stages
    pp_rank, dp_rank = divmod(me, dp)
    pipelines = [tuple(ranks[p * dp + d] for p in range(stages)) for d in range(dp)]
    replicas = [tuple(ranks[p * dp + d] for d in range(dp)) for p in range(stages)]
    backend = dist.get_backend(group)  # the new groups run on the caller's backend, not the default group's
    pp_group = dp_group = None
    for members in pipelines:
        # one pipeline spanning the whole group is that group (no second communicator for the same ranks)
        made = group if len(members) == len(ranks) else dist.new_group(list(members), backend=backend)
        if members == pipelines[dp_rank]:
            pp_group = made
    for members in replicas:
        made = group if len(members) == len(ranks) else dist.new_group(list(members), backend=backend)
        if members == replicas[pp_rank]:
            dp_group = made
    return PipelineLayout(stages, dp, pp_rank, dp_rank, pp_group, dp_group, pipelines[dp_rank], replicas[pp_rank])
